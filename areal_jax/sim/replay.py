"""A finished run replayed in virtual time: its own groups and its recorded timings through the simulation, which
should then reproduce the run's schedule (which groups each step trained, at which staleness).

What is replayed, from the run's workdir: every group of `rollouts.jsonl` by its id (its answers' lengths and
rewards, `lengths.RecordedGroups`), and from `metrics.jsonl` each learner step's seconds: waiting for its batch
(`learner/wait_s`, not replayed but what separates the rest), training, publishing (`sync/seconds`), the host's work
before the next wait, and the sampler's busy seconds over its decode steps in that step. `ReplayCosts` answers the
cost model's questions with them.

    job, costs = replay_job(workdir, settings, num_shards=2, prompt_len=25)
    result = simulate(job, costs)
    run_schedule(workdir) == sim_schedule(result)     # {step: {group id: [staleness per answer]}}
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from etils import epath

from areal_jax.sim.costs import Efficiency
from areal_jax.sim.job import Job, Result
from areal_jax.sim.lengths import RecordedGroups


@dataclasses.dataclass(frozen=True)
class StepTimings:
  """One learner step's recorded seconds, and the sampler's work while the learner was on it."""

  train_s: float
  publish_s: float
  after_s: float  # from the step's metrics row to awaiting the next batch (metrics, checkpoint)
  decode_step_s: float  # the sampler's busy seconds in the step over its decode steps


def step_timings(workdir: str) -> list[StepTimings]:
  """Each step's timings from a run's `metrics.jsonl` (rows with `learner/wait_s`, written since it was added)."""
  path = epath.Path(workdir) / "metrics.jsonl"
  rows = [r for r in map(json.loads, path.read_text().splitlines()) if r.get("step", 0) > 0]
  if not rows or any("learner/wait_s" not in r or "sampler/step_busy_s" not in r for r in rows):
    raise ValueError(f"{path}: no step rows with learner/wait_s and sampler/step_busy_s to replay")
  out, busy = [], 0.0
  for i, r in enumerate(rows):
    step_busy = r["learner/busy_s"] - busy
    busy = r["learner/busy_s"]
    after = 0.0
    if i + 1 < len(rows):
      nxt = rows[i + 1]
      after = max(0.0, nxt["time/elapsed_s"] - r["time/elapsed_s"] - nxt["learner/wait_s"]
                  - (nxt["learner/busy_s"] - busy))
    steps = r["sampler/decode_steps"]
    out.append(StepTimings(train_s=step_busy - r["sync/seconds"], publish_s=r["sync/seconds"], after_s=after,
                           decode_step_s=r["sampler/step_busy_s"] / steps if steps else 0.0))
  return out


class ReplayCosts:
  """The cost model's interface, answered with a run's recorded seconds: the learner's k-th step trains, publishes
  and does its host work for what step k took; while the learner is on step k, each sampler decode step costs step
  k's mean (prefills folded into it: a prefill costs nothing of its own)."""

  eff = Efficiency(decode_call_s=0.0, decode_step_s=0.0, prefill_call_s=0.0)
  transfer_overlaps = False  # a run in one process: its learner waited for each publish as recorded
  colocated = False  # its host's work after a step is replayed beside the sampler, as it ran
  acceptance = None  # replays price no speculation (a run with it records its decode steps' seconds already)

  def __init__(self, steps: list[StepTimings], pages_per_shard: int):
    self.steps, self._pages = steps, pages_per_shard
    self.trained = self.published = self.after = 0

  def _step(self, k: int) -> StepTimings:
    return self.steps[min(k, len(self.steps) - 1)]

  def decode_step(self, batch: np.ndarray, context: np.ndarray) -> float:
    del context
    return self._step(self.published).decode_step_s if np.any(batch) else 0.0

  def decode_call(self, device_s: float, slots: int, *, overlap: bool, drafting: float = 0.0) -> float:
    del slots, overlap, drafting  # the recorded step's seconds hold its host work
    return device_s

  def prefill(self, rows: int, length: int, *, sharded: bool = True) -> float:
    del rows, length, sharded
    return 0.0

  def train_step(self, lengths: np.ndarray) -> float:
    del lengths
    self.trained += 1
    return self._step(self.trained - 1).train_s

  def transfer(self) -> float:
    self.published += 1
    return self._step(self.published - 1).publish_s

  def after_step(self) -> float:
    self.after += 1
    return self._step(self.after - 1).after_s

  def pages_per_shard(self, page_size: int, memory_fraction: float = 0.8) -> int:
    del page_size, memory_fraction
    return self._pages


def replay_job(workdir: str, settings, *, num_shards: int, prompt_len: int) -> tuple[Job, ReplayCosts]:
  """The run in `workdir` (its validated `settings`, its sampler's data shards) as a job and its recorded costs.
  The run must have set `sampler.num_pages` (the simulated pool is sized from it)."""
  if not settings.sampler.num_pages:
    raise ValueError("sampler.num_pages=0: a replay needs the run's pool size set explicitly")
  recorded = RecordedGroups.from_rollouts([str(epath.Path(workdir) / "rollouts.jsonl")])
  if not recorded.by_id:
    raise ValueError(f"{recorded.source}: no group ids (recorded before rollouts.jsonl had 'group')")
  timings = step_timings(workdir)
  r = settings.rollout
  job = Job(model=settings.model, sampler=settings.sampler, num_shards=num_shards, batch_prompts=r.batch_size,
            answers=r.group_size, prompt_len=prompt_len, eta=r.max_head_offpolicyness, steps=len(timings),
            target_staleness=r.target_staleness, max_concurrent=r.max_concurrent_rollouts, recorded=recorded,
            filter_uniform=settings.learner.filter_uniform_groups, reward_workers=settings.reward.num_workers,
            seed=settings.seed)
  return job, ReplayCosts(timings, settings.sampler.num_pages // num_shards)


def run_schedule(workdir: str) -> dict[int, dict[int, list[int]]]:
  """{step: {group id: each answer's staleness}} of the groups a run trained, from its `rollouts.jsonl`."""
  out: dict[int, dict[int, list[int]]] = {}
  for row in map(json.loads, (epath.Path(workdir) / "rollouts.jsonl").read_text().splitlines()):
    if not row["filtered"]:
      out.setdefault(row["step"], {})[row["group"]] = [row["version"] - 1 - v for v in row["version_start"]]
  return out


def sim_schedule(result: Result) -> dict[int, dict[int, list[int]]]:
  """The same of a simulation."""
  out: dict[int, dict[int, list[int]]] = {}
  for step, (ids, stale) in enumerate(zip(result.group_ids, result.staleness), 1):
    for g, s in zip(ids, stale):
      out.setdefault(step, {}).setdefault(g, []).append(s)
  return out
