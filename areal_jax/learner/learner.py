"""The learner: holds sharded parameters and optimizer state and turns a batch of trajectories into one PPO step.

One `train_step` (= one policy version):

The objective is `learner.loss`, by name (`objectives.py`: ppo, gspo, sapo, cispo).

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
   passes route each token to the experts the sampler recorded for it (`Trajectory.routes`). With
   `m2_threshold` (M2PO) each minibatch's loss mask then drops the tokens `objectives.m2po_mask` chooses from them;
4. per minibatch: gradients accumulated over its micro-batches, each weighted by 1 / (loss tokens of the minibatch),
   then one AdamW update;
5. the step's statistics on the host (learner/step_stats.py).

Steps 1-2 are `prepare` (a `StepPlan`), 3-5 `update`. Each device pass returns new batch dicts (the proximal and
reference logprobs, GAE's advantages added) for the next; none changes the batches it is given.

With `learner.critic` the step also computes the critic's values beside the proximal pass, replaces the advantages
by GAE's (`critic.critic_targets`), and after the policy's updates runs one critic update per minibatch
(`critic.critic_update`); the `Learner` holds the critic's state and checkpoints it with its own.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax import faults
from areal_jax.learner import critic as critic_lib
from areal_jax.learner import objectives
from areal_jax.learner import flops as flops_lib
from areal_jax.learner import step_stats
from areal_jax.learner.advantages import sequence_advantages, token_advantages, uniform_group_mask
from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.microbatch import Layout, MicroBatch, StepPlan, assemble, balanced_split, plan_packed
from areal_jax.learner.optimizer import learning_rate
from areal_jax.learner.ppo import loglinear_alpha
from areal_jax.learner.step import (BATCH_FLOAT_KEYS, BATCH_INT_KEYS, ROUTES_KEY, STALENESS_BUCKETS, STALENESS_KEY,
                                    StepFns, build_step)
from areal_jax.models.config import ModelConfig
from areal_jax.sharding import LEARNER_RULES, Rules, device_bytes
from areal_jax.types import Trajectory

if TYPE_CHECKING:
  from areal_jax.checkpoint.store import CheckpointMeta


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

  def working_bytes(self) -> int:
    """Per device, what a step allocates beyond the learner's state (parameters, optimizer state, a critic's): the
    policy's float32 gradient accumulators, the most scratch memory one of its programs needs for rows of
    `max_tokens_per_mb` tokens (as the compiler reports it), and the KL reference copied at the first step. A sampler
    on the same devices (`mesh.colocated`) leaves this free beside its KV pool. Compiles the step's programs."""
    fns, length = self.fns, self.config.max_tokens_per_mb
    lowered = fns.lower(length)
    if self.critic is not None:
      lowered |= self.critic.lower(fns.abstract_batch(length, BATCH_INT_KEYS + ("loss_mask",)))
    reference = device_bytes(fns.abstract_state()[0]) if self.config.kl_coef and self.ref_params is None else 0
    return fns.working_bytes(length, fns.scratch_bytes(lowered)) + reference

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

    staleness = [[np.where(mb.loss_mask > 0, np.clip(self.version - mb.versions, 0, STALENESS_BUCKETS - 1),
                           0).astype(np.int32) for mb in minibatch] for minibatch in plan.minibatches]

    def arrays(mb, stale):
      out = {k: getattr(mb, k) for k in BATCH_INT_KEYS + BATCH_FLOAT_KEYS}
      if mb.routes is not None:
        out[ROUTES_KEY] = mb.routes
      out[STALENESS_KEY] = stale
      if cfg.loglinear_proximal:  # the proximal policy is this step's starting one, version `self.version`
        out["prox_alpha"] = np.where(mb.loss_mask > 0, loglinear_alpha(mb.versions, self.version), 0).astype(np.float32)
      return out

    batches = [[jax.device_put(arrays(mb, s), fns.batch_sharding) for mb, s in zip(minibatch, stale)]
               for minibatch, stale in zip(plan.minibatches, staleness)]
    if cfg.kl_coef and self.ref_params is None:
      self.ref_params = fns.copy_params(self.params)
    batches, gaps, proximal = self._forward_passes(plan.minibatches, batches)
    critic_batches = targets = None
    if self.critic is not None:
      batches, critic_batches, targets = critic_lib.critic_targets(
          self.critic, self.critic_params, self.critic.base_of(self.params), batches, gamma=cfg.gae_gamma,
          lam=cfg.gae_lambda, gather=fns.gather)
    denominators, m2po_stats = plan.denominators, {}
    if cfg.m2_threshold:
      batches, denominators, m2po_stats = self._m2po_masks(plan.minibatches, batches, proximal)
    faults.reach("learner_step")
    sums, grad_norms = self._apply_minibatches(batches, denominators)
    microbatches = [mb for minibatch in plan.minibatches for mb in minibatch]
    critic_stats = {}
    if self.critic is not None:
      self.critic_params, self.critic_opt, critic_stats = critic_lib.critic_update(
          self.critic, self.critic_params, self.critic_opt, self.critic.base_of(self.params), critic_batches, targets,
          plan.loss_tokens, [mb.loss_mask > 0 for mb in microbatches], replicated=fns.replicated)
    sums, grad_norms, gaps, proximal = jax.device_get((sums, grad_norms, gaps, proximal))
    elapsed = time.perf_counter() - start
    lr = float(self._lr(max(self._updates + len(sums) - 1, 0)))
    self._updates += len(sums)
    self.version += 1
    stats = step_stats.learner_stats(plan, sums, grad_norms, elapsed=elapsed, lr=lr, version=self.version, config=cfg,
                                     model_cfg=self.model_cfg, stat_keys=fns.stat_keys, peak_flops=self.peak_flops)
    if sums:
      by_staleness = {k: np.sum([s[k] for s in sums], axis=0) for k in fns.stat_keys if k.endswith("_by_staleness")}
      stats |= step_stats.staleness_stats(by_staleness, microbatches, [s for stale in staleness for s in stale],
                                          proximal if cfg.recompute_proximal else None)
    if cfg.recompute_proximal:
      stats |= step_stats.gap_stats(gaps)
    return stats | critic_stats | m2po_stats

  def _m2po_masks(self, microbatches: Sequence[Sequence[MicroBatch]], batches: list[list[dict]],
                  proximal: list) -> tuple[list[list[dict]], tuple[float, ...], dict[str, float]]:
    """M2PO (`learner.m2_threshold`): each minibatch's loss tokens of largest (log π_behav - log π_prox)² leave its
    loss mask and its token mean (`objectives.m2po_mask`). The choice is one sort over the whole minibatch, so it
    does not depend on how the minibatch is cut into micro-batches (AReaL chooses per micro-batch). Reads the
    proximal logprobs on the host first, so the updates wait for the proximal pass. Returns (batches with the new
    `loss_mask`, each update's denominator: the tokens kept, `learner/m2po_masked_fraction`)."""
    flat = lambda arrays: np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in arrays])
    host = iter(jax.device_get(proximal))
    out, denominators, masked, total = [], [], 0.0, 0.0
    for minibatch, minibatch_batches in zip(microbatches, batches):
      masks = [mb.loss_mask > 0 for mb in minibatch]
      prox = [next(host) for _ in minibatch]
      keep = np.asarray(objectives.m2po_mask(flat(mb.behavior_logprobs for mb in minibatch), flat(prox),
                                             flat(masks) > 0, self.config.m2_threshold))
      parts = np.split(keep, np.cumsum([m.size for m in masks])[:-1])
      out.append([b | {"loss_mask": jax.device_put(k.reshape(m.shape).astype(np.float32), self.fns.batch_sharding)}
                  for b, k, m in zip(minibatch_batches, parts, masks)])
      denominators.append(float(keep.sum()))
      masked += sum(float(m.sum()) for m in masks) - float(keep.sum())
      total += sum(float(m.sum()) for m in masks)
    return out, tuple(denominators), {"learner/m2po_masked_fraction": masked / max(total, 1.0)}

  def _forward_passes(self, microbatches: Sequence[Sequence[MicroBatch]],
                      batches: list[list[dict]]) -> tuple[list[list[dict]], list, list]:
    """Forward-only passes with the parameters at the start of the step, all dispatched before any update, per
    micro-batch (minibatch by minibatch): the proximal logprobs (gathered too, for `staleness/*`) with the sampler's
    gap on this version's own tokens, and the KL reference's logprobs. Returns (the batches with
    `proximal_logprobs` / `ref_logprobs` added, likewise nested, gaps, proximal), still on the devices."""
    cfg, fns = self.config, self.fns
    out, gaps, proximal = [], [], []
    for minibatch, minibatch_batches in zip(microbatches, batches):
      out.append([])
      for mb, b in zip(minibatch, minibatch_batches):
        inputs, passes = {k: b[k] for k in BATCH_INT_KEYS}, {}
        if cfg.recompute_proximal:
          lp = passes["proximal_logprobs"] = fns.logprobs(self.params, {k: b[k] for k in fns.forward_keys})
          proximal.append(fns.gather(lp))  # read on the host for `staleness/*`
          # Tokens drawn by the sampler under this very version (their context re-prefilled under it too).
          same = (mb.loss_mask > 0) & (mb.versions == self.version)
          if same.any():
            gaps.append(fns.logprob_gap(lp, b["behavior_logprobs"], jax.device_put(same, fns.batch_sharding)))
        if cfg.kl_coef:
          passes["ref_logprobs"] = fns.logprobs(self.ref_params, inputs)
        out[-1].append(b | passes)
    return out, gaps, proximal

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

  def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """One learner step (one new policy version) on a batch of scored trajectories; returns `learner/*` stats.

    A batch whose groups are all filtered out still counts as a step (the version advances; parameters do not move).
    """
    return self.update(self.prepare(trajectories))

  def peak_flops(self) -> float:
    if self._peak_flops is None:
      self._peak_flops = flops_lib.peak_flops(list(self.mesh.devices.flat), self.model_cfg.compute_dtype)
    return self._peak_flops
