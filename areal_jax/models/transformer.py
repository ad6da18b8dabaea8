"""Decoder-only transformer (Qwen2/Qwen2.5, Qwen3, Qwen3-MoE, Llama 3) in Flax NNX.

`model(tokens, positions=..., segment_ids=...)` is the packed training forward: several sequences share a row, each
with its own `segment_ids` value (0 = padding) and positions restarting at 0; segments never attend to each other.
The sampler drives the same layers through `run_layers` with its own paged-cache `attend`.

The decoder layers are one `Block` whose parameters carry a leading `layers` axis (logical name "layers"), run by
`jax.lax.scan` (`cfg.scan_layers`): one layer is traced and compiled whatever the depth, and under `cfg.remat` only
each layer's input stays live for the backward pass. Unrolled, they run as a Python loop over static slices: faster
for a few layers on CPU (the tiny preset), and what callers need that index per-layer state by a Python int (the
sampler's decode, whose KV pool is one array per layer). A mixture-of-experts model that mixes dense and sparse layers
keeps two such stacks (`layers`, the sparse ones, and `dense_layers`) and runs each run of consecutive layers of one
kind as a scan of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models import lora
from areal_jax.models.config import ModelConfig
from areal_jax.models.modules import Block, RMSNorm, _param
from areal_jax.models.packed_attention import packed_attention
from areal_jax.sharding import constrain

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


LayerAttend = Callable[[Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


def stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs, num: int | None = None, *, sparse: bool = False) -> Block:
  """`num` (default `cfg.num_layers`) independently initialised Blocks as one Block with a leading `layers` axis on
  every parameter."""
  keys = jax.random.split(rngs.params(), cfg.num_layers if num is None else num)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0), sparse=sparse)))
  # Adapters draw from a stream of their own: a LoRA model's base starts as the plain model of the same seed.
  rngs_of = lambda key: nnx.Rngs(params=key, lora=jax.random.fold_in(key, 1))
  state = jax.vmap(lambda key: nnx.state(Block(cfg, rngs=rngs_of(key), sparse=sparse)))(keys)
  state = jax.tree.map(lambda v: v.replace(logical_axes=("layers",) + tuple(v.get_metadata()["logical_axes"])),
                       state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, lora.quantize_base(state, cfg))


def _segments(cfg: ModelConfig) -> list[tuple[str, int, int, int]]:
  """Runs of consecutive decoder layers in the same stacked group: (group, first layer, first index in the group,
  length), in layer order."""
  group_of = {i: (name, j) for name, layers in cfg.layer_groups().items() for j, i in enumerate(layers)}
  out = []
  for i in range(cfg.num_layers):
    name, j = group_of[i]
    if out and out[-1][0] == name:
      out[-1] = out[-1][:3] + (out[-1][3] + 1,)
    else:
      out.append((name, i, j, 1))
  return out


def _concat(parts: list) -> Any:
  """Trees stacked along a leading layers axis, joined in order (None parts dropped; None when all are)."""
  parts = [p for p in parts if p is not None]
  if not parts:
    return None
  return parts[0] if len(parts) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


class Transformer(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.weight_dtype)
    groups = cfg.layer_groups()
    self.layers = stacked_blocks(cfg, rngs, len(groups["layers"]), sparse=any(cfg.sparse_layers()))
    if "dense_layers" in groups:
      self.dense_layers = stacked_blocks(cfg, rngs, len(groups["dense_layers"]))
    self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=cfg.weight_dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.weight_dtype)

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    x = jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.compute_dtype)
    return constrain(x, ("batch", "seq", None))

  def layer(self, i: int) -> Block:
    """Decoder layer `i` as a Block of its own (static slices of the stacked parameters)."""
    name, j = next((n, ls.index(i)) for n, ls in self.cfg.layer_groups().items() if i in ls)
    graphdef, state = nnx.split(getattr(self, name))
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[j], state))

  def run_layers(self, x: jax.Array, positions: jax.Array, attend: LayerAttend, *, remat: bool = True,
                 unroll: bool | None = None, valid: jax.Array | None = None, routes: jax.Array | None = None,
                 routing: bool = False) -> tuple[jax.Array, Any] | tuple[jax.Array, Any, Any]:
    """All decoder layers then the final norm. `attend(layer, q, k, v) -> (out, aux)`; returns (h, aux of every
    layer). Under the scan `layer` is a traced int32 and the auxes come stacked along a leading layers axis;
    unrolled (`unroll`, default `not cfg.scan_layers`) `layer` is a Python int and the auxes a list.

    A mixture-of-experts model's sparse layers route the `valid` [B, T] tokens (None: all; the routing statistics
    count those); `routes` [sparse layers, B, T, k] replays a routing. `routing=True` also returns the sparse layers'
    `MoE` routing stacked along a leading axis (None for a dense model).

    `remat=False` ignores `cfg.remat`: forward-only callers (the sampler) have no backward pass to save memory for.
    """
    unroll = not self.cfg.scan_layers if unroll is None else unroll
    auxes, routings, sparse_done = [], [], 0
    for name, first, start, n in _segments(self.cfg):
      graphdef, state = nnx.split(getattr(self, name))
      if n != len(self.cfg.layer_groups()[name]):
        state = jax.tree.map(lambda a: a[start:start + n], state)
      seg_routes = None
      if routes is not None and self.cfg.sparse_layers()[first]:
        seg_routes, sparse_done = routes[sparse_done:sparse_done + n], sparse_done + n
      x, aux, routed = self._run_segment(graphdef, state, x, positions, attend, first, n, remat=remat, unroll=unroll,
                                         valid=valid, routes=seg_routes)
      auxes.append(aux)
      routings.append(routed)
    h = self.final_norm(x)
    aux = [a for part in auxes for a in part] if unroll else _concat(auxes)
    return (h, aux, _concat(routings)) if routing else (h, aux)

  def _run_segment(self, graphdef, state, x, positions, attend, first: int, n: int, *, remat: bool, unroll: bool,
                   valid, routes):
    """Layers first .. first + n - 1 of one stacked group (`state` sliced to them): (x, auxes, routing stacked)."""

    def run(i, x, layer_state, layer_routes):
      return nnx.merge(graphdef, layer_state)(x, positions, lambda q, k, v: attend(i, q, k, v), valid=valid,
                                              routes=layer_routes)

    def checkpoint(f):
      if not remat or self.cfg.remat == "none":
        return f
      return jax.checkpoint(f, policy=_REMAT_POLICIES[self.cfg.remat], prevent_cse=unroll)  # no CSE risk in a scan

    if unroll:
      auxes, routings = [], []
      for j in range(n):
        layer_state = jax.tree.map(lambda a, j=j: a[j], state)
        if self.cfg.lora_base_quant:  # dequantize a layer once the one before is done: XLA may hoist them all
          x, layer_state = jax.lax.optimization_barrier((x, layer_state))
        layer_routes = None if routes is None else routes[j]
        x, aux, routed = checkpoint(functools.partial(run, first + j))(x, layer_state, layer_routes)
        auxes.append(aux)
        routings.append(routed)
      stacked = None if routings[0] is None else jax.tree.map(lambda *xs: jnp.stack(xs), *routings)
      return x, auxes, stacked

    def body(x, layer):
      i, layer_state, layer_routes = layer
      x, aux, routed = run(i, x, layer_state, layer_routes)
      return x, (aux, routed)

    x, (aux, routed) = jax.lax.scan(checkpoint(body), x,
                                    (jnp.arange(first, first + n, dtype=jnp.int32), state, routes))
    return x, aux, routed

  def unembedding(self) -> jax.Array:
    """The output projection [hidden, vocab]: `lm_head`, or the tied embedding transposed."""
    return self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]

  def logits(self, h: jax.Array) -> jax.Array:
    """Float32 logits [..., vocab] from final hidden states."""
    out = jnp.einsum("...d,dv->...v", h, self.unembedding().astype(h.dtype), preferred_element_type=jnp.float32)
    return constrain(out, ("batch", "seq", "act_vocab")) if out.ndim == 3 else out

  def hidden(self, tokens: jax.Array, *, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
             routes: jax.Array | None = None, routing: bool = False):
    """Final hidden states [B, T, D] of the packed training forward; with `routing`, (h, the sparse layers' routing
    over the non-padding tokens, `run_layers`)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    if segment_ids is None:
      segment_ids = jnp.ones(tokens.shape, jnp.int32)
    attend = packed_attention(segment_ids, impl=self.cfg.attention, block=self.cfg.attention_block)
    h, _, routed = self.run_layers(self.embed_tokens(tokens), positions, lambda i, q, k, v: attend(q, k, v),
                                   valid=segment_ids != 0, routes=routes, routing=True)
    return (h, routed) if routing else h

  def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, vocab] (float32) for int32 tokens [B, T]."""
    return self.logits(self.hidden(tokens, positions=positions, segment_ids=segment_ids))


def create(cfg: ModelConfig, seed: int = 0) -> Transformer:
  """A randomly initialised model (normal(0.02) weights, unit norms, zero biases)."""
  return Transformer(cfg, rngs=nnx.Rngs(params=seed))
