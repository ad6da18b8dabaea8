"""The planner against measurement: predicts the runs of a `tools/bench_async.py --processes` workdir from this
machine's calibrated costs, and sets the predictions beside what the bench measured.

Each run is simulated in its layout (colocated: one process, sampler and learner both on its 4 emulated devices
(`mesh.colocated`), both cores, generate-then-train; split: a sampler and a learner process of one emulated device on one core each), with its
η, loss (PPO at η = 0: no proximal pass) and variant overrides, the bench's prompt groups (from its
`rollouts.jsonl`: each simulated group replays a recorded one's answer lengths and rewards together, so groups are
dropped as uniform as often as they were, and are as long as they were), B x G and slots, for the steps it ran.
"""

from __future__ import annotations

import json
import os

import numpy as np

from areal_jax.sim.calibrate import Calibration
from areal_jax.sim.job import Job, simulate
from areal_jax.sim.lengths import RecordedGroups

# Tolerances the planner is held to (the planner issue): trained answers/s, staleness mean, busy shares.
TOLERANCE = {"samples_per_s": 0.15, "staleness_mean": 0.3, "busy": 0.10}


def mean_prompt_len(settings, mix: str = "1:12,4:1", n: int = 1000) -> int:
  """Mean prompt tokens of the run's training data under the bench's `data.synthetic_mix`."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  from areal_jax.data.dataset import build_dataset  # pylint: disable=g-import-not-at-top
  from areal_jax.tokenizer import load_tokenizer  # pylint: disable=g-import-not-at-top

  data = settings.data
  if data.source == "synthetic":
    data = dataclasses.replace(data, synthetic_mix=mix)
  records = build_dataset(data, load_tokenizer(settings.model_source.tokenizer), split="train").records[:n]
  return round(float(np.mean([r.num_prompt_tokens for r in records])))


def _steps(bench_dir: str, name: str, run: dict) -> tuple[int, int]:
  """(learner steps, untimed first steps) of a bench run, as it ran them: its staleness mean counts every step."""
  with open(os.path.join(bench_dir, name, "bench_config.json")) as f:
    total = json.load(f)["total_steps"]
  return total, total - run["per_seed"][0]["steps"]


def predict(bench_dir: str, settings, calibrations: dict[str, Calibration], *, prompt_len: int) -> list[dict]:
  """One row per run of `bench_dir/bench_async.json`: measured (mean over seeds) and predicted figures, each run
  simulated for as many steps as it ran."""
  with open(os.path.join(bench_dir, "bench_async.json")) as f:
    runs = json.load(f)
  recorded = RecordedGroups.from_rollouts([os.path.join(bench_dir, n, "rollouts.jsonl")
                                           for n, r in runs.items() if len(r["seeds"]) == 1])
  rows = []
  for name, run in runs.items():
    colocated = run["processes"] == 1
    cal = calibrations["colocated" if colocated else "split"]
    shards = cal.samples["devices"]
    overrides = dict(run["overrides"])
    eta, (steps, skip) = run["eta"], _steps(bench_dir, name, run)
    costs = cal.costs(settings.model, settings.learner, shards=shards, colocated=colocated,
                      passes=4.0 if eta else 3.0)
    target = overrides.get("rollout.target_staleness")
    job = Job(model=settings.model, sampler=settings.sampler, num_shards=shards,
              batch_prompts=settings.rollout.batch_size, answers=settings.rollout.group_size,
              prompt_len=prompt_len, eta=eta, max_concurrent=settings.rollout.max_concurrent_rollouts,
              steps=steps, target_staleness=float(target) if target is not None else None, recorded=recorded,
              filter_uniform=settings.learner.filter_uniform_groups, seed=0)
    r = simulate(job, costs)
    measured = {k: float(np.mean([s[k] for s in run["per_seed"]]))
                for k in ("samples_per_s", "staleness_mean", "sampler_busy", "learner_busy")}
    sampler_busy, learner_busy = r.busy(skip)
    predicted = {"samples_per_s": r.answers_per_s(skip), "staleness_mean": float(np.mean(np.concatenate(
        [np.array(s, float) for s in r.staleness]))), "sampler_busy": sampler_busy, "learner_busy": learner_busy}
    rows.append({"run": run["label"], "measured": measured, "predicted": predicted})
  return rows


def within(row: dict) -> dict[str, bool]:
  m, p = row["measured"], row["predicted"]
  return {"samples_per_s": abs(p["samples_per_s"] / m["samples_per_s"] - 1) <= TOLERANCE["samples_per_s"],
          "staleness_mean": abs(p["staleness_mean"] - m["staleness_mean"]) <= TOLERANCE["staleness_mean"],
          "busy": all(abs(p[k] - m[k]) <= TOLERANCE["busy"] for k in ("sampler_busy", "learner_busy"))}


def format_check(rows: list[dict]) -> str:
  head = ("run", "answers/s measured", "predicted", "staleness measured", "predicted", "sampler busy measured",
          "predicted", "learner busy measured", "predicted", "within tolerance")
  lines = [" | ".join(head), " | ".join("---" for _ in head)]
  for row in rows:
    m, p, ok = row["measured"], row["predicted"], within(row)
    lines.append(f"{row['run']} | {m['samples_per_s']:.2f} | {p['samples_per_s']:.2f} | {m['staleness_mean']:.2f} | "
                 f"{p['staleness_mean']:.2f} | {m['sampler_busy']:.0%} | {p['sampler_busy']:.0%} | "
                 f"{m['learner_busy']:.0%} | {p['learner_busy']:.0%} | "
                 + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in ok.items()))
  return "\n".join(lines)
