"""Fits the cost model to this machine's CPU from the project's own programs: the tiny preset's decode calls,
prefills and learner steps, each role measured in a process pinned to the cores and holding the emulated devices it
has in a run (`measure` below runs there; `calibrate` starts those processes and fits).

    cal = calibrate(config, LAYOUTS)   # layout -> (cores, emulated devices, devices per role)
    cal["split"].eff, cal["split"].device, cal["split"].error   # fitted efficiencies, the core's peaks, the fit's error

A CPU "chip" is the cores of one process: its peaks are a measured float32 matmul and read bandwidth; the fit finds
what the programs reach of them (`Efficiency`) and their fixed costs per call, by least squares on relative error.

    python -m areal_jax.sim.calibrate --config=configs/math.py --role_devices=2   # one layout's samples, as JSON
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np

from areal_jax.sim.costs import CostModel, Efficiency
from areal_jax.hardware import Device


# tools/bench_async.py --processes on a 2-core machine: colocated = one process, 4 devices on both cores, both roles
# on all 4 (`mesh.colocated`); split = a sampler process and a learner process, each with 1 device on one core.
LAYOUTS = {"colocated": (2, 4, 4), "split": (1, 1, 1)}


@dataclasses.dataclass(frozen=True)
class Calibration:
  """One layout's fitted costs: the device (a core), what the programs reach, and how well the fit holds."""

  device: Device
  eff: Efficiency
  error: dict  # program -> mean absolute relative error of the fit
  samples: dict  # what was measured

  def to_json(self) -> dict:
    eff = {k: float(v) for k, v in dataclasses.asdict(self.eff).items()}
    return {"device": dataclasses.asdict(self.device), "eff": eff, "error": self.error,
            "samples": self.samples}

  def costs(self, model_cfg, learner_cfg, *, shards: int, colocated: bool = False, passes: float = 4.0) -> CostModel:
    """The cost model of one CPU process's cores (float32 weights and cache) with these efficiencies."""
    return CostModel(model=model_cfg, device=self.device, sampler_chips=1, learner_chips=1, sampler_shards=shards,
                     colocated=colocated, weight_bytes=4, kv_bytes=4, passes=passes, remat=0.0,
                     max_tokens_per_mb=learner_cfg.max_tokens_per_mb, minibatches=learner_cfg.ppo_n_minibatches,
                     eff=self.eff)

  @classmethod
  def from_json(cls, d: dict) -> Calibration:
    return cls(device=Device(**d["device"]), eff=Efficiency(**d["eff"]), error=d["error"], samples=d["samples"])


def _timed(fn, repeats: int = 3) -> float:
  """Best wall seconds of `fn()` (which blocks until its result is ready)."""
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def _decode_samples(model, mesh, sampler_cfg) -> list[dict]:
  """Seconds of one decode call of 1 step and of `decode_steps` with `b` live answers, for a few b, after their
  prefill and a warm call (a call's fixed cost and a step's are told apart)."""
  from areal_jax.sampler.engine import Engine  # pylint: disable=g-import-not-at-top

  out = []
  for steps in sorted({1, sampler_cfg.decode_steps}):
    cfg = sampler_cfg.replace(decode_steps=steps)
    engine = Engine(model=model, config=cfg, mesh=mesh)
    out += _decode_calls(engine, engine.load_params(model), cfg)
  return out


def _decode_calls(engine, params, sampler_cfg) -> list[dict]:
  from areal_jax.sampler.requests import Request, SamplingParams  # pylint: disable=g-import-not-at-top
  from areal_jax.sampler.scheduler import Scheduler  # pylint: disable=g-import-not-at-top

  out = []
  for b in sorted({1, 16, sampler_cfg.num_slots}):
    sched = Scheduler(engine=engine, params=params)
    sp = SamplingParams(max_new_tokens=sampler_cfg.max_new_tokens - 1, ignore_eos=True)
    for g in range(b):
      sched.submit(Request(group_id=g, prompt_ids=np.full(24, 3, np.int32), sampling=sp))
    sched.step()
    sched.step()  # compiled, every answer running
    shards = np.bincount([engine.slots.shard_of(s) for s in sched.running], minlength=engine.num_shards)
    context = np.bincount([engine.slots.shard_of(s) for s in sched.running],
                          weights=[engine.slots.cached[s] for s in sched.running], minlength=engine.num_shards)
    seconds = _timed(sched.step, repeats=2)
    out.append({"live": shards.tolist(), "context": (context + shards * sampler_cfg.decode_steps).tolist(),
                "steps": sampler_cfg.decode_steps, "seconds": seconds})
  return out


def _prefill_samples(engine, params) -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top

  from areal_jax.sampler.engine import Draws  # pylint: disable=g-import-not-at-top

  out = []
  for rows, length in ((1, 32), (4, 32), (16, 32), (1, 64), (8, 64)):
    call = lambda: jax.block_until_ready(engine.prefill_batch(
        params, [np.full(length - 1, 3, np.int32)] * rows, [Draws(keys=np.zeros((1, 2), np.uint32))] * rows))
    call()
    out.append({"rows": rows, "length": length, "seconds": _timed(call)})
  return out


def _learner_samples(model_cfg, learner_cfg, devices) -> list[dict]:
  from areal_jax.learner.learner import Learner  # pylint: disable=g-import-not-at-top
  from areal_jax.learner.step import make_learner_mesh  # pylint: disable=g-import-not-at-top
  from areal_jax.types import Trajectory  # pylint: disable=g-import-not-at-top

  learner = Learner(model_cfg=model_cfg, config=learner_cfg, mesh=make_learner_mesh(devices))
  rng = np.random.default_rng(0)
  out = []
  for n in (32, 128):
    trajs = []
    for i in range(n):
      r = int(np.clip(rng.lognormal(np.log(25), 0.5), 2, 64))
      trajs.append(Trajectory(prompt_ids=np.full(24, 3, np.int32), response_ids=np.full(r, 4, np.int32),
                              logprobs=np.full(r, -1.0, np.float32), versions=np.zeros(r, np.int32),
                              finish_reason="eos", group_id=i // 8, reward=float(i % 2)))
    learner.train_step(trajs)
    out.append({"lengths": [t.num_tokens for t in trajs], "seconds": _timed(lambda t=trajs: learner.train_step(t))})
  return out


def measure(config, role_devices: int) -> dict:
  """Both roles' samples in this process: the sampler on its first `role_devices` devices, the learner on the next
  ones (or the same when there are too few: the roles of a split run are processes of their own)."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from areal_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from areal_jax.learner.flops import measure_bandwidth, measure_matmul_peak  # pylint: disable=g-import-not-at-top
  from areal_jax.models.transformer import Transformer  # pylint: disable=g-import-not-at-top
  from areal_jax.sampler.engine import Engine  # pylint: disable=g-import-not-at-top
  from areal_jax.sharding import make_mesh  # pylint: disable=g-import-not-at-top

  settings = config_lib.validate(config, data=False)
  devices = jax.devices()
  sampler_devices = devices[:role_devices]
  learner_devices = devices[role_devices:2 * role_devices] or sampler_devices
  model = Transformer(settings.model.without_lora(), rngs=nnx.Rngs(0))
  mesh = make_mesh(sampler_devices, {"data": -1, "tensor": 1})
  engine = Engine(model=model, config=settings.sampler, mesh=mesh)
  params = engine.load_params(model)
  return {"cores": len(os.sched_getaffinity(0)), "devices": role_devices,
          "matmul_flops": measure_matmul_peak(devices[:1], repeats=10), "bandwidth": measure_bandwidth(devices[0]),
          "decode": _decode_samples(model, mesh, settings.sampler), "prefill": _prefill_samples(engine, params),
          "learner": _learner_samples(settings.model, settings.learner, learner_devices)}


def _fit(residuals, x0: list[float]) -> np.ndarray:
  """Positive parameters minimising the squared log-ratios `residuals(params)` returns."""
  import scipy.optimize  # pylint: disable=g-import-not-at-top

  res = scipy.optimize.least_squares(lambda z: residuals(np.exp(z)), np.log(x0))
  return np.exp(res.x)


def fit(samples: dict, model_cfg, sampler_cfg, learner_cfg) -> Calibration:
  """The device (the process's cores as one chip) and the efficiencies that best predict `samples`."""
  device = Device("cpu", flops=samples["matmul_flops"], hbm_bw=samples["bandwidth"], hbm=float(2**40),
                  link=samples["bandwidth"])
  costs = lambda eff: Calibration(device, eff, {}, samples).costs(model_cfg, learner_cfg, shards=samples["devices"])

  def decode(s, eff):
    live, ctx = np.array(s["live"]), np.array(s["context"], np.float64)
    return sum(costs(eff).decode_step(live, ctx + live * j) for j in range(s["steps"])) + eff.decode_call_s

  def prefill(s, eff):
    return costs(eff).prefill(s["rows"], s["length"], sharded=False)  # measured without shards: every shard all rows

  def learner(s, eff):
    return costs(eff).train_step(np.array(s["lengths"]))

  def log_error(fn, group, eff):
    return np.array([np.log(fn(s, eff) / s["seconds"]) for s in samples[group]])

  f, b, c, s = _fit(lambda p: log_error(decode, "decode", Efficiency(
      decode_flops=p[0], decode_bw=p[1], decode_call_s=p[2], decode_step_s=p[3])), [0.3, 0.3, 1e-3, 1e-3])
  eff = Efficiency(decode_flops=f, decode_bw=b, decode_call_s=c, decode_step_s=s)
  f, c = _fit(lambda p: log_error(prefill, "prefill", eff.replace(prefill_flops=p[0], prefill_call_s=p[1])),
              [0.3, 1e-3])
  eff = eff.replace(prefill_flops=f, prefill_call_s=c)
  m, c = _fit(lambda p: log_error(learner, "learner", eff.replace(learner_mfu=p[0], step_s=p[1])), [0.3, 1e-2])
  eff = eff.replace(learner_mfu=m, step_s=c)
  error = {g: float(np.mean(np.abs(np.expm1(log_error(fn, g, eff)))))
           for g, fn in (("decode", decode), ("prefill", prefill), ("learner", learner))}
  return Calibration(device=device, eff=eff, error=error, samples=samples)


def calibrate(config, layouts: dict[str, tuple[int, int, int]]) -> dict[str, Calibration]:
  """Each layout name -> (cores, emulated devices, devices per role) measured in a process of its own, pinned like
  the run's, and fitted. `config` is the run's ConfigDict (handed to the processes as JSON)."""
  import tempfile  # pylint: disable=g-import-not-at-top

  from areal_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from areal_jax.distributed import local_job  # pylint: disable=g-import-not-at-top

  settings = config_lib.validate(config, data=False)
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    f.write(config.to_json_best_effort())
  from_json = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                           "from_json.py")
  config_spec = f"{from_json}:{f.name}"
  cores = sorted(os.sched_getaffinity(0))
  out = {}
  try:
    for name, (n_cores, n_devices, role_devices) in layouts.items():
      env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS=str(n_cores),
                 XLA_FLAGS=f"--xla_force_host_platform_device_count={n_devices}")
      cmd = local_job.pinned([cores[i % len(cores)] for i in range(n_cores)],
                             ["-m", "areal_jax.sim.calibrate", f"--config={config_spec}",
                              f"--role_devices={role_devices}"])
      proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
      if proc.returncode:
        raise RuntimeError(f"calibrating {name} failed:\n{proc.stderr[-3000:]}")
      samples = json.loads(proc.stdout.strip().splitlines()[-1])
      out[name] = fit(samples, settings.model, settings.sampler, settings.learner)
  finally:
    os.unlink(f.name)
  return out


def main(argv: list[str]) -> None:
  from areal_jax import config as config_lib  # pylint: disable=g-import-not-at-top

  args = dict(a.removeprefix("--").split("=", 1) for a in argv)
  print(json.dumps(measure(config_lib.load_config(args["config"]), int(args["role_devices"]))))


if __name__ == "__main__":
  main(sys.argv[1:])
