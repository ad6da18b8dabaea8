r"""LoRA in the sampler: adapters applied unmerged in the forward vs merged into the weights, and what a weight
update costs with adapters alone vs the whole model, side by side in one run on one device.

The same random base weights and random (non-zero) adapters, in the sampler's dtype:

* decode: `--slots` answers of `--new-tokens` tokens (EOS ignored) through the engine, once with the adapters in the
  forward (what the trainer runs) and once with a base-only model holding the merged weights W + (alpha / r)·A·B;
  rounds alternate, the best counts;
* a weight update: the learner's float32 tree moved (`weight_transfer.transfer`: cast and copy) onto the sampler's
  shardings, for the whole model, for the adapters alone (joined to the held base, as `LocalRollout` does), and for
  the adapters then merged on the device (`lora.merged`: what a merged sampler would run each version, holding the
  base and the merged copy).

    python tools/bench_lora.py                                    # the tiny preset, rank 8 on every projection
    python tools/bench_lora.py --preset=qwen2.5-1.5b --param-dtype=bfloat16 --rank=16 --slots=64   # on a GPU/TPU
"""

from __future__ import annotations

import argparse
import pathlib
import time


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="tiny", help="a preset of configs/math.py (its model shape, random weights)")
  p.add_argument("--layers", type=int, default=0, help="decoder layers (0 = the preset's)")
  p.add_argument("--rank", type=int, default=8)
  p.add_argument("--alpha", type=float, default=16.0)
  p.add_argument("--targets", default="q,k,v,o,gate,up,down")
  p.add_argument("--param-dtype", default="float32", help="the sampler's weights (sampler.param_dtype)")
  p.add_argument("--slots", type=int, default=32)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3, help="timed rounds per variant, alternating; the best counts")
  return p.parse_args()


def main():
  args = parse_args()
  import jax
  import ml_collections
  import numpy as np
  from flax import nnx

  from areal_jax.config import load_config
  from areal_jax.distributed import weight_transfer
  from areal_jax.models import ModelConfig, create, lora
  from areal_jax.sampler import Engine, Request, SamplerConfig, SamplingParams, Scheduler

  path = pathlib.Path(__file__).resolve().parent.parent / "configs" / "math.py"
  base_cfg = ModelConfig.from_config(load_config(f"{path}:{args.preset}").model)
  if args.layers:
    base_cfg = base_cfg.replace(num_layers=args.layers)
  group = ml_collections.ConfigDict({"rank": args.rank, "alpha": args.alpha, "targets": args.targets, "dropout": 0.0,
                                     "quantize_base": ""})
  cfg = base_cfg.with_lora(group)
  state = jax.jit(lambda: nnx.state(create(cfg, 0), nnx.Param))()
  adapters, base = lora.split(state)
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(adapters))))
  adapters = jax.tree.map(lambda x: 0.02 * jax.random.normal(next(keys), x.shape, x.dtype), adapters)
  state = nnx.merge_state(base, adapters)
  merged_state = jax.jit(lambda s: lora.merged(s, cfg))(state)
  print(f"model: {args.preset}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{lora.nbytes(base) / 4 / 1e6:.1f}M base parameters; LoRA rank {cfg.lora_rank} on "
        f"{','.join(cfg.lora_targets)} ({lora.nbytes(adapters) / 4 / 1e6:.2f}M); sampler weights {args.param_dtype}; "
        f"{jax.devices()[0].device_kind}")

  rng = np.random.default_rng(0)
  prompts = [rng.integers(2, cfg.vocab_size, int(rng.integers(16, 33))).astype(np.int32) for _ in range(args.slots)]
  max_seq_len = 32 + args.new_tokens
  sampler_cfg = SamplerConfig(num_slots=args.slots, page_size=16, max_seq_len=max_seq_len,
                              max_new_tokens=args.new_tokens, num_pages=args.slots * -(-max_seq_len // 16) + 1,
                              max_prefill_tokens=4096, param_dtype=args.param_dtype)
  engines = {"unmerged": Engine(model=nnx.eval_shape(lambda: create(cfg, 0)), config=sampler_cfg),
             "merged": Engine(model=nnx.eval_shape(lambda: create(base_cfg, 0)), config=sampler_cfg)}
  sampler_params = {"unmerged": engines["unmerged"].load_params(state),
                    "merged": engines["merged"].load_params(merged_state)}

  def decode(name, new_tokens):
    engine, params = engines[name], sampler_params[name]
    sched = Scheduler(engine=engine, params=params)
    for g, p in enumerate(prompts):
      sched.submit(Request(group_id=g, prompt_ids=p, sampling=SamplingParams(max_new_tokens=new_tokens, seed=0)))
    jax.block_until_ready(sched.state)
    done, t = 0, time.perf_counter()
    while not sched.idle:
      done += sum(len(x.tokens) for x in sched.step())
    jax.block_until_ready(sched.state)
    return done, time.perf_counter() - t

  start = time.perf_counter()
  for name in engines:
    decode(name, args.new_tokens)  # compiles every program the timed rounds run
  print(f"compiled both samplers and ran them once: {time.perf_counter() - start:.0f} s")
  seconds = dict.fromkeys(engines, float("inf"))
  for _ in range(args.repeats):
    for name in engines:
      tokens, t = decode(name, args.new_tokens)
      seconds[name] = min(seconds[name], t)

  # --- a weight update: learner tree (float32) -> the sampler's shardings and dtype ---
  shardings, dtype = engines["unmerged"].param_shardings, engines["unmerged"].param_dtype
  held = lora.split(sampler_params["unmerged"])[1]
  adapter_shardings = lora.split(shardings)[0]
  merge = jax.jit(lambda s: lora.merged(s, cfg))

  def full():
    return weight_transfer.transfer(state, shardings, dtype=dtype)

  def adapters_only():
    return nnx.merge_state(held, weight_transfer.transfer(adapters, adapter_shardings, dtype=dtype))

  def adapters_merged():
    return jax.block_until_ready(merge(adapters_only()))

  updates = {"whole model": (full, lora.nbytes(full())), "adapters (unmerged sampler)": (adapters_only, 0),
             "adapters, merged on the device": (adapters_merged, 0)}
  adapter_bytes = lora.nbytes(lora.split(adapters_only())[0])
  update_s = {}
  for name, (fn, _) in updates.items():
    fn()  # compiles
    update_s[name] = min(_timed(fn) for _ in range(max(args.repeats, 3)))

  print(f"decode: {args.slots} answers x {args.new_tokens} tokens")
  print(f"{'sampler':<24}{'seconds':>10}{'tokens/s':>11}")
  for name, t in seconds.items():
    print(f"{name:<24}{t:>10.3f}{tokens / t:>11.0f}")
  print(f"ratio unmerged / merged decode time: {seconds['unmerged'] / seconds['merged']:.2f}x")
  print(f"{'weight update':<34}{'bytes moved':>14}{'seconds':>11}")
  for name, t in update_s.items():
    moved = updates[name][1] or adapter_bytes
    print(f"{name:<34}{moved:>14}{t:>11.4f}")
  print(f"ratio whole-model / adapter bytes: {updates['whole model'][1] / adapter_bytes:.1f}x; update seconds "
        f"whole / adapters {update_s['whole model'] / update_s['adapters (unmerged sampler)']:.1f}x, whole / merged "
        f"{update_s['whole model'] / update_s['adapters, merged on the device']:.1f}x")


def _timed(fn) -> float:
  import jax

  t = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t


if __name__ == "__main__":
  main()
