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

`--agent calculator` measures instead what keeping an episode's turns on one sampler replica does for the prefix
cache, on the bundled calculator agent (`agents/calculator.py`) and its task (products of two-digit numbers):
`--episodes` episodes at once through `EpisodeRunner` on a `LocalRollout` of `--replicas` engine replicas (one CPU
device each), `sampler.prefix_cache` on, greedy, configs/agent.py:fast's model shape. Its policy is the random init
warm-started as a run warm-starts (`rl.warmstart.sft` on `agents.demonstration_episodes`, `--warm-steps` steps) on the
calculator's demonstrations of these very problems, every one calling the tool: its episodes call `calc` and answer
from the result in a second turn that extends the first. `--policy-dir` keeps it for the next run. The episodes run
twice, each time on fresh replicas (empty caches): with the tag dropped on the way to the rollout (each turn to the
least loaded replica, as before the tag; the same agent, client, routes and recording otherwise), then with each
request tagged with its episode as the runner tags it (`Request.episode`: every turn on the replica of the first).
Prints, per variant, the turns, tool calls and solved episodes, how many episodes' turns all landed on one replica
(from `sampler/replica{i}/answers`), and the share of prompt tokens found in the cache (`sampler/replica{i}/
prefix_hits`, overall and per replica). About 2 minutes on a 2-core CPU, 1 with the policy kept:

    python tools/bench_agents.py --agent calculator --replicas 2 [--policy-dir /tmp/calculator_policy]

`--agent calculator --speculation` instead runs the same policy's episodes with `sampler.speculation` off and
`suffix` (`--spec-tokens` drafts, from the rollouts drawn so far: `sampler/drafts.py`) side by side, submitted as a
run submits them: `--group` episodes of each of the `--episodes` problems at once (`--episodes` slots per replica),
tagged, at temperature 1.0 (the run's sampling), for `--epochs` epochs (an epoch once the last one's episodes are
done). Each round runs on fresh replicas (empty caches and draft histories); one untimed round of each variant first
compiles what the rounds run, then `--repeats` rounds alternate, the best counting. Each replica's drafter thus
sees what a run's would of the episodes on it: the group's finished answers and an earlier epoch's to the same
first-turn prompt, other recent answers, and in a second turn's prompt the first turn's text (the question, the call,
the tool's result).
Per variant, `calculator speculation=<off|suffix>: tokens N, seconds S, tokens/s R, decode calls C, tokens per
slot-forward F` (tokens: the episodes' answers; F: `spec_tokens / spec_forwards`, 1 without speculation) and with it
the slot-forwards and the share that carried a draft, the drafts verified and accepted, the acceptance overall and by
draft position, and accepted per slot-forward by position, as `bench_sampler.py --speculation` prints them (its
`spec_figures`); then the episodes (turns, tool calls, solved), the acceptance by epoch, and `calculator ratio suffix /
off tokens/s`. Answers differ between the variants (verification draws from other keys), so each counts its own.
11-13 minutes on a 2-core CPU shared with other jobs (load 4-7), 1-2 of them the warm-start (`--policy-dir` keeps
it):

    python tools/bench_agents.py --agent calculator --speculation [--group 4 --epochs 2] [--policy-dir /tmp/p]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import itertools
import os
import threading
import time

import numpy as np


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--episodes", type=int, default=64, help="episodes in flight at once")
  p.add_argument("--turns", type=int, default=2, help="chat completions per episode")
  p.add_argument("--max-tokens", type=int, default=24, help="tokens per answer (EOS ignored)")
  p.add_argument("--repeats", type=int, default=3, help="timed rounds of each, alternating; the best counts")
  p.add_argument("--decode-steps", type=int, default=8, help="sampler.decode_steps: decode steps per device call (an "
                 "answer arriving during a call waits for its end)")
  p.add_argument("--shape", choices=("tiny", "100m", "fast"), default=None, help="model shape (random weights), as "
                 "in bench_sampler.py: a longer decode step hides more of the per-request cost; fast: configs/agent.py"
                 ":fast's (hidden 64, 2 layers). Default: tiny, and fast for the calculator (its warm-start is ~15x "
                 "cheaper; the cache's hits do not depend on the width)")
  p.add_argument("--agent", choices=("chat", "calculator"), default="chat", help="chat: the overheads above; "
                 "calculator: the prefix cache's hits with an episode's turns kept on one replica vs scattered")
  p.add_argument("--replicas", type=int, default=2, help="calculator: sampler engine replicas (one CPU device each)")
  p.add_argument("--warm-steps", type=int, default=600, help="calculator: warm-start steps of the policy (600: "
                 "every episode calls the tool with the right operands and answers right)")
  p.add_argument("--policy-dir", default="", help="calculator: keep the warm-started policy here (under a key of what "
                 "decides it) and load it from here next time; empty: warm-start every run")
  p.add_argument("--page-size", type=int, default=16, help="calculator: tokens per KV page (the cache's unit)")
  p.add_argument("--seed", type=int, default=0, help="calculator: the problems' and the warm-start's seed")
  p.add_argument("--speculation", action="store_true", help="calculator: instead, sampler.speculation off vs suffix "
                 "on the same episodes (see the module docstring)")
  p.add_argument("--spec-tokens", type=int, default=4, help="--speculation: sampler.spec_tokens")
  p.add_argument("--group", type=int, default=4, help="--speculation: episodes of each problem at once (a run's group)")
  p.add_argument("--epochs", type=int, default=2, help="--speculation: passes over the same problems")
  args = p.parse_args()
  if args.shape is None:
    args.shape = "fast" if args.agent == "calculator" else "tiny"
  if args.speculation and args.agent != "calculator":
    p.error("--speculation runs the calculator agent's episodes: add --agent calculator")
  if args.agent == "calculator" and args.replicas < 2 and not args.speculation:
    p.error(f"--replicas={args.replicas}: the calculator mode compares dispatch over >= 2 replicas")
  return args


def shape_config(shape: str):
  """The model config of `shape`: bench_sampler.py's (`tiny`, `100m`), or configs/agent.py:fast's model (`fast`)."""
  from bench_sampler import model_config  # pylint: disable=g-import-not-at-top
  from areal_jax.config import load_config  # pylint: disable=g-import-not-at-top
  from areal_jax.models import ModelConfig  # pylint: disable=g-import-not-at-top

  if shape != "fast":
    return model_config(shape)
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "agent.py")
  return ModelConfig.from_config(load_config(f"{path}:fast").model)


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
  if args.agent == "calculator":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.replicas}").strip()
    return calculator_speculation_main(args) if args.speculation else calculator_main(args)
  from areal_jax import agents  # pylint: disable=g-import-not-at-top  # first: it picks the backend before JAX loads
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from areal_jax.models import create  # pylint: disable=g-import-not-at-top
  from areal_jax.distributed.replicas import LocalRollout  # pylint: disable=g-import-not-at-top
  from areal_jax.sampler.config import SamplerConfig  # pylint: disable=g-import-not-at-top
  from areal_jax.sampler.engine import Engine  # pylint: disable=g-import-not-at-top
  from areal_jax.sampler.requests import Request, SamplingParams  # pylint: disable=g-import-not-at-top
  from areal_jax.sharding import make_mesh  # pylint: disable=g-import-not-at-top
  from areal_jax.tokenizer import CharTokenizer  # pylint: disable=g-import-not-at-top

  model_cfg = shape_config(args.shape)
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

# The calculator's episodes as configs/agent.py runs them: answers of at most 80 tokens, sequences of at most 224.
CALC_MAX_TOKENS, CALC_SEQ_LEN = 80, 224


class Routed:
  """The rollout as the runner sees it: each request goes on with its episode tag (`keep_tag`) or without it, and
  `landed` notes where it went ((episode, replica) per request, read from `sampler/replica{i}/answers`). Everything
  else is the rollout's."""

  def __init__(self, rollout, *, keep_tag: bool):
    self.rollout, self.keep_tag = rollout, keep_tag
    self.landed: list[tuple[str, int]] = []
    self._lock = threading.Lock()  # one submit at a time, so the answers counter that moved is this request's

  def submit(self, request):
    with self._lock:
      before = self._answers()
      futures = self.rollout.submit(request if self.keep_tag else dataclasses.replace(request, episode=None))
      [replica] = [i for i, (a, b) in enumerate(zip(before, self._answers())) if b > a]
      self.landed.append((request.episode, replica))
    return futures

  def _answers(self) -> list[float]:
    metrics = self.rollout.sampler_metrics()
    return [metrics[f"sampler/replica{i}/answers"] for i in range(len(self.rollout.replicas))]

  def __getattr__(self, name):
    return getattr(self.rollout, name)


def calculator_policy(args, model_cfg, problems, tok):
  """(the policy's parameters, how it was made): the random init warm-started as a run's warm-start trains
  (`rl.warmstart.sft` on `agents.demonstration_episodes`, turns merged) on the calculator's demonstrations of
  `problems`, every one calling the tool. Kept in `args.policy_dir` under a key of everything that decides it."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from areal_jax import agents  # pylint: disable=g-import-not-at-top
  from areal_jax.agents.calculator import Calculator  # pylint: disable=g-import-not-at-top
  from areal_jax.learner.config import LearnerConfig  # pylint: disable=g-import-not-at-top
  from areal_jax.learner.step import build_step, make_learner_mesh  # pylint: disable=g-import-not-at-top
  from areal_jax.models import orbax_io  # pylint: disable=g-import-not-at-top
  from areal_jax.rl import warmstart  # pylint: disable=g-import-not-at-top

  lr, batch_size, max_tokens = 2e-3, 16, 1024
  decides = (model_cfg, [p["question"] for p in problems], args.warm_steps, lr, batch_size, max_tokens, args.seed)
  where = None
  if args.policy_dir:
    where = os.path.join(args.policy_dir, "calculator-" + hashlib.sha256(repr(decides).encode()).hexdigest()[:16])
    if os.path.exists(os.path.join(where, "model_config.json")):
      return nnx.state(orbax_io.load_orbax(where), nnx.Param), f"the warm-start kept in {where}"
  demos = [Calculator(demo_tool_share=1.0).demonstration(p) for p in problems]
  examples = agents.demonstration_episodes(demos, tok, max_response_len=CALC_MAX_TOKENS)
  fns = build_step(model_cfg, LearnerConfig(max_tokens_per_mb=max_tokens, min_bucket=64),
                   make_learner_mesh(jax.devices()[:1]))
  start = time.perf_counter()
  params, loss, steps = warmstart.sft(fns, fns.init_params(args.seed), examples, steps=args.warm_steps,
                                      batch_size=min(batch_size, len(examples)), lr=lr, max_tokens=max_tokens,
                                      seed=args.seed, accumulate=True)
  made = (f"warm-started {steps} steps on the episodes' demonstrations (loss {loss:.3f}, "
          f"{time.perf_counter() - start:.0f} s)")
  if where is not None:
    orbax_io.save_orbax(nnx.merge(fns.graphdef, params), where)
  return params, made


class CalculatorTask:
  """What the calculator's comparisons share: its `--episodes` problems, the policy warm-started on them
  (`calculator_policy`), the sampler's settings (configs/agent.py's lengths, the prefix cache on) and one CPU device
  per replica."""

  def __init__(self, args):
    import jax  # pylint: disable=g-import-not-at-top
    from flax import nnx  # pylint: disable=g-import-not-at-top

    from areal_jax.data import synthetic  # pylint: disable=g-import-not-at-top
    from areal_jax.models import create  # pylint: disable=g-import-not-at-top
    from areal_jax.sampler.config import SamplerConfig  # pylint: disable=g-import-not-at-top
    from areal_jax.sharding import make_mesh  # pylint: disable=g-import-not-at-top
    from areal_jax.tokenizer import CharTokenizer  # pylint: disable=g-import-not-at-top

    self.args, self.model_cfg, self.tok = args, shape_config(args.shape), CharTokenizer()
    self.problems = [{"uid": p.uid, "question": p.question, "reference": p.reference, "kind": p.kind,
                      "solution": p.solution, "prompt": ""}
                     for p in synthetic.generate(args.episodes, difficulty=1, seed=args.seed, task="products",
                                                 distinct=True)]
    self.params, self.made = calculator_policy(args, self.model_cfg, self.problems, self.tok)
    pages = -(-CALC_SEQ_LEN // args.page_size)
    self.cfg = SamplerConfig(num_slots=args.episodes, page_size=args.page_size,
                             num_pages=2 * args.episodes * pages + 1, max_seq_len=CALC_SEQ_LEN,
                             max_new_tokens=CALC_MAX_TOKENS, vocab_limit=self.tok.vocab_size,
                             decode_steps=args.decode_steps, prefix_cache=True)
    self.meshes = [make_mesh(jax.devices()[i:i + 1], {"data": 1, "tensor": 1}) for i in range(args.replicas)]
    self.abstract_model = nnx.eval_shape(lambda: create(self.model_cfg, 0))

  def rollout(self, **changes):
    """Fresh replicas (empty caches and draft histories), the sampler's settings with `changes`."""
    from areal_jax.distributed.replicas import LocalRollout  # pylint: disable=g-import-not-at-top

    return LocalRollout(abstract_model=self.abstract_model, config=dataclasses.replace(self.cfg, **changes),
                        meshes=self.meshes, params=self.params, version=0, eos_ids=[self.tok.eos_id],
                        detokenize=self.tok.decode)

  def runner(self, rollout, *, temperature: float):
    """The calculator agent's `EpisodeRunner` on `rollout`, sampling at `temperature`."""
    from areal_jax import agents  # pylint: disable=g-import-not-at-top
    from areal_jax.agents.calculator import Calculator  # pylint: disable=g-import-not-at-top
    from areal_jax.sampler.requests import SamplingParams  # pylint: disable=g-import-not-at-top

    return agents.EpisodeRunner(
        agent=Calculator(max_tokens=CALC_MAX_TOKENS).run, config=agents.AgentConfig(max_turns=4, timeout_s=600),
        rollout=rollout, tokenizer=self.tok, sampling=SamplingParams(temperature=temperature, seed=self.args.seed),
        limits={"max_seq_len": CALC_SEQ_LEN, "vocab_size": self.model_cfg.vocab_size}, version=lambda: 0)

  def episodes(self, runner, *, group: int = 1, first_group: int = 0) -> list:
    """`group` episodes of every problem at once (group ids from `first_group`): their `EpisodeResult`s."""
    futures = [runner.submit(p, group_id=first_group + i, index=j, min_version=0)
               for i, p in enumerate(self.problems) for j in range(group)]
    return [f.result() for f in futures]


def episodes_line(results) -> str:
  """`N episodes: T turns, M episodes of 2 or more, C tool calls, S solved, F failed` (calls the tool ran)."""
  from areal_jax.serve import tool_calls  # pylint: disable=g-import-not-at-top

  calls = sum(len(tool_calls.parse(c.text)[1] or ()) for r in results for c in r.completions[:-1])  # run by it
  return (f"{len(results)} episodes: {sum(r.turns for r in results)} turns, "
          f"{sum(r.turns >= 2 for r in results)} episodes of 2 or more, {calls} tool calls, "
          f"{sum(r.reward == 1.0 for r in results)} solved, {sum(bool(r.failure) for r in results)} failed")


def calculator_main(args):
  """The calculator agent's episodes on `args.replicas` replicas, each episode's turns kept on one replica vs
  scattered over them: the prefix cache's hits (see the module docstring)."""
  from areal_jax import agents  # pylint: disable=g-import-not-at-top,unused-import  # first: it picks the backend
  import jax  # pylint: disable=g-import-not-at-top

  task = CalculatorTask(args)

  def run(keep_tag: bool):
    """Every episode at once on fresh replicas (empty caches): (results, where each request landed, per replica
    (tokens cached, prefilled), the rollout's sampler metrics)."""
    rollout = task.rollout()
    routed = Routed(rollout, keep_tag=keep_tag)
    runner = task.runner(routed, temperature=0.0)
    try:
      results = task.episodes(runner)
    finally:
      runner.stop()
      rollout.stop()  # after its last step: every counter is in
    stats = [r.sampler.stats() for r in rollout.replicas]
    per = [(int(st["cached_tokens"]), int(st["prefill_tokens"])) for st in stats]
    return results, routed.landed, per, rollout.sampler_metrics()

  print(f"calculator agent: {args.episodes} episodes at once over {args.replicas} replicas, prefix cache on, page "
        f"{args.page_size}, greedy; the policy: {task.made} ({jax.devices()[0].platform}, {args.shape} shape)")
  drawn = {}
  for name, keep_tag in (("scattered (no episode)", False), ("kept (Request.episode)", True)):
    results, landed, per, metrics = run(keep_tag)
    cached, prefilled = sum(c for c, _ in per), sum(p for _, p in per)
    rates = ", ".join(f"{metrics[f'sampler/replica{i}/prefix_hits']:.2f}" for i in range(args.replicas))
    where = {}
    for episode, replica in landed:
      where.setdefault(episode, set()).add(replica)
    failed = [r.failure for r in results if r.failure]
    print(f"  {name:24s} prefix hits {cached / max(cached + prefilled, 1):.3f} (per replica {rates}); {cached} tokens "
          f"cached, {prefilled} prefilled")
    print(f"  {'':24s} {episodes_line(results)}; {sum(len(w) == 1 for w in where.values())} episodes' turns all on "
          "one replica")
    if failed:
      print(f"  {'':24s} e.g. {failed[0]}")
    drawn[name] = [[c.tokens.tolist() for c in r.completions] for r in results]
  scattered, kept = drawn.values()
  same = sum(a == b for x, y in zip(scattered, kept) for a, b in zip(x, y))
  print(f"answers drawn alike by both: {same} of {sum(len(x) for x in kept)}")


def spec_counts(rollout) -> tuple[dict, object, object]:
  """The rollout's schedulers' counters summed over its replicas, and with speculation the drafts verified and
  accepted by draft position (`spec_drafted_at`, `spec_accepted_at`; else None)."""
  scheds = [r.sampler.scheduler for r in rollout.replicas]
  counters = {k: sum(s.counters[k] for s in scheds) for k in scheds[0].counters}
  if scheds[0].drafter is None:
    return counters, None, None
  return counters, sum(s.spec_drafted_at for s in scheds), sum(s.spec_accepted_at for s in scheds)


def calculator_speculation_main(args):
  """The calculator agent's episodes with `sampler.speculation` off and `suffix` side by side (see the module
  docstring)."""
  from areal_jax import agents  # pylint: disable=g-import-not-at-top,unused-import  # first: it picks the backend
  import jax  # pylint: disable=g-import-not-at-top
  from bench_sampler import best_rounds, by_epoch_line, spec_figures  # pylint: disable=g-import-not-at-top  # tools/

  task, variants = CalculatorTask(args), ("off", "suffix")

  def run(v: str):
    """One round of every epoch on fresh replicas: (tokens, seconds, results, counters, drafted and accepted by
    position, (accepted, drafted) per epoch)."""
    rollout = task.rollout(speculation=v, spec_tokens=args.spec_tokens)
    runner = task.runner(rollout, temperature=1.0)
    results, by_epoch = [], []
    try:
      start = time.perf_counter()
      for epoch in range(args.epochs):  # an epoch's episodes once the last one's are done
        before = spec_counts(rollout)[0]
        results += task.episodes(runner, group=args.group, first_group=epoch * len(task.problems))
        after = spec_counts(rollout)[0]
        by_epoch.append(tuple(after.get(k, 0) - before.get(k, 0) for k in ("spec_accepted", "spec_drafted")))
      seconds = time.perf_counter() - start
    finally:
      runner.stop()
      rollout.stop()  # after its last step: every counter is in
    tokens = sum(len(c.tokens) for r in results for c in r.completions)
    return (tokens, seconds, results, *spec_counts(rollout), by_epoch)

  print(f"calculator agent, speculation off vs suffix: {args.episodes} problems x {args.group} episodes at once x "
        f"{args.epochs} epochs over {args.replicas} replicas, prefix cache on, temperature 1.0, spec_tokens "
        f"{args.spec_tokens}, decode_steps {args.decode_steps}, best of {args.repeats}; the policy: {task.made} "
        f"({jax.devices()[0].platform}, {args.shape} shape)", flush=True)
  best = best_rounds(run, variants, args.repeats)  # fresh replicas of the same settings share the programs
  rate = {}
  for v in variants:
    tokens, seconds, results, counters, drafted_at, accepted_at, by_epoch = best[v]
    rate[v] = tokens / seconds
    print(f"calculator speculation={v}: tokens {tokens}, seconds {seconds:.2f}, tokens/s {rate[v]:.0f}, decode calls "
          f"{counters['decode_calls']}" + spec_figures(counters, drafted_at, accepted_at))
    print(f"calculator speculation={v}: {episodes_line(results)}")
    if v != "off":
      print(by_epoch_line("calculator", v, by_epoch))
  print(f"calculator ratio suffix / off tokens/s: {rate['suffix'] / rate['off']:.2f}x")


if __name__ == "__main__":
  main()
