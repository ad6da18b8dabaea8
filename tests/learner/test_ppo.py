"""The decoupled PPO objective (`objectives.loss("ppo")`) against a token-by-token numpy transcription of paper
Eq. 5, and the off-policy corrections against AReaL's rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.learner import objectives
from areal_jax.learner.ppo import Rejection, behavior_weights, kl_estimate


def decoupled_ppo_loss(lt, lp, lb, adv, mask, *, behav_imp_weight_cap=None, rejection=None, segment_ids=None, **kw):
  """`objectives.loss("ppo")` with positional arrays (so `jax.grad` can take argnums), a cap as its rejection rule."""
  if behav_imp_weight_cap is not None:
    rejection = Rejection(upper=behav_imp_weight_cap)
  return objectives.loss("ppo", logprobs=lt, proximal_logprobs=lp, behavior_logprobs=lb, advantages=adv, mask=mask,
                         segment_ids=segment_ids, rejection=rejection, **kw)


def reference(lt, lp, lb, adv, mask, *, eps_low, eps_high, cap, c):
  """Loss, per-token gradient d loss / d lt, and stats, one token at a time."""
  n = max(mask.sum(), 1)
  total, grad = 0.0, np.zeros_like(lt, np.float64)
  clipped = capped = dual = 0
  weights = []
  for idx in np.ndindex(lt.shape):
    if not mask[idx]:
      continue
    u = np.exp(np.float64(lt[idx]) - lp[idx])
    w = np.exp(np.float64(lp[idx]) - lb[idx])
    weights.append(w)
    a = adv[idx]
    obj_u, obj_c = u * a, min(max(u, 1 - eps_low), 1 + eps_high) * a
    obj, dobj = (obj_u, u * a) if obj_u <= obj_c else (obj_c, 0.0)
    clipped += obj_c < obj_u
    if c is not None and a < 0 and obj < c * a:  # dual clip: the objective is at least c·A
      obj, dobj = c * a, 0.0
      dual += 1
    if cap is not None and w > cap:
      w = 0.0
      capped += 1
    total += -w * obj
    grad[idx] = -w * dobj / n
  stats = {"clip_fraction": clipped / n, "capped_fraction": capped / n, "dual_clip_fraction": dual / n,
           "importance_weight_mean": np.sum(weights) / n, "importance_weight_max": max(weights)}
  return total / n, grad, stats


def random_inputs(seed, shape=(4, 23)):
  rng = np.random.default_rng(seed)
  lb = -rng.uniform(0.1, 4.0, shape)
  lp = lb + rng.normal(0, 0.4, shape)  # π_prox/π_behav spans ~e^±1, so a cap of 1.5 bites
  lt = lp + rng.normal(0, 0.3, shape)  # enough to leave the [0.8, 1.28] trust region often
  lt += 1.5 * (rng.random(shape) < 0.15)  # u ≈ 4.5 on some tokens, where a dual clip of 2 or 3 binds if A < 0
  adv = rng.normal(0, 1.5, shape)
  mask = rng.random(shape) < 0.7
  mask[-1] = False  # a fully masked row
  return [x.astype(np.float32) for x in (lt, lp, lb, adv)] + [mask]


@pytest.mark.parametrize("eps_high, cap, c", [(None, None, None), (0.28, 1.5, None), (0.28, 1.5, 3.0),
                                              (0.1, None, 2.0)])
def test_loss_matches_numpy_reference(eps_high, cap, c):
  lt, lp, lb, adv, mask = random_inputs(0)
  want, want_grad, want_stats = reference(lt, lp, lb, adv, mask, eps_low=0.2,
                                          eps_high=0.2 if eps_high is None else eps_high, cap=cap, c=c)
  kw = dict(eps_clip=0.2, eps_clip_higher=eps_high, behav_imp_weight_cap=cap, c_clip=c)
  (loss, stats), grads = jax.value_and_grad(decoupled_ppo_loss, argnums=(0, 1, 2), has_aux=True)(
      lt, lp, lb, adv, mask.astype(np.float32), **kw)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose(grads[0], want_grad, rtol=1e-4, atol=1e-7)
  # Proximal and behaviour logprobs are constants of the objective.
  assert not np.any(grads[1]) and not np.any(grads[2])
  for k, v in want_stats.items():
    np.testing.assert_allclose(stats[k], v, rtol=1e-5, err_msg=k)
  assert want_stats["clip_fraction"] > 0.05
  if cap is not None:
    assert want_stats["capped_fraction"] > 0.05  # capped tokens are present and still counted in the mean
  if c is not None:
    assert want_stats["dual_clip_fraction"] > 0.02


def test_capped_tokens_stay_in_the_denominator():
  lt = lp = np.zeros((1, 4), np.float32)
  lb = np.array([[0.0, 0.0, -5.0, -5.0]], np.float32)  # the last two have w = e^5
  adv = np.ones((1, 4), np.float32)
  loss, stats = decoupled_ppo_loss(lt, lp, lb, adv, np.ones((1, 4)), eps_clip=0.2, behav_imp_weight_cap=5.0)
  np.testing.assert_allclose(loss, -2.0 / 4, rtol=1e-6)
  np.testing.assert_allclose(stats["capped_fraction"], 0.5)


def test_standard_ppo_when_proximal_is_behaviour():
  lt, _, lb, adv, mask = random_inputs(1)
  loss, stats = decoupled_ppo_loss(lt, lb, lb, adv, mask, eps_clip=0.2)
  want, _, _ = reference(lt, lb, lb, adv, mask, eps_low=0.2, eps_high=0.2, cap=None, c=None)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose(stats["importance_weight_max"], 1.0)


def test_invalid_dual_clip_is_named():
  x = jnp.zeros((1, 2))
  with pytest.raises(ValueError, match="c_clip=0.5"):
    decoupled_ppo_loss(x, x, x, x, x + 1, eps_clip=0.2, c_clip=0.5)


def test_kl_estimators():
  rng = np.random.default_rng(2)
  lt, lr = -rng.uniform(0, 3, 50), -rng.uniform(0, 3, 50)
  r = np.exp(lr - lt)
  np.testing.assert_allclose(kl_estimate(lt, lr, "k1"), lt - lr, rtol=1e-5)
  np.testing.assert_allclose(kl_estimate(lt, lr, "k2"), 0.5 * np.log(r) ** 2, rtol=1e-5)
  np.testing.assert_allclose(kl_estimate(lt, lr, "k3"), r - 1 - np.log(r), rtol=1e-4, atol=1e-7)
  with pytest.raises(ValueError, match="k4"):
    kl_estimate(lt, lr, "k4")


def rejection_reference(lp, lb, mask, seg, *, level, action, metric, agg, upper, lower):
  """AReaL's rejection sampling (`apply_rejection_sampling`) transcribed sequence by sequence in numpy: (weight the
  loss uses, tokens masked or clamped)."""
  lp, lb = lp.astype(np.float64), lb.astype(np.float64)
  log_w = np.where(mask, lp - lb, 0.0)
  w = np.exp(log_w)
  kl = {"kl_k1": log_w, "kl_k2": 0.5 * log_w ** 2, "kl_k3": np.exp(-log_w) - 1 + log_w}
  metric_of = (lambda i: np.exp(log_w[i])) if metric == "ratio" else (lambda i: kl[metric][i])
  ok = lambda v: v <= upper and (lower is None or v >= lower)
  weight, changed = np.zeros_like(w), np.zeros(w.shape, bool)
  for r in range(w.shape[0]):
    for s in np.unique(seg[r][mask[r]]):
      idx = np.flatnonzero((seg[r] == s) & mask[r])
      cells = [(r, i) for i in idx]
      if level == "token":
        for c in cells:
          inside = ok(metric_of(c))
          weight[c] = w[c] if inside else (0.0 if action == "mask" else np.clip(w[c], lower or 0.0, upper))
          changed[c] = not inside and weight[c] != w[c]
        continue
      if metric == "ratio":  # aggregated in log space; every token gets the geometric mean
        logs = [log_w[c] for c in cells]
        value = np.exp({"mean": np.mean, "sum": np.sum, "max": np.max}[agg](logs))
        seq_w = np.exp(np.mean(logs))
      else:
        value = {"mean": np.mean, "sum": np.sum, "max": np.max}[agg]([metric_of(c) for c in cells])
        seq_w = None
      inside = ok(value)
      for c in cells:
        base = seq_w if seq_w is not None else w[c]
        weight[c] = base if inside else (0.0 if action == "mask" else np.clip(base, lower or 0.0, upper))
        changed[c] = not inside and weight[c] != base
  return weight, changed


REJECTIONS = [("token", "mask", "ratio", "mean", 1.5, None), ("token", "mask", "ratio", "mean", 1.5, 0.7),  # IcePop
              ("token", "clamp", "ratio", "mean", 1.5, 0.7), ("token", "mask", "kl_k3", "mean", 0.05, None),
              ("token", "mask", "kl_k1", "mean", 0.3, -0.3),
              ("sequence", "mask", "ratio", "mean", 1.2, 0.85), ("sequence", "clamp", "ratio", "mean", 1.1, 0.9),
              ("sequence", "mask", "ratio", "max", 2.0, None), ("sequence", "mask", "kl_k2", "sum", 0.2, None),
              ("sequence", "clamp", "kl_k3", "max", 0.1, None), ("sequence", "mask", "ratio", "sum", 1.5, 0.5)]


@pytest.mark.parametrize("level, action, metric, agg, upper, lower", REJECTIONS)
def test_rejection_sampling_matches_areal_s_rule(level, action, metric, agg, upper, lower):
  """Packed rows of several sequences (segment ids), a masked prompt and padding: the weights and the masked or
  clamped tokens equal the reference, and the loss uses those weights."""
  _, lp, lb, adv, mask = random_inputs(3, shape=(3, 30))
  seg = np.repeat(np.arange(1, 7), 5)[None].repeat(3, 0).astype(np.int32)
  seg[:, -4:] = 0  # padding
  mask &= seg != 0
  rule = Rejection(level=level, action=action, metric=metric, agg=agg, upper=upper, lower=lower)
  want_w, want_changed = rejection_reference(lp, lb, mask, seg, level=level, action=action, metric=metric, agg=agg,
                                             upper=upper, lower=lower)
  assert 0 < want_changed.sum() < mask.sum()  # the rule bites, but not everywhere
  weight, raw, changed = behavior_weights(jnp.asarray(lp), jnp.asarray(lb), jnp.asarray(mask), rule,
                                          jnp.asarray(seg))
  np.testing.assert_allclose(weight, want_w, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(changed, want_changed)
  # The loss: -w · A per token at u = 1 (no clipping), over every loss token.
  loss, stats = decoupled_ppo_loss(lp, lp, lb, adv, mask.astype(np.float32), eps_clip=0.2, rejection=rule,
                                   segment_ids=seg)
  np.testing.assert_allclose(loss, -(want_w * adv)[mask].sum() / mask.sum(), rtol=1e-5)
  np.testing.assert_allclose(stats["capped_fraction"], want_changed.sum() / mask.sum(), rtol=1e-6)


def test_rejection_rules_are_checked():
  with pytest.raises(ValueError, match="level='seq'"):
    Rejection(level="seq")
  with pytest.raises(ValueError, match="lower is above upper"):
    Rejection(upper=1.0, lower=2.0)
  with pytest.raises(ValueError, match="segment ids"):
    lt, lp, lb, adv, mask = random_inputs(0)
    behavior_weights(lp, lb, mask, Rejection(level="sequence"))
