"""Lossless delta weight sync (`sync.delta`): what changes per version under real AdamW updates, and what a pull costs,
full copy against delta, side by side in one run.

A model of a preset's shapes (random normal(0.02) weights: no checkpoint is downloaded) trains on random token
sequences with the learner's own optimizer (`learner/optimizer.py`: AdamW with the preset's betas, eps, weight decay,
clipping and warm-up; `ppo_n_minibatches` updates a version) at each `--lrs` learning rate. After every version the float32 master weights are staged in the
sampler's dtype as the learner publishes them (`WeightPublisher.stage`), diffed against the version before
(`WeightPublisher.delta`), and pulled by a second process on this machine (`WeightPuller`, over
`jax.experimental.transfer`) twice: the whole copy, then the delta applied to the previous version. Both pulls are
checked against the published fingerprint (the delta's rebuilt copy is bit-identical or the tool fails).

Printed per learning rate and step: the share of elements whose bits changed (all, embeddings, output head, the
transformer layers), bytes per version full and delta, the two pulls' seconds, and the publisher's seconds to stage
and to diff. With fewer layers than the preset (`--layers`) the per-layer share is also extrapolated to the preset's
depth (the embeddings and head as measured, every layer as the measured layers' mean). The summary line averages the
steps after the learner's warm-up (`learner.warmup_steps`).

    python tools/bench_delta_sync.py                       # qwen2.5-1.5b shapes, 2 of 28 layers, lr 1e-6 and 1e-5
    python tools/bench_delta_sync.py --preset=tiny --layers=0 --lrs=1e-3
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="qwen2.5-1.5b", help="model and learner settings from configs/math.py")
  p.add_argument("--layers", type=int, default=2, help="transformer layers built (0: the preset's own)")
  p.add_argument("--lrs", default="1e-6,1e-5", help="learning rates, comma-separated")
  p.add_argument("--steps", type=int, default=6, help="learner steps (versions) per learning rate")
  p.add_argument("--tokens", type=int, default=256, help="tokens per training sequence (one sequence an update)")
  p.add_argument("--json", default="", help="also write the rows to this file")
  p.add_argument("--puller", default="", help=argparse.SUPPRESS)  # internal: the pulling process, at this address
  return p.parse_args(argv)


def _settings(args):
  from areal_jax.config import load_config, validate

  # No data or weights are read: only the model and learner settings are used (random weights, on purpose).
  overrides = {"data.source": "synthetic", "model.allow_random_init": True}
  if args.layers:
    overrides["model.num_layers"] = args.layers
  return validate(load_config(f"{os.path.join(ROOT, 'configs', 'math.py')}:{args.preset}", **overrides))


def _abstract(settings):
  import jax
  from flax import nnx

  from areal_jax.models import create
  from areal_jax.models.weights import with_dtype

  model = nnx.eval_shape(lambda: create(settings.model, 0))
  return with_dtype(nnx.state(model, nnx.Param), settings.sampler.weight_dtype), jax


def run_puller(args) -> None:
  """The second process: pulls what the parent names on stdin (one JSON line each) and answers with the seconds
  and the fingerprint of what it rebuilt."""
  import jax

  from areal_jax.distributed.weight_transfer import WeightPuller

  abstract, _ = _abstract(_settings(args))
  puller = WeightPuller(address=args.puller, abstract_params=abstract, tensor=1, devices=jax.local_devices(),
                        host="127.0.0.1", keep=True)
  print("ready", flush=True)
  for line in sys.stdin:
    order = json.loads(line)
    start = time.perf_counter()
    _, fp = puller.pull(order["uuid"], timeout_s=600, codes=order["codes"])
    print(json.dumps({"seconds": time.perf_counter() - start, "fingerprint": fp.tolist(),
                      "nbytes": puller.last_nbytes}), flush=True)


def _groups(paths: list[str]) -> list[str]:
  """Each leaf's group: "embeddings", "head", "layers" (the stacked transformer layers) or "other" (the final norm)."""
  names = {"['embed']": "embeddings", "['lm_head']": "head", "['layers']": "layers"}
  return [next((g for k, g in names.items() if p.startswith(k)), "other") for p in paths]


def main(args) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx

  from areal_jax.distributed import weight_delta
  from areal_jax.distributed.weight_transfer import WeightPublisher, _leaf_paths
  from areal_jax.learner.optimizer import make_optimizer
  from areal_jax.models import create

  settings = _settings(args)
  abstract, _ = _abstract(settings)
  full_layers = _settings(argparse.Namespace(**{**vars(args), "layers": 0})).model.num_layers
  graphdef, params, rest = nnx.split(create(settings.model, 0), nnx.Param, ...)
  paths = _leaf_paths(params)
  groups = _groups(paths)
  sizes = [x.size for x in jax.tree.leaves(params)]
  del params
  print(f"{args.preset}: {settings.model.num_layers} of {full_layers} layers, {sum(sizes) / 1e9:.3f}B parameters "
        f"({settings.model.num_params() / 1e9:.3f}B counted by the config), sampler dtype "
        f"{np.dtype(settings.sampler.weight_dtype).name}; {args.tokens} tokens a step", flush=True)

  pub = WeightPublisher(abstract_params=abstract, tensor=1, devices=jax.local_devices(), host="127.0.0.1")
  child = subprocess.Popen([sys.executable, __file__, f"--puller={pub.address}", f"--preset={args.preset}",
                            f"--layers={args.layers}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           env=dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu")))
  if child.stdout.readline().strip() != "ready":
    raise RuntimeError("the pulling process did not start")

  def pull(staged, version, delta=None) -> dict:
    uuids, fp = pub.offer(staged, version, [0], delta=delta)
    child.stdin.write(json.dumps({"uuid": uuids[0], "codes": list(delta.codes) if delta else None}) + "\n")
    child.stdin.flush()
    got = json.loads(child.stdout.readline())
    if not np.array_equal(np.asarray(got["fingerprint"], np.float32), fp):
      raise RuntimeError(f"version {version}: the pulled copy differs from the published one")
    pub.pulled(version, 0)
    return got

  def loss(p, tokens):
    logits = nnx.merge(graphdef, p, rest)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  rows, version = [], 0
  for lr in [float(x) for x in args.lrs.split(",")]:
    tx = make_optimizer(settings.learner.replace(lr=lr))

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # one copy of the weights and moments at a time
    def step(p, opt_state, tokens, tx=tx):
      grads = jax.grad(loss)(p, tokens)
      updates, opt_state = tx.update(grads, opt_state, p)
      return optax.apply_updates(p, updates), opt_state

    p = nnx.state(create(settings.model, 0), nnx.Param)  # the same initial weights for every learning rate
    opt_state = tx.init(p)
    staged = pub.stage(p)
    pull(staged, version)  # the puller's first (whole) copy at this learning rate
    rng = np.random.default_rng(0)
    print(f"\nlr {lr:g}\nstep | changed | embeddings | head | layers | full MB | delta MB | full pull s | "
          "delta pull s | stage s | diff s\n---|---|---|---|---|---|---|---|---|---|---", flush=True)
    for i in range(1, args.steps + 1):
      for _ in range(settings.learner.ppo_n_minibatches):  # a learner step: this many updates, then a version
        tokens = jnp.asarray(rng.integers(0, settings.model.vocab_size, (1, args.tokens + 1)), jnp.int32)
        p, opt_state = step(p, opt_state, tokens)
      jax.block_until_ready(p)
      version += 1
      t0 = time.perf_counter()
      previous, staged = staged, pub.stage(p)
      t1 = time.perf_counter()
      delta = pub.delta(staged, previous)
      jax.block_until_ready(delta.payload)
      t2 = time.perf_counter()
      changed = [int(np.sum(c)) for c in jax.device_get(  # per leaf (summed over its shards)
          weight_delta.count_changed(jax.tree.leaves(staged), jax.tree.leaves(previous)))]
      share = {g: sum(c for c, gg in zip(changed, groups) if gg == g) / max(1, sum(n for n, gg in zip(sizes, groups)
                                                                                if gg == g))
               for g in ("embeddings", "head", "layers")}
      whole = pull(staged, version)  # a sampler that joined: the whole copy (then the delta rebuilds the same)
      small = pull(staged, version, delta)
      row = {"lr": lr, "step": i, "changed_fraction": delta.changed_fraction, **share,
             "full_bytes": pub.nbytes(), "delta_bytes": delta.nbytes, "full_pull_s": whole["seconds"],
             "delta_pull_s": small["seconds"], "stage_s": t1 - t0, "diff_s": t2 - t1}
      if args.layers and full_layers > settings.model.num_layers:
        layer_n = sum(n for n, g in zip(sizes, groups) if g == "layers")
        other_n = sum(sizes) - layer_n
        scale = full_layers / settings.model.num_layers
        other_c = sum(c for c, g in zip(changed, groups) if g != "layers")
        row["changed_fraction_at_full_depth"] = (other_c + share["layers"] * layer_n * scale) / (
            other_n + layer_n * scale)
      rows.append(row)
      print(f"{i} | {row['changed_fraction']:.4f} | {share['embeddings']:.4f} | {share['head']:.4f} | "
            f"{share['layers']:.4f} | {row['full_bytes'] / 1e6:.1f} | {row['delta_bytes'] / 1e6:.1f} | "
            f"{row['full_pull_s']:.3f} | {row['delta_pull_s']:.3f} | {row['stage_s']:.3f} | {row['diff_s']:.3f}",
            flush=True)
    warm = settings.learner.warmup_steps  # the steps after the warm-up, at the learning rate itself
    later = [r for r in rows if r["lr"] == lr and r["step"] > warm] or [r for r in rows if r["lr"] == lr]
    mean = {k: float(np.mean([r[k] for r in later])) for k in later[0] if k not in ("lr", "step")}
    deep = (f"; at {full_layers} layers {mean['changed_fraction_at_full_depth']:.4f}"
            if "changed_fraction_at_full_depth" in mean else "")
    print(f"lr {lr:g}, steps {later[0]['step']}-{later[-1]['step']}: changed {mean['changed_fraction']:.4f}{deep}; "
          f"delta {mean['delta_bytes'] / mean['full_bytes']:.3f}x the full copy's bytes; pull "
          f"{mean['delta_pull_s'] / mean['full_pull_s']:.2f}x the full pull's seconds", flush=True)
  child.stdin.close()
  child.wait(60)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  parsed = parse_args()
  if parsed.puller:
    run_puller(parsed)
  else:
    main(parsed)
