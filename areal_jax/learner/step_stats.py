"""A learner step's statistics on the host, from what its device passes returned: `learner/*` (`learner_stats`),
`staleness/*` (`staleness_stats`) and `sampler/logprob_gap*` (`gap_stats`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.microbatch import MicroBatch, StepPlan
from areal_jax.models import moe
from areal_jax.models.config import ModelConfig


def gap_stats(gaps: Sequence[np.ndarray]) -> dict[str, float]:
  """`sampler/logprob_gap` (mean |behaviour - learner logprob|), `_max` and `_tokens` from `logprob_gap`'s
  [sum, count, max] per micro-batch; with no comparable token only the count (0) is reported."""
  total, count = float(sum(g[0] for g in gaps)), float(sum(g[1] for g in gaps))
  out = {"sampler/logprob_gap_tokens": count}
  if count:
    out |= {"sampler/logprob_gap": total / count, "sampler/logprob_gap_max": max(float(g[2]) for g in gaps)}
  return out


def staleness_stats(sums: dict[str, np.ndarray], microbatches: Sequence[MicroBatch], staleness: Sequence[np.ndarray],
                    proximal: Sequence[np.ndarray] | None) -> dict[str, float]:
  """What staleness does to a step, by the loss tokens' staleness s (`staleness/<s>/...`; the last bucket holds
  STALENESS_BUCKETS - 1 or more): `tokens`, `clip_fraction` (the PPO clip's active share over the step's updates),
  `dropped_fraction` (the behaviour weight masked or clamped by the off-policy correction); with the proximal pass
  also `log_ratio_mean` / `_max` (log π_prox - log π_behav: its mean is minus a KL estimate of π_behav against
  π_prox) and the behaviour weight's `weight_p50` / `_p90` / `_p99` / `_max`. `sums` are `accumulate`'s
  `*_by_staleness` sums over the step; `staleness` and `proximal` are per micro-batch, [rows, length]."""
  out = {}
  ratios = {}
  if proximal is not None:
    for mb, s, lp in zip(microbatches, staleness, proximal):
      ok = (mb.loss_mask > 0) & np.isfinite(lp) & np.isfinite(mb.behavior_logprobs)
      for b in np.unique(s[ok]):
        ratios.setdefault(int(b), []).append((lp - mb.behavior_logprobs)[ok & (s == b)])
  tokens = sums["tokens_by_staleness"]
  for b in np.flatnonzero(tokens):
    key = f"staleness/{b}"
    out[f"{key}/tokens"] = float(tokens[b])
    out[f"{key}/clip_fraction"] = float(sums["clipped_by_staleness"][b] / tokens[b])
    out[f"{key}/dropped_fraction"] = float(sums["capped_by_staleness"][b] / tokens[b])
    if int(b) in ratios:
      r = np.concatenate(ratios[int(b)]).astype(np.float64)
      w = np.exp(r)
      out |= {f"{key}/log_ratio_mean": float(r.mean()), f"{key}/log_ratio_max": float(r.max()),
              f"{key}/weight_p50": float(np.quantile(w, 0.5)), f"{key}/weight_p90": float(np.quantile(w, 0.9)),
              f"{key}/weight_p99": float(np.quantile(w, 0.99)), f"{key}/weight_max": float(w.max())}
  return out


def learner_stats(plan: StepPlan, sums: Sequence[dict], grad_norms: Sequence, *, elapsed: float, lr: float,
                  version: int, config: LearnerConfig, model_cfg: ModelConfig, stat_keys: Sequence[str],
                  peak_flops: Callable[[], float]) -> dict[str, float]:
  """The `learner/*` statistics of a step that made policy `version`: `sums` and `grad_norms` are `accumulate`'s
  sums and the gradient norm of each update (on the host), `elapsed` the step's seconds, `lr` its last update's
  learning rate, `stat_keys` `accumulate`'s statistics, `peak_flops()` the mesh's FLOP/s (read only when the step
  trained on some token).

  Raises FloatingPointError on a non-finite loss or gradient norm, before anything is published or checkpointed.
  """
  total = {k: float(sum(s[k] for s in sums)) for k in stat_keys
           if not k.endswith("_by_staleness") and k != "expert_counts"}
  n = max(total["tokens"], 1.0)
  out = {f"learner/{k}": v for k, v in plan.host_stats.items()}
  tokens = sum(plan.seq_lengths)
  slots = sum(mb.tokens.size for minibatch in plan.minibatches for mb in minibatch)
  passes = 3 + int(config.recompute_proximal) + int(bool(config.kl_coef))  # fwd+bwd, proximal, reference
  model_flops = passes * sum(n_tok * model_cfg.flops_per_token(n_tok) for n_tok in plan.seq_lengths)
  out |= {
      "learner/version": float(version),
      "learner/loss": total["loss"] / n,
      "learner/clip_fraction": total["clipped"] / n,
      "learner/dual_clip_fraction": total["dual_clipped"] / n,
      "learner/importance_weight_mean": total["importance_weight"] / n,
      "learner/importance_weight_max": max((float(s["importance_weight_max"]) for s in sums), default=0.0),
      "learner/capped_fraction": total["capped"] / n,
      "learner/approx_kl": total["approx_kl"] / n,
      "learner/entropy": total["entropy"] / n,
      "learner/grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
      "learner/lr": lr,
      "learner/num_sequences": float(len(plan.seq_lengths)),
      "learner/num_filtered": float(plan.num_filtered),
      "learner/loss_tokens": total["tokens"],
      "learner/micro_batches": float(sum(map(len, plan.minibatches))),
      "learner/padding_fraction": 1.0 - tokens / slots if slots else 0.0,
      "learner/tokens_per_s": tokens / elapsed,
      "learner/step_time_s": elapsed,
      "learner/mfu": model_flops / elapsed / peak_flops() if tokens else 0.0,
      "learner/nonfinite_tokens": total["nonfinite"],
  }
  if config.kl_coef:
    out["learner/ref_kl"] = total["ref_kl"] / n
  if "aux_loss" in total:
    out["learner/aux_loss"] = total["aux_loss"] / n
    counts = np.sum([s["expert_counts"] for s in sums], axis=0) if sums else np.zeros(1)
    out["learner/expert_load_max"] = float(moe.expert_load_max({"counts": counts}))
  if "replayed" in total:
    out["learner/rerouted_fraction"] = total["rerouted"] / max(total["replayed"], 1.0)
  bad = [f"{key.split('/')[1]} is {out[key]}" for key in ("learner/loss", "learner/grad_norm")
         if not np.isfinite(out[key])]
  if bad:
    raise FloatingPointError(f"learner step {version}: {', '.join(bad)}; stopping before these parameters are "
                             "published or checkpointed (the last checkpoint is intact)")
  return out
