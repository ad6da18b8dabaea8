"""Paged attention against the dense reference, cache writes, the Pallas TPU and GPU kernels (interpreted on CPU)
against the pure-JAX path (the decode's, and the speculative verify's `verify_kernel`), and the Pallas TPU path
compiling for a v5e topology with the pool updated in place."""

import functools
import os
import re

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from areal_jax.models import ModelConfig
from areal_jax.models.modules import gqa_attention
from areal_jax.sampler import attention
from areal_jax.sampler.attention import pallas_paged_attention, paged_attention, write_chunks, write_decode_kv
from areal_jax.sampler.config import SamplerConfig


def _random_paged(rng, *, slots, heads, kv_heads, dim, page, pages_per_seq, lengths):
  """Dense keys/values scattered into a shuffled page pool (page 0 left as scratch)."""
  num_pages = slots * pages_per_seq + 1
  q = rng.normal(size=(slots, heads, dim)).astype(np.float32)
  k = rng.normal(size=(slots, pages_per_seq * page, kv_heads, dim)).astype(np.float32)
  v = rng.normal(size=(slots, pages_per_seq * page, kv_heads, dim)).astype(np.float32)
  ids = rng.permutation(np.arange(1, num_pages)).reshape(slots, pages_per_seq).astype(np.int32)
  k_pages = np.zeros((kv_heads, num_pages, page, dim), np.float32)
  v_pages = np.zeros_like(k_pages)
  for s in range(slots):
    for j in range(pages_per_seq):
      k_pages[:, ids[s, j]] = k[s, j * page:(j + 1) * page].transpose(1, 0, 2)
      v_pages[:, ids[s, j]] = v[s, j * page:(j + 1) * page].transpose(1, 0, 2)
  return q, k, v, k_pages, v_pages, ids


@pytest.mark.parametrize("pages_per_block", [1, 3, 8])
def test_paged_attention_equals_dense(pages_per_block):
  rng = np.random.default_rng(0)
  slots, heads, kv_heads, dim, page, m = 5, 4, 2, 8, 4, 6
  lengths = np.array([1, 4, 5, 17, 24], np.int32)
  q, k, v, kp, vp, ids = _random_paged(rng, slots=slots, heads=heads, kv_heads=kv_heads, dim=dim, page=page,
                                       pages_per_seq=m, lengths=lengths)
  got = paged_attention(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(lengths), jnp.asarray(ids),
                        pages_per_block=pages_per_block)
  mask = (np.arange(m * page)[None, :] < lengths[:, None])[:, None, :]
  want = gqa_attention(jnp.asarray(q)[:, None], jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))[:, 0]
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
  # A zero length gives zeros, not NaN.
  none = paged_attention(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.zeros(slots, jnp.int32),
                         jnp.asarray(ids))
  assert np.all(np.asarray(none) == 0)


def test_decode_write_goes_to_the_slot_page_or_scratch():
  kv_heads, num_pages, page, dim = 2, 6, 4, 3
  kp = jnp.zeros((kv_heads, num_pages, page, dim))
  table = jnp.array([[2, 5], [3, 4]], jnp.int32)
  k = jnp.ones((2, kv_heads, dim)) * jnp.array([1.0, 2.0])[:, None, None]
  kp2, _ = write_decode_kv(kp, kp, k, k, table, jnp.array([5, 1]), jnp.array([True, False]))
  kp2 = np.asarray(kp2)
  assert np.all(kp2[:, 5, 1] == 1.0)  # slot 0, position 5 -> page table[0, 1] = 5, offset 1
  assert np.all(kp2[:, 0, 1] == 2.0)  # idle slot 1 -> scratch page 0
  assert np.count_nonzero(kp2) == 2 * kv_heads * dim


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1)])
def test_pallas_kernel_interpreted_equals_jax_path(heads, kv_heads):
  """Ragged lengths (0, one key, mid-page, page-aligned, the full sequence) over shuffled pages, in several compute
  blocks. Keys and values are bfloat16 values held in float32: the kernel reads them in bfloat16, exactly then."""
  pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
  rng = np.random.default_rng(2)
  slots, dim, page, m = 5, 8, 4, 8
  lengths = np.array([0, 1, 7, 16, m * page], np.int32)
  q, _, _, kp, vp, ids = _random_paged(rng, slots=slots, heads=heads, kv_heads=kv_heads, dim=dim, page=page,
                                       pages_per_seq=m, lengths=lengths)
  kp, vp = (jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32) for x in (kp, vp))
  args = (jnp.asarray(q), kp, vp, jnp.asarray(lengths), jnp.asarray(ids))
  want = paged_attention(*args)
  with pltpu.force_tpu_interpret_mode():
    got = jax.jit(functools.partial(pallas_paged_attention, block_tokens=2 * page))(*args)  # 4 blocks of 2 pages
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(got)[0] == 0)  # length 0: zeros


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2)])
def test_pallas_gpu_kernel_interpreted_equals_jax_path(heads, kv_heads):
  """The GPU decode path under the sampler's shard_map (slots and pages over 2 data shards), the Pallas GPU kernel
  interpreted on CPU: ragged lengths (an idle slot, one key, mid-page, page-aligned, full) over shuffled pages, in
  several splits and compute blocks, query heads per KV head not a multiple of the kernel's head block."""
  rng = np.random.default_rng(3)
  slots, dim, page, m = 4, 16, 4, 8
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  lengths = np.array([0, 1, 7, m * page, 16, 5, 3, 2], np.int32)
  q, _, _, kp, vp, ids = _random_paged(rng, slots=2 * slots, heads=heads, kv_heads=kv_heads, dim=dim, page=page,
                                       pages_per_seq=m, lengths=lengths)
  k_new = jnp.asarray(rng.normal(size=(2 * slots, kv_heads, dim)), jnp.float32)
  kp2, vp2 = (jnp.concatenate([jnp.asarray(x)] * 2, axis=1) for x in (kp, vp))  # each data shard: a copy of the pool
  table = jnp.asarray(ids)
  args = (jnp.asarray(q), k_new, k_new, kp2, vp2, table, jnp.asarray(np.maximum(lengths - 1, 0)),
          jnp.asarray(lengths > 0))
  want = attention.sharded_decode_attention(mesh, kv_heads, impl="jax", pages_per_block=2)(*args)
  got = jax.jit(attention.sharded_decode_attention(mesh, kv_heads, impl="pallas_gpu", pages_per_block=2,
                                                   interpret=True))(*args)
  np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(got[0])[0] == 0)  # the idle slot: zeros


# A speculative call's key counts per slot and query (Q = 3): a dead slot, one key, lengths ending mid-page and at the
# table's end (8 pages of 4), a dead query in a live slot.
VERIFY_LENGTHS = np.array([[0, 0, 0], [1, 2, 3], [7, 8, 9], [30, 31, 32], [13, 0, 15]], np.int32)


@pytest.mark.parametrize("heads,kv_heads,pages_per_block", [(4, 2, 3), (6, 2, 2), (4, 1, 8)])
def test_verify_kernel_interpreted_equals_jax_path(heads, kv_heads, pages_per_block):
  """The verify attention's Pallas TPU kernel, interpreted, against `paged_attention_queries` (itself, query by
  query, `paged_attention`) over shuffled pages, in blocks of several pages (the last past the page table with 3),
  query heads per KV head 2 to 4 (tiles of 6 to 12 rows padded to 8 or 16); a call with every slot dead gives zeros."""
  pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
  from areal_jax.sampler.attention import paged_attention_queries
  from areal_jax.sampler.verify_kernel import paged_verify_attention

  rng = np.random.default_rng(4)
  slots, nq, dim, page, m = 5, 3, 8, 4, 8
  _, _, _, kp, vp, ids = _random_paged(rng, slots=slots, heads=heads, kv_heads=kv_heads, dim=dim, page=page,
                                       pages_per_seq=m, lengths=None)
  q = jnp.asarray(rng.normal(size=(slots, nq, heads, dim)), jnp.float32)
  args = (q, jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(VERIFY_LENGTHS), jnp.asarray(ids))
  want = paged_attention_queries(*args, pages_per_block=pages_per_block)
  for j in range(nq):
    np.testing.assert_allclose(want[:, j], paged_attention(q[:, j], *args[1:3], args[3][:, j], args[4]), atol=1e-6)
  kernel = jax.jit(functools.partial(paged_verify_attention, pages_per_block=pages_per_block))
  with pltpu.force_tpu_interpret_mode():
    got = kernel(*args)
    dead = kernel(*args[:3], jnp.zeros_like(args[3]), args[4])
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(got)[0] == 0) and np.all(np.asarray(got)[4, 1] == 0)  # dead rows: zeros
  assert np.all(np.asarray(dead) == 0)


def test_write_chunks_keeps_only_this_shard():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  k = jnp.arange(2 * 8 * 1 * 2, dtype=jnp.float32).reshape(2, 8, 1, 2)  # B=2, T=8, K=1, D=2, page 4
  pages = jnp.zeros((1, 5, 4, 2))
  f = jax.shard_map(lambda *a: write_chunks(*a), mesh=mesh, in_specs=jax.sharding.PartitionSpec(),
                    out_specs=jax.sharding.PartitionSpec(), check_vma=False)
  out, _ = f(pages, pages, k, k, jnp.array([1, 0, 0]), jnp.array([1, 0, 1]), jnp.array([3, 1, 2]),
             jnp.array([0, 0, 1]))
  out = np.asarray(out)
  np.testing.assert_array_equal(out[0, 3], np.asarray(k)[1, 4:8, 0])
  np.testing.assert_array_equal(out[0, 1], np.asarray(k)[0, 0:4, 0])
  assert np.all(out[0, 2] == 0)  # chunk for shard 1 dropped


def test_pallas_tpu_path_compiles_for_v5e():
  pytest.importorskip("libtpu", reason="libtpu (the `tpu` extra) compiles for TPU topologies")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process on this machine may hold libtpu's lock
  topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
  from areal_jax.aot_check import pallas_kernels
  from areal_jax.sampler.aot import lower_sampler

  mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(2, 2), ("data", "tensor"))
  cfg = ModelConfig(family="qwen2", vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
                    num_kv_heads=4, head_dim=128, attention_bias=True, dtype="bfloat16", param_dtype="bfloat16")
  sc = SamplerConfig(num_slots=8, page_size=16, num_pages=64, max_seq_len=128, attention="pallas_tpu",
                     speculation="suffix")
  lowered = lower_sampler(cfg, sc, mesh, prefill_len=32)
  decode = lowered["decode"].compile()
  assert "tpu_custom_call" in lowered["decode"].as_text()  # the Pallas kernel, not the pure-JAX fallback
  # The speculative call's verify attention: its own kernel, through Mosaic's tiling checks (interpret mode has none).
  assert pallas_kernels(lowered["speculate"].compile()) == ("paged_verify_attention",)
  assert decode.memory_analysis() is not None
  # The pool is carried through the decode loop (8 steps) and updated in place: no copy of a layer's pages, which
  # XLA inserted (entering and leaving the loop, and per layer and step) while the cache write was a scatter.
  # A layer's pages per device: 2 of 4 heads (tensor), 32 of 64 pages (data), 16 x 128 (with one head per device
  # XLA kept the default layout even with the scatter).
  assert sc.decode_steps == 8 and " while(" in decode.as_text()
  copies = re.findall(r"= bf16\[2,32,16,128\]\{[^}]*\} copy\(", decode.as_text())
  assert not copies, f"{len(copies)} copies of a layer's pages in the decode program"
  lowered["insert"].compile()
  lowered["prefill_after"].compile()  # the prefix cache's pages gathered per data shard under shard_map


def test_prefill_attention_in_query_blocks_equals_dense():
  from areal_jax.models.modules import packed_mask
  from areal_jax.sampler.attention import prefill_attention

  rng = np.random.default_rng(1)
  b, t, h, kh, d = 2, 48, 4, 2, 8
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, t, kh, d)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, t, kh, d)), jnp.float32)
  lengths = jnp.array([48, 29])
  seg = (jnp.arange(t)[None] < lengths[:, None]).astype(jnp.int32)
  want = gqa_attention(q, k, v, packed_mask(seg))
  for chunk in (48, 16, 12):
    np.testing.assert_allclose(prefill_attention(q, k, v, lengths, query_chunk=chunk), want, atol=1e-6)


@pytest.mark.parametrize("pages_per_block,query_chunk", [(1, 512), (4, 6)])
def test_prefill_after_cached_pages_equals_dense_over_the_whole_sequence(pages_per_block, query_chunk):
  """Rows that continue 0, 1, 3 and 5 cached pages: the same as a causal prefill of past + new tokens, read at the
  new tokens' positions."""
  from areal_jax.models.modules import packed_mask
  from areal_jax.sampler.attention import prefill_attention_after

  rng = np.random.default_rng(2)
  b, h, kh, d, page, m, t = 4, 4, 2, 8, 4, 6, 12
  past = np.array([0, 4, 12, 20], np.int32)
  lengths = np.array([12, 7, 1, 4], np.int32)
  _, kfull, vfull, kp, vp, ids = _random_paged(rng, slots=b, heads=h, kv_heads=kh, dim=d, page=page,
                                               pages_per_seq=m, lengths=None)
  q = rng.normal(size=(b, t, h, d)).astype(np.float32)
  k, v = rng.normal(size=(2, b, t, kh, d)).astype(np.float32)
  got = prefill_attention_after(*map(jnp.asarray, (q, k, v, lengths, kp, vp, ids, past)),
                                pages_per_block=pages_per_block, query_chunk=query_chunk)
  for r in range(b):
    n, total = past[r], past[r] + lengths[r]
    keys = np.concatenate([kfull[r, :n], k[r, :lengths[r]]])[None]
    vals = np.concatenate([vfull[r, :n], v[r, :lengths[r]]])[None]
    queries = np.zeros((1, total, h, d), np.float32)
    queries[0, n:] = q[r, :lengths[r]]
    want = gqa_attention(queries, keys, vals, packed_mask(np.ones((1, total), np.int32)))[0, n:]
    np.testing.assert_allclose(got[r, :lengths[r]], want, atol=1e-5)
    assert not np.any(got[r, lengths[r]:])  # padding queries attend to nothing
