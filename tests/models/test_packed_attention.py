"""Packed training attention (models/packed_attention.py) equals the dense masked reference, values and gradients:
the pure-JAX block-skipping `flash` kernel on random packings, and the Pallas TPU splash and Pallas GPU flash kernels
in interpret mode, all through `packed_attention` under the learner's sharding rules (shard_map over rows and
heads)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models.modules import gqa_attention, packed_mask
from areal_jax.models.packed_attention import (block_ranges, flash_attention, packed_attention, resolve,
                                              splash_block_tables, splash_blocks_computed)
from areal_jax.sharding import LEARNER_RULES, make_mesh, use_rules


def _packing(rng, rows: int, length: int, *, max_len: int, pad: bool = True) -> np.ndarray:
  """Random contiguous segments (ids 1, 2, ... per row), optionally a padded tail (id 0)."""
  seg = np.zeros((rows, length), np.int32)
  for r in range(rows):
    t, sid = 0, 1
    end = length - (int(rng.integers(0, length // 4)) if pad else 0)
    while t < end:
      n = min(int(rng.integers(1, max_len + 1)), end - t)
      seg[r, t:t + n] = sid
      t, sid = t + n, sid + 1
  return seg


def _qkv(rng, rows, length, heads=4, kv_heads=2, dim=8):
  q = jnp.asarray(rng.normal(size=(rows, length, heads, dim)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(rows, length, kv_heads, dim)), jnp.float32) for _ in range(2))
  return q, k, v


def _check(attend, seg, q, k, v, *, atol=2e-5):
  """attend's output and its gradients (a random cotangent) equal the dense reference's."""
  seg = jnp.asarray(seg)
  ref = lambda q, k, v: gqa_attention(q, k, v, packed_mask(seg))
  w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
  loss = lambda f: lambda q, k, v: (f(q, k, v) * w).sum()
  np.testing.assert_allclose(attend(q, k, v), ref(q, k, v), atol=atol)
  for got, want in zip(jax.grad(loss(attend), (0, 1, 2))(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(got, want, atol=atol)


CASES = ["random", "long", "one_segment", "all_padding_row", "block_edges"]


@pytest.mark.parametrize("case", CASES)
def test_flash_equals_dense(case):
  rng = np.random.default_rng(CASES.index(case))
  rows, length, block = 2, 56, 8
  if case == "random":
    seg = _packing(rng, rows, length, max_len=12)
  elif case == "long":  # segments spanning several blocks, lengths not multiples of the block
    seg = _packing(rng, rows, length, max_len=30)
  elif case == "one_segment":
    seg = np.ones((rows, length), np.int32)
  elif case == "all_padding_row":
    seg = np.stack([_packing(rng, 1, length, max_len=20)[0], np.zeros(length, np.int32)])
  else:  # segment boundaries exactly on and one off the block edges; row length not a multiple of the block
    seg = np.repeat(np.asarray([[1] * 8 + [2] * 9 + [3] * 7 + [4] * 16 + [5] * 10 + [0] * 6]), rows, 0)
  q, k, v = _qkv(rng, rows, length)
  _check(lambda q, k, v: flash_attention(q, k, v, jnp.asarray(seg), block=block), seg, q, k, v)


def test_block_ranges_cover_exactly_the_blocks_segments_reach():
  seg = jnp.asarray([[1] * 3 + [2] * 10 + [3] * 3 + [0] * 8], jnp.int32)  # 24 tokens, blocks of 4
  first, last = block_ranges(seg, 4)
  # Query block 3 (tokens 12-15) holds the end of segment 2 (starts in block 0) and segment 3 (starts in block 3).
  np.testing.assert_array_equal(first, [0, 0, 0, 0, 6, 6])  # blocks 4, 5 are padding: empty ranges
  np.testing.assert_array_equal(last, [3, 3, 3, 3, -1, -1])


def test_flash_skips_blocks_no_segment_reaches():
  """The work follows the segments: a row of many short sequences costs far less than one sequence filling it."""
  length, block = 1024, 64
  short = np.repeat(np.arange(1, length // 64 + 1), 64)[None].astype(np.int32)
  long = np.ones((1, length), np.int32)
  pairs = lambda seg: int(sum(i - f + 1 for i, f in enumerate(np.asarray(block_ranges(jnp.asarray(seg), block)[0]))))
  assert pairs(short) == length // block  # only the diagonal blocks
  assert pairs(long) == (length // block) * (length // block + 1) // 2


def _learner_mesh(tensor: int):
  return make_mesh(jax.devices()[:4], {"data": 1, "fsdp": 4 // tensor, "tensor": tensor})


@pytest.mark.parametrize("tensor", [1, 2])
def test_flash_under_learner_sharding(tensor):
  rng = np.random.default_rng(tensor)
  seg = _packing(rng, 4 // tensor, 40, max_len=15)
  q, k, v = _qkv(rng, 4 // tensor, 40)
  attend = packed_attention(jnp.asarray(seg), impl="flash", block=8)

  def sharded(q, k, v):
    with use_rules(_learner_mesh(tensor), LEARNER_RULES):
      return attend(q, k, v)[0]

  _check(jax.jit(sharded), seg, q, k, v)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["random", "long"])
def test_splash_kernel_in_interpret_mode_under_learner_sharding(case):
  """The TPU path (Pallas splash kernel with segment ids and block tables from the segments, under shard_map on fsdp x
  tensor, GQA heads) run on CPU: rows of 3 blocks of 128, a padded tail (whole blocks of padding in one row), segments
  across block edges; `random` has a row of padding only beside a real row on the same device."""
  rng = np.random.default_rng(7)
  if case == "random":
    seg = np.stack([_packing(rng, 1, 330, max_len=90)[0], np.zeros(330, np.int32)])  # padded to 384 inside
  else:
    seg = _packing(rng, 2, 384, max_len=300)
  q, k, v = _qkv(rng, 2, seg.shape[1])
  attend = packed_attention(jnp.asarray(seg), impl="splash", block=128, interpret=True)

  def sharded(q, k, v):
    with use_rules(_learner_mesh(2), LEARNER_RULES):
      return attend(q, k, v)[0]

  _check(sharded, seg, q, k, v, atol=1e-4)


@pytest.mark.parametrize("tensor", [1, 2])
def test_pallas_gpu_kernel_in_interpret_mode_under_learner_sharding(tensor):
  """The GPU path (JAX's Pallas GPU flash kernel with segment ids, GQA heads repeated) run on CPU: rows padded from
  40 to 48 tokens (blocks of 16), segments across block edges, a row of padding only."""
  rng = np.random.default_rng(11 + tensor)
  seg = _packing(rng, 4 // tensor, 40, max_len=15)
  seg[-1] = 0
  q, k, v = _qkv(rng, 4 // tensor, 40)
  attend = packed_attention(jnp.asarray(seg), impl="pallas_gpu", block=16, interpret=True)

  def sharded(q, k, v):
    with use_rules(_learner_mesh(tensor), LEARNER_RULES):
      return attend(q, k, v)[0]

  _check(jax.jit(sharded), seg, q, k, v, atol=1e-4)


def test_splash_block_tables_follow_the_segments():
  """The kernel's forward tables list, per query block, the key blocks its segments reach, then repeat the last one
  (no new copy) unmasked-off; the dkv tables the query blocks per key block, padded at the front."""
  seg = jnp.asarray([1] * 3 + [2] * 10 + [3] * 3 + [0] * 8, jnp.int32)  # 24 tokens, blocks of 4 (block_ranges' test)
  fwd, dq, dkv = splash_block_tables(seg, 4)
  assert fwd is dq
  np.testing.assert_array_equal(fwd.block_mask[0], [[1, 0, 0, 0, 0, 0], [2, 1, 0, 0, 0, 0], [2, 2, 1, 0, 0, 0],
                                                    [2, 2, 2, 1, 0, 0], [0] * 6, [0] * 6])
  np.testing.assert_array_equal(fwd.data_next[0, 3], [0, 1, 2, 3, 3, 3])
  np.testing.assert_array_equal(dkv.block_mask[0].T[0], [0, 0, 1, 2, 2, 2])  # key block 0: query blocks 0..3
  np.testing.assert_array_equal(dkv.data_next[0].T[0], [0, 0, 0, 1, 2, 3])
  np.testing.assert_array_equal(dkv.block_mask[0].T[4], [0] * 6)  # a key block of padding: nothing
  short = np.repeat(np.arange(1, 17), 64)[None].astype(np.int32)  # 16 sequences of one block each
  assert splash_blocks_computed(short, 64) == 16
  assert splash_blocks_computed(np.ones((1, 1024), np.int32), 64) == 16 * 17 // 2


def test_auto_picks_dense_only_for_rows_of_two_blocks_off_tpu(monkeypatch):
  assert resolve("auto", 256, 128) == "dense" and resolve("auto", 384, 128) == "flash"
  for platform, impl in (("gpu", "pallas_gpu"), ("tpu", "splash")):
    monkeypatch.setattr("areal_jax.sharding.platform", lambda p=platform: p)
    assert resolve("auto", 256, 128) == impl
  assert resolve("splash", 256, 128) == "splash"
  with pytest.raises(ValueError, match="'flashy'"):
    resolve("flashy", 256, 128)
