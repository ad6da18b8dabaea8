"""Packed training attention alone, forward + backward, side by side in one run: the block-skipping `flash` kernel
against the dense masked reference, on rows packed with long-tail sequences (and, on a GPU with rows up to 8192 tokens,
`jax.nn.dot_product_attention` with the packed mask as its boolean mask).

Prints, per variant, the time of one jitted forward + backward over the rows, the score pairs it needs (Σ L(L+1)/2
per segment) as achieved GFLOP/s of useful work, and the speed-up over dense. Runs on whatever JAX's default backend is:

    python tools/bench_attention.py --rows 2 --length 8192 --heads 12 --kv-heads 2 --dim 128
"""

from __future__ import annotations

import argparse
import statistics
import time


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", type=int, default=1)
  p.add_argument("--length", type=int, default=2048, help="tokens per packed row")
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--median", type=int, default=100, help="median sequence length (log-normal, sigma 1)")
  p.add_argument("--blocks", default="64,128,256", help="flash block sizes to time")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args()


def packing(rows: int, length: int, median: int, seed: int):
  """[rows, length] segment ids: log-normal sequence lengths packed back to back, the last one cut at the row end."""
  import numpy as np

  rng = np.random.default_rng(seed)
  seg = np.zeros((rows, length), np.int32)
  for r in range(rows):
    t, sid = 0, 1
    while t < length:
      n = int(np.clip(rng.lognormal(np.log(median), 1.0), 1, length - t))
      seg[r, t:t + n] = sid
      t, sid = t + n, sid + 1
  return seg


def main():
  args = parse_args()
  import jax
  import jax.numpy as jnp
  import numpy as np

  from areal_jax.models.modules import dense_attention, packed_mask
  from areal_jax.models.packed_attention import flash_attention

  seg_np = packing(args.rows, args.length, args.median, args.seed)
  seg = jnp.asarray(seg_np)
  dtype = jnp.dtype(args.dtype)
  rng = np.random.default_rng(args.seed)
  shape_q = (args.rows, args.length, args.heads, args.dim)
  shape_kv = (args.rows, args.length, args.kv_heads, args.dim)
  q, k, v = (jnp.asarray(rng.normal(size=s), dtype) for s in (shape_q, shape_kv, shape_kv))
  lengths = [np.bincount(r)[1:] for r in seg_np]
  pairs = sum(int((n * (n + 1) // 2).sum()) for n in lengths)
  useful = 4 * args.heads * args.dim * pairs * 3.5  # q.k and p.v forward (2 FLOPs each), backward ~2.5x forward

  variants = {"dense (query blocks x whole row)": lambda q, k, v, seg: dense_attention(seg)(q, k, v)[0]}
  for b in (int(x) for x in args.blocks.split(",")):
    variants[f"flash, block {b}"] = lambda q, k, v, seg, b=b: flash_attention(q, k, v, seg, block=b)
  if jax.default_backend() == "gpu" and args.length <= 8192:  # it materialises [heads, T, T] float32 scores
    variants["jax.nn.dot_product_attention"] = (
        lambda q, k, v, seg: jax.nn.dot_product_attention(q, k, v, mask=packed_mask(seg)[:, None]))

  w = jnp.asarray(rng.normal(size=shape_q), dtype)
  loss = lambda f: lambda q, k, v, w, seg: (f(q, k, v, seg) * w).astype(jnp.float32).sum()
  step = {name: jax.jit(jax.value_and_grad(loss(f), (0, 1, 2))) for name, f in variants.items()}
  times = {name: [] for name in variants}
  for name, f in step.items():
    jax.block_until_ready(f(q, k, v, w, seg))  # compile
  for _ in range(args.repeats):  # interleaved: every variant sees the same machine load
    for name, f in step.items():
      t = time.perf_counter()
      jax.block_until_ready(f(q, k, v, w, seg))
      times[name].append(time.perf_counter() - t)
  print(f"{jax.devices()[0].device_kind} | {args.rows} rows x {args.length} tokens, {sum(map(len, lengths))} sequences "
        f"(median {int(np.median(np.concatenate(lengths)))}, max {max(int(n.max()) for n in lengths)}) | "
        f"{args.heads} heads / {args.kv_heads} KV heads x {args.dim} | {args.dtype}")
  dense_s = statistics.median(times[next(iter(times))])
  print(f"{'variant':<36}{'fwd+bwd ms':>12}{'useful GFLOP/s':>16}{'vs dense':>10}")
  for name, ts in times.items():
    s = statistics.median(ts)
    print(f"{name:<36}{s * 1e3:>12.2f}{useful / s / 1e9:>16.1f}{dense_s / s:>9.2f}x")


if __name__ == "__main__":
  main()
