r"""Asynchronous vs synchronous RL, side by side in one run (the paper's Table 7, on the hardware at hand).

    python tools/bench_async.py [--processes] [--etas=0,1,2,4,8] [--steps=20] [--seeds=0,1,2] \
        [--eval_every=10] [--variant=NAME:KEY=VALUE,...] [--workdir=/tmp/bench_async] [--config.*=...]

Every run uses the same model, data, seeds and starting weights; only the staleness bound η and the process layout
differ. η = 0 with the plain PPO loss is synchronous RL (generate a batch, train on it, repeat); η > 0 uses the
decoupled loss. Without `--processes`, every run is one process whose devices are split into a sampler and a learner
slice (`config.mesh`). With `--processes` (CPU, a machine of at least 2 cores):

- `colocated sync`: one process using every core, both roles on every device (`mesh.colocated`), generate-then-train
  (the verl-style baseline);
- `split sync`: a learner process and a sampler process, each pinned to its own cores (`launch/local.py`), η = 0;
- `split η=k`: the same split, asynchronous, for each η > 0 in `--etas`.

The workload is long-tailed like chain-of-thought answers: `--mix` sets `data.synthetic_mix`, short and long
arithmetic problems, so a synchronous batch waits for its longest answers. Without `model.init_from`, one supervised
warm-start is trained first and every run starts from it. Every run is a fresh process (or processes), so each pays
its own compilation; the first `--skip` steps are not timed.

Throughput counts trained answers (`learner/num_sequences`) and their tokens (`learner/loss_tokens`) between the end
of step `--skip` and the last step. Busy fractions are the seconds each role spent computing (sampler: scheduler
steps; learner: train steps and weight publication) over the same wall time. Accuracy is the held-out evaluation at
step 0 and after the last step (`eval.*`). Every run trains the same number of answers (steps x B x G), so the
final accuracies compare equal amounts of training. With several `--seeds` (`config.seed`: sampling, evaluation
samples) every run is repeated per seed from the same warm-start; the table gives mean ± standard deviation over the
seeds, and the accuracy gap to the first synchronous run is taken seed by seed (same seed, same start) before
averaging. The table, the answer-length distribution and every run's metrics go to `<workdir>`.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

from absl import flags, logging

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from areal_jax import cli  # pylint: disable=g-import-not-at-top  # does not import JAX
from areal_jax.distributed import local_job  # pylint: disable=g-import-not-at-top  # does not import JAX
from areal_jax.rl.metrics import read_metrics  # pylint: disable=g-import-not-at-top

_CONFIG = cli.define_config()
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/bench_async", "Directory for the runs (one subdirectory each).")
_ETAS = flags.DEFINE_list("etas", ["0", "1", "2", "4", "8"], "Staleness bounds to compare; 0 = synchronous.")
_STEPS = flags.DEFINE_integer("steps", 20, "Learner steps per run.")
_SKIP = flags.DEFINE_integer("skip", 2, "Steps not timed at the start of each run (compilation).")
_MIX = flags.DEFINE_string("mix", "1:12,4:1", "data.synthetic_mix of the workload ('' = keep the config's data).")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "config.seed of each repetition of every run.")
_PROCESSES = flags.DEFINE_bool("processes", False, "Compare colocated sync, split sync and split async processes.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 0, "Evaluate every this many steps (0: at the end only).")
_TARGET_DROP = flags.DEFINE_float("target_drop", 0.01, "Time-to-accuracy target: the first sync run's final accuracy "
                                  "(same seed) minus this.")
_VARIANTS = flags.DEFINE_multi_string("variant", [], "NAME:KEY=VALUE,...: every asynchronous run again with these "
                                      "config overrides (KEY relative to the config, e.g. learner.lr=5e-5).")


@dataclasses.dataclass(frozen=True)
class Run:
  name: str  # its subdirectory
  label: str
  eta: int
  processes: int = 1  # 1: one process, sampler and learner slices of its devices; 2: a learner and a sampler process
  cpu_devices: int | None = None  # emulated CPU devices per process; None = the config's
  overrides: tuple[tuple[str, str], ...] = ()  # config overrides (key, value as written) of a variant


def parse_variant(spec: str) -> tuple[str, tuple[tuple[str, str], ...]]:
  """"NAME:KEY=VALUE,KEY=VALUE" -> (NAME, ((KEY, VALUE), ...))."""
  name, sep, rest = spec.partition(":")
  pairs = [p.partition("=") for p in rest.split(",") if p]
  if not sep or not name or not pairs or any(not k or not eq for k, eq, _ in pairs):
    raise ValueError(f"--variant={spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
  return name, tuple((k, v) for k, _, v in pairs)


def runs_for(etas, processes: bool, variants=()) -> list[Run]:
  """The runs to compare; each asynchronous run once plain and once per variant (name, overrides)."""
  variants = [("", ())] + list(variants)
  if not processes:
    sync = [Run("eta0", "sync", 0)] if 0 in etas else []
    return sync + [Run(f"eta{e}{'_' + v if v else ''}", f"η={e}{' ' + v if v else ''}", e, overrides=o)
                   for e in etas if e > 0 for v, o in variants]
  colocated = Run("colocated_sync", "colocated sync", 0, 1, overrides=(("mesh.colocated", "true"),))
  return ([colocated, Run("split_sync", "split sync", 0, 2, 1)]
          + [Run(f"split_eta{e}{'_' + v if v else ''}", f"split η={e}{' ' + v if v else ''}", e, 2, 1, o)
             for e in etas if e > 0 for v, o in variants])


def _set(config, key: str, text: str) -> None:
  """Sets a dotted config key from its text, parsed as the field's type (as a --config.KEY=TEXT override is)."""
  *parents, leaf = key.split(".")
  node = config
  for p in parents:
    node = node[p]
  old = node[leaf]
  if isinstance(old, bool):
    value = text.lower() in ("1", "true", "yes")
  elif isinstance(old, (int, float)) or old is None:
    value = type(old)(float(text)) if old is not None else float(text)
  else:
    value = text
  node[leaf] = value


def bench_config(config, *, eta: int, steps: int, init_from: str, mix: str, cpu_devices: int | None = None,
                 seed: int | None = None, eval_every: int = 0, overrides=()):
  """The config of one run: `config` with η, the matching loss, `steps` steps, evaluations every `eval_every` steps
  (0: at the end only) and a variant's `overrides`."""
  c = config.copy_and_resolve_references()
  c.unlock()
  if seed is not None:
    c.seed = seed
  c.rollout.max_head_offpolicyness = eta
  c.learner.use_decoupled_loss = eta > 0
  c.total_steps = steps
  c.eval.every_steps = eval_every or max(steps, 1)
  for key, text in overrides:
    _set(c, key, text)
  c.checkpoint.every_steps = max(10 * steps, 1)  # only the final one
  c.metrics.tensorboard = False
  if cpu_devices:
    c.mesh.cpu_devices = cpu_devices
  if mix:
    if c.data.source != "synthetic":
      raise ValueError(f"--mix={mix!r} needs data.source='synthetic', not {c.data.source!r}; pass --mix=''")
    c.data.synthetic_mix = mix
  if init_from:
    c.model.init_from = init_from
  c.lock()
  return c


def launch(config, workdir: str, processes: int) -> list[dict]:
  """Runs `config` as `processes` processes (`launch/local.py`'s launcher) in a fresh `workdir`; its metrics rows."""
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  path = os.path.join(workdir, "bench_config.json")
  with open(path, "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  script = os.path.join(ROOT, "launch", "tpu_run.py")
  args = [f"--config={os.path.join(ROOT, 'configs', 'from_json.py')}:{path}", f"--workdir={workdir}"]
  if processes == 1:  # one process: the script on its own
    rc = subprocess.run([sys.executable, script, *args], check=False).returncode
  else:
    rc = local_job.run_local(script=script, args=args, num_processes=processes, sampler_processes=1)
  if rc:
    raise RuntimeError(f"bench run in {workdir} failed (exit status {rc}); its output is above")
  return read_metrics(workdir)


def training_time(rows: list[dict]) -> dict[int, float]:
  """Seconds since the start at each step's metrics row, the evaluations before it taken out (a row's time is
  stamped before its own evaluation)."""
  out, evals = {}, 0.0
  for r in sorted(rows, key=lambda r: r["step"]):
    if r["step"] > 0:
      out[r["step"]] = r["time/elapsed_s"] - evals
    evals += r.get("eval/seconds", 0.0)
  return out


def summarize(rows: list[dict], skip: int) -> dict:
  """Throughput, busy fractions, staleness and accuracy of one run's metrics rows, and its accuracy curve against
  training time (`curve`: [(seconds, accuracy)], step 0 at 0 s)."""
  steps = [r for r in rows if r["step"] > 0]
  first = next(r for r in steps if r["step"] == skip)
  timed = [r for r in steps if r["step"] > skip]
  train_s = training_time(rows)
  seconds = train_s[timed[-1]["step"]] - train_s[skip]
  samples = sum(r["learner/num_sequences"] for r in timed)
  tokens = sum(r["learner/loss_tokens"] for r in timed)

  def busy(key):
    return (timed[-1][key] - first[key]) / seconds

  return {"steps": len(timed), "seconds": seconds, "samples_per_s": samples / seconds, "tokens_per_s": tokens / seconds,
          "sampler_busy": busy("sampler/busy_s"), "learner_busy": busy("learner/busy_s"),
          "staleness_mean": sum(r["staleness/mean"] for r in steps) / len(steps),
          "staleness_max": max(r["staleness/max"] for r in steps),
          "accuracy": steps[-1].get("eval/accuracy", float("nan")),
          "initial_accuracy": next((r["eval/accuracy"] for r in rows if r["step"] == 0), float("nan")),
          "curve": [(train_s.get(r["step"], 0.0), r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]}


def time_to(curve, target: float) -> float:
  """Training seconds at the first evaluation reaching `target` (nan: none does)."""
  return next((t for t, acc in curve if acc >= target), float("nan"))


def answer_lengths(rollouts_path: str) -> list[int]:
  """Generated answer lengths (tokens) of every finished group in a run's rollouts.jsonl, filtered groups included."""
  with open(rollouts_path) as f:
    return [n for line in f for n in json.loads(line)["lengths"]]


def length_line(lengths) -> str:
  import numpy as np  # pylint: disable=g-import-not-at-top

  x = np.asarray(lengths)
  return (f"answer lengths (tokens, {len(x)} answers): mean {x.mean():.1f}, p50 {np.median(x):.0f}, "
          f"p90 {np.percentile(x, 90):.0f}, max {x.max()} (max/mean {x.max() / x.mean():.2f})")


def _mean_std(values) -> tuple[float, float]:
  import numpy as np  # pylint: disable=g-import-not-at-top

  x = np.asarray(values, np.float64)
  return float(x.mean()), float(x.std(ddof=1)) if len(x) > 1 else 0.0


def _fmt(values, digits: int, sign: bool = False) -> str:
  mean, std = _mean_std(values)
  text = f"{mean:+.{digits}f}" if sign else f"{mean:.{digits}f}"
  return text + (f" ± {std:.{digits}f}" if len(values) > 1 else "")


def aggregate(results: dict[Run, list[dict]], target_drop: float = 0.01) -> dict[Run, dict]:
  """Per run over its seeds: means and standard deviations, and against the first synchronous run, seed by seed (one
  value per seed): the accuracy gap (`accuracy_gap`) and the training seconds to reach its final accuracy minus
  `target_drop` (`time_to_target`, nan where never)."""
  base = next((run for run in results if run.eta == 0), None)
  out = {}
  for run, per_seed in results.items():
    agg = {k: _mean_std([r[k] for r in per_seed]) for k in per_seed[0] if k != "curve"}
    agg["seeds"] = len(per_seed)
    if base is not None:
      agg["accuracy_gap"] = [r["accuracy"] - b["accuracy"] for r, b in zip(per_seed, results[base])]
      agg["time_to_target"] = [time_to(r["curve"], b["accuracy"] - target_drop)
                               for r, b in zip(per_seed, results[base])]
    out[run] = agg
  return out


def _time_cell(times) -> str:
  """Mean ± std of the seeds that reached the target, and how many did."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  reached = [t for t in times if np.isfinite(t)]
  return f"{_fmt(reached, 0)} s ({len(reached)}/{len(times)})" if reached else f"- (0/{len(times)})"


def table(results: dict[Run, list[dict]], target_drop: float = 0.01) -> str:
  """Markdown table, one line per run (mean ± std over its seeds)."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  baselines = [run for run in results if run.eta == 0]
  base = baselines[0] if baselines else None
  head = (["run", "processes", "η", "loss", "trained samples/s", "tokens/s"] + [f"× {b.label}" for b in baselines]
          + ["sampler busy", "learner busy", "staleness mean / max", "accuracy (start → final)"]
          + ([f"accuracy − {base.label}", f"time to {base.label} − {target_drop:g}", "time-to-accuracy ×"]
             if base else []))
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  agg = aggregate(results, target_drop)
  for run, per_seed in results.items():
    col = lambda k: [r[k] for r in per_seed]
    mean = lambda run, k: agg[run][k][0]
    ratios = [f"{mean(run, 'samples_per_s') / mean(b, 'samples_per_s'):.2f}×" for b in baselines]
    cells = [run.label, str(run.processes), str(run.eta), "decoupled" if run.eta else "PPO",
             _fmt(col("samples_per_s"), 2), f"{mean(run, 'tokens_per_s'):.0f}", *ratios,
             f"{mean(run, 'sampler_busy'):.0%}", f"{mean(run, 'learner_busy'):.0%}",
             f"{mean(run, 'staleness_mean'):.2f} / {max(col('staleness_max')):.0f}",
             f"{mean(run, 'initial_accuracy'):.3f} → {_fmt(col('accuracy'), 3)}"]
    if base:
      times, base_times = agg[run]["time_to_target"], agg[base]["time_to_target"]
      # A target met at step 0 (0 s) says nothing about speed: no ratio for that seed.
      speedups = [b / t for t, b in zip(times, base_times) if np.isfinite(t) and np.isfinite(b) and t > 0 and b > 0]
      cells += [_fmt(agg[run]["accuracy_gap"], 3, sign=True), _time_cell(times),
                f"{_fmt(speedups, 2)}×" if speedups else "-"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def run_bench(config, *, runs: list[Run], steps: int, skip: int, mix: str, root: str,
              seeds: tuple[int, ...] = (0,), eval_every: int = 0,
              target_drop: float = 0.01) -> tuple[dict[Run, list[dict]], str]:
  """One warm-start (unless `model.init_from` is set), then every run once per seed; returns (results by run, one
  summary per seed, in `seeds` order; report)."""
  if steps <= skip:
    raise ValueError(f"steps={steps} must exceed skip={skip} (the untimed compilation steps)")
  init_from = config.model.init_from
  if not init_from and config.warmstart.steps:  # one warm-start, shared by every run
    warm = os.path.join(root, "warmstart_run")
    launch(bench_config(config, eta=0, steps=0, init_from="", mix=mix), warm, 1)
    init_from = os.path.join(warm, "warmstart")
  results, lengths = {run: [] for run in runs}, []
  for seed in seeds:  # seed-major: a partial bench still compares every run
    for run in runs:
      workdir = os.path.join(root, run.name if len(seeds) == 1 else f"{run.name}_seed{seed}")
      logging.info("bench_async: %s, seed %d, in %s", run.label, seed, workdir)
      c = bench_config(config, eta=run.eta, steps=steps, init_from=init_from, mix=mix, cpu_devices=run.cpu_devices,
                       seed=seed, eval_every=eval_every, overrides=run.overrides)
      results[run].append(summarize(launch(c, workdir, run.processes), skip))
      lengths += answer_lengths(os.path.join(workdir, "rollouts.jsonl"))
      logging.info("bench_async: %s, seed %d: %s", run.label, seed, json.dumps(results[run][-1]))
  report = (f"workload: data.synthetic_mix={mix or config.data.synthetic_mix!r}, B={config.rollout.batch_size}, "
            f"G={config.rollout.group_size}, {config.sampler.num_slots} slots, {steps} steps per run "
            f"({skip} untimed), seeds {', '.join(map(str, seeds))}, evaluations every {eval_every or steps} steps; "
            f"{length_line(lengths)}\n\n{table(results, target_drop)}")
  with open(os.path.join(root, "bench_async.md"), "w") as f:
    f.write(report + "\n")
  with open(os.path.join(root, "bench_async.json"), "w") as f:
    json.dump({run.name: {**dataclasses.asdict(run), "seeds": list(seeds), "per_seed": r}
               for run, r in results.items()}, f, indent=2)
  return results, report


def main(argv):
  del argv
  runs = runs_for([int(e) for e in _ETAS.value], _PROCESSES.value, [parse_variant(v) for v in _VARIANTS.value])
  _, report = run_bench(_CONFIG.value, runs=runs, steps=_STEPS.value, skip=_SKIP.value, mix=_MIX.value,
                        root=_WORKDIR.value, seeds=tuple(int(s) for s in _SEEDS.value), eval_every=_EVAL_EVERY.value,
                        target_drop=_TARGET_DROP.value)
  print(report)


if __name__ == "__main__":
  cli.run(main)
