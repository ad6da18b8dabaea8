r"""The device check: one command that measures the system on a GPU (written for an H100 or H200) in a few minutes,
and prints one table (also written to `--out`: `device_check.md`, `device_check.json`).

    python tools/device_check.py --out=/tmp/device_check            # on the GPU
    python tools/device_check.py --dry_run --out=/tmp/device_check  # anywhere: tiny shapes, the kernels interpreted

Rows, each measured side by side with its reference in this run:

* kernels: the Pallas GPU packed-attention kernel against the dense reference (values and gradients) and the Pallas
  GPU paged-attention kernel against the pure-JAX paged path, largest absolute differences;
* logprobs: the sampler's logprobs of its own draws against the learner's forward pass (float32 and bfloat16 sampler
  weights), and a greedy answer of a small random Qwen2 against `transformers` on the same device;
* sampler: decode tokens/s of a Qwen2.5-1.5B-shaped model (random bfloat16 weights) at 64 and 256 slots with 4k-token
  contexts (decode alone: a run to `--new_tokens` minus a run to one token), against the HBM roofline (weights and
  live keys/values read once per step at the measured bandwidth) and against `transformers` `generate` with the
  same work;
* learner: tokens/s and MFU of a packed Qwen2.5-1.5B step (8k-token rows, long-tail lengths) against an eager
  PyTorch step with SDPA on the same device;
* the tiny default run for 10 RL steps end to end.

Each judged row prints its threshold and `pass` or `FAIL` (`THRESHOLDS`; the performance ones against the card's
datasheet, `areal_jax/hardware.py`, on the real check only), and the command exits non-zero when a row fails or a
section raised (out of memory, a kernel the backend refuses: reported as a failed row, and the rest run).
`device_check.json` holds the rows, their verdicts and the measured figures the planner's efficiencies stand for
(`calibration`: decode share of the datasheet's HBM bandwidth, learner MFU, measured bandwidth).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent

# What each judged figure must reach. Correctness bounds sit well above float32 rounding on a GPU (TF32 matmuls give
# errors of 1e-3 on these sizes) and well below what a bug gives (a wrong mask or page index: 0.1 to 1). Performance
# floors are against the datasheet and say "not broken", not "tuned": engines reach 50-80% of HBM bandwidth in decode
# and 30-50% MFU in training at these sizes; below the floor something is wrong (a host stall, an unfused program).
THRESHOLDS = {
    "kernel_max_abs": 1e-2,  # a kernel's output against its reference
    "kernel_grad_max_abs": 5e-2,  # its gradients (summed over a 2k-token row: larger)
    "logprob_gap_f32": 2e-3,  # mean |sampler - learner| logprob of the sampler's own draws, float32 weights
    "logprob_gap_bf16": 5e-2,  # the same with bfloat16 sampler weights
    "greedy_agreement": 0.75,  # share of greedy answers equal to transformers' token for token
    "decode_of_spec_roofline": 0.2,  # decode tokens/s over the roofline at the datasheet's HBM bandwidth
    "bandwidth_of_spec": 0.6,  # measured HBM bandwidth over the datasheet's
    "learner_mfu": 0.15,  # model FLOP utilisation of the packed learner step against the datasheet's peak
}

# The real check's sizes, and the dry run's.
SIZES = {
    "real": dict(preset="qwen2.5-1.5b", layers=0, slots=(64, 256), context=4096, new_tokens=64, rows=8192,
                 sequences=96, max_len=8192, attn=(2, 2048, 12, 2, 128), paged=(64, 12, 2, 128, 16, 256),
                 run_steps=10, run_preset="tiny"),
    "dry": dict(preset="tiny", layers=0, slots=(4,), context=48, new_tokens=8, rows=128, sequences=8,
                max_len=96, attn=(2, 48, 4, 2, 16), paged=(4, 4, 2, 16, 4, 8), run_steps=1, run_preset="fast"),
}


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True, help="directory for device_check.md and device_check.json")
  p.add_argument("--dry_run", action="store_true", help="tiny shapes, Pallas kernels interpreted (any backend)")
  p.add_argument("--skip", default="", help=f"comma-separated sections to skip, of {','.join(SECTIONS)}")
  return p.parse_args()


SECTIONS = ("kernels", "logprobs", "sampler", "learner", "run")


def _tool(name: str):
  spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _math_config(preset: str):
  from areal_jax.config import load_config  # pylint: disable=g-import-not-at-top  # after the flags (imports JAX)

  return load_config(f"{ROOT / 'configs' / 'math.py'}:{preset}")


@dataclasses.dataclass
class Row:
  section: str
  check: str
  value: str
  reference: str = ""
  ratio: str = ""
  threshold: str = ""  # what the figure must reach, when judged
  ok: bool | None = None  # the verdict; None: not judged

  @property
  def verdict(self) -> str:
    return "" if self.ok is None else ("pass" if self.ok else "FAIL")


class Table:
  def __init__(self, judge_speed: bool, spec=None):
    self.rows: list[Row] = []
    self.judge_speed, self.spec = judge_speed, spec  # performance judged on the real check, against `spec`
    self.calibration: dict[str, float | str] = {}

  def add(self, *args, **kw):
    row = Row(*args, **kw)
    self.rows.append(row)
    print(f"  {row.section:<9} {row.check:<52} {row.value:<22} {row.reference:<26} {row.ratio:<22} "
          f"{row.threshold:<14} {row.verdict}", flush=True)

  def speed(self, value: float, floor: float, what: str) -> dict:
    """`threshold`/`ok` keywords for a performance figure: judged on the real check with a datasheet, else noted."""
    if not self.judge_speed:
      return dict(threshold=f">= {floor:.0%} ({what}; real check only)")
    return dict(threshold=f">= {floor:.0%}", ok=bool(value >= floor))

  def markdown(self, header: str) -> str:
    lines = [header, "", "| section | check | measured | reference | ratio | threshold | verdict |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.section} | {r.check} | {r.value} | {r.reference} | {r.ratio} | {r.threshold} | {r.verdict} |"
              for r in self.rows]
    return "\n".join(lines) + "\n"


def _torch_device():
  import torch  # pylint: disable=g-import-not-at-top

  return "cuda" if torch.cuda.is_available() else "cpu"


def _sync():
  import torch  # pylint: disable=g-import-not-at-top

  if torch.cuda.is_available():
    torch.cuda.synchronize()


# --- kernels -----------------------------------------------------------------------------------------------------


def check_kernels(table: Table, size: dict, interpret: bool) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from areal_jax.models.modules import gqa_attention, packed_mask
  from areal_jax.models.packed_attention import pallas_gpu_attention
  from areal_jax.sampler import attention

  rng = np.random.default_rng(0)
  b, t, h, kh, d = size["attn"]
  seg = np.zeros((b, t), np.int32)
  for r in range(b):  # long-tail segments, a padded tail
    pos, sid = 0, 1
    while pos < t - t // 8:
      n = min(int(rng.lognormal(math.log(t / 8), 1.0)) + 1, t - t // 8 - pos)
      seg[r, pos:pos + n], pos, sid = sid, pos + n, sid + 1
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, t, kh, d)), jnp.float32) for _ in range(2))
  seg_j = jnp.asarray(seg)
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  block = 16 if interpret else 64
  kernel = lambda q, k, v: pallas_gpu_attention(q, k, v, seg_j, block=block, interpret=interpret)
  ref = lambda q, k, v: jnp.where((seg_j != 0)[..., None, None], gqa_attention(q, k, v, packed_mask(seg_j)), 0)
  grads = lambda f: jax.jit(jax.grad(lambda q, k, v: (f(q, k, v) * w).sum(), (0, 1, 2)))(q, k, v)
  err = float(jnp.abs(jax.jit(kernel)(q, k, v) - jax.jit(ref)(q, k, v)).max())
  gerr = max(float(jnp.abs(a - b_).max()) for a, b_ in zip(grads(kernel), grads(ref)))
  tol, gtol = THRESHOLDS["kernel_max_abs"], THRESHOLDS["kernel_grad_max_abs"]
  table.add("kernels", f"packed attention (Pallas GPU) vs dense, {b}x{t} tokens", f"max abs diff {err:.1e}",
            "float32", f"grads {gerr:.1e}", threshold=f"<= {tol:.0e}, {gtol:.0e}", ok=err <= tol and gerr <= gtol)

  slots, h, kh, d, page, m = size["paged"]
  lengths = rng.integers(1, m * page + 1, slots).astype(np.int32)
  lengths[0] = 0
  kp, vp = (jnp.asarray(rng.normal(size=(kh, slots * m + 1, page, d)), jnp.float32) for _ in range(2))
  table_ids = jnp.asarray(rng.permutation(np.arange(1, slots * m + 1)).reshape(slots, m), jnp.int32)
  qd = jnp.asarray(rng.normal(size=(slots, h, d)), jnp.float32)
  args = (qd, kp, vp, jnp.asarray(lengths), table_ids)
  want = jax.jit(attention.paged_attention)(*args)
  got = jax.jit(lambda *a: attention.pallas_gpu_paged_attention(*a, interpret=interpret))(*args)
  err = float(jnp.abs(got - want).max())
  table.add("kernels", f"paged attention (Pallas GPU) vs pure JAX, {slots} slots x {m * page}",
            f"max abs diff {err:.1e}", "float32", threshold=f"<= {tol:.0e}", ok=err <= tol)


# --- logprobs ----------------------------------------------------------------------------------------------------


def _small_qwen2():
  from areal_jax.models import ModelConfig, create

  cfg = ModelConfig(family="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=32, max_position_embeddings=256, attention_bias=True)
  return create(cfg, seed=3)


def check_logprobs(table: Table) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers

  from areal_jax.models.hf_io import save_hf
  from areal_jax.sampler import Engine, Request, SamplerConfig, SamplingParams, Scheduler

  model = _small_qwen2()
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 512, int(rng.integers(8, 24))).astype(np.int32) for _ in range(8)]

  def draw(param_dtype: str, temperature: float, n: int):
    cfg = SamplerConfig(num_slots=8, page_size=16, num_pages=8 * 8 + 1, max_seq_len=128, max_new_tokens=n,
                        param_dtype=param_dtype)
    engine = Engine(model=model, config=cfg)
    sched = Scheduler(engine=engine, params=engine.load_params(model))
    for g, p in enumerate(prompts):
      sched.submit(Request(group_id=g, prompt_ids=p, sampling=SamplingParams(temperature=temperature,
                                                                             max_new_tokens=n, ignore_eos=True)))
    done = []
    while not sched.idle:
      done += sched.step()
    return sorted(done, key=lambda s: s.request.group_id)

  forward = jax.jit(lambda ids: jax.nn.log_softmax(model(ids).astype(jnp.float32), axis=-1))
  for dtype in ("float32", "bfloat16"):
    gaps = []
    for seq in draw(dtype, 1.0, 32):
      prompt = np.asarray(seq.request.prompt_ids)
      ids = np.concatenate([prompt, seq.tokens])
      rows = np.asarray(forward(jnp.asarray(ids[None])))[0, len(prompt) - 1:-1]
      gaps.append(np.abs(rows[np.arange(len(seq.tokens)), seq.tokens] - np.asarray(seq.logprobs)))
    gaps = np.concatenate(gaps)
    tol = THRESHOLDS["logprob_gap_f32" if dtype == "float32" else "logprob_gap_bf16"]
    table.add("logprobs", f"sampler ({dtype} weights) vs learner forward", f"mean abs gap {gaps.mean():.1e}",
              f"max {gaps.max():.1e}", f"{len(gaps)} tokens", threshold=f"mean <= {tol:.0e}",
              ok=bool(gaps.mean() <= tol))

  device = _torch_device()
  with tempfile.TemporaryDirectory() as d:
    save_hf(model, d)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(device).eval()
  same = total = 0
  for seq in draw("float32", 0.0, 24):
    prompt = np.asarray(seq.request.prompt_ids, np.int64)
    with torch.inference_mode():
      out = hf.generate(torch.from_numpy(prompt[None]).to(device), do_sample=False, max_new_tokens=24,
                        min_new_tokens=24, pad_token_id=0)
    want = out[0, len(prompt):].cpu().numpy()
    same += int((want == np.asarray(seq.tokens)).all())
    total += 1
  floor = THRESHOLDS["greedy_agreement"]
  table.add("logprobs", f"greedy answers equal to transformers ({device})", f"{same}/{total}", "24 tokens each",
            threshold=f">= {floor:.0%}", ok=same >= floor * total)


# --- sampler -----------------------------------------------------------------------------------------------------


def check_sampler(table: Table, size: dict) -> None:
  import jax
  import numpy as np
  from flax import nnx

  from areal_jax.learner.flops import measure_bandwidth
  from areal_jax.models import ModelConfig, create
  from areal_jax.sampler import Engine, Request, SamplerConfig, SamplingParams, Scheduler

  bench = _tool("bench_sampler")
  cfg = ModelConfig.from_config(_math_config(size["preset"]).model).replace(dtype="bfloat16",
                                                                            max_position_embeddings=size["context"])
  model = nnx.jit(lambda: create(cfg, seed=0))()
  ctx, new = size["context"], size["new_tokens"]
  bandwidth = measure_bandwidth(jax.devices()[0])
  rng = np.random.default_rng(2)
  for slots in size["slots"]:
    prompts = [rng.integers(2, cfg.vocab_size, ctx - new).astype(np.int32) for _ in range(slots)]
    sc = SamplerConfig(num_slots=slots, page_size=16, max_seq_len=ctx, max_new_tokens=new, param_dtype="bfloat16",
                       num_pages=slots * (ctx // 16) + 1, max_prefill_tokens=max(8192, ctx))
    engine = Engine(model=model, config=sc)
    params = engine.load_params(model)

    def run(n: int) -> float:
      sched = Scheduler(engine=engine, params=params)
      for g, p in enumerate(prompts):
        sched.submit(Request(group_id=g, prompt_ids=p, sampling=SamplingParams(max_new_tokens=n, ignore_eos=True)))
      start = time.perf_counter()
      while not sched.idle:
        sched.step()
      jax.block_until_ready(sched.state)
      return time.perf_counter() - start

    run(new)  # compiles
    decode_s = max(run(new) - run(1), 1e-9)
    tokens = slots * (new - 1)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    kv_bytes = slots * (ctx - new / 2) * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # bfloat16 cache
    roofline = slots / ((param_bytes + kv_bytes) / bandwidth)
    ours = tokens / decode_s
    table.add("sampler", f"decode tokens/s, {slots} slots x {ctx}-token contexts", f"{ours:,.0f}",
              f"HBM roofline {roofline:,.0f}", f"{ours / roofline:.0%} of roofline (measured BW)")
    if table.spec is not None:
      spec_roofline = slots / ((param_bytes + kv_bytes) / table.spec.hbm_bw)
      share = ours / spec_roofline
      table.calibration[f"decode_of_spec_roofline_{slots}"] = share
      table.add("sampler", f"  the same against the {table.spec.name} datasheet", f"{share:.0%}",
                f"roofline {spec_roofline:,.0f} at {table.spec.hbm_bw / 1e9:,.0f} GB/s", "",
                **table.speed(share, THRESHOLDS["decode_of_spec_roofline"], "of the datasheet roofline"))
    try:
      hf_run, _ = bench.make_hf_generate(model, seed=0, device=_torch_device(), dtype="bfloat16")
      hf_run(prompts[:1], 2)

      def timed(n):
        start = time.perf_counter()
        hf_run(prompts, n)
        _sync()
        return time.perf_counter() - start

      hf_decode = max(timed(new) - timed(1), 1e-9)
      table.add("sampler", f"  transformers generate, same work", f"{tokens / hf_decode:,.0f}", "",
                f"ours {hf_decode / decode_s:.2f}x faster")
    except Exception as e:  # pylint: disable=broad-except  # e.g. out of memory at 256 x 4k
      table.add("sampler", "  transformers generate, same work", f"failed: {type(e).__name__}", str(e)[:60])
  table.calibration["hbm_bw"] = bandwidth
  if table.spec is None:
    table.add("sampler", "measured HBM bandwidth", f"{bandwidth / 1e9:,.0f} GB/s", "no datasheet for this device")
  else:
    share = bandwidth / table.spec.hbm_bw
    table.add("sampler", "measured HBM bandwidth", f"{bandwidth / 1e9:,.0f} GB/s",
              f"datasheet {table.spec.hbm_bw / 1e9:,.0f} GB/s", f"{share:.0%}",
              **table.speed(share, THRESHOLDS["bandwidth_of_spec"], "of the datasheet"))


# --- learner -----------------------------------------------------------------------------------------------------


def check_learner(table: Table, size: dict) -> None:
  import statistics

  import jax

  from areal_jax.learner.config import LearnerConfig
  from areal_jax.learner.learner import Learner
  from areal_jax.learner.step import make_learner_mesh
  from areal_jax.models.config import ModelConfig

  bench = _tool("bench_learner")
  config = _math_config(size["preset"])
  model_cfg = ModelConfig.from_config(config.model).replace(max_position_embeddings=size["max_len"])
  learner_cfg = LearnerConfig.from_config(config.learner, max_new_tokens=config.sampler.max_new_tokens).replace(
      max_tokens_per_mb=size["rows"])
  devices = jax.devices()[:1]
  learner = Learner(model_cfg=model_cfg, config=learner_cfg, mesh=make_learner_mesh(devices),
                    temperature=config.sampler.temperature)
  trajs = bench.long_tail_batch(size["sequences"], size["max_len"], model_cfg.vocab_size, seed=0)
  plan = learner.prepare(trajs, None)
  learner.update(plan)  # compiles
  stats = [learner.update(plan) for _ in range(2)]
  tps = statistics.median(s["learner/tokens_per_s"] for s in stats)
  mfu = statistics.median(s["learner/mfu"] for s in stats)
  table.calibration["learner_mfu"] = mfu
  peak = "of the datasheet peak" if table.spec is not None else "of a measured matmul peak"
  table.add("learner", f"packed step, {size['rows']}-token rows, {sum(t.num_tokens for t in trajs)} tokens",
            f"{tps:,.0f} tokens/s", f"MFU {mfu:.1%} ({peak})",
            f"{int(stats[0]['learner/micro_batches'])} micro-batches",
            **table.speed(mfu, THRESHOLDS["learner_mfu"], "MFU"))
  try:
    step, _ = bench.make_torch_step(learner, trajs, size["rows"], config.sampler.temperature,
                                    device=_torch_device(), dtype="bfloat16" if _torch_device() == "cuda" else
                                    "float32")
    step()
    _sync()
    start = time.perf_counter()
    step()
    _sync()
    torch_tps = sum(t.num_tokens for t in trajs) / (time.perf_counter() - start)
    table.add("learner", "  eager PyTorch step (SDPA), same batch", f"{torch_tps:,.0f} tokens/s", "",
              f"ours {tps / torch_tps:.2f}x faster")
  except Exception as e:  # pylint: disable=broad-except
    table.add("learner", "  eager PyTorch step (SDPA), same batch", f"failed: {type(e).__name__}", str(e)[:60])


# --- the tiny run ------------------------------------------------------------------------------------------------


def check_run(table: Table, size: dict) -> None:
  from areal_jax.config import load_config
  from areal_jax.run import trainer
  from areal_jax.rl.metrics import read_metrics

  config = load_config(f"{ROOT / 'configs' / 'math.py'}:{size['run_preset']}", total_steps=size["run_steps"])
  with tempfile.TemporaryDirectory() as workdir:
    start = time.perf_counter()
    trainer.run(config, workdir)
    seconds = time.perf_counter() - start
    rows = [m for m in read_metrics(workdir) if "reward/mean" in m]
  steps = max((m["step"] for m in rows), default=0)
  table.add("run", f"configs/math.py:{size['run_preset']}, {size['run_steps']} RL steps end to end",
            f"{seconds:.0f} s", f"reward {rows[0]['reward/mean']:.2f} -> {rows[-1]['reward/mean']:.2f}",
            threshold=f"{size['run_steps']} steps", ok=steps == size["run_steps"])


def main():
  args = parse_args()
  size = SIZES["dry" if args.dry_run else "real"]
  from areal_jax.devices import cpu_without_accelerator  # pylint: disable=g-import-not-at-top  # before JAX

  cpu_without_accelerator()
  import jax  # pylint: disable=g-import-not-at-top

  dev = jax.devices()[0]
  if not args.dry_run and dev.platform != "gpu":
    raise SystemExit(f"device_check: the real check needs a GPU, found {dev.platform!r} ({dev.device_kind}); "
                     f"--dry_run runs the tiny shapes anywhere")
  header = (f"# device check{' (dry run)' if args.dry_run else ''}: {jax.device_count()} x {dev.device_kind}, "
            f"JAX {jax.__version__}, {time.strftime('%Y-%m-%d')}")
  print(header)
  from areal_jax import hardware  # pylint: disable=g-import-not-at-top

  spec = hardware.of_kind(dev.device_kind)
  table = Table(judge_speed=not args.dry_run and spec is not None, spec=spec)
  skip = set(filter(None, args.skip.split(",")))
  sections = {"kernels": lambda: check_kernels(table, size, interpret=args.dry_run),
              "logprobs": lambda: check_logprobs(table), "sampler": lambda: check_sampler(table, size),
              "learner": lambda: check_learner(table, size), "run": lambda: check_run(table, size)}
  for name, check in sections.items():
    if name in skip:
      continue
    start = time.perf_counter()
    try:
      check()
    except Exception as e:  # pylint: disable=broad-except  # one section's failure is a row; the rest still run
      traceback.print_exc()
      table.add(name, "section failed", f"{type(e).__name__}", str(e)[:80])
    print(f"  ({name}: {time.perf_counter() - start:.0f} s)", flush=True)
  os.makedirs(args.out, exist_ok=True)
  pathlib.Path(args.out, "device_check.md").write_text(table.markdown(header))
  pathlib.Path(args.out, "device_check.json").write_text(json.dumps(
      {"header": header, "device": None if spec is None else spec.name, "dry_run": args.dry_run,
       "thresholds": THRESHOLDS, "calibration": table.calibration,
       "rows": [dataclasses.asdict(r) | {"verdict": r.verdict} for r in table.rows]}, indent=1))
  failed = [r for r in table.rows if r.ok is False or r.value.startswith("failed") or r.check == "section failed"]
  judged = sum(r.ok is not None for r in table.rows)
  print(f"wrote {args.out}/device_check.md ({len(table.rows)} rows, {judged} judged, {len(failed)} failed"
        + (": " + "; ".join(f"{r.section} {r.check.strip()}" for r in failed) if failed else "") + ")")
  return 1 if failed else 0


if __name__ == "__main__":
  raise SystemExit(main())
