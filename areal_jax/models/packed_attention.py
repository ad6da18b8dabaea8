"""Training attention over packed rows, causal within each segment, in time linear in the row length.

A packed row holds several sequences back to back (`segment_ids`, 0 = padding); a token attends to the tokens before
it in its own segment. Computed densely (`modules.dense_attention`, the reference), a row of T tokens costs T² score
pairs however short its sequences are. Two exact implementations avoid that:

* `flash` (pure JAX, every backend): queries and keys are cut into blocks; query block i visits only the key blocks
  from the one holding the start of its earliest segment up to block i, and in the backward pass key block j visits
  only the query blocks up to the end of its latest segment. Online softmax forward, logsumexp saved, two backward
  passes (dq; dk and dv), under one `jax.custom_vjp`. A segment of L tokens costs about (L / block + 1)² / 2 block
  pairs, so a row costs Σ L² / 2 + T · block pairs instead of T² / 2. Segments must be contiguous, as the learner
  packs them.
* `splash` (TPU): JAX's Pallas splash-attention kernel with segment ids, given block tables made from each row's
  segments (`splash_block_tables`), so it visits the same blocks as `flash` (per row) instead of every block below the
  causal diagonal.
* `pallas_gpu` (GPU): JAX's Pallas GPU (Triton) flash-attention kernel (`pallas.ops.gpu.attention.mha`) with segment
  ids, forward and backward. It visits every block below the causal diagonal (T² / 2 pairs a row, masked by segment)
  and has no grouped heads, so keys and values are repeated to the query heads.

Inside a sharding context (`sharding.use_rules`) `packed_attention` runs either one per device under `shard_map` (rows
over the batch axes, heads over `tensor`), so the block bounds of one device's rows never need another device.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from areal_jax import sharding
from areal_jax.models.config import ATTENTION_IMPLS as IMPLS

# Tokens per query/key block of the pure-JAX kernel, by platform (tools/bench_attention.py: on a 2-core CPU 128 beat
# 64 and 256; on an H100, bfloat16, 512 was 1.9x faster than 256 at 32k-token rows).
FLASH_BLOCK = {"cpu": 128}
FLASH_BLOCK_DEFAULT = 512
SPLASH_BLOCK = 512  # the splash kernel's largest tile; rows are padded to a multiple of 128


def block_ranges(segment_ids: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """(first key block of each query block, last query block of each key block), shared by the rows: [T / block] each.

  Query block i needs key blocks first[i]..i (first[i] > i: no real query); key block j is needed by query blocks
  j..last[j] (last[j] < j: no real key).
  """
  rows, t = segment_ids.shape
  idx = jnp.arange(t)
  real = segment_ids != 0
  starts = jnp.concatenate([jnp.ones((rows, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  ends = jnp.concatenate([segment_ids[:, 1:] != segment_ids[:, :-1], jnp.ones((rows, 1), bool)], axis=1)
  seg_start = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
  seg_end = jax.lax.cummin(jnp.where(ends, idx, t - 1), axis=1, reverse=True)
  n = t // block
  first = jnp.where(real, seg_start, t).reshape(rows, n, block).min((0, 2)) // block
  last = jnp.where(real, seg_end, -block).reshape(rows, n, block).max((0, 2)) // block
  return first, last


def _scores(qi, kj, si, sj, i, j, block: int, scale: float):
  """Masked float32 scores of query block i against key block j: [B, K, G, block, block]."""
  s = jnp.einsum("bkgqd,bksd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale
  qpos = i * block + jnp.arange(block)
  kpos = j * block + jnp.arange(block)
  mask = (qpos[:, None] >= kpos[None, :])[None] & (si[:, :, None] == sj[:, None, :]) & (si != 0)[:, :, None]
  return jnp.where(mask[:, None, None], s, -jnp.inf)


def _slice(x, i, block: int, axis: int):
  return jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=axis)


def _forward(q, k, v, seg, block: int, scale: float):
  """(out [B, K, G, T, D], logsumexp [B, K, G, T]; +inf where a query sees no key)."""
  first, last = block_ranges(seg, block)
  n = seg.shape[1] // block

  def query_block(i):
    qi, si = _slice(q, i, block, 3), _slice(seg, i, block, 1)

    def body(j, carry):
      m, l, acc = carry
      s = _scores(qi, _slice(k, j, block, 2), si, _slice(seg, j, block, 1), i, j, block, scale)
      m_new = jnp.maximum(m, s.max(-1))
      safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(s - safe[..., None])
      corr = jnp.exp(m - safe)
      acc = acc * corr[..., None] + jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), _slice(v, j, block, 2),
                                               preferred_element_type=jnp.float32)
      return m_new, l * corr + p.sum(-1), acc

    shape = qi.shape[:-1]
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(qi.shape, jnp.float32))
    m, l, acc = jax.lax.fori_loop(first[i], i + 1, body, init)
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    return out.astype(q.dtype), jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)

  out, lse = jax.lax.map(query_block, jnp.arange(n))  # [n, B, K, G, block, ...]
  out = jnp.moveaxis(out, 0, 3).reshape(q.shape)
  lse = jnp.moveaxis(lse, 0, 3).reshape(q.shape[:-1])
  return out, lse, (first, last)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, seg, block: int, scale: float):
  return _forward(q, k, v, seg, block, scale)[0]


def _flash_fwd(q, k, v, seg, block, scale):
  out, lse, ranges = _forward(q, k, v, seg, block, scale)
  return out, (q, k, v, seg, out, lse, ranges)


def _flash_bwd(block, scale, res, dout):
  q, k, v, seg, out, lse, (first, last) = res
  n = seg.shape[1] // block
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, K, G, T]

  def probs(i, j, qi, si, kj, vj, doi, lsei, di):
    """p and dS of query block i against key block j."""
    s = _scores(qi, kj, si, _slice(seg, j, block, 1), i, j, block, scale)
    p = jnp.exp(s - lsei[..., None])
    dp = jnp.einsum("bkgqd,bksd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
    return p, p * (dp - di[..., None])

  def query_side(i):
    return (_slice(q, i, block, 3), _slice(seg, i, block, 1), _slice(dout, i, block, 3), _slice(lse, i, block, 3),
            _slice(delta, i, block, 3))

  def dq_block(i):
    qi, si, doi, lsei, di = query_side(i)

    def body(j, dq):
      kj = _slice(k, j, block, 2)
      _, ds = probs(i, j, qi, si, kj, _slice(v, j, block, 2), doi, lsei, di)
      return dq + jnp.einsum("bkgqs,bksd->bkgqd", ds.astype(k.dtype), kj, preferred_element_type=jnp.float32)

    return jax.lax.fori_loop(first[i], i + 1, body, jnp.zeros(qi.shape, jnp.float32)) * scale

  def dkv_block(j):
    kj, vj = _slice(k, j, block, 2), _slice(v, j, block, 2)

    def body(i, carry):
      dk, dv = carry
      qi, si, doi, lsei, di = query_side(i)
      p, ds = probs(i, j, qi, si, kj, vj, doi, lsei, di)
      dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p.astype(dout.dtype), doi, preferred_element_type=jnp.float32)
      dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds.astype(q.dtype), qi, preferred_element_type=jnp.float32)
      return dk, dv

    zeros = jnp.zeros(kj.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(j, last[j] + 1, body, (zeros, zeros))
    return dk * scale, dv

  dq = jnp.moveaxis(jax.lax.map(dq_block, jnp.arange(n)), 0, 3).reshape(q.shape)
  dk, dv = jax.lax.map(dkv_block, jnp.arange(n))
  dk, dv = (jnp.moveaxis(x, 0, 2).reshape(k.shape) for x in (dk, dv))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_rows(x, t: int, axis: int = 1):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, t - x.shape[axis])
  return jnp.pad(x, pad)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                    block: int = 128) -> jax.Array:
  """Causal attention within contiguous packed segments, skipping blocks no segment spans (exact; custom VJP).

  q: [B, T, H, D]; k, v: [B, T, K, D] (H a multiple of K); segment_ids: [B, T] (0 = padding, zero output).
  """
  b, t, h, d = q.shape
  kh = k.shape[2]
  block = min(block, t)
  tp = -(-t // block) * block
  qg = _pad_rows(q, tp).reshape(b, tp, kh, h // kh, d).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
  kk, vv = (_pad_rows(x, tp).transpose(0, 2, 1, 3) for x in (k, v))  # [B, K, T, D]
  out = _flash(qg, kk, vv, _pad_rows(segment_ids, tp), block, 1.0 / math.sqrt(d))
  return out.transpose(0, 3, 1, 2, 4).reshape(b, tp, h, d)[:, :t]


def _causal(q_ids, kv_ids):
  return q_ids >= kv_ids


def _smem_int(n: int):
  """The smallest integer type for block indices below `n` (the block tables live in the TPU's scarce scalar memory)."""
  return jnp.int8 if n <= 127 else jnp.int16 if n <= 32767 else jnp.int32


def splash_block_tables(segment_ids: jax.Array, block: int):
  """The splash kernel's block tables (`MaskInfo`s: forward, dq, dkv) for one packed row `segment_ids` [T]: which
  block pairs it computes, from the segments, not from the causal mask alone.

  The kernel walks a grid of (query block, step) and loads at each step the key block `data_next` names, computing it
  only where `block_mask` > 0. Query block i computes key blocks first[i]..i (`block_ranges`), in order, then repeats
  the last index (no new copy) with `block_mask` 0; the dkv grid walks key block j's query blocks j..last[j], padded
  at the front with its first one. The causal mask inside a block comes from the kernel's mask function, segments
  from the segment ids.
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info  # pylint: disable=g-import-not-at-top
  t = segment_ids.shape[0]
  n = t // block
  first, last = block_ranges(segment_ids[None], block)
  idx, step = jnp.arange(n), jnp.arange(n)
  itype = _smem_int(n)

  # Forward and dq: row i, step s -> key block first[i] + s while that is <= i.
  kv = first[:, None] + step[None, :]
  real = kv <= idx[:, None]
  data_next = jnp.where(real, kv, idx[:, None])
  block_mask = jnp.where(real, jnp.where(kv == idx[:, None], 1, 2), 0)
  forward = info.MaskInfo(data_next=data_next[None].astype(itype), mask_next=None,
                          block_mask=block_mask[None].astype(jnp.int8), partial_mask_blocks=None,
                          q_sequence=jnp.arange(t, dtype=jnp.int32))

  # dkv: key block j, step s -> query block j + s - (n - count_j) for the last count_j steps; [step, key block].
  count = jnp.maximum(last - idx + 1, 0)
  offset = step[:, None] - (n - count[None, :])
  real = offset >= 0
  data_next = jnp.where(real, idx[None, :] + offset, idx[None, :])
  block_mask = jnp.where(real, jnp.where(offset == 0, 1, 2), 0)
  dkv = info.MaskInfo(data_next=data_next[None].astype(itype), mask_next=None,
                      block_mask=block_mask[None].astype(jnp.int8), partial_mask_blocks=None,
                      q_sequence=jnp.arange(t, dtype=jnp.int32))
  return forward, forward, dkv


def splash_blocks_computed(segment_ids, block: int) -> int:
  """How many (query block, key block) pairs the splash kernel computes for rows `segment_ids` [B, T] (numpy), per
  head, forward pass; the backward computes the same pairs twice (dq, dkv)."""
  seg = np.asarray(segment_ids)
  return int(sum(int((np.asarray(splash_block_tables(jnp.asarray(row), block)[0].block_mask) > 0).sum())
                 for row in seg))


def splash_block(length: int) -> int:
  """The splash kernel's block for rows of `length` tokens (a multiple of 128): the largest tile that divides it."""
  return max(x for x in (128, 256, SPLASH_BLOCK) if length % x == 0)


def _splash_row(q, k, v, seg, *, block: int, interpret: bool):
  """One row through JAX's splash kernel with block tables made from its segments: q [H, T, D], k, v [K, T, D]."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash  # pylint: disable=g-import-not-at-top
  blk = block
  sizes = splash.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                            block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
  kernel = splash.SplashAttentionKernel(*splash_block_tables(seg, blk), block_sizes=sizes, is_mqa=False,
                                        save_residuals=False, mask_value=splash.DEFAULT_MASK_VALUE,
                                        attn_logits_soft_cap=None, residual_checkpoint_name=None,
                                        mask_function=_causal, interpret=interpret)
  return kernel(q, k, v, segment_ids=splash.SegmentIds(seg, seg))


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, block: int = 0,
                     interpret: bool = False) -> jax.Array:
  """The same contract on JAX's Pallas TPU splash-attention kernel (`interpret`: run it on CPU, for tests), each row
  with block tables made from its own segments (`splash_block_tables`). `block`: a multiple of 128 (0: by length)."""
  b, t, h, d = q.shape
  if block % 128:
    raise ValueError(f"splash attention blocks are multiples of 128 tokens, not {block}")
  tp = -(-t // (block or 128)) * (block or 128)
  block = block or splash_block(tp)
  qs = (_pad_rows(q, tp).astype(jnp.float32) / math.sqrt(d)).astype(q.dtype).transpose(0, 2, 1, 3)  # [B, H, T, D]
  ks, vs = (_pad_rows(x, tp).transpose(0, 2, 1, 3) for x in (k, v))
  out = jax.vmap(functools.partial(_splash_row, block=block, interpret=interpret))(qs, ks, vs, _pad_rows(segment_ids, tp))
  out = out.transpose(0, 2, 1, 3)[:, :t]
  return jnp.where((segment_ids != 0)[..., None, None], out, 0).astype(q.dtype)


GPU_BLOCK = 64  # the Pallas GPU kernel's query/key tile (its default is 128; 64 keeps bfloat16 tiles of d=128 in SRAM)


def pallas_gpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, block: int = GPU_BLOCK,
                         interpret: bool = False) -> jax.Array:
  """The same contract on JAX's Pallas GPU flash kernel (`interpret`: run it on CPU, for tests). Rows are padded to a
  multiple of `block`; keys and values are repeated to the query heads (the kernel has no grouped heads)."""
  from jax.experimental.pallas.ops.gpu import attention as gpu  # pylint: disable=g-import-not-at-top

  b, t, h, d = q.shape
  tp = -(-t // block) * block
  k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
  sizes = gpu.BlockSizes(block_q=block, block_k=block, block_q_dkv=block, block_kv_dkv=block, block_q_dq=block,
                         block_kv_dq=block)
  out = gpu.mha(_pad_rows(q, tp), _pad_rows(k, tp), _pad_rows(v, tp), _pad_rows(segment_ids, tp),
                sm_scale=1.0 / math.sqrt(d), causal=True, block_sizes=sizes, interpret=interpret)
  return jnp.where((segment_ids != 0)[..., None, None], out[:, :t], 0).astype(q.dtype)


def resolve(impl: str, length: int, block: int) -> str:
  """`auto` → `splash` on TPU, `pallas_gpu` on GPU; elsewhere `flash`, or `dense` for rows of at most two blocks, where
  skipping blocks saves at most a quarter of the work and the loops cost more to compile than they save (the tiny CPU
  preset's rows)."""
  if impl not in IMPLS:
    raise ValueError(f"attention implementation {impl!r}; choose one of {IMPLS}")
  if impl != "auto":
    return impl
  if sharding.platform() in ("tpu", "gpu"):
    return "splash" if sharding.platform() == "tpu" else "pallas_gpu"
  return "dense" if length <= 2 * block else "flash"


def packed_attention(segment_ids: jax.Array, *, impl: str = "auto", block: int = 0, interpret: bool = False):
  """The training `attend(q, k, v) -> (out, None)` over packed rows (see the module docstring); `dense` is
  `modules.dense_attention`, the quadratic reference. `block`: tokens per block (0: by platform for `flash`, by row
  length for `splash`)."""
  impl = resolve(impl, segment_ids.shape[1], block or FLASH_BLOCK.get(sharding.platform(), FLASH_BLOCK_DEFAULT))
  if impl == "dense":
    from areal_jax.models.modules import dense_attention  # pylint: disable=g-import-not-at-top
    return dense_attention(segment_ids)
  if impl == "splash":
    local = functools.partial(splash_attention, block=block, interpret=interpret)
  elif impl == "pallas_gpu":
    local = functools.partial(pallas_gpu_attention, block=block or GPU_BLOCK, interpret=interpret)
  else:
    local = functools.partial(flash_attention, block=block or FLASH_BLOCK.get(sharding.platform(), FLASH_BLOCK_DEFAULT))

  def attend(q, k, v):
    ctx = sharding.current()
    if ctx is None:
      return local(q, k, v, segment_ids), None
    mesh, rules = ctx
    qs = sharding.spec(q.shape, ("batch", None, "act_heads", None), mesh, rules)
    ks = sharding.spec(k.shape, ("batch", None, "act_kv_heads", None), mesh, rules)
    if qs[2] != ks[2]:  # query heads split but not KV heads: keep every group whole on each device
      qs, ks = P(qs[0], None, None, None), P(ks[0], None, None, None)
    out = jax.shard_map(local, mesh=mesh, in_specs=(qs, ks, ks, P(qs[0], None)), out_specs=qs,
                        check_vma=False)(q, k, v, segment_ids)
    return out, None

  return attend
