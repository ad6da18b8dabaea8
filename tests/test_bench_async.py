"""tools/bench_async.py end to end on a fast model: one shared warm-start, a sync and an async run, one table."""

import functools
import importlib.util
import json
import os

import pytest

from areal_jax.config import load_config
from helpers import FAST

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def _tool():  # once: the tool defines its absl flags at import
  spec = importlib.util.spec_from_file_location("bench_async", os.path.join(ROOT, "tools", "bench_async.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_bench_async_compares_sync_and_async_runs(tmp_path):
  bench = _tool()
  config = load_config(os.path.join(ROOT, "configs", "math.py"), **FAST)
  runs = bench.runs_for([0, 2], processes=False)
  results, report = bench.run_bench(config, runs=runs, steps=3, skip=1, mix="1:3,2:1", root=str(tmp_path))
  assert [r.eta for r in results] == [0, 2]
  for run, (r,) in results.items():
    assert r["steps"] == 2 and r["seconds"] > 0 and r["samples_per_s"] > 0 and r["tokens_per_s"] > r["samples_per_s"]
    assert r["staleness_max"] <= run.eta and 0 <= r["accuracy"] <= 1
    assert 0 < r["sampler_busy"] <= 1.05 and 0 < r["learner_busy"] <= 1.05
  assert results[runs[0]][0]["staleness_max"] == 0
  # Both runs started from the one cached warm-start: the same weights give the same step-0 evaluation.
  assert results[runs[0]][0]["initial_accuracy"] == results[runs[1]][0]["initial_accuracy"]
  for eta in (0, 2):
    with open(tmp_path / f"eta{eta}" / "config.json") as f:
      run = json.load(f)
    assert run["rollout"]["max_head_offpolicyness"] == eta and run["learner"]["use_decoupled_loss"] == (eta > 0)
    assert run["data"]["synthetic_mix"] == "1:3,2:1" and run["model"]["init_from"].endswith("warmstart")
  lines = report.splitlines()
  assert "answer lengths" in lines[0] and "max/mean" in lines[0]
  assert "| × sync |" in lines[2] and "| accuracy − sync |" in lines[2]
  assert lines[-2].startswith("| sync | 1 | 0 | PPO |") and "| 1.00× |" in lines[-2] and lines[-2].endswith("| +0.000 |")
  assert lines[-1].startswith("| η=2 | 1 | 2 | decoupled |")
  assert (tmp_path / "bench_async.md").read_text().strip() == report
  with pytest.raises(ValueError, match="steps=1 must exceed skip=1"):
    bench.run_bench(config, runs=runs, steps=1, skip=1, mix="", root=str(tmp_path))


def test_bench_async_process_layouts():
  bench = _tool()
  runs = bench.runs_for([0, 1, 4], processes=True)
  assert [(r.label, r.processes, r.eta, r.cpu_devices) for r in runs] == [
      ("colocated sync", 1, 0, None), ("split sync", 2, 0, 1), ("split η=1", 2, 1, 1), ("split η=4", 2, 4, 1)]


def test_bench_async_seeds_give_mean_std_and_paired_gap():
  bench = _tool()
  sync, eta4 = bench.Run("eta0", "sync", 0), bench.Run("eta4", "η=4", 4)

  def summary(samples_per_s, accuracy):
    return {"steps": 8, "seconds": 10.0, "samples_per_s": samples_per_s, "tokens_per_s": 20 * samples_per_s,
            "sampler_busy": 0.5, "learner_busy": 0.5, "staleness_mean": 0.0, "staleness_max": 0,
            "accuracy": accuracy, "initial_accuracy": 0.3}

  results = {sync: [summary(10, 0.50), summary(12, 0.60), summary(11, 0.40)],
             eta4: [summary(20, 0.52), summary(22, 0.58), summary(21, 0.43)]}
  agg = bench.aggregate(results)
  assert agg[eta4]["samples_per_s"] == pytest.approx((21.0, 1.0))
  assert agg[eta4]["accuracy_gap"] == pytest.approx([0.02, -0.02, 0.03])  # seed by seed, not mean minus mean
  line = bench.table(results).splitlines()[-1]
  assert line.startswith("| η=4 | 1 | 4 | decoupled | 21.00 ± 1.00 | 420 | 1.91× |")
  assert "0.300 → 0.510 ± 0.075" in line and line.endswith("| +0.010 ± 0.026 |")
