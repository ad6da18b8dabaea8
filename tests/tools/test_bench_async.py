"""tools/bench_async.py end to end on a fast model: one shared warm-start, a sync and an async run, one table."""

import functools
import importlib.util
import json
import os

import numpy as np
import pytest

from areal_jax.config import load_config

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.cache
def _tool():  # once: the tool defines its absl flags at import
  spec = importlib.util.spec_from_file_location("bench_async", os.path.join(ROOT, "tools", "bench_async.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_bench_async_compares_sync_and_async_runs(tmp_path):
  bench = _tool()
  config = load_config(os.path.join(ROOT, "configs", "math.py:fast"))
  runs = bench.runs_for([0, 2], processes=False)  # a variant's run: test_bench_async_process_layouts_and_variants
  results, report = bench.run_bench(config, runs=runs, steps=3, skip=1, mix="1:3,2:1", root=str(tmp_path),
                                    eval_every=3)
  assert [(r.eta, r.label) for r in results] == [(0, "sync"), (2, "η=2")]
  for run, (r,) in results.items():
    assert r["steps"] == 2 and r["seconds"] > 0 and r["samples_per_s"] > 0 and r["tokens_per_s"] > r["samples_per_s"]
    assert r["staleness_max"] <= run.eta and 0 <= r["accuracy"] <= 1, (run, r)
    assert 0 <= r["sampler_busy"] <= 1.05 and 0 < r["learner_busy"] <= 1.05, (run, r)
  # Sync generates every measured batch after the step before it; η=2 may have made them all during step 1.
  assert results[runs[0]][0]["staleness_max"] == 0 and results[runs[0]][0]["sampler_busy"] > 0
  # Both runs started from the one cached warm-start: the same weights give the same step-0 evaluation.
  assert results[runs[0]][0]["initial_accuracy"] == results[runs[1]][0]["initial_accuracy"]
  for name, eta in (("eta0", 0), ("eta2", 2)):
    with open(tmp_path / name / "config.json") as f:
      run = json.load(f)
    assert run["rollout"]["max_head_offpolicyness"] == eta and run["learner"]["use_decoupled_loss"] == (eta > 0)
    assert run["data"]["synthetic_mix"] == "1:3,2:1" and run["model"]["init_from"].endswith("warmstart")
    assert run["learner"]["lr"] == config.learner.lr
  for run, (r,) in results.items():  # evaluated at steps 0 and 3, on the training-time axis
    assert len(r["curve"]) == 2 and r["curve"][0][0] == 0 and r["curve"][1][0] >= r["seconds"] > 0
  lines = report.splitlines()
  assert "answer lengths" in lines[0] and "max/mean" in lines[0]
  assert "| × sync |" in lines[2] and "| accuracy − sync | time to sync − 0.01 | time-to-accuracy × |" in lines[2]
  assert lines[-2].startswith("| sync | 1 | 0 | PPO |") and "| 1.00× |" in lines[-2] and "| +0.000 |" in lines[-2]
  assert "(1/1) |" in lines[-2]  # sync reaches its own final accuracy minus a point
  assert lines[-1].startswith("| η=2 | 1 | 2 | decoupled |")
  assert (tmp_path / "bench_async.md").read_text().strip() == report
  with pytest.raises(ValueError, match="steps=1 must exceed skip=1"):
    bench.run_bench(config, runs=runs, steps=1, skip=1, mix="", root=str(tmp_path))


def test_bench_async_process_layouts_and_variants():
  bench = _tool()
  runs = bench.runs_for([0, 1, 4], processes=True)
  assert [(r.label, r.processes, r.eta, r.cpu_devices) for r in runs] == [
      ("colocated sync", 1, 0, None), ("split sync", 2, 0, 1), ("split η=1", 2, 1, 1), ("split η=4", 2, 4, 1)]
  icepop = bench.parse_variant("icepop:learner.rejection.level=token,learner.rejection.lower=0.5")
  assert icepop == ("icepop", (("learner.rejection.level", "token"), ("learner.rejection.lower", "0.5")))
  runs = bench.runs_for([0, 4], processes=True, variants=[icepop])
  assert [(r.name, r.overrides) for r in runs[2:]] == [("split_eta4", ()), ("split_eta4_icepop", icepop[1])]
  config = load_config(os.path.join(ROOT, "configs", "math.py"))
  c = bench.bench_config(config, eta=4, steps=8, init_from="", mix="", overrides=icepop[1] + (("learner.lr", "3e-4"),))
  assert (c.learner.rejection.level, c.learner.rejection.lower, c.learner.lr) == ("token", 0.5, 3e-4)
  for bad in ("icepop", "icepop:", ":a=1", "x:a"):
    with pytest.raises(ValueError, match="NAME:KEY=VALUE"):
      bench.parse_variant(bad)


def test_bench_async_seeds_give_mean_std_and_paired_gap():
  bench = _tool()
  sync, eta4 = bench.Run("eta0", "sync", 0), bench.Run("eta4", "η=4", 4)

  def summary(samples_per_s, accuracy, seconds):
    curve = [(0.0, 0.3)] + [(t, a) for t, a in zip(seconds, (0.4, 0.5, accuracy))]
    return {"steps": 8, "seconds": 10.0, "samples_per_s": samples_per_s, "tokens_per_s": 20 * samples_per_s,
            "sampler_busy": 0.5, "learner_busy": 0.5, "staleness_mean": 0.0, "staleness_max": 0,
            "accuracy": accuracy, "initial_accuracy": 0.3, "curve": curve}

  results = {sync: [summary(10, 0.50, (10, 20, 30)), summary(12, 0.60, (10, 20, 30)), summary(11, 0.40, (10, 20, 30))],
             eta4: [summary(20, 0.52, (5, 10, 15)), summary(22, 0.58, (6, 12, 18)), summary(21, 0.43, (5, 10, 15))]}
  agg = bench.aggregate(results)
  assert agg[eta4]["samples_per_s"] == pytest.approx((21.0, 1.0))
  assert agg[eta4]["accuracy_gap"] == pytest.approx([0.02, -0.02, 0.03])  # seed by seed, not mean minus mean
  # Targets by seed 0.49, 0.59, 0.39: sync reaches them at 20 (0.5), 30 (0.6), 10 (0.4 at 10 s) seconds.
  assert agg[sync]["time_to_target"] == [20, 30, 10]
  assert agg[eta4]["time_to_target"][::2] == [10, 5] and np.isnan(agg[eta4]["time_to_target"][1])  # 0.58 < 0.59
  line = bench.table(results).splitlines()[-1]
  assert line.startswith("| η=4 | 1 | 4 | decoupled | 21.00 ± 1.00 | 420 | 1.91× |")
  assert "0.300 → 0.510 ± 0.075" in line and "| +0.010 ± 0.026 | 8 ± 4 s (2/3) | 2.00 ± 0.00× |" in line
  results[eta4][1]["curve"] = [(0.0, 0.3), (9.0, 0.6)]  # now seed 1 gets there: 30 / 9 s
  assert "| 8 ± 3 s (3/3) | 2.44 ± 0.77× |" in bench.table(results).splitlines()[-1]
