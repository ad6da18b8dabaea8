"""Transformer layers shared by the learner (packed training forward) and the sampler (prefill, paged decode).

Attention is split so callers can plug in how keys and values are stored and attended: `Attention.__call__` projects
q/k/v (with RoPE and optional q/k norms), calls `attend(q, k, v) -> (out, aux)`, and projects the output. The learner
passes `dense_attention` over packed segments (in query blocks, for rows of 32k tokens); the sampler passes a function
that writes the paged KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models import lora, moe
from areal_jax.models.config import ModelConfig
from areal_jax.sharding import constrain

Attend = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]
_NEG = float(np.finfo(np.float32).min)


def _param(rngs: nnx.Rngs | None, shape, names, dtype, init: str = "normal") -> nnx.Param:
  if init == "ones":
    value = jnp.ones(shape, dtype)
  elif init == "zeros":
    value = jnp.zeros(shape, dtype)
  else:
    value = 0.02 * jax.random.normal(rngs.params(), shape, dtype)
  return nnx.Param(value, logical_axes=tuple(names))


class RMSNorm(nnx.Module):
  """y = w * x / rms(x), computed in float32 (as HF does) and cast back."""

  def __init__(self, dim: int, *, eps: float, dtype, names=("norm",)):
    self.scale = _param(None, (dim,), names, dtype, init="ones")
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x.dtype) * xf.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies [head_dim // 2] in float32, with HF's "linear" and "llama3" scaling."""
  d = cfg.head_dim
  inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d)))
  inv = inv.astype(np.float32)
  r = cfg.rope
  if cfg.rope_type == "linear":
    inv = inv / np.float32(r["factor"])
  elif cfg.rope_type == "llama3":
    factor, lo, hi = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
    old = r["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    inv = np.where(medium, smoothed, scaled).astype(np.float32)
  return inv


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotary embedding (HF "rotate_half" layout). x: [B, T, N, D]; positions: [B, T]."""
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
  cos = jnp.cos(freqs)[:, :, None, :].astype(x.dtype)
  sin = jnp.sin(freqs)[:, :, None, :].astype(x.dtype)
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax attention with grouped KV heads. q: [B, T, H, D]; k, v: [B, S, K, D]; mask: [B, T, S] (True = attend).

  Rows with no visible key (padding) return zeros rather than NaN.
  """
  b, t, h, d = q.shape
  kh = k.shape[2]
  qg = q.reshape(b, t, kh, h // kh, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / np.sqrt(d)
  m = mask[:, None, None, :, :]
  scores = jnp.where(m, scores, _NEG)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(m, probs, 0.0).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, h, d)


def packed_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, T, T] causal mask within segments; segment id 0 is padding and attends to nothing."""
  t = segment_ids.shape[1]
  causal = jnp.tril(jnp.ones((t, t), dtype=bool))
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return causal[None] & same & (segment_ids[:, :, None] != 0)


# Float32 score bytes one query block may take ([heads, block, keys] per row): packed rows of 32k tokens would need
# heads x 4 GiB of scores at once, more than a chip's HBM.
SCORE_BLOCK_BYTES = 256 << 20


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                        block_mask: Callable[[jax.Array, int], jax.Array], *, query_chunk: int = 0) -> jax.Array:
  """`gqa_attention` in blocks of queries, each rematerialised in the backward pass, so scores take
  [heads, block, keys] instead of [heads, T, T]. `block_mask(start, size) -> [B, size, S]`; the block is the largest
  divisor of T up to `query_chunk` (default: what keeps one row's float32 scores within SCORE_BLOCK_BYTES)."""
  b, t, h, _ = q.shape
  s = k.shape[1]
  query_chunk = query_chunk or max(64, SCORE_BLOCK_BYTES // (4 * h * s))
  chunk = max(c for c in range(1, min(t, query_chunk) + 1) if t % c == 0)

  def block(start):
    return gqa_attention(jax.lax.dynamic_slice_in_dim(q, start, chunk, axis=1), k, v, block_mask(start, chunk))

  if chunk == t:
    return block(0)
  out = jax.lax.map(jax.checkpoint(block), jnp.arange(0, t, chunk))  # [T / chunk, B, chunk, H, D]
  return jnp.moveaxis(out, 0, 1).reshape(q.shape)


def dense_attention(segment_ids: jax.Array, *, query_chunk: int = 0) -> Attend:
  """The training-time `attend`: causal attention within packed segments (`packed_mask`), in query blocks."""
  keys = jnp.arange(segment_ids.shape[1])

  def block_mask(start, size):
    seg = jax.lax.dynamic_slice_in_dim(segment_ids, start, size, axis=1)[:, :, None]
    causal = keys[None, :] <= (start + jnp.arange(size))[:, None]
    return causal[None] & (seg == segment_ids[:, None, :]) & (seg != 0)

  return lambda q, k, v: (blockwise_attention(q, k, v, block_mask, query_chunk=query_chunk), None)


def _weight(p: nnx.Param, dtype) -> jax.Array:
  """A projection's weight in `dtype`: a QLoRA base's is dequantized here, where it is used (models/lora.py)."""
  return lora.dequantized(p.get_value()).astype(dtype)


class _Adapted(nnx.Module):
  """A module whose projections may carry LoRA adapters (`cfg.lora_targets`, models/lora.py)."""

  def _add_adapters(self, cfg: ModelConfig, rngs: nnx.Rngs, shapes: dict[str, tuple]) -> None:
    """`shapes`: projection -> (input dims, output dims, input names, output names)."""
    for name, (in_shape, out_shape, in_names, out_names) in shapes.items():
      if cfg.lora_rank and name in cfg.lora_targets:
        a, b = lora.create(rngs, in_shape, out_shape, in_names, out_names, cfg.lora_rank)
        setattr(self, f"{name}_lora_a", a)
        setattr(self, f"{name}_lora_b", b)

  def _adapted(self, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """y = x·W plus the adapters' (x·A)·B·scale when `name` has them."""
    a = getattr(self, f"{name}_lora_a", None)
    if a is None:
      return y
    return y + lora.delta(x, a[...], getattr(self, f"{name}_lora_b")[...], lora.scale(self.cfg))


class Attention(_Adapted):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, h, k, hd, pd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.weight_dtype
    self.q = _param(rngs, (d, h, hd), ("embed", "q_heads", "head_dim"), pd)
    self.k = _param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), pd)
    self.v = _param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), pd)
    self.o = _param(rngs, (h, hd, d), ("q_heads", "head_dim", "embed"), pd)
    if cfg.attention_bias:
      self.q_bias = _param(rngs, (h, hd), ("q_heads", "head_dim"), pd, init="zeros")
      self.k_bias = _param(rngs, (k, hd), ("kv_heads", "head_dim"), pd, init="zeros")
      self.v_bias = _param(rngs, (k, hd), ("kv_heads", "head_dim"), pd, init="zeros")
    if cfg.qk_norm:
      self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=pd, names=("head_dim",))
      self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=pd, names=("head_dim",))
    self.cfg = cfg
    heads = lambda n, names: ((d,), (n, hd), ("embed",), names)
    self._add_adapters(cfg, rngs, {"q": heads(h, ("q_heads", "head_dim")), "k": heads(k, ("kv_heads", "head_dim")),
                                   "v": heads(k, ("kv_heads", "head_dim")),
                                   "o": ((h, hd), (d,), ("q_heads", "head_dim"), ("embed",))})

  def qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Projected q [B, T, H, D] and k, v [B, T, K, D], RoPE applied."""
    dt, inv_freq = x.dtype, rope_inv_freq(self.cfg)
    q = self._adapted("q", x, jnp.einsum("btd,dhk->bthk", x, _weight(self.q, dt)))
    k = self._adapted("k", x, jnp.einsum("btd,dhk->bthk", x, _weight(self.k, dt)))
    v = self._adapted("v", x, jnp.einsum("btd,dhk->bthk", x, _weight(self.v, dt)))
    if self.cfg.attention_bias:
      q, k, v = q + self.q_bias[...].astype(dt), k + self.k_bias[...].astype(dt), v + self.v_bias[...].astype(dt)
    if self.cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = constrain(apply_rope(q, positions, inv_freq), ("batch", "seq", "act_heads", None))
    k = constrain(apply_rope(k, positions, inv_freq), ("batch", "seq", "act_kv_heads", None))
    v = constrain(v, ("batch", "seq", "act_kv_heads", None))
    return q, k, v

  def __call__(self, x: jax.Array, positions: jax.Array, attend: Attend) -> tuple[jax.Array, Any]:
    q, k, v = self.qkv(x, positions)
    out, aux = attend(q, k, v)
    return self._adapted("o", out, jnp.einsum("bthk,hkd->btd", out, _weight(self.o, x.dtype))), aux


class MLP(_Adapted):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f, pd = cfg.hidden_size, cfg.intermediate_size, cfg.weight_dtype
    self.gate = _param(rngs, (d, f), ("embed", "mlp"), pd)
    self.up = _param(rngs, (d, f), ("embed", "mlp"), pd)
    self.down = _param(rngs, (f, d), ("mlp", "embed"), pd)
    self.cfg = cfg
    self._add_adapters(cfg, rngs, {"gate": ((d,), (f,), ("embed",), ("mlp",)), "up": ((d,), (f,), ("embed",), ("mlp",)),
                                   "down": ((f,), (d,), ("mlp",), ("embed",))})

  def __call__(self, x: jax.Array) -> jax.Array:
    dt = x.dtype
    g = jax.nn.silu(self._adapted("gate", x, x @ _weight(self.gate, dt))) * self._adapted(
        "up", x, x @ _weight(self.up, dt))
    g = constrain(g, ("batch", "seq", "act_mlp"))
    return self._adapted("down", g, g @ _weight(self.down, dt))


class MoE(nnx.Module):
  """Mixture-of-experts SwiGLU (models/moe.py): `router` [embed, E]; each expert's gate, up [E, embed, mlp] and
  down [E, mlp, embed]."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, e, f, pd = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.weight_dtype
    self.router = _param(rngs, (d, e), ("embed", "router"), pd)
    self.gate = _param(rngs, (e, d, f), ("experts", "embed", "mlp"), pd)
    self.up = _param(rngs, (e, d, f), ("experts", "embed", "mlp"), pd)
    self.down = _param(rngs, (e, f, d), ("experts", "mlp", "embed"), pd)
    self.cfg = cfg

  def __call__(self, x: jax.Array, valid: jax.Array | None = None,
               routes: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x [B, T, D] -> (out [B, T, D], this layer's `moe.router_stats` over the `valid` [B, T] tokens, with the
    chosen `experts` [B, T, k]). `routes` [B, T, k] replays a routing (the experts fixed, their weights recomputed;
    `moe.replay_stats` counts the tokens it sends elsewhere than the router would)."""
    b, t, d = x.shape
    cfg, k = self.cfg, self.cfg.num_experts_per_tok
    flat = lambda a: None if a is None else a.reshape(b * t, *a.shape[2:])
    weights, experts, probs = moe.route(flat(x), self.router[...], k, norm_topk=cfg.norm_topk_prob,
                                        routes=flat(routes))
    out = moe.sharded_experts_mlp(x, experts.reshape(b, t, k), weights.reshape(b, t, k), _weight(self.gate, x.dtype),
                                  _weight(self.up, x.dtype), _weight(self.down, x.dtype), impl=cfg.experts_impl)
    stats = moe.router_stats(probs, experts, flat(valid))
    if routes is not None:
      stats |= moe.replay_stats(probs, experts, flat(routes), flat(valid))
    return out, dict(stats, experts=experts.reshape(b, t, k))


class Block(nnx.Module):
  """Pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.)); the MLP a mixture of experts when `sparse`."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, sparse: bool = False):
    self.attn_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=cfg.weight_dtype)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=cfg.weight_dtype)
    self.mlp = MoE(cfg, rngs=rngs) if sparse else MLP(cfg, rngs=rngs)
    self.sparse = sparse

  def __call__(self, x: jax.Array, positions: jax.Array, attend: Attend, *, valid: jax.Array | None = None,
               routes: jax.Array | None = None) -> tuple[jax.Array, Any, dict[str, jax.Array] | None]:
    """(x, attend's aux, the MoE's routing (`MoE.__call__`) or None for a dense layer)."""
    a, aux = self.attn(self.attn_norm(x), positions, attend)
    x = constrain(x + a, ("batch", "seq", None))
    h = self.mlp_norm(x)
    h, routing = self.mlp(h, valid, routes) if self.sparse else (self.mlp(h), None)
    return constrain(x + h, ("batch", "seq", None)), aux, routing
