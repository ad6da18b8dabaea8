"""PPO with a learned critic (`learner.critic`): a value model, GAE, and the clipped value loss.

The value model is the policy's transformer with a value head, a zero vector at the start, so the first step's values
are 0; it trains with its own AdamW (`learner.critic_lr`, default the policy's). Two kinds:

- "copy": a copy of the policy's weights (LoRA adapters merged in), every weight trained;
- "lora" (a LoRA run's): a LoRA branch of the policy. The critic's programs take the policy's frozen base (quantized
  under QLoRA) as an argument, and the critic owns only its adapters (copied from the policy's at the start) and the
  head: no second copy of the model in memory, and only those are trained, updated and checkpointed.

Per step:

1. old values V(s_t) at every loss position of every micro-batch, one forward pass with the step's starting critic
   (beside the proximal pass: computed once per batch; `critic_targets`, with step 2);
2. GAE on the device (`gae`, associative scans over the packed rows): the answer's reward (as the critic-free path
   shapes and normalises it) at its last loss token, δ_t = r_t + γ V(s_t+1) - V(s_t) and A_t = Σ_k (γλ)^k δ_t+k over
   the answer's loss tokens (tokens the policy did not draw, e.g. a tool's output inside a merged multi-turn
   sequence, are skipped, not steps), returns R_t = A_t + V(s_t). With γ = λ = 1 and a zero critic A_t is the
   critic-free advantage exactly;
3. the policy's decoupled-PPO updates use these A_t; then per minibatch one critic update on
   ½ max((V - R)², (V_old + clip(V - V_old, ±value_clip) - R)²), averaged over the minibatch's loss tokens
   (`critic_update`, which returns the new state and the `critic/*` statistics of `critic_stats`).

`build_critic` makes the programs (`CriticFns`); the `Learner` holds the critic's parameters and optimizer state and
passes them, with the policy's base and the step's batches, to these functions, which return new ones.

Staleness needs nothing more: old values and returns are computed by the critic at the step's start, like the
proximal logprobs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.optimizer import make_optimizer
from areal_jax.learner.step import BATCH_INT_KEYS, opt_state_shardings, with_rules
from areal_jax.models import lora
from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import Transformer
from areal_jax.sharding import Rules, state_shardings

CRITIC_STATS = ("value_loss", "value_clipped", "values", "returns", "tokens")


class ValueModel(nnx.Module):
  """The policy's transformer and a value head: V(s_t) = h_t · w, float32."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.body = Transformer(cfg, rngs=rngs)
    self.head = nnx.Param(jnp.zeros((cfg.hidden_size,), jnp.float32), logical_axes=("embed",))

  def __call__(self, tokens, positions, segment_ids) -> jax.Array:
    h = self.body.hidden(tokens, positions=positions, segment_ids=segment_ids)
    return jnp.einsum("btd,d->bt", h.astype(jnp.float32), self.head[...])


def _reverse_linear(a: jax.Array, b: jax.Array) -> jax.Array:
  """x along axis 1 with x_t = a_t x_t+1 + b_t and x_T = 0, as one associative scan (log-depth, on the device)."""
  def compose(later, earlier):  # the map x -> earlier(later(x))
    return earlier[0] * later[0], earlier[0] * later[1] + earlier[1]

  return jax.lax.associative_scan(compose, (a, b), reverse=True, axis=1)[1]


@functools.partial(jax.jit, static_argnames=("gamma", "lam"))
def gae(values: jax.Array, advantages: jax.Array, loss_mask: jax.Array, segment_ids: jax.Array, *, gamma: float,
        lam: float) -> tuple[jax.Array, jax.Array]:
  """(advantages, returns) [rows, length] over packed rows, 0 off the loss tokens. `advantages` holds each answer's
  critic-free advantage on its loss tokens; it becomes the reward at the answer's last loss token. A segment's loss
  tokens are its steps, in order (tokens between them are skipped); the value after its last one is 0."""
  m = (loss_mask > 0).astype(jnp.float32)
  shift = lambda x: jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)  # x_t+1
  same = shift(segment_ids) == segment_ids  # t + 1 is in t's segment
  same = same.at[:, -1].set(False).astype(jnp.float32)
  carry = (1.0 - m) * same  # off the loss tokens, whatever follows in the segment carries back
  later = same * shift(_reverse_linear(carry, m))  # another loss token follows in the segment
  rewards = m * (1.0 - (later > 0)) * advantages
  next_value = same * shift(_reverse_linear(carry, m * values))
  delta = rewards + gamma * next_value - values
  adv = m * _reverse_linear(same * jnp.where(m > 0, gamma * lam, 1.0), m * delta)
  return adv, m * (adv + values)


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, mask: jax.Array,
               clip: float) -> tuple[jax.Array, jax.Array]:
  """(per-token clipped value loss, whether the clipped term was the larger), 0 off `mask`."""
  clipped = old_values + jnp.clip(values - old_values, -clip, clip)
  plain, held = jnp.square(values - returns), jnp.square(clipped - returns)
  return jnp.where(mask, 0.5 * jnp.maximum(plain, held), 0.0), mask & (held > plain)


def _sds(tree, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


@dataclasses.dataclass(frozen=True)
class CriticFns:
  """The critic's programs and shardings (the policy's mesh and rules). `base` is what the critic shares with the
  policy (`base_of(policy params)`: its frozen base under "lora", else nothing)."""

  graphdef: Any
  abstract_params: nnx.State
  param_shardings: Any
  abstract_base: nnx.State
  base_shardings: Any
  opt_shardings: Any
  optimizer: optax.GradientTransformation
  from_policy: Callable  # policy params -> critic params (policy weights or adapters; a zero head)
  base_of: Callable  # policy params -> base
  init_opt_state: Callable
  zero_accumulators: Callable
  values: Callable  # (critic params, base, batch) -> [rows, length]
  accumulate: Callable  # (params, base, grads, stats, batch, inv_tokens) -> (grads, stats)
  apply: Callable  # (params, opt_state, grads) -> (params, opt_state, grad_norm)

  def abstract_state(self) -> tuple[Any, Any]:
    opt = jax.eval_shape(self.optimizer.init, self.abstract_params)
    return _sds(self.abstract_params, self.param_shardings), _sds(opt, self.opt_shardings)

  def abstract_shared(self) -> nnx.State:
    """The (sharded, abstract) base the critic's programs take from the policy."""
    return _sds(self.abstract_base, self.base_shardings)

  def lower(self, batch: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.stages.Lowered]:
    """AOT-lowers the critic's programs from abstract shapes: `batch` holds the policy's [rows, length] int arrays
    and `loss_mask` (the critic's old values and returns take its shape)."""
    params, opt = self.abstract_state()
    base = self.abstract_shared()
    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding), params)
    floats = {k: batch["loss_mask"] for k in ("old_values", "returns")}
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(batch["loss_mask"].sharding.mesh, P()))
    stats = {k: scalar for k in CRITIC_STATS}
    inputs = {k: batch[k] for k in ("tokens", "positions", "segment_ids")}
    return {"critic_values": self.values.lower(params, base, inputs),
            "critic_accumulate": self.accumulate.lower(params, base, grads, stats, batch | floats, scalar),
            "critic_apply": self.apply.lower(params, opt, grads)}


def _accumulate(values, value_clip: float, params, base, grads, stats, batch, inv_tokens):
  """The value loss's gradients (scaled by `inv_tokens`) and statistics of one micro-batch, added to the running
  sums."""
  mask = batch["loss_mask"] > 0

  def loss_fn(params):
    v = values(params, base, batch)
    loss, clipped = value_loss(v, batch["old_values"], batch["returns"], mask, value_clip)
    return loss.sum() * inv_tokens, (loss, clipped, v)

  (_, (loss, clipped, v)), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
  step = {"value_loss": loss.sum(), "value_clipped": clipped.sum(), "values": jnp.where(mask, v, 0.0).sum(),
          "returns": jnp.where(mask, batch["returns"], 0.0).sum(), "tokens": mask.sum().astype(jnp.float32)}
  return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g), {k: stats[k] + step[k] for k in stats}


def build_critic(model_cfg: ModelConfig, cfg: LearnerConfig, mesh: Mesh, *, batch_sharding: NamedSharding,
                 replicated: NamedSharding, rules: Rules) -> CriticFns:
  """The critic's programs on the policy's `mesh`, sharded by the policy's `rules`."""
  branch = cfg.critic == "lora"
  if branch and not model_cfg.lora_rank:
    raise ValueError("learner.critic='lora': a LoRA branch needs the policy's adapters (learner.lora.rank > 0)")
  body_cfg = model_cfg if branch else model_cfg.without_lora()
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: ValueModel(body_cfg, rngs=nnx.Rngs(0))))
  # Under "lora" the critic trains its adapters and head; the base is the policy's (nested under "body").
  abstract, abstract_base = (nnx.split_state(abstract, nnx.Any(lora.ADAPTERS, nnx.PathContains("head")), ...)
                             if branch else (abstract, nnx.State({})))
  param_sh, base_sh = state_shardings(abstract, mesh, rules), state_shardings(abstract_base, mesh, rules)
  tx = make_optimizer(cfg.replace(lr=cfg.critic_lr or cfg.lr))
  opt_sh = opt_state_shardings(jax.eval_shape(tx.init, abstract), abstract, param_sh, replicated)

  ruled = lambda fn: with_rules(fn, mesh, rules)

  def from_policy(policy):
    if branch:
      body = lora.split(policy)[0]
    else:
      body = lora.merged(policy, model_cfg) if model_cfg.lora_rank else policy
    head = jnp.zeros(abstract["head"].shape, abstract["head"].dtype)
    return jax.tree.unflatten(jax.tree.structure(abstract), jax.tree.leaves(body) + [head])  # "body" < "head"

  def base_of(policy):
    if not branch:
      return nnx.State({})
    return nnx.from_flat_state([(("body", *path), v) for path, v in nnx.to_flat_state(lora.split(policy)[1])])

  def values(params, base, batch):
    return nnx.merge(graphdef, params, base)(batch["tokens"], batch["positions"], batch["segment_ids"])

  def zeros():
    return (jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), abstract),
            {k: jnp.zeros((), jnp.float32) for k in CRITIC_STATS})

  accumulate = functools.partial(_accumulate, values, cfg.value_clip)

  def apply(params, opt_state, grads):
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grad_norm

  stats_sh = {k: replicated for k in CRITIC_STATS}
  return CriticFns(
      graphdef=graphdef, abstract_params=abstract, param_shardings=param_sh, abstract_base=abstract_base,
      base_shardings=base_sh, opt_shardings=opt_sh, optimizer=tx, base_of=base_of,
      from_policy=jax.jit(from_policy, out_shardings=param_sh),
      init_opt_state=jax.jit(tx.init, in_shardings=(param_sh,), out_shardings=opt_sh),
      zero_accumulators=jax.jit(zeros, out_shardings=(param_sh, stats_sh)),
      values=jax.jit(ruled(values), in_shardings=(param_sh, base_sh, batch_sharding), out_shardings=batch_sharding),
      accumulate=jax.jit(ruled(accumulate), in_shardings=(param_sh, base_sh, param_sh, stats_sh, batch_sharding,
                                                          replicated),
                         out_shardings=(param_sh, stats_sh), donate_argnums=(2, 3)),
      apply=jax.jit(ruled(apply), in_shardings=(param_sh, opt_sh, param_sh), out_shardings=(param_sh, opt_sh,
                                                                                             replicated),
                    donate_argnums=(0, 1)))


def critic_targets(critic: CriticFns, params, base, batches: list[list[dict]], *, gamma: float, lam: float,
                   gather: Callable) -> tuple[list[list[dict]], list[list[dict]], list]:
  """The critic's values at the step's start (`params`, the policy's `base`), then GAE, on the devices, per
  micro-batch of the policy's `batches` (minibatch by minibatch). Returns the policy's batches with GAE's
  `advantages`, the critic's batches (old values, returns) likewise nested, and (values, returns) per micro-batch
  replicated by `gather` (for `critic_stats`' explained variance, read with the step's other statistics)."""
  policy, out, targets = [], [], []
  for minibatch in batches:
    policy.append([])
    out.append([])
    for b in minibatch:
      v = critic.values(params, base, {k: b[k] for k in BATCH_INT_KEYS})
      advantages, returns = gae(v, b["advantages"], b["loss_mask"], b["segment_ids"], gamma=gamma, lam=lam)
      policy[-1].append(b | {"advantages": advantages})
      out[-1].append({k: b[k] for k in BATCH_INT_KEYS + ("loss_mask",)} | {"old_values": v, "returns": returns})
      targets.append((gather(v), gather(returns)))
  return policy, out, targets


def critic_update(critic: CriticFns, params, opt_state, base, batches: list[list[dict]], targets: list,
                  loss_tokens: Sequence[int], loss_masks: Sequence[np.ndarray], *,
                  replicated: NamedSharding) -> tuple[Any, Any, dict[str, float]]:
  """One critic update per minibatch of `critic_targets`' `batches` (its loss averaged over the minibatch's
  `loss_tokens`). Returns (new params, new optimizer state, `critic_stats`), the stats read from the devices;
  `loss_masks` are the micro-batches' loss tokens on the host (boolean [rows, length]), in order."""
  sums, norms = [], []
  for minibatch, n in zip(batches, loss_tokens):
    inv_tokens = jax.device_put(np.float32(1.0 / max(n, 1)), replicated)
    grads, stats = critic.zero_accumulators()
    for b in minibatch:
      grads, stats = critic.accumulate(params, base, grads, stats, b, inv_tokens)
    params, opt_state, norm = critic.apply(params, opt_state, grads)
    sums.append(stats)
    norms.append(norm)
  sums, norms, targets = jax.device_get((sums, norms, targets))
  return params, opt_state, critic_stats(sums, norms, targets, loss_masks)


def critic_stats(sums: Sequence[dict], norms: Sequence, targets: Sequence, loss_masks: Sequence[np.ndarray]
                 ) -> dict[str, float]:
  """`critic/*` from the updates' statistic sums and gradient norms and the micro-batches' (values, returns), all on
  the host: the value loss, clip fraction, mean value and return per loss token, gradient norm, explained variance."""
  total = {k: float(sum(s[k] for s in sums)) for k in CRITIC_STATS}
  n = max(total["tokens"], 1.0)
  v = np.concatenate([vals[m] for (vals, _), m in zip(targets, loss_masks)] or [np.zeros(0)])
  r = np.concatenate([ret[m] for (_, ret), m in zip(targets, loss_masks)] or [np.zeros(0)])
  explained = 1.0 - np.var(r - v) / np.var(r) if r.size and np.var(r) > 0 else 0.0
  return {"critic/value_loss": total["value_loss"] / n, "critic/clip_fraction": total["value_clipped"] / n,
          "critic/values_mean": total["values"] / n, "critic/returns_mean": total["returns"] / n,
          "critic/grad_norm": float(np.mean(norms)) if norms else 0.0,
          "critic/explained_variance": float(explained)}
