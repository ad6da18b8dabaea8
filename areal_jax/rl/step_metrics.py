"""A learner step's metrics row beyond the learner's own statistics: rewards, sampler work and timing, an agent's
turns, and `rollouts.jsonl` (one line per finished group)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import numpy as np
from etils import epath

from areal_jax.rl.metrics import append_lines

if TYPE_CHECKING:
  from areal_jax.rl.controller import RolloutController


def agent_metrics(controller: RolloutController, groups) -> dict[str, float]:
  """With multi-turn episodes (an agent's, `multi_turn_math`): completions per episode in the step's groups, and since
  the start, episodes failed and turns whose history held an answer that had to be re-encoded (`agents.turns`)."""
  if not any(g.turns for g in groups):
    return {}
  return {"agent/turns_mean": float(np.mean([n for g in groups for n in g.turns])),
          "agent/episode_failures": controller.counters["episode_failures"],
          "agent/retokenized_turns": controller.counters["retokenized_turns"]}


def step_metrics(stats: dict, trajectories, finished_rewards: list[float]) -> dict[str, float]:
  """The learner's step statistics with the rewards: every answer scored since the last step, and the trained ones."""
  stats = dict(stats)
  return {"reward/mean": float(np.mean(finished_rewards)) if finished_rewards else float("nan"),
          "reward/trained_mean": float(np.mean([t.reward for t in trajectories])),
          "staleness/mean": stats.pop("learner/staleness_mean"),
          "staleness/max": stats.pop("learner/staleness_max"), **stats}


class Timer:
  """Per-step timing: sampler throughput and work since the last step, busy seconds of both sides, the weight sync.

  The sampler's work in the step: `decode_steps`, `tokens_per_decode_step` (about the mean number of live slots),
  `prefill_rows` (prompts started, one row for all the answers that share it, or answers resumed), `prefill_tokens`
  (the tokens those rows prefilled), `cached_tokens` (tokens they found in the prefix cache instead) and `recomputed`
  (answers whose keys/values were computed again under new weights), summed over the samplers. With
  `sampler.speculation`: `spec_tokens_per_call` (tokens emitted per slot and forward of the target) and
  `spec_acceptance` (the share of drafted tokens accepted)."""

  def __init__(self, sampler_stats: dict):
    self.last_t, self.last_stats, self.learner_busy = time.time(), sampler_stats, 0.0

  def tick(self, sampler_stats: dict, *, wait_start: float, busy_start: float, sync_start: float) -> dict[str, float]:
    """The step's row: it waited for its batch from `wait_start`, trained from `busy_start`, published from
    `sync_start` until now."""
    now = time.time()
    self.learner_busy += now - busy_start
    done = {k: sampler_stats.get(k, 0) - self.last_stats.get(k, 0)
            for k in ("tokens", "decode_steps", "prefill_rows", "prefill_tokens", "cached_tokens", "recomputed")}
    out = {"sampler/tokens_per_s": done["tokens"] / max(now - self.last_t, 1e-9),
           "sampler/decode_steps": done["decode_steps"],
           "sampler/tokens_per_decode_step": done["tokens"] / done["decode_steps"] if done["decode_steps"] else 0.0,
           **{f"sampler/{k}": done[k] for k in ("prefill_rows", "prefill_tokens", "cached_tokens", "recomputed")},
           "sampler/busy_s": sampler_stats.get("busy_s", 0.0),
           "sampler/step_busy_s": sampler_stats.get("busy_s", 0.0) - self.last_stats.get("busy_s", 0.0),
           "learner/busy_s": self.learner_busy, "learner/wait_s": busy_start - wait_start,
           "sync/seconds": now - sync_start}
    if "spec_forwards" in sampler_stats:  # speculation: tokens per slot and target forward, drafts accepted
      spec = {k: sampler_stats[k] - self.last_stats.get(k, 0)
              for k in ("spec_forwards", "spec_tokens", "spec_drafted", "spec_accepted")}
      out["sampler/spec_tokens_per_call"] = spec["spec_tokens"] / max(spec["spec_forwards"], 1)
      out["sampler/spec_acceptance"] = spec["spec_accepted"] / max(spec["spec_drafted"], 1)
    self.last_t, self.last_stats = now, sampler_stats
    return out


def log_rollouts(workdir: epath.Path, step: int, version: int, trained, filtered) -> None:
  """One line per finished group: the prompt, whether it was trained on at `step` or filtered (uniform rewards)
  since the previous step, its rewards and the policy versions of its answers."""
  append_lines(workdir / "rollouts.jsonl", [
      json.dumps({"step": step, "version": version, "uid": g.record.uid, "group": g.trajectories[0].group_id,
                  "filtered": was_filtered,
                  "rewards": g.rewards.tolist(),
                  "version_start": [t.version_start for t in g.trajectories],
                  "version_end": [t.version_end for t in g.trajectories],
                  "lengths": [len(t.response_ids) for t in g.trajectories], **({"turns": g.turns} if g.turns else {})})
      for g, was_filtered in [(g, False) for g in trained] + [(g, True) for g in filtered]])
