"""Decoder-only transformer (Qwen2/Qwen2.5, Qwen3, Llama 3) in Flax NNX.

`model(tokens, positions=..., segment_ids=...)` is the packed training forward: several sequences share a row, each
with its own `segment_ids` value (0 = padding) and positions restarting at 0; segments never attend to each other.
The sampler drives the same layers through `run_layers` with its own paged-cache `attend`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.modules import Attend, Block, RMSNorm, _param, dense_attention
from areal_jax.sharding import constrain

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _with_attend(attend: Attend):
  """`(block, x, positions) -> block(x, positions, attend)`, `attend` closed over: nnx.remat would trace a default
  argument as an input."""
  return lambda block, x, positions: block(x, positions, attend)


class Transformer(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.weight_dtype)
    self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=cfg.weight_dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.weight_dtype)

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    x = jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.compute_dtype)
    return constrain(x, ("batch", "seq", None))

  def run_layers(self, x: jax.Array, positions: jax.Array,
                 attend: Callable[[int, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]], *,
                 remat: bool = True) -> tuple[jax.Array, list[Any]]:
    """All decoder layers then the final norm. `attend(layer_index, q, k, v) -> (out, aux)`; returns (h, [aux]).

    `remat=False` ignores `cfg.remat`: forward-only callers (the sampler) have no backward pass to save memory for,
    and nnx.remat cannot run inside the sampler's decode loop (`lax.while_loop`) on a module merged outside it.
    """
    auxes = []
    for i, block in enumerate(self.layers):
      layer_attend: Attend = lambda q, k, v, i=i: attend(i, q, k, v)
      if self.cfg.remat == "none" or not remat:
        x, aux = block(x, positions, layer_attend)
      else:
        fn = nnx.remat(_with_attend(layer_attend), policy=_REMAT_POLICIES[self.cfg.remat])
        x, aux = fn(block, x, positions)
      auxes.append(aux)
    return self.final_norm(x), auxes

  def logits(self, h: jax.Array) -> jax.Array:
    """Float32 logits [..., vocab] from final hidden states."""
    w = self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
    out = jnp.einsum("...d,dv->...v", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    return constrain(out, ("batch", "seq", "act_vocab")) if out.ndim == 3 else out

  def hidden(self, tokens: jax.Array, *, positions: jax.Array | None = None,
             segment_ids: jax.Array | None = None) -> jax.Array:
    """Final hidden states [B, T, D] of the packed training forward."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    if segment_ids is None:
      segment_ids = jnp.ones(tokens.shape, jnp.int32)
    attend = dense_attention(segment_ids)
    h, _ = self.run_layers(self.embed_tokens(tokens), positions, lambda i, q, k, v: attend(q, k, v))
    return h

  def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, vocab] (float32) for int32 tokens [B, T]."""
    return self.logits(self.hidden(tokens, positions=positions, segment_ids=segment_ids))


def create(cfg: ModelConfig, seed: int = 0) -> Transformer:
  """A randomly initialised model (normal(0.02) weights, unit norms, zero biases)."""
  return Transformer(cfg, rngs=nnx.Rngs(params=seed))
