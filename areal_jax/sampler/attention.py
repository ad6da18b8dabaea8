"""Paged attention: write each decode step's keys/values into the page pool, then attend over a slot's pages.

Cache layout per layer: `[kv_heads, num_pages, page_size, head_dim]` (the Pallas TPU kernel's layout), pages sharded
over the mesh's `data` axis and heads over `tensor`. Both attention implementations run per device inside
`shard_map`: every data shard holds the pages of its own slots, so page ids are local and no page crosses devices.

* `paged_attention`: pure JAX (CPU/GPU, and the TPU fallback). An online-softmax loop over blocks of pages that stops
  at the longest live sequence, so a step costs what the sequences hold, not the cache's maximum length.
* `paged_attention_queries`: several queries per sequence over its pages (a speculative call's verified positions);
  beside the Pallas TPU decode kernel, `verify_kernel.paged_verify_attention` (a Pallas TPU kernel) runs instead.
* `prefill_attention_after`: a prefill's queries over the pages a row continues (the prefix cache's) and its own
  keys, pure JAX, one program for any number of cached pages.
* `pallas_paged_attention`: `jax.experimental.pallas.ops.tpu.paged_attention` (TPU; on CPU under Pallas' TPU
  interpret mode, for tests). Chosen over `ragged_paged_attention` because it reads this layout as it is (the ragged
  kernel wants keys and values interleaved per page, `[pages, page_size, 2 * kv_heads, head_dim]`) and the engine
  prefills densely, so it needs decode only. The kernel reads keys and values in bfloat16 whatever the cache's dtype.
* `pallas_gpu_paged_attention`: `jax.experimental.pallas.ops.gpu.paged_attention` (GPU, Triton; on CPU in Pallas
  interpret mode, for tests), which reads the same layout. It splits each sequence's pages over `k_splits` programs
  and visits every page of the table (masked past the length), not only up to the longest live sequence.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from areal_jax.models.modules import blockwise_attention
from areal_jax.sampler.paging import SCRATCH_PAGE


def _in_blocks(page_table: jax.Array, pages_per_block: int) -> tuple[jax.Array, int]:
  """The page table padded (with the scratch page) to whole blocks, and the pages per block."""
  m = page_table.shape[1]
  ppb = max(1, min(pages_per_block, m))
  if m % ppb:
    page_table = jnp.pad(page_table, ((0, 0), (0, ppb - m % ppb)), constant_values=SCRATCH_PAGE)
  return page_table, ppb


def _softmax_init(shape: tuple[int, ...], d: int):
  """An online softmax over no keys yet: (running max, denominator, weighted values [*shape, d])."""
  return (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(shape + (d,), jnp.float32))


def _softmax_update(carry, scores: jax.Array, values: jax.Array, spec: str):
  """The online softmax after one more block of keys: `scores` (-inf where masked) and their `values`, combined by
  the einsum `spec` (probabilities, values -> weighted values)."""
  mx, denom, acc = carry
  new_mx = jnp.maximum(mx, scores.max(-1))
  safe = jnp.where(jnp.isfinite(new_mx), new_mx, 0.0)
  probs = jnp.exp(scores - safe[..., None])
  corr = jnp.exp(mx - safe)
  acc = acc * corr[..., None] + jnp.einsum(spec, probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
  return new_mx, denom * corr + probs.sum(-1), acc


def _softmax_result(carry) -> jax.Array:
  """The attention output; zero where no key was visible."""
  _, denom, acc = carry
  return jnp.where(denom[..., None] > 0, acc / jnp.maximum(denom, 1e-30)[..., None], 0.0)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                    page_table: jax.Array, *, pages_per_block: int = 8) -> jax.Array:
  """Decode attention of one query per sequence over its pages.

  q: [S, H, D]; k_pages, v_pages: [K, N, page_size, D]; lengths: [S] keys to attend (0 gives a zero output);
  page_table: [S, M] page ids. Returns [S, H, D] in q's dtype.
  """
  s, h, d = q.shape
  kh, _, page, _ = k_pages.shape
  page_table, ppb = _in_blocks(page_table, pages_per_block)
  block = ppb * page
  qg = q.reshape(s, kh, h // kh, d)
  scale = 1.0 / math.sqrt(d)

  def body(i, carry):
    pages = jax.lax.dynamic_slice_in_dim(page_table, i * ppb, ppb, axis=1)  # [S, ppb]
    k = k_pages[:, pages].reshape(kh, s, block, d)
    v = v_pages[:, pages].reshape(kh, s, block, d)
    scores = jnp.einsum("skgd,kstd->skgt", qg, k, preferred_element_type=jnp.float32) * scale
    visible = (i * block + jnp.arange(block))[None, :] < lengths[:, None]  # [S, block]
    return _softmax_update(carry, jnp.where(visible[:, None, None, :], scores, -jnp.inf), v, "skgt,kstd->skgd")

  num_blocks = (jnp.max(lengths) + block - 1) // block
  out = _softmax_result(jax.lax.fori_loop(0, num_blocks, body, _softmax_init(qg.shape[:-1], d)))
  return out.reshape(s, h, d).astype(q.dtype)


def paged_attention_queries(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                            page_table: jax.Array, *, pages_per_block: int = 8) -> jax.Array:
  """`paged_attention` of Q queries per sequence (a speculative call's verified positions), each over its own number
  of keys, reading each block of a sequence's pages once for all its queries.

  q: [S, Q, H, D]; lengths: [S, Q] keys query j attends to (0 gives a zero output). Returns [S, Q, H, D].
  """
  s, nq, h, d = q.shape
  kh, _, page, _ = k_pages.shape
  page_table, ppb = _in_blocks(page_table, pages_per_block)
  block = ppb * page
  qg = q.reshape(s, nq, kh, h // kh, d)
  scale = 1.0 / math.sqrt(d)

  def body(i, carry):
    pages = jax.lax.dynamic_slice_in_dim(page_table, i * ppb, ppb, axis=1)  # [S, ppb]
    k = k_pages[:, pages].reshape(kh, s, block, d)
    v = v_pages[:, pages].reshape(kh, s, block, d)
    scores = jnp.einsum("sqkgd,kstd->skgqt", qg, k, preferred_element_type=jnp.float32) * scale
    visible = (i * block + jnp.arange(block))[None, None, :] < lengths[:, :, None]  # [S, Q, block]
    return _softmax_update(carry, jnp.where(visible[:, None, None], scores, -jnp.inf), v, "skgqt,kstd->skgqd")

  num_blocks = (jnp.max(lengths) + block - 1) // block
  out = _softmax_result(jax.lax.fori_loop(0, num_blocks, body, _softmax_init((s, kh, h // kh, nq), d)))
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(s, nq, h, d).astype(q.dtype)


def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                      query_chunk: int = 512) -> jax.Array:
  """Causal attention over the first `lengths[b]` positions of each row (the learner's masking), in blocks of
  `query_chunk` queries when the sequence is longer, so scores take [chunk, T] per head instead of [T, T].

  q: [B, T, H, D]; k, v: [B, T, K, D]. Rows past a sequence's length attend to nothing (zero output).
  """
  keys = jnp.arange(q.shape[1])
  valid = keys[None, :] < lengths[:, None]  # [B, T]

  def block_mask(start, size):
    qpos = start + jnp.arange(size)
    return (keys[None, :] <= qpos[:, None])[None] & valid[:, None, :] & valid[:, qpos][..., None]

  return blockwise_attention(q, k, v, block_mask, query_chunk=query_chunk)


def prefill_attention_after(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, k_pages: jax.Array,
                            v_pages: jax.Array, page_table: jax.Array, past_lengths: jax.Array, *,
                            pages_per_block: int = 8, query_chunk: int = 512) -> jax.Array:
  """`prefill_attention` of rows that continue `past_lengths[b]` tokens already in the pool: each query attends to
  the row's first `past_lengths[b]` cached keys (pages `page_table[b]` of `k_pages`, `v_pages` [K, N, page, D]) and
  causally to the row's own first `lengths[b]` keys (k, v [B, T, K, D]).

  One online softmax: the own keys first, then a loop over blocks of pages that stops at the longest past, so a
  call costs what the rows hold, whatever the page table's width (one compiled program for any past). Queries come in
  blocks of `query_chunk`. Returns [B, T, H, D] in q's dtype; rows past `lengths[b]` are zero.
  """
  b, t, h, d = q.shape
  kh, _, page, _ = k_pages.shape
  page_table, ppb = _in_blocks(page_table, pages_per_block)
  block = ppb * page
  num_blocks = (jnp.max(past_lengths) + block - 1) // block
  chunk = max(c for c in range(1, min(t, query_chunk) + 1) if t % c == 0)
  own = jnp.arange(t)
  scale = 1.0 / math.sqrt(d)

  def queries(start):
    qg = jax.lax.dynamic_slice_in_dim(q, start, chunk, axis=1).reshape(b, chunk, kh, h // kh, d)
    qpos = start + jnp.arange(chunk)
    scores = jnp.einsum("bqkgd,btkd->bkgqt", qg, k, preferred_element_type=jnp.float32) * scale
    visible = (own[None, :] <= qpos[:, None])[None] & (own[None, None, :] < lengths[:, None, None])  # [B, q, T]
    carry = _softmax_update(_softmax_init((b, kh, h // kh, chunk), d),
                            jnp.where(visible[:, None, None], scores, -jnp.inf), v, "bkgqt,btkd->bkgqd")

    def past(i, carry):
      pages = jax.lax.dynamic_slice_in_dim(page_table, i * ppb, ppb, axis=1)  # [B, ppb]
      pk = jnp.moveaxis(k_pages[:, pages].reshape(kh, b, block, d), 0, 2)  # [B, block, K, D]
      pv = jnp.moveaxis(v_pages[:, pages].reshape(kh, b, block, d), 0, 2)
      scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, pk, preferred_element_type=jnp.float32) * scale
      visible = (i * block + jnp.arange(block))[None, :] < past_lengths[:, None]  # [B, block]
      return _softmax_update(carry, jnp.where(visible[:, None, None, None], scores, -jnp.inf), pv,
                             "bkgqs,bskd->bkgqd")

    out = _softmax_result(jax.lax.fori_loop(0, num_blocks, past, carry))  # [B, K, G, q, D]
    out = jnp.where((qpos[None, :] < lengths[:, None])[:, None, None, :, None], out, 0.0)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, chunk, h, d)

  if chunk == t:
    return queries(0).astype(q.dtype)
  out = jax.lax.map(queries, jnp.arange(0, t, chunk))  # [T / chunk, B, chunk, H, D]
  return jnp.moveaxis(out, 0, 1).reshape(q.shape).astype(q.dtype)


def _pages_per_compute_block(pages_per_seq: int, page_size: int, target_tokens: int = 512) -> int:
  """Largest divisor of pages_per_seq whose block holds at most `target_tokens` (the kernel needs a divisor)."""
  best = 1
  for b in range(1, pages_per_seq + 1):
    if pages_per_seq % b == 0 and b * page_size <= target_tokens:
      best = b
  return best


def pallas_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                           page_table: jax.Array, *, block_tokens: int = 512) -> jax.Array:
  """Same contract as `paged_attention`, on the Pallas TPU kernel (which expects q pre-scaled and lengths >= 1, and
  rounds keys and values to bfloat16), in blocks of at most `block_tokens` keys."""
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel  # TPU-only import

  d = q.shape[-1]
  ppcb = _pages_per_compute_block(page_table.shape[1], k_pages.shape[2], block_tokens)
  q = (q.astype(jnp.float32) / math.sqrt(d)).astype(q.dtype)
  out = kernel(q, k_pages, v_pages, jnp.maximum(lengths, 1).astype(jnp.int32), page_table,
               pages_per_compute_block=ppcb)
  return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q.dtype)


def pallas_gpu_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                               page_table: jax.Array, *, block_tokens: int = 128, k_splits: int = 16,
                               interpret: bool = False) -> jax.Array:
  """Same contract as `paged_attention`, on the Pallas GPU kernel (which expects q pre-scaled and lengths >= 1): blocks
  of about `block_tokens` keys, the page table padded with the scratch page to whole blocks in `k_splits` parts."""
  from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as kernel  # imported on use

  d, page, m = q.shape[-1], k_pages.shape[2], page_table.shape[1]
  ppcb = max(1, min(m, block_tokens // page))
  splits = max(1, min(k_splits, -(-m // ppcb)))
  table, _ = _in_blocks(page_table, ppcb * splits)
  q = (q.astype(jnp.float32) / math.sqrt(d)).astype(q.dtype)
  out = kernel(q, k_pages, v_pages, table, jnp.maximum(lengths, 1).astype(jnp.int32), pages_per_compute_block=ppcb,
               k_splits=splits, interpret=interpret)
  return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q.dtype)


def tpu_interpret_forced() -> bool:
  """Whether Pallas TPU kernels traced now run in TPU interpret mode (`pltpu.force_tpu_interpret_mode()`)."""
  from jax._src import config  # the mode has no public getter

  return config.pallas_tpu_interpret_mode_context_manager.value is not None


def write_decode_kv(k_pages, v_pages, k, v, page_table, positions, active):
  """Writes one token per slot: k, v [S, K, D] at `positions` [S]; idle slots write to the scratch page.

  One `dynamic_update_slice` per slot, not one scatter: on TPU a scatter makes XLA carry the pool through the decode
  loop in a layout of its own (heads second-minor), which costs a copy of the whole pool into and out of the loop
  and, per layer and step, one into the Pallas kernel's layout. An update slice writes in place in any layout.
  """
  page = k_pages.shape[2]
  rows = jnp.arange(page_table.shape[0])
  col = jnp.minimum(positions // page, page_table.shape[1] - 1)
  dst = jnp.where(active, page_table[rows, col], SCRATCH_PAGE)
  off = positions % page
  for s in range(k.shape[0]):
    at = (0, dst[s], off[s], 0)
    k_pages = jax.lax.dynamic_update_slice(k_pages, k[s, :, None, None].astype(k_pages.dtype), at)
    v_pages = jax.lax.dynamic_update_slice(v_pages, v[s, :, None, None].astype(v_pages.dtype), at)
  return k_pages, v_pages


def write_chunks(k_pages, v_pages, k, v, src_row, src_chunk, dst, shard, *, axis: str = "data"):
  """Copies page-sized chunks of dense keys/values into pages of this data shard.

  k, v: [B, T, K, D] with T a multiple of the page size; chunk c copies rows `src_row[c]`, positions
  `src_chunk[c] * page_size ...` to local page `dst[c]` if `shard[c]` is this device's data index (else dropped).
  """
  b, t, kh, d = k.shape
  page = k_pages.shape[2]
  me = jax.lax.axis_index(axis)
  local = jnp.where(shard == me, dst, k_pages.shape[1])  # out of range: dropped

  def put(pages, x):
    chunks = x.reshape(b, t // page, page, kh, d)[src_row, src_chunk]  # [n, page, K, D]
    return pages.at[:, local].set(jnp.transpose(chunks, (2, 0, 1, 3)).astype(pages.dtype), mode="drop")

  return put(k_pages, k), put(v_pages, v)


def kv_head_axis(mesh: Mesh, num_kv_heads: int) -> str | None:
  """The mesh axis KV heads (and, inside attention, query heads) are split over: `tensor` if it divides them."""
  t = mesh.shape.get("tensor", 1)
  return "tensor" if t > 1 and num_kv_heads % t == 0 else None


def cache_spec(mesh: Mesh, num_kv_heads: int) -> P:
  return P(kv_head_axis(mesh, num_kv_heads), "data", None, None)


def sharded_decode_attention(mesh: Mesh, num_kv_heads: int, *, impl: str, pages_per_block: int,
                             interpret: bool = False):
  """`f(q [S,H,D], k, v [S,K,D], k_pages, v_pages, page_table, positions, active) -> (out, k_pages, v_pages)`,
  run per device with `shard_map`: writes the step's keys/values, then attends over positions + 1 keys (`impl`:
  "jax", "pallas_tpu" or "pallas_gpu"; `interpret`: the GPU kernel interpreted, for tests on CPU)."""
  heads = kv_head_axis(mesh, num_kv_heads)

  def local(q, k, v, k_pages, v_pages, page_table, positions, active):
    k_pages, v_pages = write_decode_kv(k_pages, v_pages, k, v, page_table, positions, active)
    lengths = jnp.where(active, positions + 1, 0)
    if impl == "pallas_tpu":
      out = pallas_paged_attention(q, k_pages, v_pages, lengths, page_table)
    elif impl == "pallas_gpu":
      out = pallas_gpu_paged_attention(q, k_pages, v_pages, lengths, page_table, interpret=interpret)
    else:
      out = paged_attention(q, k_pages, v_pages, lengths, page_table, pages_per_block=pages_per_block)
    return out, k_pages, v_pages

  act, pages = P("data", heads, None), P(heads, "data", None, None)
  return jax.shard_map(local, mesh=mesh, in_specs=(act, act, act, pages, pages, P("data", None), P("data"), P("data")),
                       out_specs=(act, pages, pages), check_vma=False)


def sharded_verify_attention(mesh: Mesh, num_kv_heads: int, *, impl: str, pages_per_block: int):
  """`f(q [S,Q,H,D], k, v [S,Q,K,D], k_pages, v_pages, page_table, positions [S], written [S], live [S]) -> (out,
  k_pages, v_pages)` per device with `shard_map`: a speculative call's Q positions per slot, `positions + j`; the
  first `written[s]` of a live slot write their keys/values (the rest go to the scratch page), then query j attends
  over `positions + j + 1` keys. `impl` is the decode attention's: "pallas_tpu" runs the Pallas TPU kernel
  `verify_kernel.paged_verify_attention` in blocks of 512 keys (the decode kernel's), "jax" and "pallas_gpu"
  `paged_attention_queries` in blocks of `pages_per_block` pages (pure JAX: no GPU kernel takes several queries per
  sequence in this layout)."""
  heads = kv_head_axis(mesh, num_kv_heads)
  if impl == "pallas_tpu":
    from areal_jax.sampler.verify_kernel import paged_verify_attention  # imported on use, as the other kernels

  def local(q, k, v, k_pages, v_pages, page_table, positions, written, live):
    nq = q.shape[1]
    for j in range(nq):
      k_pages, v_pages = write_decode_kv(k_pages, v_pages, k[:, j], v[:, j], page_table, positions + j,
                                         live & (j < written))
    lengths = jnp.where(live[:, None], positions[:, None] + jnp.arange(1, nq + 1)[None, :], 0)
    if impl == "pallas_tpu":
      out = paged_verify_attention(q, k_pages, v_pages, lengths, page_table,
                                   pages_per_block=max(1, 512 // k_pages.shape[2]))
    else:
      out = paged_attention_queries(q, k_pages, v_pages, lengths, page_table, pages_per_block=pages_per_block)
    return out, k_pages, v_pages

  act, pages, idx = P("data", None, heads, None), P(heads, "data", None, None), P("data")
  return jax.shard_map(local, mesh=mesh, in_specs=(act, act, act, pages, pages, P("data", None), idx, idx, idx),
                       out_specs=(act, pages, pages), check_vma=False)


def sharded_prefill_attention_after(mesh: Mesh, num_kv_heads: int, *, pages_per_block: int):
  """`f(q, k, v, lengths, k_pages, v_pages, page_table, past_lengths) -> out`: `prefill_attention_after` per device
  with `shard_map`. Prefill rows are split over `data`, each on the shard whose pages it continues, so every shard
  attends over its own rows and its own pages only: nothing crosses shards."""
  heads = kv_head_axis(mesh, num_kv_heads)
  local = functools.partial(prefill_attention_after, pages_per_block=pages_per_block)
  rows, pages, idx = P("data", None, heads, None), P(heads, "data", None, None), P("data")
  return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, idx, pages, pages, P("data", None), idx),
                       out_specs=rows, check_vma=False)


def sharded_write_chunks(mesh: Mesh, num_kv_heads: int, rows_per_shard: int = 0):
  """`write_chunks` over the mesh, heads split as the cache's. Dense keys/values replicated over `data`
  (`rows_per_shard` = 0), or split over it, R rows per shard: then chunk c's `src_row` is a row of its own shard
  (R * shard[c] <= src_row < R * (shard[c] + 1)), read where it lies."""
  heads = kv_head_axis(mesh, num_kv_heads)
  pages, idx = P(heads, "data", None, None), P()
  dense = P("data" if rows_per_shard else None, None, heads, None)

  def local(k_pages, v_pages, k, v, src_row, src_chunk, dst, shard):
    if rows_per_shard:
      src_row = src_row - rows_per_shard * jax.lax.axis_index("data")  # other shards' chunks: dropped by `shard`
    return write_chunks(k_pages, v_pages, k, v, src_row, src_chunk, dst, shard, axis="data")

  return jax.shard_map(local, mesh=mesh, in_specs=(pages, pages, dense, dense, idx, idx, idx, idx),
                       out_specs=(pages, pages), check_vma=False)
