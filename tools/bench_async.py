r"""Asynchronous vs synchronous RL, side by side in one run (the paper's Table 7, on the devices at hand).

    python tools/bench_async.py [--etas=0,1,2,4,8] [--steps=30] [--workdir=/tmp/bench_async] [--config.*=...]

Every run uses the same devices, model, data, seed and starting weights; only the staleness bound η differs. η = 0
with the plain PPO loss is synchronous RL (generate a batch, train on it, repeat); η > 0 uses the decoupled loss. The
workload is long-tailed like chain-of-thought answers: `--mix` sets `data.synthetic_mix`, short and long arithmetic
problems (generated answers of the default mix: max ≈ 2.9× mean), so a synchronous batch waits for its longest answers
while the sampler's slots empty. Without `model.init_from`, one supervised warm-start is trained first and every run
starts from it.

Throughput counts trained answers (`learner/num_sequences`) and their tokens (`learner/loss_tokens`) between the end
of step `--skip` (compilation done) and the last step; `time/elapsed_s` is taken before the final evaluation. Final
accuracy is the run's held-out evaluation after its last step (`eval.*` settings). The table, the answer-length
distribution the runs generated, and every run's metrics go to `<workdir>`.
"""

import json
import os
import shutil
import sys

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from areal_jax.devices import emulate_cpu_devices  # pylint: disable=g-import-not-at-top  # does not import JAX

_CONFIG = config_flags.DEFINE_config_file("config", "configs/math.py", "Config file[:preset].", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/bench_async", "Directory for the runs (each run in eta<η>/).")
_ETAS = flags.DEFINE_list("etas", ["0", "1", "2", "4", "8"], "Staleness bounds to compare; 0 = synchronous.")
_STEPS = flags.DEFINE_integer("steps", 30, "Learner steps per run.")
_SKIP = flags.DEFINE_integer("skip", 2, "Steps not timed at the start of each run (compilation).")
_MIX = flags.DEFINE_string("mix", "1:12,4:1", "data.synthetic_mix of the workload ('' = keep the config's data).")


def bench_config(config, *, eta: int, steps: int, init_from: str, mix: str):
  """The config of one run: `config` with η, the matching loss, `steps` steps and one evaluation at the end."""
  c = config.copy_and_resolve_references()
  c.unlock()
  c.rollout.max_head_offpolicyness = eta
  c.learner.use_decoupled_loss = eta > 0
  c.total_steps = steps
  c.eval.every_steps = max(steps, 1)
  c.checkpoint.every_steps = max(10 * steps, 1)  # only the final one
  c.metrics.tensorboard = False
  if mix:
    if c.data.source != "synthetic":
      raise ValueError(f"--mix={mix!r} needs data.source='synthetic', not {c.data.source!r}; pass --mix=''")
    c.data.synthetic_mix = mix
  if init_from:
    c.model.init_from = init_from
  c.lock()
  return c


def summarize(rows: list[dict], skip: int) -> dict:
  """Throughput, staleness and final accuracy of one run's metrics rows."""
  steps = [r for r in rows if r["step"] > 0]
  t0 = next(r["time/elapsed_s"] for r in steps if r["step"] == skip)
  timed = [r for r in steps if r["step"] > skip]
  seconds = timed[-1]["time/elapsed_s"] - t0
  samples = sum(r["learner/num_sequences"] for r in timed)
  tokens = sum(r["learner/loss_tokens"] for r in timed)
  return {"steps": len(timed), "seconds": seconds, "samples_per_s": samples / seconds, "tokens_per_s": tokens / seconds,
          "staleness_mean": sum(r["staleness/mean"] for r in steps) / len(steps),
          "staleness_max": max(r["staleness/max"] for r in steps),
          "accuracy": steps[-1].get("eval/accuracy", float("nan")),
          "initial_accuracy": next((r["eval/accuracy"] for r in rows if r["step"] == 0), float("nan"))}


def answer_lengths(rollouts_path: str) -> list[int]:
  """Generated answer lengths (tokens) of every finished group in a run's rollouts.jsonl, filtered groups included."""
  with open(rollouts_path) as f:
    return [n for line in f for n in json.loads(line)["lengths"]]


def length_line(lengths) -> str:
  import numpy as np  # pylint: disable=g-import-not-at-top

  x = np.asarray(lengths)
  return (f"answer lengths (tokens, {len(x)} answers): mean {x.mean():.1f}, p50 {np.median(x):.0f}, "
          f"p90 {np.percentile(x, 90):.0f}, max {x.max()} (max/mean {x.max() / x.mean():.2f})")


def table(results: dict[int, dict]) -> str:
  sync = results.get(0)
  lines = ["| η | loss | trained samples/s | tokens/s | ratio to sync | staleness mean / max | accuracy (start → final) |",
           "|---|---|---|---|---|---|---|"]
  for eta, r in results.items():
    ratio = f"{r['samples_per_s'] / sync['samples_per_s']:.2f}×" if sync else "–"
    lines.append(f"| {eta} | {'decoupled' if eta else 'PPO (sync)'} | {r['samples_per_s']:.2f} | "
                 f"{r['tokens_per_s']:.0f} | {ratio} | {r['staleness_mean']:.2f} / {r['staleness_max']:.0f} | "
                 f"{r['initial_accuracy']:.3f} → {r['accuracy']:.3f} |")
  return "\n".join(lines)


def run_bench(config, *, etas, steps: int, skip: int, mix: str, root: str) -> tuple[dict[int, dict], str]:
  """Runs one warm-start (unless `model.init_from` is set) and one run per η; returns (results by η, report)."""
  from areal_jax.system import trainer  # pylint: disable=g-import-not-at-top

  if steps <= skip:
    raise ValueError(f"steps={steps} must exceed skip={skip} (the untimed compilation steps)")
  init_from = config.model.init_from
  if not init_from and config.warmstart.steps:  # one warm-start, shared by every run
    warm = os.path.join(root, "warmstart_run")
    trainer.run(bench_config(config, eta=0, steps=0, init_from="", mix=mix), warm)
    init_from = os.path.join(warm, "warmstart")
  results, lengths = {}, []
  for eta in etas:
    workdir = os.path.join(root, f"eta{eta}")
    shutil.rmtree(workdir, ignore_errors=True)
    logging.info("bench_async: eta=%d in %s", eta, workdir)
    rows = trainer.run(bench_config(config, eta=eta, steps=steps, init_from=init_from, mix=mix), workdir)
    results[eta] = summarize(rows, skip)
    lengths += answer_lengths(os.path.join(workdir, "rollouts.jsonl"))
    logging.info("bench_async: eta=%d: %s", eta, json.dumps(results[eta]))
  report = (f"workload: data.synthetic_mix={mix or config.data.synthetic_mix!r}, B={config.rollout.batch_size}, "
            f"G={config.rollout.group_size}, {config.sampler.num_slots} slots, {steps} steps per run "
            f"({skip} untimed); {length_line(lengths)}\n\n{table(results)}")
  with open(os.path.join(root, "bench_async.md"), "w") as f:
    f.write(report + "\n")
  with open(os.path.join(root, "bench_async.json"), "w") as f:
    json.dump({str(k): v for k, v in results.items()}, f, indent=2)
  return results, report


def main(argv):
  del argv
  config = _CONFIG.value
  emulate_cpu_devices(config.mesh.cpu_devices)  # before JAX starts
  _, report = run_bench(config, etas=[int(e) for e in _ETAS.value], steps=_STEPS.value, skip=_SKIP.value,
                        mix=_MIX.value, root=_WORKDIR.value)
  print(report)


if __name__ == "__main__":
  app.run(main)
