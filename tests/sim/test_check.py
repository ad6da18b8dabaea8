"""The planner against a bench_async workdir: every run predicted from calibrated costs beside its measurement."""

import json

import numpy as np

from areal_jax import config as config_lib
from areal_jax.sim import check
from areal_jax.sim.calibrate import Calibration, fit
from areal_jax.sim.costs import Efficiency
from areal_jax.hardware import Device


def _bench(tmp_path):
  """A bench_async workdir as the tool writes it: bench_async.json and each run's rollouts.jsonl."""
  runs = {"colocated_sync": ("colocated sync", 0, 1, ()), "split_eta2": ("split η=2", 2, 2, ()),
          "split_eta2_t1": ("split η=2 t1", 2, 2, (("rollout.target_staleness", "1"),))}
  summary = {"steps": 4, "samples_per_s": 40.0, "staleness_mean": 1.0, "sampler_busy": 0.5, "learner_busy": 0.5}
  out = {}
  for name, (label, eta, processes, overrides) in runs.items():
    out[name] = {"name": name, "label": label, "eta": eta, "processes": processes, "cpu_devices": None,
                 "overrides": [list(o) for o in overrides], "seeds": [0], "per_seed": [summary]}
    (tmp_path / name).mkdir()
    (tmp_path / name / "bench_config.json").write_text(json.dumps({"total_steps": 6}))  # 2 untimed
    rng = np.random.default_rng(0)
    (tmp_path / name / "rollouts.jsonl").write_text("\n".join(
        json.dumps({"lengths": rng.integers(5, 60, 8).tolist(), "rewards": rng.integers(0, 2, 8).tolist()})
        for _ in range(50)))
  (tmp_path / "bench_async.json").write_text(json.dumps(out))
  return tmp_path


def test_every_run_is_predicted_in_its_layout_beside_its_measurement(tmp_path):
  config = config_lib.load_config("configs/math.py:tiny", **{"rollout.batch_size": 4, "rollout.group_size": 8})
  settings = config_lib.validate(config, data=False)
  cpu = Device("cpu", flops=2e11, hbm_bw=2e10, hbm=2.0**40, link=2e10)
  eff = Efficiency(decode_call_s=0.05, prefill_call_s=0.005, step_s=0.1, learner_mfu=0.2, transfer_s=0.01)
  cals = {"colocated": Calibration(device=cpu, eff=eff, error={}, samples={"devices": 2}),
          "split": Calibration(device=cpu, eff=eff, error={}, samples={"devices": 1})}
  rows = check.predict(str(_bench(tmp_path)), settings, cals, prompt_len=20)
  assert 10 < check.mean_prompt_len(settings) < 48
  by_run = {r["run"]: r for r in rows}
  assert set(by_run) == {"colocated sync", "split η=2", "split η=2 t1"}
  assert by_run["colocated sync"]["predicted"]["staleness_mean"] == 0
  assert 0 < by_run["split η=2 t1"]["predicted"]["staleness_mean"] <= by_run["split η=2"]["predicted"][
      "staleness_mean"]
  assert all(r["predicted"]["samples_per_s"] > 0 for r in rows)
  assert set(check.within(rows[0])) == {"samples_per_s", "staleness_mean", "busy"}
  assert "answers/s measured" in check.format_check(rows)


def test_a_fit_recovers_the_efficiency_that_made_the_samples():
  """Samples made by the cost model itself are fitted back to the efficiencies that made them."""
  settings = config_lib.validate(config_lib.load_config("configs/math.py:tiny"), data=False)
  cpu = Device("cpu", flops=1e11, hbm_bw=1e10, hbm=2.0**40, link=1e10)
  true = Efficiency(decode_flops=0.3, decode_bw=0.5, decode_call_s=0.02, prefill_flops=0.4, prefill_call_s=0.003,
                    learner_mfu=0.25, step_s=0.08)
  from areal_jax.sim.costs import CostModel  # the model the fit inverts
  costs = CostModel(model=settings.model, device=cpu, sampler_chips=1, learner_chips=1, sampler_shards=1,
                    weight_bytes=4, kv_bytes=4, passes=4.0, remat=0.0,
                    max_tokens_per_mb=settings.learner.max_tokens_per_mb,
                    minibatches=settings.learner.ppo_n_minibatches, eff=true)
  decode = [{"live": [b], "context": [b * 40.0], "steps": 8,
             "seconds": sum(costs.decode_step(np.array([b]), np.array([b * 40.0 + b * j])) for j in range(8))
             + true.decode_call_s} for b in (1, 16, 256, 4096)]
  prefill = [{"rows": r, "length": n, "seconds": costs.prefill(r, n)} for r, n in ((1, 32), (64, 512), (256, 2048))]
  learner = [{"lengths": [50] * n, "seconds": costs.train_step(np.full(n, 50))} for n in (32, 2048)]
  cal = fit({"matmul_flops": 1e11, "bandwidth": 1e10, "devices": 1, "decode": decode, "prefill": prefill,
             "learner": learner}, settings.model, settings.sampler, settings.learner)
  assert max(cal.error.values()) < 0.02
  assert abs(cal.eff.learner_mfu - 0.25) < 0.02 and abs(cal.eff.step_s - 0.08) < 0.01
