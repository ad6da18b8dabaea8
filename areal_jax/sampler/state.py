"""Device-side records of the engine: the decode state (paged KV cache + per-slot arrays), prefixes, result tokens.

All are frozen pytrees (`flax.struct.dataclass`) so jitted functions take and return them whole. Shapes are fixed by
the sampler config, which keeps the decode step one compiled program.
"""

from __future__ import annotations

import dataclasses

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
  """Dense keys/values of B prefilled sequences: [B, T, kv_heads, head_dim] per layer."""

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]


@dataclasses.dataclass(frozen=True)
class Prefix:
  """What `Engine.prefill` returns: dense keys/values on device; on the host, each row's true length and, for answer
  i of row b, the index into `first` (the first tokens drawn, [S] on device) and its sampling settings."""

  arrays: PrefixArrays
  true_length: np.ndarray  # int [B]
  first: jax.Array | None  # int32 [S]; None when no answers were drawn (a recompute)
  answer_index: list[list[int]]  # [b][i] -> position in `first`
  answer_settings: list[list[tuple[np.ndarray, float, float, int]]]  # [b][i] -> (key, temperature, top_p, top_k)

  @property
  def num_answers(self) -> int:
    return sum(map(len, self.answer_index))


@struct.dataclass(frozen=True)
class ResultTokens:
  """One token per slot (or per answer): the token, whether it is real output, the sequence length including it, and
  its logprob under the temperature-scaled distribution."""

  tokens: jax.Array
  valid: jax.Array
  lengths: jax.Array
  log_prob: jax.Array

  def get_result_at_slot(self, slot: int) -> tuple[int, bool, int, float]:
    return (int(self.tokens[slot]), bool(self.valid[slot]), int(self.lengths[slot]), float(self.log_prob[slot]))


@struct.dataclass(frozen=True)
class DecodeSteps:
  """What one multi-step decode call drew: tokens[s, j] and log_prob[s, j] for j < count[s] (-1 and 0 after)."""

  tokens: jax.Array  # int32 [S, decode_steps]
  log_prob: jax.Array  # float32 [S, decode_steps]
  count: jax.Array  # int32 [S]


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


def prefix_shardings(model_cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
  """Prefix keys/values: replicated over `data` (any shard may receive them), heads as the cache's."""
  return NamedSharding(mesh, P(None, None, kv_head_axis(mesh, model_cfg.num_kv_heads), None))


def page_bytes(model_cfg: ModelConfig, cfg: SamplerConfig) -> int:
  """Bytes of one page over all layers, keys and values."""
  itemsize = np.dtype(model_cfg.compute_dtype).itemsize
  return 2 * model_cfg.num_layers * model_cfg.num_kv_heads * cfg.page_size * model_cfg.head_dim * itemsize
