r"""Sampler throughput: the paged continuous-batching engine vs a dense static-batch generate, side by side.

Workload: `--requests` prompts (16-32 tokens) whose answers have long-tail lengths (log-normal, capped at 3x the mean,
as long chain-of-thought outputs have), forced with per-request `max_new_tokens` (EOS ignored). Same model (the
`tiny` preset's, random weights), same slot count, temperature 1.0:

* engine: `Scheduler` over the paged engine; a slot is refilled as soon as its answer ends;
* static: batches of `--slots` prompts in arrival order, one jitted prefill + decode loop with a dense KV cache per
  batch; every batch runs until its longest answer ends.

Prints useful (generated, unpadded) tokens/s of each, their ratio, and the engine's fraction of a memory-bandwidth
roofline measured here: bandwidth from timing a large on-device reduction; a decode step must read the parameters
and each live sequence's keys/values once. Compiles are excluded (each variant is warmed up first). Defaults take
about 2 minutes on a 2-core CPU:

    python tools/bench_sampler.py [--slots 32] [--requests 256] [--mean-len 48]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import time


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--slots", type=int, default=32, help="decode slots (batch size of the static baseline)")
  p.add_argument("--requests", type=int, default=256, help="prompts, one answer each")
  p.add_argument("--mean-len", type=int, default=48, help="mean answer length; the longest is 3x this")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--repeats", type=int, default=2, help="timed runs per variant, alternating; the best counts")
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args()


def workload(n: int, mean: int, vocab: int, seed: int):
  """(prompts, answer lengths): log-normal lengths, capped at 3x the mean, rescaled to the requested mean."""
  import numpy as np

  rng = np.random.default_rng(seed)
  raw = rng.lognormal(0.0, 1.0, n)
  for _ in range(20):  # rescale to the mean, cap at 3x, repeat until both hold
    raw = np.minimum(raw / raw.mean() * mean, 3 * mean)
  lengths = np.maximum(np.round(raw), 1).astype(int)
  prompts = [rng.integers(2, vocab, int(rng.integers(16, 33))).astype(np.int32) for _ in range(n)]
  return prompts, lengths


def make_static_generate(graphdef, slots: int, cache_len: int):
  """Jitted dense static-batch generation: prefill [S, P] prompts, then `steps` decode steps for every row."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from areal_jax.models.modules import dense_attention, gqa_attention
  from areal_jax.sampler.sampling import sample

  @jax.jit
  def run(params, prompts, lengths, keys, steps):
    model = nnx.merge(graphdef, params)
    s, p = prompts.shape
    rows = jnp.arange(s)
    ones, off = jnp.ones(s), -jnp.ones(s, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(p), (s, p))
    attend = dense_attention((pos < lengths[:, None]).astype(jnp.int32))
    h, kv = model.run_layers(model.embed_tokens(prompts), pos, lambda i, q, k, v: (attend(q, k, v)[0], (k, v)))
    pad = lambda x: jnp.zeros((s, cache_len) + x.shape[2:], x.dtype).at[:, :p].set(x)
    cache = [(pad(k), pad(v)) for k, v in kv]
    tok, _ = sample(model.logits(h[rows, lengths - 1]), keys, jnp.zeros(s, jnp.int32), ones, ones, off)
    out = jnp.zeros((s, cache_len), jnp.int32)

    def body(i, carry):
      tok, cache, out = carry
      at = lengths + i
      visible = (jnp.arange(cache_len)[None, :] <= at[:, None])[:, None, :]

      def att(layer, q, k, v):
        ck = cache[layer][0].at[rows, at].set(k[:, 0])
        cv = cache[layer][1].at[rows, at].set(v[:, 0])
        return gqa_attention(q, ck, cv, visible), (ck, cv)

      h, cache = model.run_layers(model.embed_tokens(tok[:, None]), at[:, None], att)
      nxt, _ = sample(model.logits(h[:, 0]), keys, jnp.full(s, i + 1), ones, ones, off)
      return nxt, cache, out.at[:, i].set(tok)

    _, _, out = jax.lax.fori_loop(0, steps, body, (tok, cache, out))
    return out

  return run


def measure_bandwidth(device) -> float:
  """Bytes/s of reading a 256 MiB float32 array once (a jitted sum), best of 5."""
  import jax
  import jax.numpy as jnp

  x = jax.device_put(jnp.ones((64 << 20,), jnp.float32), device)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  best = float("inf")
  for _ in range(5):
    t = time.perf_counter()
    total(x).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return x.nbytes / best


def main():
  args = parse_args()
  import jax
  import numpy as np
  from flax import nnx

  from areal_jax.models import ModelConfig, create
  from areal_jax.sampler import Engine, Request, SamplerConfig, SamplingParams, Scheduler
  from areal_jax.sampler.sampling import request_key

  path = pathlib.Path(__file__).resolve().parent.parent / "configs" / "math.py"
  spec = importlib.util.spec_from_file_location("math_config", path)
  config_module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(config_module)
  model_cfg = ModelConfig.from_config(config_module.get_config("tiny").model)
  model = nnx.jit(lambda: create(model_cfg, seed=args.seed))()
  prompts, lengths = workload(args.requests, args.mean_len, model_cfg.vocab_size, args.seed)
  total = int(lengths.sum())
  max_prompt = max(map(len, prompts))
  max_seq_len = max_prompt + 3 * args.mean_len
  s = args.slots
  print(f"model: {model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}, "
        f"{sum(x.size for x in jax.tree.leaves(nnx.state(model))) / 1e6:.1f}M params; {jax.devices()[0].platform}")
  print(f"workload: {args.requests} answers, mean {lengths.mean():.1f} / max {lengths.max()} tokens "
        f"({lengths.max() / lengths.mean():.2f}x the mean), {s} slots")

  # --- engine ---
  cfg = SamplerConfig(num_slots=s, page_size=args.page_size, max_seq_len=max_seq_len, max_new_tokens=3 * args.mean_len,
                      num_pages=s * -(-max_seq_len // args.page_size) + 1, max_prefill_tokens=4096)
  engine = Engine(model=model, config=cfg)
  params = engine.load_params(model)

  def run_engine(items):
    sched = Scheduler(engine=engine, params=params)
    sched.state = engine.warmup(params, sched.state, max_context=max_prompt)
    for g, (p, n) in enumerate(items):
      sched.submit(Request(group_id=g, prompt_ids=p, sampling=SamplingParams(max_new_tokens=int(n), seed=args.seed)))
    jax.block_until_ready(sched.state)
    done, t = 0, time.perf_counter()
    while not sched.idle:
      done += sum(len(x.tokens) for x in sched.step())
    jax.block_until_ready(sched.state)
    return done, time.perf_counter() - t, sched

  run_engine([(p, 2) for p in prompts[:s]])  # compiles

  # --- static batches ---
  graphdef, _ = nnx.split(model)
  static = make_static_generate(graphdef, s, cache_len=32 + 3 * args.mean_len)

  def static_batch(i, steps=None):
    batch = list(range(i, min(i + s, args.requests)))
    toks = np.zeros((s, 32), np.int32)
    lens = np.ones(s, np.int32)
    keys = np.zeros((s, 2), np.uint32)
    for row, j in enumerate(batch):
      toks[row, :len(prompts[j])], lens[row], keys[row] = prompts[j], len(prompts[j]), request_key(args.seed, j, 0)
    steps = int(max(lengths[j] for j in batch)) if steps is None else steps
    return static(params, toks, lens, keys, steps)

  static_batch(0, steps=2).block_until_ready()  # compile

  def run_static():
    t = time.perf_counter()
    for i in range(0, args.requests, s):
      static_batch(i).block_until_ready()
    return time.perf_counter() - t

  # Alternate the variants so that a change in machine load does not favour one; keep each one's best time.
  engine_s = static_s = float("inf")
  for _ in range(args.repeats):
    engine_tokens, seconds, sched = run_engine(list(zip(prompts, lengths)))
    assert engine_tokens == total, (engine_tokens, total)
    engine_s = min(engine_s, seconds)
    static_s = min(static_s, run_static())

  # --- roofline ---
  bandwidth = measure_bandwidth(jax.devices()[0])
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  kv_per_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * 4
  steps = sched.counters["decode_steps"]
  live_tokens = sched.counters["tokens"]  # sequence-steps decoded; each reads its cached keys/values
  mean_context = np.mean([len(p) for p in prompts]) + lengths.mean() / 2
  roofline_s = (steps * param_bytes + live_tokens * mean_context * kv_per_token) / bandwidth
  engine_tps, static_tps = total / engine_s, total / static_s
  static_steps = sum(int(max(lengths[i:i + s])) for i in range(0, args.requests, s))
  print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s; params {param_bytes / 1e6:.1f} MB")
  print(f"engine: {steps} decode steps + {sched.counters['prefill_rows']} prefill rows; static: {static_steps} decode "
        f"steps + {-(-args.requests // s)} prefills of {s} rows")
  print(f"{'variant':<30}{'tokens':>9}{'seconds':>10}{'tokens/s':>11}")
  print(f"{'engine (paged, continuous)':<30}{total:>9}{engine_s:>10.2f}{engine_tps:>11.0f}")
  print(f"{'static batches (dense)':<30}{total:>9}{static_s:>10.2f}{static_tps:>11.0f}")
  print(f"ratio engine / static: {engine_tps / static_tps:.2f}x (ideal on this workload, equal step costs and free "
        f"admission: {static_steps * s / total:.2f}x)")
  print(f"engine at {roofline_s / engine_s:.1%} of the memory-bandwidth roofline "
        f"({total / roofline_s:.0f} tokens/s at {s} slots)")


if __name__ == "__main__":
  main()
