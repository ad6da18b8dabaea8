"""Device-side records of the engine: the decode state (paged KV cache + per-slot arrays), prefixes, drawn tokens.

All are frozen pytrees (`flax.struct.dataclass`) so jitted functions take and return them whole. Shapes are fixed by
the sampler config, which keeps the decode step one compiled program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from areal_jax.models.config import ModelConfig
from areal_jax.sampler.attention import cache_spec, kv_head_axis
from areal_jax.sampler.config import SamplerConfig


@struct.dataclass(frozen=True)
class DecodeState:
  """k, v: one [kv_heads, num_pages, page_size, head_dim] array per layer. Per slot [S]: the pending token (sampled,
  not yet in the cache), its position (`lengths` = tokens already cached), the index of the next token to draw, the
  PRNG key and the sampling settings. page_table [S, pages_per_seq] holds local page ids of the slot's data shard."""

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  page_table: jax.Array
  tokens: jax.Array
  lengths: jax.Array
  index: jax.Array
  keys: jax.Array
  temperature: jax.Array
  top_p: jax.Array
  top_k: jax.Array


@struct.dataclass(frozen=True)
class PrefixArrays:
  """Dense keys/values of B prefilled sequences: [layers, B, T, kv_heads, head_dim]; with `sampler.record_routes`,
  the experts each position was routed to, int16 [sparse layers, B, T, k] (else None).

  Layout (static): with `rows_per_shard` = R > 0 the B = data x R rows are split over `data`, row b on data shard
  b // R, and only that shard holds (and can insert) its keys and values; with 0 every row is replicated over `data`
  (a JetStream prefill, whose slot is chosen after it)."""

  k: jax.Array
  v: jax.Array
  experts: jax.Array | None = None
  rows_per_shard: int = struct.field(pytree_node=False, default=0)


@struct.dataclass(frozen=True)
class Prefix:
  """What `Engine.prefill` returns, a pytree of arrays (so it can be `device_put` to another engine): the dense
  keys/values of B prefilled rows, each row's true length (tokens prefilled), the tokens before them that were
  already in the pool (`start`, whole pages of the prefix cache; 0 for most rows), and the first tokens drawn for
  their answers. Row b's answer i was drawn at position `draw_index[b, i]` (-1: no such answer) of the [S] draw
  arrays, with PRNG key `keys[r]` and settings `temperature[r]`, `top_p[r]`, `top_k[r]`. Row b is row
  `array_row[b]` of `arrays` (rows laid out by data shard, see `PrefixArrays`)."""

  arrays: PrefixArrays
  true_length: jax.Array  # int32 [B]
  start: jax.Array  # int32 [B]
  draw_index: jax.Array  # int32 [B, G]
  array_row: jax.Array  # int32 [B]
  first: jax.Array  # int32 [S]
  keys: jax.Array  # uint32 [S, 2]
  temperature: jax.Array  # float32 [S]
  top_p: jax.Array  # float32 [S]
  top_k: jax.Array  # int32 [S]

  def num_answers(self, row: int) -> int:
    """Answers drawn for `row` (0 for a recompute)."""
    return int(np.sum(np.asarray(self.draw_index[row]) >= 0))


@struct.dataclass(frozen=True)
class FirstTokens:
  """The first tokens a batched prefill drew: tokens[r] and log_prob[r] of draw r (see `Prefix.draw_index`)."""

  tokens: jax.Array  # int32 [S]
  log_prob: jax.Array  # float32 [S]


@struct.dataclass(frozen=True)
class DecodeSteps:
  """What one multi-step decode call drew: tokens[s, j] and log_prob[s, j] for j < count[s] (-1 and 0 after); with
  `sampler.record_routes`, the experts the step's input token was routed to (the routing that gave log_prob[s, j]).
  A speculative call draws up to `sampler.spec_tokens` + 1 tokens per slot and step, decode_steps in all."""

  tokens: jax.Array  # int32 [S, decode_steps]
  log_prob: jax.Array  # float32 [S, decode_steps]
  count: jax.Array  # int32 [S]
  experts: jax.Array | None = None  # int16 [S, decode_steps, sparse layers, k], or None
  # With speculation (`sampler.speculation`): the slots' forwards over their drafts in the call (one per live slot
  # and loop step), and per draft position j the drafts verified there and those accepted (int32 [spec_tokens]).
  forwards: jax.Array | None = None
  drafted_at: jax.Array | None = None
  accepted_at: jax.Array | None = None


def decode_state_shapes(model_cfg: ModelConfig, cfg: SamplerConfig, num_pages: int) -> DecodeState:
  """Abstract decode state (`jax.ShapeDtypeStruct` leaves) for a pool of `num_pages` pages over the whole mesh."""
  s, m = cfg.num_slots, cfg.pages_per_seq
  page = jax.ShapeDtypeStruct((model_cfg.num_kv_heads, num_pages, cfg.page_size, model_cfg.head_dim),
                              model_cfg.compute_dtype)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  return DecodeState(
      k=(page,) * model_cfg.num_layers, v=(page,) * model_cfg.num_layers, page_table=i32(s, m), tokens=i32(s),
      lengths=i32(s), index=i32(s), keys=jax.ShapeDtypeStruct((s, 2), jnp.uint32), temperature=f32(s), top_p=f32(s),
      top_k=i32(s))


def decode_state_shardings(model_cfg: ModelConfig, mesh: Mesh) -> DecodeState:
  """Pages over `data` (each shard owns its slots' pages), KV heads over `tensor`; slot arrays over `data`."""
  pages = NamedSharding(mesh, cache_spec(mesh, model_cfg.num_kv_heads))
  slots, table = NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data", None))
  return DecodeState(
      k=(pages,) * model_cfg.num_layers, v=(pages,) * model_cfg.num_layers, page_table=table, tokens=slots,
      lengths=slots, index=slots, keys=table, temperature=slots, top_p=slots, top_k=slots)


def prefix_shardings(model_cfg: ModelConfig, mesh: Mesh, *, sharded: bool = False) -> NamedSharding:
  """Prefix keys/values [layers, B, T, heads, head_dim]: rows over `data` (`sharded`: each shard keeps its own rows')
  or replicated there (any shard may receive them); heads as the cache's."""
  return NamedSharding(mesh, P(None, "data" if sharded else None, None, kv_head_axis(mesh, model_cfg.num_kv_heads),
                               None))


def page_bytes(model_cfg: ModelConfig, cfg: SamplerConfig) -> int:
  """Bytes of one page over all layers, keys and values."""
  itemsize = np.dtype(model_cfg.compute_dtype).itemsize
  return 2 * model_cfg.num_layers * model_cfg.num_kv_heads * cfg.page_size * model_cfg.head_dim * itemsize
