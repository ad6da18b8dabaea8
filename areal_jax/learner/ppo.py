"""The decoupled loss's behaviour weight and its corrections, the proximal approximation, and KL estimates.

AReaL's decoupled PPO (paper Eq. 5) weighs each response token's objective by w = π_prox/π_behav (no gradient), the
proximal logprob `lp` (learner, start of step) against the behaviour one `lb` (sampler); the objectives themselves
are in `objectives.py`. Passing `proximal_logprobs = behavior_logprobs` gives w = 1, standard PPO.

Off-policy corrections of w (`Rejection`, AReaL's rejection sampling; verl's TIS and MIS are instances): tokens or
whole sequences whose divergence between the proximal and behaviour policies (the ratio w, or a KL estimate) leaves
[lower, upper] are masked (weight 0, still in the denominator) or have w clamped to the bounds (truncation, TIS).
Token-level masking by ratio with both bounds is IcePop's; `level="sequence"` with `agg="mean"` judges a sequence by
its geometric-mean ratio (geometric rejection); `behav_imp_weight_cap` is token-level masking by ratio above the cap.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

KL_ESTIMATORS = ("k1", "k2", "k3")
REJECTION_LEVELS = ("token", "sequence")
REJECTION_ACTIONS = ("mask", "clamp")
REJECTION_METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3")
REJECTION_AGGS = ("mean", "sum", "max")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rejection:
  """Which behaviour importance weights w = π_prox/π_behav the loss keeps, as AReaL's `RejectionSamplingConfig`.

  `metric`: w itself, or a KL estimate of the proximal against the behaviour policy per token (k1 = log w,
  k2 = (log w)² / 2, k3 = 1/w - 1 + log w). `level="sequence"` judges a whole sequence by `agg` of its tokens'
  metric (for the ratio in log space: the geometric mean, the product, or the largest w), and for the ratio metric
  also gives every token the sequence's geometric-mean w. Out of [lower, upper] (`lower` None: no lower bound):
  `action="mask"` weighs the token (sequence) 0, `"clamp"` clamps its w to [lower or 0, upper].
  """

  level: str = "token"
  action: str = "mask"
  metric: str = "ratio"
  agg: str = "mean"
  upper: float = 5.0
  lower: float | None = None

  def __post_init__(self):
    for name, choices in (("level", REJECTION_LEVELS), ("action", REJECTION_ACTIONS), ("metric", REJECTION_METRICS),
                          ("agg", REJECTION_AGGS)):
      if getattr(self, name) not in choices:
        raise ValueError(f"rejection {name}={getattr(self, name)!r}: choose one of {choices}")
    if self.lower is not None and self.lower > self.upper:
      raise ValueError(f"rejection bounds [{self.lower}, {self.upper}]: lower is above upper")
    if self.metric == "ratio" and (self.upper <= 0 or (self.lower is not None and self.lower < 0)):
      raise ValueError(f"rejection by ratio needs bounds >= 0 and upper > 0; got [{self.lower}, {self.upper}]")


def by_sequence(x: jax.Array, segment_ids: jax.Array, reduce: str) -> jax.Array:
  """Each token's sequence's sum / max of `x` over that sequence ([rows, T] -> [rows, T]); a row's segment ids name
  its sequences."""
  t = x.shape[-1]
  op = jax.ops.segment_sum if reduce == "sum" else jax.ops.segment_max

  def row(v, seg):
    return op(v, seg, num_segments=t)[seg]

  return jax.vmap(row)(x.reshape(-1, t), segment_ids.reshape(-1, t)).reshape(x.shape)


def behavior_weights(proximal_logprobs: jax.Array, behavior_logprobs: jax.Array, mask: jax.Array,
                     rejection: Rejection | None, segment_ids: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(w the loss uses, w before the correction, tokens the correction masked or clamped), each like `mask`, zero off
  it; logprobs finite where `mask` (see `objectives.token_terms`). `segment_ids` name sequences within rows (sequence
  level)."""
  log_w = jnp.where(mask, proximal_logprobs - behavior_logprobs, 0.0)
  w = jnp.exp(log_w)
  if rejection is None:
    return jnp.where(mask, w, 0.0), jnp.where(mask, w, 0.0), jnp.zeros_like(mask)
  r = rejection
  if r.metric == "ratio":
    value = log_w  # judged in log space: bounds are compared as logs
  else:
    value = jnp.where(mask, kl_estimate(proximal_logprobs, behavior_logprobs, r.metric[3:]), 0.0)
  raw = w
  if r.level == "sequence":
    if segment_ids is None:
      raise ValueError("rejection sampling by sequence needs the tokens' segment ids")
    count = jnp.maximum(by_sequence(mask.astype(jnp.float32), segment_ids, "sum"), 1.0)
    if r.agg == "max":
      value = by_sequence(jnp.where(mask, value, -jnp.inf), segment_ids, "max")
    else:
      value = by_sequence(value, segment_ids, "sum") / (count if r.agg == "mean" else 1.0)
    if r.metric == "ratio":
      raw = w = jnp.exp(by_sequence(log_w, segment_ids, "sum") / count)
  if r.metric == "ratio":
    upper = jnp.log(r.upper)
    lower = None if r.lower is None else jnp.log(jnp.maximum(r.lower, 1e-30))
  else:
    upper, lower = r.upper, r.lower
  inside = value <= upper
  if lower is not None:
    inside &= value >= lower
  if r.action == "mask":
    w = jnp.where(inside, w, 0.0)
    changed = mask & ~inside
  else:
    w = jnp.where(inside, w, jnp.clip(w, r.lower or 0.0, r.upper))
    changed = mask & (w != raw)
  return jnp.where(mask, w, 0.0), jnp.where(mask, raw, 0.0), changed


def loglinear_alpha(versions: np.ndarray, proximal_version: int) -> np.ndarray:
  """AReaL's log-linear approximation weight, α = (v_prox - v_behav) / (v_θ - v_behav) clipped to [0, 1], for
  tokens drawn at `versions`. The proximal policy is the step's starting parameters (version `proximal_version`,
  what `recompute` evaluates) and θ the policy the step trains into version `proximal_version + 1`; so a token drawn
  by the starting parameters gets α = 0 (its behaviour logprob is the proximal one, exactly), and an older one
  moves towards the current logprob."""
  v = np.asarray(versions, np.float64)
  alpha = (proximal_version - v) / np.maximum(proximal_version + 1 - v, 1.0)
  return np.clip(alpha, 0.0, 1.0).astype(np.float32)


def loglinear_proximal(behavior_logprobs: jax.Array, current_logprobs: jax.Array, alpha: jax.Array) -> jax.Array:
  """log π_prox ≈ log π_behav + α (log π_θ - log π_behav), no gradient through π_θ; a token whose behaviour
  logprob is not finite takes the current one."""
  current = jax.lax.stop_gradient(current_logprobs)
  finite = jnp.isfinite(behavior_logprobs)
  behavior = jnp.where(finite, behavior_logprobs, current)
  return jnp.where(finite, behavior + alpha * (current - behavior), current)


def kl_estimate(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str) -> jax.Array:
  """Per-token estimate of KL(p‖q) (Schulman's k1, k2, k3) from `logprobs` = log p and `ref_logprobs` = log q of
  the sampled tokens. The penalty to a reference policy is `kl_estimate(logprobs_θ, logprobs_ref, ...)`."""
  log_ratio = ref_logprobs - logprobs
  if estimator == "k1":
    return -log_ratio
  if estimator == "k2":
    return 0.5 * jnp.square(log_ratio)
  if estimator == "k3":
    return jnp.expm1(log_ratio) - log_ratio
  raise ValueError(f"kl_estimator={estimator!r}: choose one of {KL_ESTIMATORS}")
