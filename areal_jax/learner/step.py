"""The learner's jitted programs and their shardings, built from (model config, learner config, mesh) alone.

Nothing here materialises parameters: `build_step` works from `nnx.eval_shape`, so every program can be AOT-lowered
from abstract shapes (`StepFns.lower`) for a topology that is not attached. The programs are pure functions of
(parameters, optimizer state, micro-batch arrays) with explicit in/out shardings and donated state:

* `logprobs(params, batch) -> [rows, length]`: forward only (proximal or reference logprobs); with `routes` in the
  batch (`ROUTES_KEY`), a mixture of experts routes as the sampler did.
* `accumulate(params, grads, stats, batch, inv_denominator) -> (grads, stats)`: adds one micro-batch's gradient of
  `Σ m·w·loss / D` (token weights w and the minibatch's denominator D from `loss_agg`, so the sum over micro-batches
  and data shards is the minibatch's loss exactly) and its statistic sums.
* `apply(params, opt_state, grads) -> (params, opt_state, grad_norm)`: one optimizer update.
* `logprob_gap(proximal, behavior, mask) -> [sum, count, max]` of |proximal - behaviour| over the masked tokens
  where both are finite: how far the sampler's logprobs are from the learner's under the same weights.
* `gather(x) -> x` replicated: a [rows, length] array whole on every device, so each process's host can read it.

`params` is always the whole parameter state. What trains is `lora.trainable(model_cfg)`: every parameter, or under
LoRA only the adapters (`nnx.LoRAParam`); gradients and optimizer state cover that part alone, and the frozen base
passes through `apply` untouched.

Each compiles once per row length (bucket); `apply` and the initialisers compile once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.optimizer import make_optimizer
from areal_jax.learner import objectives
from areal_jax.learner.ppo import kl_estimate, loglinear_proximal
from areal_jax.models import lora, moe
from areal_jax.models.config import ModelConfig
from areal_jax.models.logprobs import logprobs_and_entropy
from areal_jax.models.transformer import create
from areal_jax.sharding import LEARNER_RULES, Rules, device_bytes, make_mesh, spec, state_shardings, use_rules

# Micro-batch arrays fed to `accumulate`; `logprobs` reads the first three.
BATCH_INT_KEYS = ("tokens", "positions", "segment_ids")
BATCH_FLOAT_KEYS = ("loss_mask", "behavior_logprobs", "advantages", "loss_weights")
# Each loss token's staleness (learner version - the version that drew it), for statistics by staleness; optional.
STALENESS_KEY = "staleness"
# A mixture of experts' recorded routing, int16 [rows, length, sparse layers, k] (`MicroBatch.routes`), with
# `learner.routing_replay`: read by `logprobs` and `accumulate`.
ROUTES_KEY = "routes"
STALENESS_BUCKETS = 16  # staleness 0 .. 14, and 15 or more
# Statistic sums over loss tokens returned by `accumulate` (`importance_weight_max` is a max), and sums by staleness
# bucket ([STALENESS_BUCKETS] each).
SUM_STATS = ("loss", "clipped", "dual_clipped", "importance_weight", "capped", "approx_kl", "entropy", "tokens",
             "nonfinite")
STALENESS_STATS = ("tokens", "clipped", "capped")


def make_learner_mesh(devices, *, tensor: int = 1, data: int = 1) -> Mesh:
  """The learner mesh (data × fsdp × tensor); fsdp takes the devices left over."""
  return make_mesh(devices, {"data": data, "fsdp": -1, "tensor": tensor})


def batch_rows(mesh: Mesh, rules: Rules = LEARNER_RULES) -> int:
  """Rows per micro-batch: the number of shards the `batch` logical axis has on `mesh`."""
  target = dict(rules).get("batch")
  axes = (target,) if isinstance(target, str) else tuple(target or ())
  return math.prod(mesh.shape[a] for a in axes if a in mesh.shape)


def packed_logprobs(model, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array, *, temperature: float,
                    chunk: int = 0, with_entropy: bool = False, with_routing: bool = False,
                    routes: jax.Array | None = None) -> tuple[jax.Array, ...]:
  """(logprob of token t + 1 at t, [entropy at t], [a mixture of experts' routing]) over packed rows, each
  [rows, length] (the routing as `Transformer.run_layers` returns it). `routes` [rows, length, sparse layers, k]
  replays a routing (-1: the router's own).

  Values where t + 1 is not in t's segment are meaningless; callers mask them. The vocabulary projection runs
  `chunk` vocabulary entries at a time (`logprobs_and_entropy`), so the [tokens, vocab] logits never exist.
  """
  if routes is not None:
    routes = jnp.moveaxis(routes, 2, 0)  # the model's layout: [sparse layers, rows, length, k]
  h, routing = model.hidden(tokens, positions=positions, segment_ids=segment_ids, routes=routes, routing=True)
  targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
  lp, ent = logprobs_and_entropy(h, model.unembedding(), targets, temperature, chunk=chunk)
  return (lp,) + ((ent,) if with_entropy else ()) + ((routing,) if with_routing else ())


def stat_shapes(cfg: LearnerConfig, model_cfg: ModelConfig | None = None) -> dict[str, tuple[int, ...]]:
  """The statistics a step accumulates, with their shapes; a mixture of experts adds its load-balancing loss and each
  sparse layer's token-expert assignments."""
  out = dict.fromkeys(SUM_STATS + (("ref_kl",) if cfg.kl_coef else ()) + ("importance_weight_max",), ())
  out |= {f"{k}_by_staleness": (STALENESS_BUCKETS,) for k in STALENESS_STATS}
  if model_cfg is not None and model_cfg.num_experts:
    out |= {"aux_loss": (), "expert_counts": (sum(model_cfg.sparse_layers()), model_cfg.num_experts)}
    if cfg.routing_replay:  # (position, sparse layer) pairs replayed, and those the learner's router would reroute
      out |= {"replayed": (), "rerouted": ()}
  return out


def stat_keys(cfg: LearnerConfig, model_cfg: ModelConfig | None = None) -> tuple[str, ...]:
  return tuple(stat_shapes(cfg, model_cfg))


def batch_keys(cfg: LearnerConfig) -> tuple[str, ...]:
  optional = {"proximal_logprobs": cfg.recompute_proximal, "prox_alpha": cfg.loglinear_proximal,
              "ref_logprobs": bool(cfg.kl_coef), ROUTES_KEY: cfg.routing_replay}
  return BATCH_INT_KEYS + BATCH_FLOAT_KEYS + (STALENESS_KEY,) + tuple(k for k, on in optional.items() if on)


def microbatch_loss(model, batch: dict[str, jax.Array], inv_tokens: jax.Array, cfg: LearnerConfig,
                    temperature: float) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`Σ m·w·ℓ · inv_tokens` of one micro-batch (the `learner.loss` objective + optional KL and entropy terms;
  w = `loss_weights`) and its statistic sums. A mixture of experts adds `aux_loss_coef` x its load-balancing loss
  over the micro-batch's tokens, weighted as one more per-token term (`Σ m·w · inv_tokens`, the micro-batch's share
  of the loss)."""
  lp, ent, routing = packed_logprobs(model, batch["tokens"], batch["positions"], batch["segment_ids"],
                                     temperature=temperature, chunk=cfg.vocab_chunk, with_entropy=True,
                                     with_routing=True, routes=batch.get(ROUTES_KEY))
  mask = batch["loss_mask"] > 0
  behavior = batch["behavior_logprobs"]
  if cfg.loglinear_proximal:
    proximal = loglinear_proximal(behavior, lp, batch["prox_alpha"])
  else:
    proximal = batch["proximal_logprobs"] if cfg.use_decoupled_loss else behavior
  token_loss, terms = objectives.token_terms(
      cfg.loss, logprobs=lp, proximal_logprobs=proximal, behavior_logprobs=behavior, advantages=batch["advantages"],
      mask=mask, segment_ids=batch["segment_ids"], rejection=cfg.rejection_rule, **cfg.objective_kwargs)
  if cfg.kl_coef:
    kl = jnp.where(mask, kl_estimate(lp, batch["ref_logprobs"], cfg.kl_estimator), 0.0)
    token_loss = token_loss + cfg.kl_coef * kl
    terms["ref_kl"] = jax.lax.stop_gradient(kl)
  ent = jnp.where(mask, ent, 0.0)
  if cfg.entropy_coef:
    token_loss = token_loss - cfg.entropy_coef * ent
  terms["entropy"] = jax.lax.stop_gradient(ent)
  terms["loss"] = jax.lax.stop_gradient(token_loss)
  stats = {k: v.sum() for k, v in terms.items()}
  stats["importance_weight_max"] = terms["importance_weight"].max()
  bucket = jnp.clip(batch.get(STALENESS_KEY, jnp.zeros_like(batch["tokens"])), 0, STALENESS_BUCKETS - 1).reshape(-1)
  for k in STALENESS_STATS:
    stats[f"{k}_by_staleness"] = jax.ops.segment_sum(terms[k].reshape(-1), bucket, num_segments=STALENESS_BUCKETS)
  loss = (token_loss * batch["loss_weights"]).sum() * inv_tokens
  if routing is not None:
    aux = moe.load_balancing_loss(routing)
    loss = loss + cfg.aux_loss_coef * aux * jnp.sum(jnp.where(mask, batch["loss_weights"], 0.0)) * inv_tokens
    stats["aux_loss"] = jax.lax.stop_gradient(aux) * jnp.sum(mask)
    stats["expert_counts"] = routing["counts"]
    if cfg.routing_replay:  # a batch without recorded routes (the warm-start's) replays none
      for k in ("replayed", "rerouted"):
        stats[k] = jnp.sum(routing[k]) if k in routing else jnp.float32(0)
  return loss, stats


@dataclasses.dataclass(frozen=True)
class StepFns:
  """The learner's compiled-on-demand programs, the shardings they use, and the abstract parameter state."""

  mesh: Mesh
  rows: int
  graphdef: Any
  abstract_params: nnx.State  # ShapeDtypeStructs
  param_shardings: Any
  trainable: Any  # the NNX filter of the trained part of the parameters (`lora.trainable`)
  opt_shardings: Any
  batch_sharding: NamedSharding  # every [rows, length] array
  replicated: NamedSharding
  optimizer: optax.GradientTransformation
  batch_keys: tuple[str, ...]
  stat_keys: tuple[str, ...]
  routes_shape: tuple[int, int]  # (sparse layers, experts per token) of `ROUTES_KEY`; (0, 0) for a dense model
  init_params: Callable[[int], nnx.State]
  init_opt_state: Callable
  copy_params: Callable  # fresh buffers (safe to donate) with the parameter shardings
  zero_accumulators: Callable
  logprobs: Callable
  accumulate: Callable
  apply: Callable
  logprob_gap: Callable
  gather: Callable

  def abstract_batch(self, length: int, keys: tuple[str, ...] | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    keys = self.batch_keys if keys is None else keys
    dtype = lambda k: jnp.int32 if k in BATCH_INT_KEYS + (STALENESS_KEY,) else jnp.float32
    out = {k: jax.ShapeDtypeStruct((self.rows, length), dtype(k), sharding=self.batch_sharding) for k in keys}
    if ROUTES_KEY in keys:
      out[ROUTES_KEY] = jax.ShapeDtypeStruct((self.rows, length, *self.routes_shape), jnp.int16,
                                             sharding=self.batch_sharding)
    return out

  @property
  def forward_keys(self) -> tuple[str, ...]:
    """The micro-batch arrays `logprobs` reads (the recorded routing too with `learner.routing_replay`)."""
    return BATCH_INT_KEYS + ((ROUTES_KEY,) if ROUTES_KEY in self.batch_keys else ())

  def split(self, params) -> tuple[nnx.State, nnx.State]:
    """(trained part, frozen part) of a parameter state (or of a state of shardings)."""
    return nnx.split_state(params, self.trainable, ...)

  def abstract_state(self) -> tuple[nnx.State, Any]:
    """(params, optimizer state) as sharded ShapeDtypeStructs."""
    sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    params = jax.tree.map(sds, self.abstract_params, self.param_shardings)
    opt = jax.eval_shape(self.optimizer.init, self.split(self.abstract_params)[0])
    return params, jax.tree.map(sds, opt, self.opt_shardings)

  def abstract_args(self, length: int) -> dict[str, tuple]:
    """The arguments of the three per-step programs for rows of `length` tokens, as sharded abstract shapes."""
    params, opt = self.abstract_state()
    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding),
                         self.split(params)[0])
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=self.replicated)
    vector = jax.ShapeDtypeStruct((STALENESS_BUCKETS,), jnp.float32, sharding=self.replicated)
    stats = {k: vector if k.endswith("_by_staleness") else scalar for k in self.stat_keys}
    return {
        "logprobs": (params, self.abstract_batch(length, self.forward_keys)),
        "accumulate": (params, grads, stats, self.abstract_batch(length), scalar),
        "apply": (params, opt, grads),
    }

  def lower(self, length: int) -> dict[str, jax.stages.Lowered]:
    """AOT-lowers the three per-step programs for rows of `length` tokens, from abstract shapes only."""
    return {name: getattr(self, name).lower(*args) for name, args in self.abstract_args(length).items()}

  def scratch_bytes(self, lowered: dict[str, jax.stages.Lowered]) -> int:
    """Per device, the most scratch memory one of the `lowered` programs needs, as the compiler reports it
    (compiles them; a program that exceeds the HBM raises the compiler's RESOURCE_EXHAUSTED error)."""
    analyses = [program.compile().memory_analysis() for program in lowered.values()]
    return max((m.temp_size_in_bytes for m in analyses if m is not None), default=0)

  def working_bytes(self, length: int, scratch: int) -> int:
    """Per device, what a step on rows of `length` tokens allocates beyond the learner's state: the policy's float32
    gradient accumulators and `scratch`, the most one of its programs needs (`scratch_bytes`, or the compiler's
    report of each). The one formula behind `Learner.working_bytes` and `aot_check.check_colocated`."""
    return device_bytes(self.abstract_args(length)["accumulate"][1]) + scratch


def with_rules(fn: Callable, mesh: Mesh, rules: Rules) -> Callable:
  """`fn` traced under the logical-axis `rules` on `mesh` (its `constrain` calls resolve to them)."""
  def wrapped(*args):
    with use_rules(mesh, rules):
      return fn(*args)
  return wrapped


def opt_state_shardings(abstract_opt, abstract_params, param_shardings, replicated: NamedSharding):
  """Each optimizer-state leaf that mirrors a parameter (same key path suffix and shape) takes its sharding."""
  by_path = {}
  shapes = dict(jax.tree_util.tree_flatten_with_path(abstract_params)[0])
  for path, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]:
    by_path[path] = (s, shapes[path].shape)

  def pick(path, leaf):
    for i in range(len(path)):
      hit = by_path.get(path[i:])
      if hit is not None and hit[1] == leaf.shape:
        return hit[0]
    return replicated

  return jax.tree_util.tree_map_with_path(pick, abstract_opt)


def _zeros(abstract_trained, shapes):
  """Zero gradient and statistic accumulators of a step."""
  grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), abstract_trained)
  return grads, {k: jnp.zeros(shape, jnp.float32) for k, shape in shapes.items()}


def _logprob_gap(proximal, behavior, mask):
  """[sum, count, max] of |proximal - behaviour| over the masked tokens where both are finite."""
  ok = mask & jnp.isfinite(proximal) & jnp.isfinite(behavior)
  gap = jnp.where(ok, jnp.abs(proximal - behavior), 0.0)
  return jnp.stack([gap.sum(), ok.sum().astype(jnp.float32), gap.max()])


def _apply(tx, split, params, opt_state, grads):
  """One optimizer update of the trained parameters (`split` parts them from the frozen ones) and the gradients'
  norm."""
  trained, frozen = split(params)
  grad_norm = optax.tree.norm(grads)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trained)
  updates, opt_state = tx.update(grads, opt_state, trained)
  return nnx.merge_state(optax.apply_updates(trained, updates), frozen), opt_state, grad_norm


def build_step(model_cfg: ModelConfig, cfg: LearnerConfig, mesh: Mesh, *, temperature: float = 1.0,
               rules: Rules = LEARNER_RULES) -> StepFns:
  """The learner's programs for `model_cfg` on `mesh`, sharded by `rules`; no parameters are created."""
  abstract_model = nnx.eval_shape(lambda: create(model_cfg, 0))
  graphdef, abstract_params = nnx.split(abstract_model)
  param_sh = state_shardings(abstract_params, mesh, rules)
  replicated = NamedSharding(mesh, P())
  tx = make_optimizer(cfg)
  trainable = lora.trainable(model_cfg)
  split = lambda state: nnx.split_state(state, trainable, ...)
  abstract_trained, trained_sh = split(abstract_params)[0], split(param_sh)[0]
  opt_sh = opt_state_shardings(jax.eval_shape(tx.init, abstract_trained), abstract_trained, trained_sh, replicated)
  rows = batch_rows(mesh, rules)
  batch_sh = NamedSharding(mesh, spec((rows, 1), ("batch", None), mesh, rules))
  skeys = stat_keys(cfg, model_cfg)

  ruled = lambda fn: with_rules(fn, mesh, rules)

  def init_params(seed: int):
    return jax.jit(lambda: nnx.split(create(model_cfg, seed))[1], out_shardings=param_sh)()

  def logprobs(params, batch):
    model = nnx.merge(graphdef, params)
    (lp,) = packed_logprobs(model, batch["tokens"], batch["positions"], batch["segment_ids"],
                            temperature=temperature, chunk=cfg.vocab_chunk, routes=batch.get(ROUTES_KEY))
    return lp

  def accumulate(params, grads, stats, batch, inv_tokens):
    trained, frozen = split(params)

    def loss_fn(trained):
      return microbatch_loss(nnx.merge(graphdef, trained, frozen), batch, inv_tokens, cfg, temperature)

    (_, s), g = jax.value_and_grad(loss_fn, has_aux=True)(trained)
    grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
    stats = {k: jnp.maximum(stats[k], s[k]) if k.endswith("_max") else stats[k] + s[k] for k in skeys}
    return grads, stats

  return StepFns(
      mesh=mesh, rows=rows, graphdef=graphdef, abstract_params=abstract_params, param_shardings=param_sh,
      trainable=trainable, opt_shardings=opt_sh, batch_sharding=batch_sh, replicated=replicated, optimizer=tx,
      batch_keys=batch_keys(cfg), stat_keys=skeys, init_params=init_params,
      routes_shape=(sum(model_cfg.sparse_layers()), model_cfg.num_experts_per_tok) if model_cfg.num_experts else (0, 0),
      init_opt_state=jax.jit(lambda p: tx.init(split(p)[0]), in_shardings=(param_sh,), out_shardings=opt_sh),
      copy_params=jax.jit(lambda p: jax.tree.map(jnp.copy, p), in_shardings=(param_sh,), out_shardings=param_sh),
      zero_accumulators=jax.jit(functools.partial(_zeros, abstract_trained, stat_shapes(cfg, model_cfg)),
                                out_shardings=(trained_sh, replicated)),
      logprobs=jax.jit(ruled(logprobs), in_shardings=(param_sh, batch_sh), out_shardings=batch_sh),
      accumulate=jax.jit(ruled(accumulate), in_shardings=(param_sh, trained_sh, replicated, batch_sh, replicated),
                         out_shardings=(trained_sh, replicated), donate_argnums=(1, 2)),
      apply=jax.jit(ruled(functools.partial(_apply, tx, split)), in_shardings=(param_sh, opt_sh, trained_sh),
                    out_shardings=(param_sh, opt_sh, replicated), donate_argnums=(0, 1)),
      logprob_gap=jax.jit(_logprob_gap, in_shardings=(batch_sh,) * 3, out_shardings=replicated),
      gather=jax.jit(lambda x: x, in_shardings=batch_sh, out_shardings=replicated),
  )

