r"""Agents' episodes vs the same completions as plain sampler requests: what running agents behind the OpenAI client
and recording every answer costs.

`--episodes` concurrent episodes of a multi-turn chat agent (`--turns` answers each, `--max-tokens` per answer, EOS
ignored) run through `agents.EpisodeRunner` on a `LocalRollout` (the tiny preset's shape, random weights, the char
tokenizer; `--shape=100m` for a longer decode step). Two baselines do the same sampler work:
- the same agent, unrecorded: the same episodes through the same OpenAI client and routes, their requests without
  the episode tag, so nothing is recorded (what the recording itself adds);
- plain requests: exactly the recorded completions (the same prompt token ids, each answer its recorded length)
  replayed as `Rollout.submit` requests, the same episodes concurrently, each episode's turns in order (what the
  client, the routes and the recording add together).
Rounds alternate between the three after one untimed round of each, every sampler program compiled first; the best
round of each counts. Prints completions/s and tokens/s of each, the sampler's work in each (busy seconds, decode
calls, steps, prefill rows, tokens drawn) and both overheads. 1-3 minutes on a 2-core CPU (`--shape=100m`: 5-12):

    python tools/bench_agents.py [--episodes 64] [--turns 2] [--max-tokens 24] [--repeats 3] [--shape tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--episodes", type=int, default=64, help="episodes in flight at once")
  p.add_argument("--turns", type=int, default=2, help="chat completions per episode")
  p.add_argument("--max-tokens", type=int, default=24, help="tokens per answer (EOS ignored)")
  p.add_argument("--repeats", type=int, default=3, help="timed rounds of each, alternating; the best counts")
  p.add_argument("--decode-steps", type=int, default=8, help="sampler.decode_steps: decode steps per device call (an "
                 "answer arriving during a call waits for its end)")
  p.add_argument("--shape", choices=("tiny", "100m"), default="tiny", help="model shape (random weights), as in "
                 "bench_sampler.py: a longer decode step hides more of the per-request cost")
  return p.parse_args()


def make_agent(turns: int, max_tokens: int):
  async def agent(data, client):
    messages = [{"role": "user", "content": data["question"]}]
    for _ in range(turns):
      r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens,
                                               extra_body={"ignore_eos": True})
      messages += [{"role": "assistant", "content": r.choices[0].message.content},
                   {"role": "user", "content": "and again"}]
    return 1.0
  return agent


def main():
  args = parse_args()
  from areal_jax import agents  # pylint: disable=g-import-not-at-top  # first: it picks the backend before JAX loads
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from bench_sampler import model_config  # pylint: disable=g-import-not-at-top
  from areal_jax.models import create  # pylint: disable=g-import-not-at-top
  from areal_jax.distributed.replicas import LocalRollout  # pylint: disable=g-import-not-at-top
  from areal_jax.sampler.config import SamplerConfig  # pylint: disable=g-import-not-at-top
  from areal_jax.sampler.engine import Engine  # pylint: disable=g-import-not-at-top
  from areal_jax.sampler.requests import Request, SamplingParams  # pylint: disable=g-import-not-at-top
  from areal_jax.sharding import make_mesh  # pylint: disable=g-import-not-at-top
  from areal_jax.tokenizer import CharTokenizer  # pylint: disable=g-import-not-at-top

  model_cfg = model_config(args.shape)
  model = create(model_cfg, 0)
  tok = CharTokenizer()
  seq_len = min(model_cfg.max_position_embeddings, 256)
  cfg = SamplerConfig(num_slots=args.episodes, page_size=16, num_pages=args.episodes * seq_len // 16 + 1,
                      max_seq_len=seq_len, max_new_tokens=args.max_tokens, vocab_limit=tok.vocab_size,
                      decode_steps=args.decode_steps)
  mesh = make_mesh(jax.devices()[:1], {"data": 1, "tensor": 1})
  # Every prefill shape compiled first (on an engine of its own: same programs, its own cache): episodes' turns
  # arrive spread out, in prefill batches of many sizes, each a compile the first time it is seen.
  warm = Engine(model=nnx.eval_shape(lambda: model), config=cfg, mesh=mesh)
  warm.warmup(warm.load_params(nnx.state(model, nnx.Param)), warm.init_decode_state())
  del warm
  rollout = LocalRollout(abstract_model=nnx.eval_shape(lambda: model), config=cfg, params=nnx.state(model, nnx.Param),
                         meshes=[mesh], version=0, eos_ids=[tok.eos_id], detokenize=tok.decode)
  runner = agents.EpisodeRunner(
      agent=make_agent(args.turns, args.max_tokens), config=agents.AgentConfig(max_turns=args.turns),
      rollout=rollout, tokenizer=tok, sampling=SamplingParams(temperature=1.0, seed=0),
      limits={"max_seq_len": seq_len, "vocab_size": model_cfg.vocab_size}, version=lambda: 0)
  problems = [{"uid": str(i), "question": f"what is {i}+{i * 7 % 13}?"} for i in range(args.episodes)]
  group_ids = itertools.count()

  def episodes():
    futures = [runner.submit(p, group_id=i, index=0, min_version=0) for i, p in enumerate(problems)]
    results = [f.result() for f in futures]
    failed = [r.failure for r in results if r.failure]
    if failed:
      raise RuntimeError(f"{len(failed)} episodes failed, e.g. {failed[0]}")
    return [r.completions for r in results]

  async def unrecorded_all():  # the same agent and client, its requests without the episode tag: nothing recorded
    agent = make_agent(args.turns, args.max_tokens)

    async def one(problem):
      client = runner.client()
      try:
        await agent(problem, client)
      finally:
        await client.close()
    await asyncio.gather(*(one(p) for p in problems))

  async def replay_all(recorded):
    async def one(completions):
      for c in completions:
        [f] = rollout.submit(Request(group_id=next(group_ids), prompt_ids=c.prompt_ids, sampling=SamplingParams(
            temperature=1.0, max_new_tokens=len(c.tokens), ignore_eos=True, seed=0)))
        await asyncio.wrap_future(f)
    await asyncio.gather(*(one(cs) for cs in recorded))

  work = {}  # the best round's sampler work: seconds busy, decode calls, prefilled rows
  keys = ("busy_s", "decode_calls", "decode_steps", "prefill_rows", "tokens")

  def timed(fn, name=None):
    start, before = time.perf_counter(), rollout.stats()
    out = fn()
    seconds, after = time.perf_counter() - start, rollout.stats()
    if name is not None and seconds < best[name]:
      work[name] = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    return seconds, out

  try:
    best = {"episodes (recorded)": float("inf"), "same agent, unrecorded": float("inf"),
            "plain requests": float("inf")}
    _, recorded = timed(episodes)  # compiles
    timed(lambda: asyncio.run(unrecorded_all()))
    timed(lambda: asyncio.run(replay_all(recorded)))
    for _ in range(args.repeats):
      seconds, recorded = timed(episodes, "episodes (recorded)")
      best["episodes (recorded)"] = min(best["episodes (recorded)"], seconds)
      seconds, _ = timed(lambda: asyncio.run(unrecorded_all()), "same agent, unrecorded")
      best["same agent, unrecorded"] = min(best["same agent, unrecorded"], seconds)
      seconds, _ = timed(lambda: asyncio.run(replay_all(recorded)), "plain requests")
      best["plain requests"] = min(best["plain requests"], seconds)
  finally:
    runner.stop()
    rollout.stop()
  completions = sum(len(cs) for cs in recorded)
  tokens = sum(len(c.tokens) for cs in recorded for c in cs)
  print(f"{args.episodes} episodes in flight, {args.turns} turns each, {args.max_tokens} tokens per answer, "
        f"{args.shape} shape, {args.decode_steps} decode steps per call ({jax.devices()[0].platform}, best of "
        f"{args.repeats}):")
  for name, seconds in best.items():
    print(f"  {name:22s} {completions} completions, {tokens} tokens in {seconds:6.2f} s: "
          f"{completions / seconds:7.1f} completions/s, {tokens / seconds:8.1f} tokens/s; the sampler: busy "
          f"{work[name]['busy_s']:.2f} s, {work[name]['decode_calls']} decode calls of "
          f"{work[name]['decode_steps']} steps, {work[name]['prefill_rows']} prefill rows, "
          f"{work[name]['tokens']} tokens drawn")
  recording = best["episodes (recorded)"] / best["same agent, unrecorded"]
  ratio = best["episodes (recorded)"] / best["plain requests"]
  print(f"recording overhead: {100 * (recording - 1):+.1f}% time (episodes / the same agent unrecorded = "
        f"{recording:.3f})")
  print(f"agents' overhead (client, routes and recording): {100 * (ratio - 1):+.1f}% time (episodes / plain "
        f"requests = {ratio:.3f})")


if __name__ == "__main__":
  main()
