r"""The same policy and prompts through JetStream's own gRPC server (`tools/serve.py --api=jetstream`: JetStream's
Driver over this project's engine, one token per slot per device call) and through `tools/serve.py` (this project's
OpenAI-compatible server: its scheduler, `--decode-steps` tokens per call), side by side in one run, in the manner of
JetStream's `benchmark_serving.py`: `--requests` greedy completions of `--max-tokens` tokens, `--concurrency` in
flight, token-id prompts of 8-32 tokens, JetStream driven by its own `jetstream_pb2_grpc` stub and the OpenAI server
by the `openai` client. Both servers run in this process on one CPU device with the same engine sizes; each gets an
untimed round first (compiles), then the timed rounds alternate and the best counts. Both stop an answer at the
tokenizer's EOS, JetStream also at its pad id, so the table reports the tokens each produced.

Needs JetStream (the README's test command installs 0.2.2). About a minute on a 2-core CPU with the tiny default:

    python tools/bench_serving.py [--requests 128] [--concurrency 32] [--max-tokens 48] [--repeats 2]
    python tools/bench_serving.py --checkpoint_dir=/tmp/areal_tiny   # a run's policy, the run's tokenizer
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import socket
import tempfile
import time


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--checkpoint_dir", default="", help="what tools/serve.py serves (default: the tiny preset's "
                 "shape with random weights and the char tokenizer)")
  p.add_argument("--tokenizer", default="", help="tokenizer spec (default: the checkpoint's, else char)")
  p.add_argument("--requests", type=int, default=128)
  p.add_argument("--concurrency", type=int, default=32)
  p.add_argument("--max-tokens", type=int, default=48)
  p.add_argument("--slots", type=int, default=32, help="decode slots of each server")
  p.add_argument("--decode-steps", type=int, default=8, help="the OpenAI server's decode steps per device call")
  p.add_argument("--repeats", type=int, default=2, help="timed rounds of each, alternating; the best counts")
  return p.parse_args()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _timed(fn, prompts, concurrency: int) -> tuple[float, int]:
  """(seconds, tokens produced) for `fn(prompt) -> tokens` over every prompt, `concurrency` at a time."""
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    tokens = sum(pool.map(fn, prompts))
  return time.perf_counter() - start, tokens


def main():
  args = parse_args()
  from areal_jax import serve  # pylint: disable=g-import-not-at-top  # first: it picks the backend before JAX loads
  import grpc  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import openai  # pylint: disable=g-import-not-at-top

  from areal_jax.serve import jetstream  # pylint: disable=g-import-not-at-top
  jetstream.import_jetstream()
  from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # pylint: disable=g-import-not-at-top

  checkpoint, tokenizer = args.checkpoint_dir, args.tokenizer
  if not checkpoint:
    from areal_jax.config import load_config  # pylint: disable=g-import-not-at-top
    from areal_jax.models import create, orbax_io  # pylint: disable=g-import-not-at-top
    from areal_jax.models.config import ModelConfig  # pylint: disable=g-import-not-at-top
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = ModelConfig.from_config(load_config(os.path.join(root, "configs/math.py:tiny")).model)
    checkpoint = os.path.join(tempfile.mkdtemp(prefix="bench_serving_"), "policy")
    orbax_io.save_orbax(create(cfg, 0), checkpoint)
    tokenizer = tokenizer or "char"
  tokenizer = tokenizer or None
  sizes = dict(num_slots=args.slots, page_size=16, max_seq_len=128, devices=jax.devices()[:1])
  vocab = serve.policy.describe(checkpoint).model_cfg.vocab_size
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(2, min(vocab, 60), size=int(rng.integers(8, 33)))]
             for _ in range(args.requests)]

  ours = serve.build(checkpoint, tokenizer=tokenizer, port=_free_port(), max_queue=args.requests,
                     decode_steps=args.decode_steps, **sizes).start()
  client = openai.OpenAI(base_url=f"http://127.0.0.1:{ours.port}/v1", api_key="unused", max_retries=0)
  model = client.models.list().data[0].id

  def ask_ours(prompt) -> int:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0)
    return r.usage.completion_tokens

  js_port = _free_port()
  theirs = jetstream.build(checkpoint, tokenizer=tokenizer, port=js_port, **sizes)
  channel = grpc.insecure_channel(f"localhost:{js_port}")
  stub = jetstream_pb2_grpc.OrchestratorStub(channel)

  def ask_theirs(prompt) -> int:
    request = jetstream_pb2.DecodeRequest(token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=prompt),
                                          max_tokens=args.max_tokens)
    return sum(len(r.stream_content.samples[0].token_ids) for r in stub.Decode(request))

  runs = {"JetStream 0.2.2 server (Driver + engine)": ask_theirs, "tools/serve.py (scheduler + engine)": ask_ours}
  best = {}
  try:
    for name, fn in runs.items():  # untimed: compiles
      _timed(fn, prompts[:args.concurrency], args.concurrency)
    for _ in range(args.repeats):
      for name, fn in runs.items():
        seconds, tokens = _timed(fn, prompts, args.concurrency)
        if name not in best or seconds < best[name][0]:
          best[name] = (seconds, tokens)
  finally:
    channel.close()
    theirs.stop()
    ours.stop()
  print(f"{args.requests} requests, {args.concurrency} in flight, up to {args.max_tokens} tokens, {args.slots} slots, "
        f"best of {args.repeats}")
  print("| server | seconds | requests/s | tokens | tokens/s |\n|---|---|---|---|---|")
  for name, (seconds, tokens) in best.items():
    print(f"| {name} | {seconds:.2f} | {args.requests / seconds:.1f} | {tokens} | {tokens / seconds:.0f} |")


if __name__ == "__main__":
  main()
