"""The learner: holds sharded parameters and optimizer state and turns a batch of trajectories into one PPO step.

One `train_step` (= one policy version):

1. advantages on the host (shaped rewards, group/batch normalisation, uniform groups filtered);
2. the batch is split into `ppo_n_minibatches` token-balanced minibatches, each packed into bucketed micro-batches
   (`microbatch.plan_packed`);
3. proximal logprobs: one forward pass over every micro-batch with the parameters at the start of the step, before
   any update (skipped with `use_decoupled_loss=False`, where π_prox := π_behav, and with
   `prox_logp_method="loglinear"`, where the loss interpolates them by token versions); reference logprobs likewise
   when `kl_coef > 0`. The tokens the sampler drew with these same parameters (version `version`) give
   `sampler/logprob_gap`: the mean |behaviour - proximal logprob| over them, the sampler/learner mismatch (float32
   sampler: within 1e-5; bfloat16 sampler weights: measurably more). Steps without the proximal pass (loglinear, or
   use_decoupled_loss=False) do not report it. With `routing_replay` a mixture of experts' proximal and training
   passes route each token to the experts the sampler recorded for it (`Trajectory.routes`);
4. per minibatch: gradients accumulated over its micro-batches, each weighted by 1 / (loss tokens of the minibatch),
   then one AdamW update.

With `learner.critic` (learner/critic.py) the step also computes the critic's values beside the proximal pass,
replaces the advantages by GAE's, and after the policy's updates runs one critic update per minibatch.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax import faults
from areal_jax.learner import flops as flops_lib
from areal_jax.learner import critic as critic_lib
from areal_jax.learner.advantages import sequence_advantages, token_advantages, uniform_group_mask
from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.microbatch import Layout, MicroBatch, assemble, balanced_split, plan_packed
from areal_jax.learner.optimizer import learning_rate
from areal_jax.learner.ppo import loglinear_alpha
from areal_jax.learner.step import (BATCH_FLOAT_KEYS, BATCH_INT_KEYS, ROUTES_KEY, STALENESS_BUCKETS, STALENESS_KEY,
                                    StepFns, build_step)
from areal_jax.models import moe
from areal_jax.models.config import ModelConfig
from areal_jax.sharding import LEARNER_RULES, Rules
from areal_jax.types import Trajectory

if TYPE_CHECKING:
  from areal_jax.checkpoint.store import CheckpointMeta


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPlan:
  """A learner step's host-side input: minibatches of packed micro-batches and what went into them."""

  minibatches: tuple[tuple[MicroBatch, ...], ...]
  loss_tokens: tuple[int, ...]  # response tokens per minibatch
  denominators: tuple[float, ...]  # the loss denominator of each update (`loss_agg`)
  seq_lengths: tuple[int, ...]  # prompt + response tokens of every sequence trained on
  num_filtered: int  # answers dropped with their uniform-reward groups
  host_stats: dict[str, float]


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


class Learner:
  """Sharded PPO learner on `mesh`. `params` / `opt_state` are its live state; `version` counts completed steps.

  Each step donates the previous `params` and `opt_state` buffers: read (e.g. transfer to the sampler) the current
  ones between steps, from the thread that calls `train_step`.
  """

  def __init__(self, *, model_cfg: ModelConfig, config: LearnerConfig, mesh: Mesh, temperature: float = 1.0,
               params: nnx.State | None = None, seed: int = 0, rules: Rules = LEARNER_RULES,
               peak_flops: float | None = None):
    """`params`: initial parameter state (e.g. `nnx.split(model)[1]`), copied onto the mesh; None = random init.

    `peak_flops`: total FLOP/s of the mesh for `learner/mfu`; None = datasheet, or a measured matmul on CPU.
    """
    self.model_cfg, self.config, self.temperature = model_cfg, config, temperature
    self.fns: StepFns = build_step(model_cfg, config, mesh, temperature=temperature, rules=rules)
    if params is None:
      self.params = self.fns.init_params(seed)
    else:
      # device_put may alias the caller's buffers (and `apply` donates), so copy on the mesh.
      self.params = self.fns.copy_params(jax.device_put(params, self.fns.param_shardings))
    self.opt_state = self.fns.init_opt_state(self.params)
    self.ref_params = None  # the KL reference: a copy of `params` taken at the first step (kl_coef > 0 only)
    self.critic = None if not config.critic else critic_lib.build_critic(
        model_cfg, config, mesh, batch_sharding=self.fns.batch_sharding, replicated=self.fns.replicated, rules=rules)
    self.critic_params = self.critic_opt = None  # `init_critic`, or restored from a checkpoint
    self.version = 0
    self._updates = 0
    self._peak_flops = peak_flops
    self._lr = learning_rate(config)

  @property
  def mesh(self) -> Mesh:
    return self.fns.mesh

  @property
  def updates(self) -> int:
    """Optimizer updates applied so far (`ppo_n_minibatches` per step); checkpointed with `version`."""
    return self._updates

  def restore_counters(self, *, version: int, updates: int) -> None:
    """After restoring `params` / `opt_state` from a checkpoint: the counters saved with them."""
    self.version, self._updates = int(version), int(updates)

  def save(self, ckpt, step: int, *, meta: CheckpointMeta, force: bool = False) -> bool:
    """This process's shards of step `step`'s checkpoint (`checkpoint.store.Checkpointer`), on its schedule or
    `force`d: the trained parameters (the adapters alone under LoRA), the optimizer state, a critic's state beside
    them. Returns whether a save started."""
    extra = {} if self.critic is None else {"critic_params": self.critic_params, "critic_opt_state": self.critic_opt}
    return ckpt.save(step, params=self.fns.split(self.params)[0], opt_state=self.opt_state, force=force, meta=meta,
                     extra=extra)

  def restore(self, ckpt, step: int) -> CheckpointMeta:
    """Its state from step `step` of `ckpt`, straight onto its shardings (under LoRA the frozen base must be in
    `params` already): trained parameters, optimizer state, a critic's state, the version and update counters.
    Returns the checkpoint's meta."""
    trained, frozen = self.fns.split(self.params)
    trained, self.opt_state, meta = ckpt.restore(step, params=trained, opt_state=self.opt_state)
    self.params = nnx.merge_state(trained, frozen)
    if self.critic is not None:
      params, opt = self.critic.abstract_state()
      saved = ckpt.restore_extra(step, {"critic_params": params, "critic_opt_state": opt})
      self.critic_params, self.critic_opt = saved["critic_params"], saved["critic_opt_state"]
    self.restore_counters(version=meta.version, updates=meta.updates)
    return meta

  def init_critic(self) -> None:
    """The critic, copied from the current policy parameters (call once they are the run's initial ones)."""
    if self.critic is not None:
      self.critic_params = self.critic.from_policy(self.params)
      self.critic_opt = self.critic.init_opt_state(self.critic_params)

  def model(self) -> nnx.Module:
    """A module view of the current parameters (shares their arrays; do not keep it across steps)."""
    return nnx.merge(self.fns.graphdef, self.params)

  def prepare(self, trajectories: Sequence[Trajectory],
              planner: Callable[[Sequence[int]], list[Layout]] | None = None) -> StepPlan:
    """Advantages, filtering, minibatches and packed micro-batches, all on the host.

    `planner(sequence lengths) -> layouts` lays out one minibatch; the default is `plan_packed` (Alg. 1, bucketed).
    """
    cfg = self.config
    if planner is None:
      planner = functools.partial(plan_packed, max_tokens=cfg.max_tokens_per_mb, rows=self.fns.rows,
                                  min_bucket=cfg.min_bucket)
    trajectories = list(trajectories)
    if not trajectories:
      raise ValueError("train_step got no trajectories")
    rewards = np.array([t.reward for t in trajectories], np.float64)
    groups = np.array([t.group_id for t in trajectories])
    keep = uniform_group_mask(rewards, groups) if cfg.filter_uniform_groups else np.ones(len(rewards), bool)
    kept = [t for t, k in zip(trajectories, keep) if k]
    host_stats = {"reward_mean": float(rewards.mean()),
                  "staleness_mean": float(np.mean([self.version - t.version_start for t in trajectories])),
                  "staleness_max": float(max(self.version - t.version_start for t in trajectories))}
    minibatches, loss_tokens, denominators = [], [], []
    if kept:
      adv = sequence_advantages(rewards[keep], groups[keep], scale=cfg.reward_scale, norm=cfg.adv_norm)
      tok_adv = token_advantages(adv, [len(t.response_ids) for t in kept])
      lengths = [t.num_tokens for t in kept]
      for idx in balanced_split(lengths, min(cfg.ppo_n_minibatches, len(kept))):
        sub, sub_adv = [kept[i] for i in idx], [tok_adv[i] for i in idx]
        layouts = planner([lengths[i] for i in idx])
        weights, denominator = cfg.loss_weighting([t.num_loss_tokens for t in sub])
        routes = self.fns.routes_shape if cfg.routing_replay else None
        minibatches.append(tuple(assemble(layout, sub, sub_adv, weights, routes) for layout in layouts))
        loss_tokens.append(sum(t.num_loss_tokens for t in sub))
        denominators.append(denominator)
      host_stats["advantage_abs_mean"] = float(np.abs(adv).mean())
    return StepPlan(minibatches=tuple(minibatches), loss_tokens=tuple(loss_tokens), denominators=tuple(denominators),
                    seq_lengths=tuple(t.num_tokens for t in kept), num_filtered=len(trajectories) - len(kept),
                    host_stats=host_stats)

  def update(self, plan: StepPlan) -> dict[str, float]:
    """Runs a prepared step on the devices: proximal pass, then one optimizer update per minibatch."""
    cfg, fns = self.config, self.fns
    start = time.perf_counter()

    microbatches = [mb for minibatch in plan.minibatches for mb in minibatch]
    staleness = [np.where(mb.loss_mask > 0, np.clip(self.version - mb.versions, 0, STALENESS_BUCKETS - 1),
                          0).astype(np.int32) for mb in microbatches]
    index = {id(mb): i for i, mb in enumerate(microbatches)}

    def arrays(mb):
      out = {k: getattr(mb, k) for k in BATCH_INT_KEYS + BATCH_FLOAT_KEYS}
      if mb.routes is not None:
        out[ROUTES_KEY] = mb.routes
      out[STALENESS_KEY] = staleness[index[id(mb)]]
      if cfg.loglinear_proximal:  # the proximal policy is this step's starting one, version `self.version`
        out["prox_alpha"] = np.where(mb.loss_mask > 0, loglinear_alpha(mb.versions, self.version), 0).astype(np.float32)
      return out

    batches = [[jax.device_put(arrays(mb), fns.batch_sharding) for mb in minibatch] for minibatch in plan.minibatches]
    if cfg.kl_coef and self.ref_params is None:
      self.ref_params = fns.copy_params(self.params)
    gaps, proximal = self._forward_passes(microbatches, [b for minibatch in batches for b in minibatch])
    critic_batches, targets = self._critic_targets(batches) if self.critic is not None else (None, None)
    faults.reach("learner_step")
    sums, grad_norms = self._apply_minibatches(batches, plan.denominators)
    critic_stats = self._critic_update(critic_batches, targets, plan) if self.critic is not None else {}
    sums, grad_norms, gaps, proximal = jax.device_get((sums, grad_norms, gaps, proximal))
    elapsed = time.perf_counter() - start
    lr = float(self._lr(max(self._updates + len(sums) - 1, 0)))
    self._updates += len(sums)
    self.version += 1
    stats = self._stats(plan, sums, grad_norms, elapsed, lr)
    if sums:
      by_staleness = {k: np.sum([s[k] for s in sums], axis=0)
                      for k in self.fns.stat_keys if k.endswith("_by_staleness")}
      stats |= staleness_stats(by_staleness, microbatches, staleness, proximal if cfg.recompute_proximal else None)
    if cfg.recompute_proximal:
      stats |= gap_stats(gaps)
    return stats | critic_stats

  def _forward_passes(self, microbatches: list, batches: list[dict]) -> tuple[list, list]:
    """Forward-only passes with the parameters at the start of the step, all dispatched before any update: the
    proximal logprobs (into each batch, and gathered for `staleness/*`) with the sampler's gap on this version's own
    tokens, and the KL reference's logprobs. Returns (gaps, proximal), still on the devices."""
    cfg, fns = self.config, self.fns
    gaps, proximal = [], []
    for mb, b in zip(microbatches, batches):
      inputs = {k: b[k] for k in BATCH_INT_KEYS}
      if cfg.recompute_proximal:
        b["proximal_logprobs"] = fns.logprobs(self.params, {k: b[k] for k in fns.forward_keys})
        proximal.append(fns.gather(b["proximal_logprobs"]))  # read on the host for `staleness/*`
        # Tokens drawn by the sampler under this very version (their context re-prefilled under it too).
        same = (mb.loss_mask > 0) & (mb.versions == self.version)
        if same.any():
          gaps.append(fns.logprob_gap(b["proximal_logprobs"], b["behavior_logprobs"],
                                      jax.device_put(same, fns.batch_sharding)))
      if cfg.kl_coef:
        b["ref_logprobs"] = fns.logprobs(self.ref_params, inputs)
    return gaps, proximal

  def _apply_minibatches(self, batches: list[list[dict]], denominators) -> tuple[list, list]:
    """One optimizer update per minibatch, its micro-batches' gradients accumulated; (stats, grad norms) per update,
    still on the devices."""
    fns, poison = self.fns, faults.hit("nan_grads")
    sums, grad_norms = [], []
    for minibatch, n in zip(batches, denominators):
      inv_tokens = jax.device_put(np.float32(1.0 / max(n, 1e-9)), fns.replicated)
      grads, stats = fns.zero_accumulators()
      for b in minibatch:
        grads, stats = fns.accumulate(self.params, grads, stats, b, inv_tokens)
      if poison:
        grads = jax.tree.map(lambda g: g * np.float32("nan"), grads)
      self.params, self.opt_state, grad_norm = fns.apply(self.params, self.opt_state, grads)
      sums.append(stats)
      grad_norms.append(grad_norm)
    return sums, grad_norms

  def _critic_targets(self, batches: list[list[dict]]) -> tuple[list, list]:
    """The critic's values at the step's start, then GAE, on the devices: each micro-batch's `advantages` replaced
    (in `batches`). Returns the critic's batches (old values, returns) minibatch by minibatch, and (values, returns)
    replicated per micro-batch (for explained variance, read with the step's other statistics)."""
    cfg, fns, base = self.config, self.fns, self.critic.base_of(self.params)
    out, targets = [], []
    for minibatch in batches:
      out.append([])
      for b in minibatch:
        v = self.critic.values(self.critic_params, base, {k: b[k] for k in BATCH_INT_KEYS})
        b["advantages"], returns = critic_lib.gae(v, b["advantages"], b["loss_mask"], b["segment_ids"],
                                                  gamma=cfg.gae_gamma, lam=cfg.gae_lambda)
        out[-1].append({k: b[k] for k in BATCH_INT_KEYS + ("loss_mask",)} | {"old_values": v, "returns": returns})
        targets.append((fns.gather(v), fns.gather(returns)))
    return out, targets

  def _critic_update(self, critic_batches: list[list[dict]], targets: list, plan: StepPlan) -> dict[str, float]:
    """One critic update per minibatch (its loss averaged over the minibatch's loss tokens); `critic/*` stats."""
    c, sums, norms, base = self.critic, [], [], self.critic.base_of(self.params)
    for minibatch, n in zip(critic_batches, plan.loss_tokens):
      inv_tokens = jax.device_put(np.float32(1.0 / max(n, 1)), self.fns.replicated)
      grads, stats = c.zero_accumulators()
      for b in minibatch:
        grads, stats = c.accumulate(self.critic_params, base, grads, stats, b, inv_tokens)
      self.critic_params, self.critic_opt, norm = c.apply(self.critic_params, self.critic_opt, grads)
      sums.append(stats)
      norms.append(norm)
    sums, norms, targets = jax.device_get((sums, norms, targets))
    total = {k: float(sum(s[k] for s in sums)) for k in critic_lib.CRITIC_STATS}
    n = max(total["tokens"], 1.0)
    masks = [mb.loss_mask > 0 for minibatch in plan.minibatches for mb in minibatch]
    v = np.concatenate([vals[m] for (vals, _), m in zip(targets, masks)] or [np.zeros(0)])
    r = np.concatenate([ret[m] for (_, ret), m in zip(targets, masks)] or [np.zeros(0)])
    explained = 1.0 - np.var(r - v) / np.var(r) if r.size and np.var(r) > 0 else 0.0
    return {"critic/value_loss": total["value_loss"] / n, "critic/clip_fraction": total["value_clipped"] / n,
            "critic/values_mean": total["values"] / n, "critic/returns_mean": total["returns"] / n,
            "critic/grad_norm": float(np.mean(norms)) if norms else 0.0,
            "critic/explained_variance": float(explained)}

  def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """One learner step (one new policy version) on a batch of scored trajectories; returns `learner/*` stats.

    A batch whose groups are all filtered out still counts as a step (the version advances; parameters do not move).
    """
    return self.update(self.prepare(trajectories))

  def _stats(self, plan: StepPlan, sums: list[dict], grad_norms: list, elapsed: float, lr: float) -> dict[str, float]:
    cfg = self.config
    total = {k: float(sum(s[k] for s in sums)) for k in self.fns.stat_keys
             if not k.endswith("_by_staleness") and k != "expert_counts"}
    n = max(total["tokens"], 1.0)
    out = {f"learner/{k}": v for k, v in plan.host_stats.items()}
    tokens = sum(plan.seq_lengths)
    slots = sum(mb.tokens.size for minibatch in plan.minibatches for mb in minibatch)
    passes = 3 + int(cfg.recompute_proximal) + int(bool(cfg.kl_coef))  # fwd+bwd, proximal, reference
    model_flops = passes * sum(n_tok * self.model_cfg.flops_per_token(n_tok) for n_tok in plan.seq_lengths)
    out |= {
        "learner/version": float(self.version),
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
        "learner/mfu": model_flops / elapsed / self.peak_flops() if tokens else 0.0,
        "learner/nonfinite_tokens": total["nonfinite"],
    }
    if cfg.kl_coef:
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
      raise FloatingPointError(f"learner step {self.version}: {', '.join(bad)}; stopping before these parameters are "
                               "published or checkpointed (the last checkpoint is intact)")
    return out

  def peak_flops(self) -> float:
    if self._peak_flops is None:
      self._peak_flops = flops_lib.peak_flops(list(self.mesh.devices.flat), self.model_cfg.compute_dtype)
    return self._peak_flops
