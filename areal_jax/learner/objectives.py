"""Policy objectives by name, and M2PO's token mask.

Every objective is one function of per-token arrays ([rows, T]) that returns per-token losses; `token_terms` wraps
it with what all of them share: non-finite logprobs kept out, the behaviour weight w = π_prox/π_behav and its
off-policy correction (`ppo.Rejection`), and the statistics the learner sums over micro-batches. With u = π_θ/π_prox
(per token; for `importance_sampling_level="sequence"`, each sequence's geometric mean of u, with the sequence's
mean advantage, as GSPO and AReaL have it) and advantage A:

* `ppo` (the default; AReaL's decoupled PPO, paper Eq. 5): -min(u·A, clip(u, 1 - eps_clip, 1 + eps_clip_higher)·A),
  at most -c_clip·A where A < 0 (dual clip).
* `gspo`: `ppo` with `importance_sampling_level="sequence"`.
* `sapo` (soft gates instead of the clip; AReaL's `sapo_loss_fn`): -g·A with g = (4/τ)·σ(τ(u - 1)), τ = tau_pos
  where A > 0, else tau_neg. AReaL refuses it with the decoupled loss; so does `LearnerConfig`.
* `cispo` (MiniMax-M1): -sg(clip(u, 1 - eps_clip, 1 + eps_clip_higher))·A·log π_θ; every token keeps a gradient,
  only its weight is clipped (eps_clip=1: no lower bound).

Each token's loss is then multiplied by w (after the correction); a token the correction masks weighs 0 and stays in
the denominator, as in AReaL. Parameter names are AReaL's.

Adding an objective is one function and one `register` line::

    @register("my_objective")
    def my_objective(t: Tokens, *, beta: float = 1.0):
      u, adv = ratio(t, "token")
      return -beta * u * adv, {}

and `learner.loss = "my_objective"` chooses it; its keyword parameters are set by their names, `learner.beta`
(`LearnerConfig.objective_kwargs`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp

from areal_jax.learner.ppo import Rejection, behavior_weights, by_sequence, kl_estimate

IS_LEVELS = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class Tokens:
  """What an objective sees: `logprobs` (log π_θ, the one input with a gradient), `proximal` (log π_prox),
  `advantages`, `mask` (loss tokens whose logprobs are finite), `kept` (`mask` less the tokens the off-policy
  correction masked: what a sequence's mean runs over) and `segment_ids` (1-based sequences of a packed row)."""

  logprobs: jax.Array
  proximal: jax.Array
  advantages: jax.Array
  mask: jax.Array
  kept: jax.Array
  segment_ids: jax.Array


Objective = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class Spec:
  """A registered objective: its function, its keyword parameters with their defaults, and whether it composes with
  the decoupled loss's behaviour weight and correction (AReaL's SAPO does not)."""

  fn: Objective
  params: tuple[str, ...]
  decoupled: bool
  defaults: tuple[tuple[str, object], ...] = ()  # (parameter, default) in `params`' order


OBJECTIVES: dict[str, Spec] = {}


def register(name: str, *, decoupled: bool = True, **fixed) -> Callable[[Objective], Objective]:
  """Registers `fn(t: Tokens, **params) -> (per-token loss, terms)` as objective `name`; `fixed` pins some of its
  parameters (`gspo` is `ppo` at the sequence level). `terms` may hold `clipped` / `dual_clipped` (bool [rows, T]).
  Each parameter is keyword-only with a default; the config sets it by its name (`learner.<name>`)."""

  def wrap(fn: Objective) -> Objective:
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in fixed]
    missing = [p.name for p in params if p.default is inspect.Parameter.empty]
    if missing:
      raise ValueError(f"objective {name!r}: parameters {missing} need defaults (the config's, until set)")
    OBJECTIVES[name] = Spec(functools.partial(fn, **fixed), tuple(p.name for p in params), decoupled,
                            tuple((p.name, p.default) for p in params))
    return fn

  return wrap


def declared_params() -> dict[str, object]:
  """Every registered objective's parameters with their defaults (a name two objectives share: the first
  registered's): the `learner.*` keys the config sets them by."""
  out: dict[str, object] = {}
  for s in OBJECTIVES.values():
    for name, default in s.defaults:
      out.setdefault(name, default)
  return out


def spec(name: str) -> Spec:
  if name not in OBJECTIVES:
    raise ValueError(f"objective {name!r}: choose one of {sorted(OBJECTIVES)}")
  return OBJECTIVES[name]


def ratio(t: Tokens, level: str) -> tuple[jax.Array, jax.Array]:
  """(u, advantages) per token: u = π_θ/π_prox; at the sequence level each sequence's geometric mean of u over its
  kept tokens, and its mean advantage (GSPO, as AReaL computes it)."""
  if level not in IS_LEVELS:
    raise ValueError(f"importance_sampling_level={level!r}: choose one of {IS_LEVELS}")
  if level == "token":
    return jnp.exp(jnp.where(t.mask, t.logprobs - t.proximal, 0.0)), t.advantages
  count = jnp.maximum(by_sequence(t.kept.astype(jnp.float32), t.segment_ids, "sum"), 1.0)
  mean = lambda x: by_sequence(jnp.where(t.kept, x, 0.0), t.segment_ids, "sum") / count
  return jnp.exp(mean(t.logprobs - t.proximal)), mean(t.advantages)


@register("ppo")
def ppo(t: Tokens, *, eps_clip: float = 0.2, eps_clip_higher: float | None = None, c_clip: float | None = None,
        importance_sampling_level: str = "token"):
  if c_clip is not None and c_clip <= 1.0:
    raise ValueError(f"c_clip={c_clip}: the dual clip must be > 1 (or None to disable it)")
  u, adv = ratio(t, importance_sampling_level)
  eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
  loss_unclipped = -adv * u
  loss_clipped = -adv * jnp.clip(u, 1.0 - eps_clip, 1.0 + eps_high)
  clipped = loss_clipped > loss_unclipped
  loss = jnp.maximum(loss_unclipped, loss_clipped)
  if c_clip is None:
    return loss, {"clipped": clipped}
  dual_bound = -c_clip * adv  # only binds where A < 0
  dual_clipped = (adv < 0) & (loss > dual_bound)
  return jnp.where(dual_clipped, dual_bound, loss), {"clipped": clipped, "dual_clipped": dual_clipped}


register("gspo", importance_sampling_level="sequence")(ppo)


@register("sapo", decoupled=False)
def sapo(t: Tokens, *, tau_pos: float = 1.0, tau_neg: float = 1.05, importance_sampling_level: str = "token"):
  if tau_pos <= 0 or tau_neg <= 0:
    raise ValueError(f"SAPO temperatures tau_pos={tau_pos}, tau_neg={tau_neg}: both must be positive")
  u, adv = ratio(t, importance_sampling_level)
  gate = jnp.where(adv > 0, jax.nn.sigmoid(tau_pos * (u - 1.0)) * (4.0 / tau_pos),
                   jax.nn.sigmoid(tau_neg * (u - 1.0)) * (4.0 / tau_neg))
  return -gate * adv, {}


@register("cispo")
def cispo(t: Tokens, *, eps_clip: float = 0.2, eps_clip_higher: float | None = None):
  u, adv = ratio(t, "token")
  weight = jnp.clip(u, 1.0 - eps_clip, 1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher))
  return -jax.lax.stop_gradient(weight) * adv * t.logprobs, {"clipped": weight != u}


def token_terms(name: str = "ppo", *, logprobs: jax.Array, proximal_logprobs: jax.Array,
                behavior_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array,
                segment_ids: jax.Array | None = None, rejection: Rejection | None = None,
                **params) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-token loss `m · w · ℓ` of objective `name` [rows, T] and per-token statistics (zero off `mask`).

  Statistics: `clipped`, `dual_clipped`, `importance_weight` (w, before any correction), `capped` (w masked or
  clamped by the correction), `approx_kl` (k3 estimate of KL(π_prox‖π_θ)), `tokens` (the mask itself), `nonfinite`.
  `segment_ids` None: each row is one sequence.

  Non-finite logprobs never reach the loss: a token whose behaviour logprob is -inf/NaN gets w = 1 (as AReaL does);
  one whose proximal logprob is non-finite has no defined ratio and is left out of the loss (it stays in the
  caller's denominator). Both are counted in `nonfinite`.
  """
  objective = spec(name)
  unknown = sorted(set(params) - set(objective.params))
  if unknown:
    raise ValueError(f"objective {name!r} has no parameters {unknown}; it takes {list(objective.params)}")
  mask = mask.astype(bool)
  if segment_ids is None:
    segment_ids = jnp.ones(mask.shape, jnp.int32)
  finite_prox, finite_behav = jnp.isfinite(proximal_logprobs), jnp.isfinite(behavior_logprobs)
  nonfinite = mask & ~(finite_prox & finite_behav)
  mask = mask & finite_prox
  proximal_logprobs = jax.lax.stop_gradient(jnp.where(finite_prox, proximal_logprobs, 0.0))
  behavior_logprobs = jax.lax.stop_gradient(jnp.where(finite_behav, behavior_logprobs, proximal_logprobs))
  weight, w, capped = behavior_weights(proximal_logprobs, behavior_logprobs, mask, rejection, segment_ids)
  kept = mask & ~capped if rejection is not None and rejection.action == "mask" else mask
  tokens = Tokens(logprobs=logprobs, proximal=proximal_logprobs, advantages=jax.lax.stop_gradient(advantages),
                  mask=mask, kept=kept, segment_ids=segment_ids)
  loss, own = objective.fn(tokens, **params)
  loss = jnp.where(mask, weight * loss, 0.0)

  zero = lambda x: jnp.where(mask, x, 0.0).astype(jnp.float32)
  none = jnp.zeros_like(mask)
  stats = {
      "clipped": zero(own.get("clipped", none)),
      "dual_clipped": zero(own.get("dual_clipped", none)),
      "importance_weight": zero(w),
      "capped": zero(capped),
      "approx_kl": zero(kl_estimate(proximal_logprobs, jax.lax.stop_gradient(logprobs), "k3")),  # KL(prox‖θ)
      "tokens": zero(jnp.ones_like(w)),
      "nonfinite": nonfinite.astype(jnp.float32),
  }
  return loss, stats


def loss(name: str = "ppo", *, logprobs: jax.Array, proximal_logprobs: jax.Array, behavior_logprobs: jax.Array,
         advantages: jax.Array, mask: jax.Array, segment_ids: jax.Array | None = None,
         rejection: Rejection | None = None, **params) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Objective `name`'s token-level mean over `mask`, differentiable in `logprobs`, and its statistics (means over
  the masked tokens unless named otherwise): `clip_fraction`, `dual_clip_fraction`, `importance_weight_mean`,
  `importance_weight_max` (w = π_prox/π_behav), `capped_fraction`, `approx_kl`."""
  per_token, terms = token_terms(name, logprobs=logprobs, proximal_logprobs=proximal_logprobs,
                                 behavior_logprobs=behavior_logprobs, advantages=advantages, mask=mask,
                                 segment_ids=segment_ids, rejection=rejection, **params)
  n = jnp.maximum(terms["tokens"].sum(), 1.0)
  stats = {
      "clip_fraction": terms["clipped"].sum() / n,
      "dual_clip_fraction": terms["dual_clipped"].sum() / n,
      "importance_weight_mean": terms["importance_weight"].sum() / n,
      "importance_weight_max": jnp.max(jnp.where(jnp.asarray(mask, bool), terms["importance_weight"], 0.0)),
      "capped_fraction": terms["capped"].sum() / n,
      "approx_kl": terms["approx_kl"].sum() / n,
  }
  return per_token.sum() / n, stats


def m2po_mask(behavior_logprobs: jax.Array, proximal_logprobs: jax.Array, mask: jax.Array,
              threshold: float) -> jax.Array:
  """M2PO (AReaL's `_apply_m2po_masking`): `mask` less the tokens of largest second moment
  m2 = (log π_behav - log π_prox)², removed largest first until the mean m2 of those left is below `threshold`
  (at least one token stays). One sort over all the tokens given, so a learner calls it on a whole mini-batch.
  A token whose logprobs are not both finite has m2 = 0."""
  mask = jnp.asarray(mask, bool)
  flat = mask.reshape(-1)
  ok = jnp.isfinite(behavior_logprobs) & jnp.isfinite(proximal_logprobs)
  m2 = jnp.where(ok, jnp.square(behavior_logprobs - proximal_logprobs), 0.0).reshape(-1)
  order = jnp.argsort(jnp.where(flat, -m2, jnp.inf), stable=True)  # the loss tokens, largest m2 first
  n = flat.sum()
  position = jnp.arange(flat.size)
  valid = position < n
  sorted_m2 = jnp.where(valid, m2[order], 0.0)
  suffix = jnp.cumsum(sorted_m2[::-1])[::-1]  # Σ of sorted m2 from each position on
  below = valid & (suffix / jnp.maximum(n - position, 1) < threshold)
  first = jnp.where(below.any(), jnp.argmax(below), jnp.maximum(n - 1, 0))  # tokens masked: the first `first`
  keep = jnp.zeros_like(flat).at[order].set(valid & (position >= first))
  return keep.reshape(mask.shape)
