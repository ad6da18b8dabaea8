"""Mixture-of-experts feed-forward (Qwen3-MoE): top-k routing and dropless grouped expert matmuls.

Each token's router picks `k` of `E` experts (softmax over the router's logits in float32, top-k, renormalised when
`norm_topk_prob`); its output is the routing-weighted sum of those experts' SwiGLU MLPs. No token is dropped: the
token-expert pairs are sorted by expert and multiplied group by group (`grouped_matmul`: the Pallas megablox kernel
on TPU, `jax.lax.ragged_dot` on GPU, tiles of one expert each on CPU, where XLA lowers `ragged_dot` to a dense matmul
per expert masked to its rows: E times the work, 8.6x slower than one expert's matmul at 8 experts), so the work is
k tokens' worth whatever the routing.

Inside a sharding context the expert computation runs once per device under `shard_map`: each device sorts its own
rows' tokens, holds its slice of the MLP width (tensor parallelism; the partial sums meet in a `psum`) of its experts
(expert parallelism over the `expert` mesh axis: the tokens of the axis's devices are gathered, each device computes
its experts' pairs, and the outputs are summed back), and FSDP-sharded expert weights are gathered on the way in.

`routes` (the top-k expert ids a token was sampled with) replays a routing: the experts are fixed, their weights
recomputed from this router's probabilities (routing replay, for the learner); a token without a recorded routing
(-1) takes the router's own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from areal_jax import sharding

_MEGABLOX_TILE = 128


def route(x: jax.Array, router: jax.Array, k: int, *, norm_topk: bool,
          routes: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """x [N, D], router [D, E] -> (weights [N, k] in x's dtype, experts [N, k] int32, probs [N, E] float32).

  As HF's Qwen3-MoE router: logits in x's dtype, softmax in float32, top-k. `routes` [N, k] fixes the experts of the
  tokens whose first entry is >= 0 (the others, -1, take the router's own top-k)."""
  probs = jax.nn.softmax((x @ router.astype(x.dtype)).astype(jnp.float32), axis=-1)
  top, experts = jax.lax.top_k(probs, k)
  if routes is not None:
    routes = routes.astype(jnp.int32)
    experts = jnp.where(routes[:, :1] >= 0, routes, experts)
    top = jnp.take_along_axis(probs, experts, axis=-1)
  if norm_topk:
    top = top / jnp.sum(top, axis=-1, keepdims=True)
  return top.astype(x.dtype), experts, probs


def _megablox(lhs, rhs, group_sizes, interpret: bool):
  from jax.experimental.pallas.ops.tpu import megablox  # pylint: disable=g-import-not-at-top

  m = lhs.shape[0]
  pad = -m % _MEGABLOX_TILE
  lhs = jnp.pad(lhs, ((0, pad), (0, 0)))
  tiling = (_MEGABLOX_TILE, min(_MEGABLOX_TILE, lhs.shape[1]), min(_MEGABLOX_TILE, rhs.shape[2]))
  out = megablox.gmm(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype, tiling=tiling, interpret=interpret)
  return out[:m]


def _tiled(lhs, rhs, group_sizes):
  """Each group's rows padded to whole tiles (one group per tile), then one [tile, K] x [K, N] matmul per tile in a
  loop; at most G - 1 tiles' worth of padding."""
  (m, k), g, rhs = lhs.shape, rhs.shape[0], jnp.asarray(rhs)
  tile = int(np.clip(2 ** int(np.log2(max(m // g, 1))), 8, 128))
  tiles = -(-(m + g * (tile - 1)) // tile)
  padded = -(-group_sizes // tile) * tile
  ends, padded_ends = jnp.cumsum(group_sizes), jnp.cumsum(padded)
  rows = jnp.arange(m)
  group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), g - 1)
  dest = jnp.where(rows < ends[-1], (padded_ends - padded)[group] + rows - (ends - group_sizes)[group], tiles * tile)
  tile_group = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(tiles) * tile, side="right"), g - 1)
  buf = jnp.zeros((tiles * tile, k), lhs.dtype).at[dest].set(lhs, mode="drop", unique_indices=True)
  out = jax.lax.map(lambda xs: xs[0] @ rhs[xs[1]], (buf.reshape(tiles, tile, k), tile_group))
  return out.reshape(tiles * tile, -1).at[dest].get(mode="fill", fill_value=0, unique_indices=True)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, impl: str = "ragged_dot",
                   interpret: bool = False) -> jax.Array:
  """lhs [M, K] rows sorted by group, rhs [G, K, N], group_sizes [G] (summing to at most M) -> [M, N]: each group's
  rows times its matrix (rows past the groups come out zero, unspecified with megablox)."""
  if impl == "megablox":
    return _megablox(lhs, rhs, group_sizes, interpret)
  if impl == "tiled":
    return _tiled(lhs, rhs, group_sizes)
  return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype)


def experts_mlp(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                down: jax.Array, *, impl: str = "tiled", interpret: bool = False, first_expert=0) -> jax.Array:
  """x [N, D]; experts, weights [N, k]; gate, up [E, D, F]; down [E, F, D] -> [N, D]: sum over each token's k experts
  of weight * down(silu(gate(x)) * up(x)), grouped by expert (dropless). The weights may hold experts
  first_expert .. first_expert + E - 1 of more (expert parallelism): the others' pairs contribute nothing here."""
  n, k = experts.shape
  e = gate.shape[0]
  local = experts.reshape(-1) - first_expert
  mine = (local >= 0) & (local < e)
  key = jnp.where(mine, local, e)  # pairs of other devices' experts sort last, in no group
  order = jnp.argsort(key, stable=True)
  rows = jnp.take(x, order // k, axis=0)
  sizes = jnp.bincount(key, length=e + 1)[:e].astype(jnp.int32)
  mm = functools.partial(grouped_matmul, group_sizes=sizes, impl=impl, interpret=interpret)
  dt = x.dtype
  h = jax.nn.silu(mm(rows, gate.astype(dt))) * mm(rows, up.astype(dt))
  out = mm(h, down.astype(dt)) * jnp.take(weights.reshape(-1), order)[:, None]
  out = jnp.where(jnp.take(mine, order)[:, None], out, 0)  # megablox leaves rows past the groups unwritten
  unsorted = jnp.zeros_like(out).at[order].set(out, unique_indices=True)
  return jnp.sum(unsorted.reshape(n, k, -1), axis=1)


def resolve(impl: str) -> str:
  """`auto` -> megablox on TPU, ragged_dot on GPU, tiled on CPU (`sharding.platform()`)."""
  if impl != "auto":
    return impl
  return {"tpu": "megablox", "gpu": "ragged_dot", "cuda": "ragged_dot", "rocm": "ragged_dot"}.get(sharding.platform(),
                                                                                                   "tiled")


def _axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def sharded_experts_mlp(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                        down: jax.Array, *, impl: str = "auto", interpret: bool = False) -> jax.Array:
  """`experts_mlp` on x [B, T, D] (experts, weights [B, T, k]); per device under `shard_map` inside a sharding context.

  Rows stay on their batch shards and the MLP width on the tensor axes (partial sums meet in a `psum`). Experts
  sharded over an expert axis (expert parallelism) each see every token of their group of devices: rows sharded over
  that axis too (the learner) are gathered over it and their outputs summed back to their shard (`psum_scatter`);
  rows replicated over it (the sampler) are summed with a `psum`."""
  impl = resolve(impl)
  d, k = x.shape[-1], experts.shape[-1]

  def local(x, experts, weights, gate, up, down, *, expert_axes=(), gather=(), psum=()):
    if gather:
      x, experts, weights = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, experts, weights))
    lb, lt = x.shape[:2]
    first = jax.lax.axis_index(expert_axes) * gate.shape[0] if expert_axes else 0
    out = experts_mlp(x.reshape(lb * lt, d), experts.reshape(lb * lt, k), weights.reshape(lb * lt, k), gate, up, down,
                      impl=impl, interpret=interpret, first_expert=first).reshape(lb, lt, d)
    if gather:
      out = jax.lax.psum_scatter(out, gather, scatter_dimension=0, tiled=True)
    return jax.lax.psum(out, psum) if psum else out

  ctx = sharding.current()
  if ctx is None:
    return local(x, experts, weights, gate, up, down)
  mesh, rules = ctx
  rows = sharding.spec(x.shape, ("batch", None, None), mesh, rules)[0]
  expert_spec, _, width = sharding.spec(gate.shape, ("experts", None, "mlp"), mesh, rules)
  expert_axes = _axes(expert_spec)
  gather = tuple(a for a in expert_axes if a in _axes(rows))
  replicated = tuple(a for a in expert_axes if a not in gather)
  tok = P(rows, None, None)
  fn = functools.partial(local, expert_axes=expert_axes, gather=gather, psum=_axes(width) + replicated)
  wide, narrow = P(expert_spec, None, width), P(expert_spec, width, None)
  return jax.shard_map(fn, mesh=mesh, in_specs=(tok, tok, tok, wide, wide, narrow), out_specs=tok,
                       check_vma=False)(x, experts, weights, gate, up, down)


def router_stats(probs: jax.Array, experts: jax.Array, valid: jax.Array | None) -> dict[str, jax.Array]:
  """A layer's routing over its valid tokens: `counts` [E] (token-expert assignments), `probs` [E] (summed router
  probabilities), `tokens` (how many). probs [N, E]; experts [N, k]; valid [N] (None: all)."""
  e = probs.shape[-1]
  w = jnp.ones(probs.shape[0], jnp.float32) if valid is None else valid.astype(jnp.float32)
  counts = jnp.zeros(e, jnp.float32).at[experts.reshape(-1)].add(jnp.repeat(w, experts.shape[-1]))
  return {"counts": counts, "probs": jnp.sum(probs * w[:, None], axis=0), "tokens": jnp.sum(w)}


def replay_stats(probs: jax.Array, experts: jax.Array, routes: jax.Array, valid: jax.Array | None
                 ) -> dict[str, jax.Array]:
  """Of a layer's valid tokens with a recorded routing (`routes` [N, k] >= 0): how many (`replayed`) and how many the
  router would have sent to another set of experts (`rerouted`: its own top-k is not the recorded one)."""
  own = jnp.sort(jax.lax.top_k(probs, experts.shape[-1])[1], axis=-1)
  recorded = routes[:, 0] >= 0
  if valid is not None:
    recorded &= valid.astype(bool)
  differs = jnp.any(own != jnp.sort(experts, axis=-1), axis=-1)
  count = lambda mask: jnp.sum(mask.astype(jnp.float32))
  return {"replayed": count(recorded), "rerouted": count(recorded & differs)}


def load_balancing_loss(stats: dict[str, jax.Array]) -> jax.Array:
  """The Switch-Transformer auxiliary loss over every MoE layer, as HF's `load_balancing_loss_func`:
  E * sum_e (assignments to e / tokens) * (mean router probability of e), tokens and layers pooled.
  `stats`: `router_stats` stacked over layers ([L, E], [L, E], [L])."""
  tokens = jnp.maximum(jnp.sum(stats["tokens"]), 1.0)
  per_expert = jnp.sum(stats["counts"], axis=0) / tokens
  prob = jnp.sum(stats["probs"], axis=0) / tokens
  return stats["counts"].shape[-1] * jnp.sum(per_expert * prob)


def expert_load_max(stats: dict[str, jax.Array]) -> jax.Array:
  """The most loaded expert's assignments over the mean expert's, in the worst layer (1 = balanced)."""
  counts = stats["counts"]
  return jnp.max(jnp.max(counts, axis=-1) / jnp.maximum(jnp.mean(counts, axis=-1), 1e-9))
