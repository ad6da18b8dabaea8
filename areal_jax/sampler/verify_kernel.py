"""A Pallas TPU kernel for a speculative call's verify attention: Q queries per slot over the slot's pages, in the
sampler's cache layout `[kv_heads, num_pages, page_size, head_dim]` (the layout JAX's bundled decode kernel reads).

Same contract as `attention.paged_attention_queries`: q [S, Q, H, D] (H = kv_heads * group), lengths [S, Q] the keys
query j attends to (0: a dead row, zero output), page_table [S, M] page ids. JAX's `ragged_paged_attention` takes
several queries per sequence too, but wants keys and values interleaved per page (`[pages, page_size, 2 * kv_heads,
head_dim]`), so it would need a copy of the whole pool per call.

How it runs. The grid is (slot, kv head, block of `pages_per_block` pages). The page table and the lengths are
scalar-prefetched (`pltpu.PrefetchScalarGridSpec`) into SMEM, where the BlockSpec index maps read them: keys and values
each come in as `pages_per_block` operands (the same pool each time), operand j's index map choosing page j of the
block through the page table, so Pallas' pipeline copies a block's pages into VMEM while the previous block
computes. A slot's Q queries times the group's query heads of one kv head form one tile of Q * group rows (padded to
a multiple of 8) by D, row j * group + g being query j's head g: one matmul per block serves all of them. An online
softmax keeps its running max, denominator and weighted values in VMEM scratch across the slot's blocks; each row
masks keys at or past its query's length. The block axis runs to the call's longest slot (a dynamic grid bound), not
the page table's width; a slot's blocks past its own longest query compute nothing and map to its last needed block's
pages (an unchanged block index: no copy), so a call costs about what the slots hold.

Numerics mirror the pure-JAX path: scores q.k in the inputs' dtype with float32 accumulation, scaled by 1/sqrt(D)
after the matmul, probabilities cast to the values' dtype for p.v. Page ids must be pages of the pool.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_ROWS = 8  # a tile's second-minor dimension: the [rows, D] query tile is padded to a multiple of it


def _kernel(blocks_ref, lengths_ref, table_ref, q_ref, *refs, pages_per_block: int, num_queries: int, group: int,
            scale: float):
  """One (slot, kv head, page block) step. refs: `pages_per_block` key pages [page, D], as many value pages, the
  output tile [R, D], and the scratch: running max [R, 1], denominator [R, 1], weighted values [R, D]."""
  del table_ref  # read by the index maps only
  k_refs, v_refs = refs[:pages_per_block], refs[pages_per_block:2 * pages_per_block]
  o_ref, max_ref, denom_ref, acc_ref = refs[2 * pages_per_block:]
  slot, blk = pl.program_id(0), pl.program_id(2)
  block = pages_per_block * k_refs[0].shape[0]

  @pl.when(blk == 0)
  def _init():
    max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
    denom_ref[...] = jnp.zeros(denom_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(blk < blocks_ref[slot])
  def _attend():
    # Row r is query r // group's: its key limit. Padding rows keep 0 (no keys).
    rows = jax.lax.broadcasted_iota(jnp.int32, (o_ref.shape[0], 1), 0)
    limit = jnp.zeros(rows.shape, jnp.int32)
    for j in range(num_queries):
      limit = jnp.where((rows >= j * group) & (rows < (j + 1) * group), lengths_ref[slot * num_queries + j], limit)
    k = jnp.concatenate([r[...] for r in k_refs], axis=0)  # [block, D]
    v = jnp.concatenate([r[...] for r in v_refs], axis=0)
    q = q_ref[...]
    dtype = jnp.promote_types(q.dtype, k.dtype)
    scores = jax.lax.dot_general(q.astype(dtype), k.astype(dtype), (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32) * scale  # [R, block]
    keys = blk * block + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    scores = jnp.where(keys < limit, scores, -jnp.inf)
    prev = max_ref[...]
    new = jnp.maximum(prev, scores.max(axis=1, keepdims=True))
    safe = jnp.where(new == -jnp.inf, 0.0, new)  # a row with no key yet: exp(-inf - 0) = 0, not NaN
    probs = jnp.exp(scores - safe)
    corr = jnp.exp(prev - safe)
    max_ref[...] = new
    denom_ref[...] = denom_ref[...] * corr + probs.sum(axis=1, keepdims=True)
    acc_ref[...] = acc_ref[...] * corr + jnp.dot(probs.astype(v.dtype), v, preferred_element_type=jnp.float32)

  @pl.when(blk == pl.num_programs(2) - 1)
  def _finish():
    denom = denom_ref[...]
    out = jnp.where(denom > 0, acc_ref[...] / jnp.maximum(denom, 1e-30), 0.0)
    o_ref[...] = out.astype(o_ref.dtype)


def paged_verify_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                           page_table: jax.Array, *, pages_per_block: int = 8) -> jax.Array:
  """`attention.paged_attention_queries` on the Pallas TPU kernel (on CPU under `pltpu.force_tpu_interpret_mode()`).

  q: [S, Q, H, D]; k_pages, v_pages: [K, N, page_size, D]; lengths: [S, Q]; page_table: [S, M]. Blocks of
  `pages_per_block` pages (at most M). Returns [S, Q, H, D] in q's dtype.
  """
  s, nq, h, d = q.shape
  kh, _, page, _ = k_pages.shape
  m = page_table.shape[1]
  group = h // kh
  ppb = max(1, min(pages_per_block, m))
  block = ppb * page
  rows = -(-nq * group // _ROWS) * _ROWS

  lengths = lengths.astype(jnp.int32)
  blocks = (jnp.max(lengths, axis=1) + block - 1) // block  # [S] blocks each slot needs
  tiles = jnp.swapaxes(q.reshape(s, nq, kh, group, d), 1, 2).reshape(s, kh, nq * group, d)
  tiles = jnp.pad(tiles, ((0, 0), (0, 0), (0, rows - nq * group), (0, 0)))

  def page_map(j):
    def index(slot, head, blk, blocks_ref, lengths_ref, table_ref):
      del lengths_ref
      last = jnp.minimum(blk, jnp.maximum(blocks_ref[slot] - 1, 0))  # past the needed blocks: no new copy
      col = jnp.minimum(last * ppb + j, m - 1)  # a last block past the table: its last page again, all masked
      return head, table_ref[slot * m + col], 0, 0
    return index

  pages = [pl.BlockSpec((None, None, page, d), page_map(j)) for j in range(ppb)]
  tile = pl.BlockSpec((None, None, rows, d), lambda slot, head, blk, *_: (slot, head, 0, 0))
  kernel = functools.partial(_kernel, pages_per_block=ppb, num_queries=nq, group=group, scale=1.0 / math.sqrt(d))
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3,
          grid=(s, kh, jnp.maximum(jnp.max(blocks), 1)),  # dynamic: up to the longest slot's blocks
          in_specs=[tile, *pages, *pages],
          out_specs=tile,
          scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                          pltpu.VMEM((rows, d), jnp.float32)]),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
      out_shape=jax.ShapeDtypeStruct(tiles.shape, q.dtype),
      name="paged_verify_attention",
  )(blocks, lengths.reshape(-1), page_table.astype(jnp.int32).reshape(-1), tiles, *[k_pages] * ppb,
    *[v_pages] * ppb)
  out = out[:, :, :nq * group].reshape(s, kh, nq, group, d)
  return jnp.swapaxes(out, 1, 2).reshape(s, nq, h, d)
