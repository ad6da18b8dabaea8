"""Learner throughput: dynamic packed micro-batches vs fixed padded micro-batches, side by side in one run.

The variants run the same `Learner.update` (proximal pass + `ppo_n_minibatches` AdamW updates) on the same
long-tail batch, with the same token budget per micro-batch row (`--max-tokens`):

* packed: paper Alg. 1 on each minibatch, sequences packed back to back, row lengths bucketed; attention by
  `model.attention` (`flash` off TPU: only the key blocks a query block's segments reach);
* packed, dense attn: the same with `model.attention="dense"`, every query block against the whole row (the
  quadratic reference the flash kernel replaced);
* packed, N rows: the same as packed with `max_tokens_per_mb=N` (`--short-rows N`, at least the longest sequence):
  with attention linear in the row length, long rows should cost about what short ones do;
* padded: `max_tokens // max_len` sequences per micro-batch in arrival order, each padded to `--max-len` (one shape);
* packed, loglinear: packed with `learner.prox_logp_method="loglinear"` (no proximal forward pass).

With `--peer=torch`, a further variant runs the same step eagerly in PyTorch on the same weights and sequences (HF
`transformers` model, micro-batches padded to their longest sequence within the same token budget, the same decoupled
PPO loss, AdamW), a plain baseline a user might write instead.

`--host_answers=1024,4096,8192` instead times the learner's host work per step with no device work:
`Learner.prepare` (advantages, the minibatch split, Alg. 1's packing into micro-batches of `--max-tokens`) on that
many answers of the long-tail lengths (`--median-len`, at most `--max-len`), best of `--steps`. One line per count,
`learner host work per step at N answers (T tokens, M micro-batches): X s`, then the least-squares line through them,
`step_s + micro_batch_s x micro-batches`, the cost model's two fixed learner costs (`sim.costs.Efficiency`).

Achieved model FLOP/s (6·N per token plus causal attention, proximal pass included; padding not counted) is
reported as a fraction of a square-matmul peak measured on the same devices. "cpu s" is the process CPU time of a
step, a load-independent measure of work on a shared CPU machine. Defaults use one device and about 3 CPU-minutes
(3 minutes wall on a busy 2-core machine):

    python tools/bench_learner.py [--devices 8] [--sequences 64]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import time


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", type=int, default=1, help="learner devices (emulated on CPU when > 1)")
  p.add_argument("--sequences", type=int, default=32, help="answers in the batch (groups of 8)")
  p.add_argument("--max-len", type=int, default=1024, help="longest prompt + answer")
  p.add_argument("--max-tokens", type=int, default=2048, help="learner.max_tokens_per_mb")
  p.add_argument("--preset", default="tiny", help="model and learner settings from configs/math.py (random weights)")
  p.add_argument("--layers", type=int, default=0, help="override the preset's num_layers (0: keep)")
  p.add_argument("--short-rows", type=int, default=0,
                 help="also time packed rows of this many tokens (>= the longest sequence; 0: skip)")
  p.add_argument("--attention-block", type=int, default=0, help="model.attention_block (0: the config's)")
  p.add_argument("--no-dense", action="store_true", help="skip the dense-attention variant")
  p.add_argument("--steps", type=int, default=2, help="timed steps per variant, after one warm-up step")
  p.add_argument("--peer", choices=("none", "torch"), default="none", help="also time an eager PyTorch step")
  p.add_argument("--median-len", type=int, default=100, help="median answer length of the long-tail batch")
  p.add_argument("--host_answers", default="",
                 help="comma-separated answer counts: time the learner's host work per step (no device work)")
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args()


def long_tail_batch(n: int, max_len: int, vocab: int, seed: int, median: int = 100):
  """Answers with log-normal lengths (about `median` tokens, a few near `max_len`), rewards mixed within groups."""
  import numpy as np

  from areal_jax.types import Trajectory

  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    p = int(rng.integers(16, 48))
    r = int(np.clip(rng.lognormal(np.log(median), 1.0), 4, max_len - p))
    out.append(Trajectory(
        prompt_ids=rng.integers(0, vocab, p).astype(np.int32), response_ids=rng.integers(0, vocab, r).astype(np.int32),
        logprobs=(-np.log(vocab) + rng.normal(0, 0.3, r)).astype(np.float32), versions=np.zeros(r, np.int32),
        finish_reason="eos", group_id=i // 8, reward=float(i % 2)))
  return out


def make_torch_step(learner, trajs, max_tokens: int, temperature: float, *, device: str = "cpu",
                    dtype: str = "float32"):
  """A plain PyTorch PPO step on a copy of `learner`'s weights: proximal pass, then per minibatch (the learner's
  split) micro-batches padded to their longest sequence, decoupled PPO loss averaged over response tokens, AdamW
  (on torch `device`, weights in `dtype`; attention by transformers' default, SDPA)."""
  import tempfile

  import numpy as np
  import torch
  import transformers

  from areal_jax.learner.advantages import sequence_advantages
  from areal_jax.learner.microbatch import balanced_split
  from areal_jax.models.hf_io import save_hf

  cfg = learner.config
  transformers.utils.logging.disable_progress_bar()
  with tempfile.TemporaryDirectory() as d:
    save_hf(learner.model(), d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=getattr(torch, dtype)).to(device)
  model.train()
  opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.b1, cfg.b2), eps=cfg.adam_eps,
                          weight_decay=cfg.weight_decay)
  adv = sequence_advantages(np.array([t.reward for t in trajs]), np.array([t.group_id for t in trajs]),
                            scale=cfg.reward_scale, norm=cfg.adv_norm)
  lengths = [t.num_tokens for t in trajs]

  def micro_batches(idx):
    out, cur = [], []
    for i in idx:
      if cur and max(lengths[j] for j in cur + [i]) * (len(cur) + 1) > max_tokens:
        out.append(cur)
        cur = []
      cur.append(i)
    return out + [cur]

  def tensors(mb):
    width = max(lengths[i] for i in mb)
    ids, mask = np.zeros((len(mb), width), np.int64), np.zeros((len(mb), width), np.int64)
    behav, a, resp = (np.zeros((len(mb), width - 1), np.float32) for _ in range(3))
    for r, i in enumerate(mb):
      t, p = trajs[i], len(trajs[i].prompt_ids)
      ids[r, :lengths[i]] = np.concatenate([t.prompt_ids, t.response_ids])
      mask[r, :lengths[i]] = 1
      behav[r, p - 1:lengths[i] - 1], a[r, p - 1:lengths[i] - 1], resp[r, p - 1:lengths[i] - 1] = t.logprobs, adv[i], 1
    return [torch.from_numpy(x).to(device) for x in (ids, mask, behav, a, resp)]

  moe = bool(learner.model_cfg.num_experts)  # with the router's load-balancing loss, as the learner's

  def logprobs(ids, mask, with_aux=False):
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=moe and with_aux)
    logits = out.logits[:, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return (lp, out.aux_loss if moe else 0.0) if with_aux else lp

  minibatches = [[micro_batches(sorted(idx))] for idx in balanced_split(lengths, cfg.ppo_n_minibatches)]
  minibatches = [[tensors(mb) for mb in mbs] for (mbs,) in minibatches]

  def step():
    with torch.no_grad():
      prox = [[logprobs(ids, mask) for ids, mask, *_ in mbs] for mbs in minibatches]
    for mbs, prox_mbs in zip(minibatches, prox):
      opt.zero_grad()
      n = sum(float(resp.sum()) for *_, resp in mbs)
      for (ids, mask, behav, a, resp), px in zip(mbs, prox_mbs):
        lp, aux = logprobs(ids, mask, with_aux=True)
        ratio, weight = torch.exp(lp - px), torch.exp(px - behav)
        clipped = torch.clamp(ratio, 1 - cfg.eps_clip, 1 + cfg.eps_clip)
        loss = -(weight * torch.minimum(ratio * a, clipped * a) * resp).sum() / n
        loss = loss + cfg.aux_loss_coef * aux * resp.sum() / n
        loss.backward()
      torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
      opt.step()

  return step, torch.get_num_threads()


def host_work(args, learner, vocab: int) -> None:
  """Seconds of `Learner.prepare` per step against its micro-batches, and the line through them."""
  import numpy as np

  points = []
  for n in [int(a) for a in args.host_answers.split(",")]:
    trajs = long_tail_batch(n, args.max_len, vocab, args.seed, args.median_len)
    best, plan = float("inf"), None
    for _ in range(args.steps):
      start = time.perf_counter()
      plan = learner.prepare(trajs)
      best = min(best, time.perf_counter() - start)
    micro_batches = sum(len(mbs) for mbs in plan.minibatches)
    points.append((micro_batches, best))
    print(f"learner host work per step at {n} answers ({sum(t.num_tokens for t in trajs)} tokens, {micro_batches} "
          f"micro-batches): {best:.3f} s", flush=True)
  slope, intercept = np.polyfit(*np.array(points).T, 1)
  print(f"fit: step_s={intercept:.4g} + micro_batch_s={slope:.4g} x micro-batches (of {args.max_tokens} tokens)")


def main():
  args = parse_args()
  if args.devices > 1:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}").strip()
  import jax
  import numpy as np

  from areal_jax.config import load_config
  from areal_jax.learner.config import LearnerConfig
  from areal_jax.learner.flops import measure_matmul_peak
  from areal_jax.learner.learner import Learner
  from areal_jax.learner.microbatch import Layout
  from areal_jax.learner.step import batch_rows, make_learner_mesh
  from areal_jax.models.config import ModelConfig

  path = pathlib.Path(__file__).resolve().parent.parent / "configs" / "math.py"
  config = load_config(f"{path}:{args.preset}")
  model_cfg = ModelConfig.from_config(config.model).replace(max_position_embeddings=args.max_len)
  if args.attention_block:
    model_cfg = model_cfg.replace(attention_block=args.attention_block)
  if args.layers:
    model_cfg = model_cfg.replace(num_layers=args.layers)
  learner_cfg = LearnerConfig.from_config(config.learner, max_new_tokens=config.sampler.max_new_tokens)
  learner_cfg = learner_cfg.replace(max_tokens_per_mb=args.max_tokens)

  devices = jax.devices()[:args.devices]
  mesh = make_learner_mesh(devices)
  if args.host_answers:
    host_work(args, Learner(model_cfg=model_cfg, config=learner_cfg, mesh=mesh), model_cfg.vocab_size)
    return
  peak = measure_matmul_peak(devices, dtype=model_cfg.compute_dtype, repeats=20)
  trajs = long_tail_batch(args.sequences, args.max_len, model_cfg.vocab_size, args.seed)
  lengths = np.array([t.num_tokens for t in trajs])
  print(f"{len(devices)} x {devices[0].device_kind} | model {model_cfg.num_params() / 1e6:.1f}M params | "
        f"{len(trajs)} sequences, {lengths.sum()} tokens, length median {int(np.median(lengths))} "
        f"max {lengths.max()} | max_tokens_per_mb {args.max_tokens} | matmul peak {peak / 1e9:.1f} GFLOP/s")

  per_mb = max(args.max_tokens // args.max_len, 1)

  def padded(seq_lengths):
    rows = per_mb * batch_rows(mesh)  # same token budget per row (device) as packed
    idx = list(range(len(seq_lengths)))
    return [Layout(rows=tuple((i,) for i in idx[s:s + rows]) + ((),) * max(0, s + rows - len(idx)),
                   length=args.max_len) for s in range(0, len(idx), rows)]

  variants = {}
  runs = [("packed (Alg. 1)", None, learner_cfg, model_cfg), ("padded (fixed)", padded, learner_cfg, model_cfg),
          ("packed, loglinear", None, learner_cfg.replace(prox_logp_method="loglinear"), model_cfg)]
  if not args.no_dense:
    runs.append(("packed, dense attn", None, learner_cfg, model_cfg.replace(attention="dense")))
  if model_cfg.num_experts:  # the grouped expert matmul XLA gives for ragged_dot, beside the tiled one (CPU's auto)
    runs.append(("packed, ragged_dot", None, learner_cfg, model_cfg.replace(experts_impl="ragged_dot")))
  if args.short_rows:
    runs.append((f"packed, {args.short_rows} rows", None, learner_cfg.replace(max_tokens_per_mb=args.short_rows),
                 model_cfg))
  for name, planner, cfg, mcfg in runs:
    learner = Learner(model_cfg=mcfg, config=cfg, mesh=mesh, temperature=config.sampler.temperature,
                      peak_flops=peak)
    plan = learner.prepare(trajs, planner)
    learner.update(plan)  # compiles every shape the plan uses
    variants[name] = (learner, plan, [])
  torch_s = []
  if args.peer == "torch":
    torch_step, threads = make_torch_step(variants["packed (Alg. 1)"][0], trajs, args.max_tokens,
                                          config.sampler.temperature)
    torch_step()  # first-call setup
  for _ in range(args.steps):  # interleaved, so every variant sees the same machine load
    for learner, plan, stats in variants.values():
      cpu = time.process_time()
      stats.append(learner.update(plan) | {"cpu_s": time.process_time() - cpu})
    if args.peer == "torch":
      t = time.perf_counter()
      torch_step()
      torch_s.append(time.perf_counter() - t)
  # Best of a measurement before and after: on a shared machine a single one may catch a busy moment.
  peak_after = measure_matmul_peak(devices, dtype=model_cfg.compute_dtype, repeats=20)
  if peak_after > peak:
    print(f"matmul peak re-measured after the runs: {peak_after / 1e9:.1f} GFLOP/s (used below)")
  results = {}
  for name, (_, _, stats) in variants.items():
    for s in stats:
      s["learner/mfu"] *= peak / max(peak, peak_after)
    pick = lambda k: statistics.median(s[k] for s in stats)
    results[name] = dict(micro_batches=int(stats[0]["learner/micro_batches"]),
                         padding=stats[0]["learner/padding_fraction"], step_s=pick("learner/step_time_s"),
                         cpu_s=pick("cpu_s"), tokens_per_s=pick("learner/tokens_per_s"), mfu=pick("learner/mfu"))

  print(f"{'variant':<20}{'micro-batches':>14}{'padding':>9}{'step s':>9}{'cpu s':>8}{'tokens/s':>10}"
        f"{'model GFLOP/s':>15}{'of peak':>9}")
  for name, r in results.items():
    print(f"{name:<20}{r['micro_batches']:>14}{r['padding']:>9.1%}{r['step_s']:>9.2f}{r['cpu_s']:>8.1f}"
          f"{r['tokens_per_s']:>10.0f}{r['mfu'] * max(peak, peak_after) / 1e9:>15.2f}{r['mfu']:>9.1%}")
  packed, pad, loglinear = (results[k] for k in ("packed (Alg. 1)", "padded (fixed)", "packed, loglinear"))
  if "packed, dense attn" in results:
    dense = results["packed, dense attn"]
    print(f"flash / dense attention: step time {dense['step_s'] / packed['step_s']:.2f}x shorter, CPU time "
          f"{dense['cpu_s'] / packed['cpu_s']:.2f}x less")
  if args.short_rows:
    short = results[f"packed, {args.short_rows} rows"]
    print(f"rows of {args.max_tokens} / rows of {args.short_rows} tokens: step time "
          f"{packed['step_s'] / short['step_s']:.2f}x")
  print(f"packed / padded: tokens/s {packed['tokens_per_s'] / pad['tokens_per_s']:.2f}x, "
        f"CPU time per step {pad['cpu_s'] / packed['cpu_s']:.2f}x less")
  print(f"loglinear proximal logprobs (no proximal pass) / recompute: step time "
        f"{packed['step_s'] / loglinear['step_s']:.2f}x shorter, CPU time {packed['cpu_s'] / loglinear['cpu_s']:.2f}x "
        f"less")
  if torch_s:
    step_s = statistics.median(torch_s)
    print(f"torch (eager, padded, {threads} threads): step {step_s:.2f} s, {lengths.sum() / step_s:.0f} tokens/s; "
          f"packed / torch: tokens/s {packed['tokens_per_s'] * step_s / lengths.sum():.2f}x")


if __name__ == "__main__":
  main()
