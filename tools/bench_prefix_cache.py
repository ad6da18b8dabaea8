r"""The sampler's prefix cache (`sampler.prefix_cache`) on a multi-turn workload, side by side with it off.

`--episodes` episodes of `--turns` turns, as an agent's: every prompt starts with one `--system`-token system prompt,
then a question of `--question` tokens; a turn's answer is `--answer` tokens (EOS ignored) and the next turn's prompt
is the whole context so far + a `--tool`-token tool result. All episodes' turn k go to the `Scheduler` together; turn
k + 1 once they are all done. Random weights (`--shape`: the tiny preset's, or `100m`). Both engines draw the same
tokens (same PRNG keys, temperature 1; cached keys/values differ from prefilled ones by float rounding only).

Prints, per variant: seconds of the first round (compiles included: every prefill shape the workload meets), the
best of `--repeats` timed rounds after it (alternating between the variants), prefill rows, tokens prefilled and
tokens found in the cache, and the ratio. About a minute on a 2-core CPU (`--shape=100m`: 12):

    python tools/bench_prefix_cache.py [--episodes 64] [--turns 3] [--shape tiny]

`--replicas N` (N > 1) runs the workload through a `LocalRollout` of N engine replicas (one CPU device each), prefix
cache on, as agents run: every episode at once, each sending its next turn as soon as its answer is back, answers of
`--answer` x 0.5 to 1.5 tokens (drawn per turn, the same in both variants). Twice: each episode's turns tagged with
their episode (`Request.episode`: kept on the replica of the first) and untagged (each turn to the least loaded
replica, as before the tag). Prints, per variant, the share of prompt tokens found in the
cache (`sampler/replica{i}/prefix_hits`, overall and per replica), the tokens prefilled and the seconds (after an
untimed round of each, which compiles):

    python tools/bench_prefix_cache.py --replicas 2

The same comparison on the bundled calculator agent's own episodes (its OpenAI-client requests, its tool calls):
`tools/bench_agents.py --agent calculator`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--episodes", type=int, default=64, help="episodes, all in flight at once (one slot each)")
  p.add_argument("--turns", type=int, default=3)
  p.add_argument("--system", type=int, default=32, help="tokens of the system prompt every episode shares")
  p.add_argument("--question", type=int, default=8, help="tokens of each episode's own question")
  p.add_argument("--answer", type=int, default=40, help="tokens of every answer")
  p.add_argument("--tool", type=int, default=12, help="tokens of the tool result after each answer")
  p.add_argument("--shape", choices=("tiny", "100m"), default="tiny", help="model shape (random weights)")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--repeats", type=int, default=2, help="timed rounds per variant, alternating; the best counts")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--replicas", type=int, default=1, help="> 1: episodes kept on a replica vs scattered over them")
  return p.parse_args()


def workload(args, vocab: int):
  """(each episode's first prompt, the tool results [episode, turn, tokens], the longest sequence, the sampling)."""
  import numpy as np
  from areal_jax.sampler import SamplingParams

  rng = np.random.default_rng(args.seed)
  system = rng.integers(2, vocab, args.system)
  questions = [np.concatenate([system, rng.integers(2, vocab, args.question)]) for _ in range(args.episodes)]
  tools = rng.integers(2, vocab, (args.episodes, args.turns, args.tool))
  max_seq_len = args.system + args.question + args.turns * (args.answer + args.tool)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=args.answer, ignore_eos=True, seed=args.seed)
  return questions, tools, max_seq_len, sampling


def replicas_main(args):
  """Episodes kept on their replica vs scattered over `args.replicas` replicas: the prefix cache's hit rate."""
  import jax
  import numpy as np
  from flax import nnx

  from areal_jax.distributed.replicas import LocalRollout
  from areal_jax.models import create
  from areal_jax.sampler import Request, SamplerConfig
  from areal_jax.sharding import make_mesh
  from bench_sampler import model_config  # pylint: disable=g-import-not-at-top

  model_cfg = model_config(args.shape)
  model = nnx.jit(lambda: create(model_cfg, seed=args.seed))()
  questions, tools, _, sampling = workload(args, model_cfg.vocab_size)
  lengths = np.random.default_rng(args.seed + 1).integers(args.answer // 2, args.answer * 3 // 2 + 1,
                                                          (args.episodes, args.turns))
  max_seq_len = args.system + args.question + int(lengths.sum(1).max()) + args.turns * args.tool
  pages = -(-max_seq_len // args.page_size)
  cfg = SamplerConfig(num_slots=args.episodes, page_size=args.page_size, max_seq_len=max_seq_len,
                      max_new_tokens=int(lengths.max()), num_pages=2 * args.episodes * pages + 1, prefix_cache=True)
  meshes = [make_mesh(jax.devices()[i:i + 1], {"data": 1, "tensor": 1}) for i in range(args.replicas)]

  def run(kept: bool):
    """All episodes at once, each turn sent when the one before is back, on a fresh rollout (empty caches); returns
    (seconds, per replica (cached, prefilled))."""
    rollout = LocalRollout(abstract_model=nnx.eval_shape(lambda: model), config=cfg, meshes=meshes,
                           params=nnx.state(model, nnx.Param), version=0, eos_ids=[], detokenize=None)

    async def episode(e: int):
      context = questions[e].astype(np.int32)
      for turn in range(args.turns):
        sp = dataclasses.replace(sampling, max_new_tokens=int(lengths[e, turn]))
        [answer] = rollout.submit(Request(group_id=turn * args.episodes + e, prompt_ids=context, sampling=sp,
                                          episode=str(e) if kept else None))
        answer = (await asyncio.wrap_future(answer)).response_ids
        context = np.concatenate([context, answer, tools[e, turn]]).astype(np.int32)

    async def episodes():
      await asyncio.gather(*(episode(e) for e in range(args.episodes)))

    try:
      t = time.perf_counter()
      asyncio.run(episodes())
      seconds = time.perf_counter() - t
      stats = [r.sampler.stats() for r in rollout.replicas]
    finally:
      rollout.stop()
    return seconds, [(int(st["cached_tokens"]), int(st["prefill_tokens"])) for st in stats]

  print(f"workload: {args.episodes} episodes x {args.turns} turns over {args.replicas} replicas; prompt "
        f"{args.system}+{args.question} tokens, answers {args.answer}, tool results {args.tool}; page {args.page_size} "
        f"({jax.devices()[0].platform}, {args.shape} shape)")
  run(kept=False), run(kept=True)  # compiles every prefill shape either meets
  for name, kept in (("scattered (no episode)", False), ("kept (Request.episode)", True)):
    seconds, per = run(kept)
    cached, prefilled = sum(c for c, _ in per), sum(p for _, p in per)
    rates = ", ".join(f"{c / max(c + p, 1):.2f}" for c, p in per)
    print(f"  {name:24s} prefix hits {cached / max(cached + prefilled, 1):.3f} (per replica {rates}); "
          f"{cached} tokens cached, {prefilled} prefilled; {seconds:.2f} s")


def main():
  args = parse_args()
  if args.replicas > 1:
    import os
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.replicas}").strip()
    return replicas_main(args)
  import jax
  import numpy as np
  from flax import nnx

  from areal_jax.models import create
  from areal_jax.sampler import Engine, Request, SamplerConfig, Scheduler
  from bench_sampler import model_config  # pylint: disable=g-import-not-at-top

  model_cfg = model_config(args.shape)
  model = nnx.jit(lambda: create(model_cfg, seed=args.seed))()
  questions, tools, max_seq_len, sampling = workload(args, model_cfg.vocab_size)

  def make(prefix_cache: bool) -> Engine:
    pages = -(-max_seq_len // args.page_size)
    cfg = SamplerConfig(num_slots=args.episodes, page_size=args.page_size, max_seq_len=max_seq_len,
                        max_new_tokens=args.answer, num_pages=2 * args.episodes * pages + 1,
                        prefix_cache=prefix_cache)
    return Engine(model=model, config=cfg)

  engines = {"prefix cache off": make(False), "prefix cache on": make(True)}
  params = engines["prefix cache off"].load_params(model)

  def run(engine):
    """All turns of all episodes; returns (seconds, the scheduler, every answer's tokens)."""
    sched = Scheduler(engine=engine, params=params)
    contexts, answers = [q.astype(np.int32) for q in questions], []
    jax.block_until_ready(sched.state)
    t = time.perf_counter()
    for turn in range(args.turns):
      for e, ctx in enumerate(contexts):
        sched.submit(Request(group_id=turn * args.episodes + e, prompt_ids=ctx, sampling=sampling))
      done = {}
      while not sched.idle:
        done.update({s.request.group_id - turn * args.episodes: s.tokens for s in sched.step()})
      answers.append([done[e] for e in range(args.episodes)])
      contexts = [np.concatenate([ctx, done[e], tools[e, turn]]).astype(np.int32) for e, ctx in enumerate(contexts)]
    jax.block_until_ready(sched.state)
    return time.perf_counter() - t, sched, answers

  print(f"model: {model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}, "
        f"{sum(x.size for x in jax.tree.leaves(nnx.state(model))) / 1e6:.1f}M params; {jax.devices()[0].platform}")
  print(f"workload: {args.episodes} episodes x {args.turns} turns; prompt {args.system}+{args.question} tokens, "
        f"answers {args.answer}, tool results {args.tool}; up to {max_seq_len} tokens per sequence")
  first, best, scheds, tokens = {}, dict.fromkeys(engines, float("inf")), {}, {}
  for name, engine in engines.items():
    first[name], _, tokens[name] = run(engine)
  for _ in range(args.repeats):
    for name, engine in engines.items():
      t, scheds[name], _ = run(engine)
      best[name] = min(best[name], t)
  same = sum(a == b for x, y in zip(*tokens.values()) for a, b in zip(x, y))
  print(f"answers drawn alike by both: {same} of {args.episodes * args.turns}")
  print(f"{'variant':<20}{'first (compiles)':>18}{'best':>8}{'prefill rows':>14}{'prefilled':>11}{'cached':>9}")
  for name in engines:
    c = scheds[name].counters
    print(f"{name:<20}{first[name]:>17.2f}s{best[name]:>7.2f}s{c['prefill_rows']:>14}{c['prefill_tokens']:>11}"
          f"{c['cached_tokens']:>9}")
  off, on = best["prefix cache off"], best["prefix cache on"]
  print(f"ratio off / on (best rounds): {off / on:.2f}x; first rounds: "
        f"{first['prefix cache off'] / first['prefix cache on']:.2f}x")


if __name__ == "__main__":
  main()
