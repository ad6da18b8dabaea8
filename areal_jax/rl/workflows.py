"""Episode workflows: how one prompt item becomes a scored group, chosen by name with `rollout.workflow`.

    @workflows.register("mine")
    async def mine(sampler: GroupSampler, item: PromptRecord) -> Episodes:
      answers = sampler.generate(item.prompt_ids)            # G awaitable trajectories, drawn as the learner needs
      trajs = [t.replace(reward=(await sampler.verify(item, t.response_text, index=i)).reward)
               for i, t in enumerate(await asyncio.gather(*answers))]
      return Episodes(trajectories=tuple(trajs), rewards=tuple(t.reward for t in trajs))

The controller calls the workflow once per admitted group, on its loop, with a `GroupSampler`: the group's client to
the samplers (every request it makes is generated from the group's admission version or newer, so staleness counts
from there), the run's reward verifier, and what a multi-turn workflow needs to prompt a next turn. The workflow
returns `Episodes`: the trajectories to train on (the controller gives them the group's id), one reward per episode
(`reward/mean`), and, for multi-turn workflows, the completions of each episode (`agent/turns_mean`). A trajectory's
`loss_mask` leaves context it did not draw (feedback, tool output) out of the loss.

Bundled:

- `rlvr`: G answers to the prompt, each scored by the verifier as it finishes (single-turn math and code; the
  default without an agent);
- `agent`: G episodes of the agent at `agent.path` (`agents.EpisodeRunner`; the default with one);
- `multi_turn_math`: G episodes of up to `rollout.max_turns` answers: a wrong one gets the verifier's verdict as a
  new user turn and another try; the turns merge into one sequence whose loss covers the answers only
  (`agents.episodes`, as an agent's turns do), rewarded `rollout.turn_discount ** (turns - 1)` when the last is
  correct (AReaL's multi-turn math workflow).

`rollout.workflow` takes a registered name or a `module:function` path to an `async def` of the same shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import numpy as np

from areal_jax.agents.episodes import Completion, assign_rewards, to_trajectories
from areal_jax.async_thread import awaitable
from areal_jax.data import prompts
from areal_jax.data.records import PromptRecord
from areal_jax.errors import SamplerLost
from areal_jax.reward.service import RewardResult
from areal_jax.sampler.requests import Request, SamplingParams
from areal_jax.types import Trajectory

if TYPE_CHECKING:
  from areal_jax.agents.runner import EpisodeRunner
  from areal_jax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class Episodes:
  """A workflow's scored group."""

  trajectories: tuple[Trajectory, ...]
  rewards: tuple[float, ...]  # one per episode
  turns: tuple[int, ...] = ()  # completions per episode (multi-turn workflows)
  failures: int = 0  # episodes that failed and were scored 0 (`agent/episode_failures`)
  retokenized: int = 0  # turns whose history had to be re-encoded (`agent/retokenized_turns`)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Turns:
  """What a multi-turn workflow needs to prompt another turn: the tokenizer and `data.prompt_template` the prompts
  were rendered with, the longest prompt the sampler takes (`sampler.max_seq_len - 1`; None: no bound), and
  `rollout.max_turns` / `rollout.turn_discount`."""

  tokenizer: Tokenizer | None = None
  template: str = "plain"
  max_prompt_len: int | None = None
  max_turns: int = 2
  discount: float = 0.9


Workflow = Callable[["GroupSampler", PromptRecord], Awaitable[Episodes]]
WORKFLOWS: dict[str, Workflow] = {}


def register(name: str) -> Callable[[Workflow], Workflow]:
  def add(fn: Workflow) -> Workflow:
    WORKFLOWS[name] = fn
    return fn

  return add


def resolve(spec: str) -> Workflow:
  """The workflow `spec` names: a registered name or a `module:function` path. Raises ValueError naming it."""
  if ":" not in spec:
    if spec not in WORKFLOWS:
      raise ValueError(f"rollout.workflow={spec!r}: choose one of {sorted(WORKFLOWS)}, or give a module:function path")
    return WORKFLOWS[spec]
  module, _, name = spec.partition(":")
  try:
    fn = getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"rollout.workflow={spec!r}: cannot load it ({type(e).__name__}: {e})") from None
  if not inspect.iscoroutinefunction(fn):
    raise ValueError(f"rollout.workflow={spec!r}: must be an `async def episode(sampler, item)`, not {fn!r}")
  return fn


class GroupSampler:
  """One group's client: the samplers, the reward verifier, and the group's settings (see the module docstring)."""

  def __init__(self, *, rollout, rewards, group_id: int, group_size: int, min_version: int,
               sampling: SamplingParams, turns: Turns, agent: EpisodeRunner | None = None,
               on_reward_failure: Callable[[PromptRecord, int, RewardResult], None] = lambda item, index, r: None):
    self.group_id, self.group_size, self.min_version = group_id, group_size, min_version
    self.sampling, self.turns, self.agent = sampling, turns, agent
    self._rollout, self._rewards, self._on_reward_failure = rollout, rewards, on_reward_failure

  def generate(self, prompt_ids, *, num_answers: int | None = None, stream: int = 0,
               episode: int | None = None) -> list[Awaitable[Trajectory]]:
    """`num_answers` (default G) answers to `prompt_ids` under the run's sampling settings; each awaits to its
    `Trajectory` (or raises the sampler's error: `SamplerLost` has the group generated again). `stream` numbers
    the group's requests: 0 draws from the group's own random streams, and each other request a workflow makes
    takes a number of its own (not two in flight at once), so its draws are independent and reproducible.
    `episode` numbers the group's multi-turn series: the requests of one go to one sampler replica, whose prefix
    cache holds the turn before."""
    if not 0 <= stream < 1 << 19:
      raise ValueError(f"stream={stream}: must lie in [0, 2**19)")
    request = Request(group_id=self.group_id + (stream << 44), prompt_ids=np.asarray(prompt_ids, np.int32),
                      num_answers=num_answers or self.group_size, sampling=self.sampling,
                      min_version=self.min_version, episode=None if episode is None else f"{self.group_id}/{episode}")
    return [awaitable(f) for f in self._rollout.submit(request)]

  async def verify(self, item: PromptRecord, response: str, *, index: int = 0, turn: int = 0) -> RewardResult:
    """`response` scored against `item`'s reference by the run's reward workers (`item.kind`: math or code). A
    worker's failure scores 0 and is counted (`rollout/reward_failures`)."""
    r: RewardResult = await awaitable(
        self._rewards.submit((self.group_id, index, turn), item.kind, response, item.reference))
    if r.failure is not None and r.failure.of_worker:
      self._on_reward_failure(item, index, r)
    return r


def problem(record: PromptRecord) -> dict:
  """What an agent is handed for a prompt record."""
  return {"uid": record.uid, "question": record.question, "reference": record.reference, "kind": record.kind,
          "solution": record.solution, "prompt": record.prompt}


@register("rlvr")
async def rlvr(sampler: GroupSampler, item: PromptRecord) -> Episodes:
  """G answers to the prompt, each scored as soon as it is generated."""

  async def scored(index: int, answer: Awaitable[Trajectory]) -> Trajectory:
    traj = await answer
    return traj.replace(reward=float((await sampler.verify(item, traj.response_text, index=index)).reward))

  trajs = await asyncio.gather(*(scored(i, a) for i, a in enumerate(sampler.generate(item.prompt_ids))))
  return Episodes(trajectories=tuple(trajs), rewards=tuple(t.reward for t in trajs))


@register("agent")
async def agent(sampler: GroupSampler, item: PromptRecord) -> Episodes:
  """G episodes of the run's agent (`agent.path`) on the item's problem."""
  if sampler.agent is None:
    raise ValueError("rollout.workflow='agent': no agent to run (set agent.path)")
  results = await asyncio.gather(*(
      sampler.agent.episode(problem(item), group_id=sampler.group_id, index=i, min_version=sampler.min_version)
      for i in range(sampler.group_size)))
  if any(r.lost for r in results):
    raise SamplerLost(f"group {sampler.group_id}: a sampler was lost during its episodes")
  return Episodes(trajectories=tuple(t for r in results for t in r.trajectories),
                  rewards=tuple(r.reward for r in results), turns=tuple(r.turns for r in results),
                  failures=sum(r.failure is not None for r in results),
                  retokenized=sum(r.retokenized for r in results))


# The verifier's verdicts a follow-up turn repeats; any other reason (one that quotes the answer) reads "wrong answer".
_VERDICTS = ("wrong answer", "no answer found", "empty answer")


def feedback(reason: str) -> str:
  """The follow-up turn after an answer the verifier rejected for `reason` (lowercase: the tiny char vocabulary)."""
  verdict = reason if reason in _VERDICTS else "wrong answer"
  return f"{verdict}. check your work and try again."


@register("multi_turn_math")
async def multi_turn_math(sampler: GroupSampler, item: PromptRecord) -> Episodes:
  """G episodes of up to `rollout.max_turns` tries, each wrong one answered with the verifier's verdict."""
  turns = sampler.turns
  if turns.tokenizer is None:
    raise ValueError("rollout.workflow='multi_turn_math': the controller was given no tokenizer to prompt a follow-up")

  async def episode(index: int) -> tuple[list[Trajectory], float, int]:
    completions, prompt, reward = [], np.asarray(item.prompt_ids, np.int32), 0.0
    for turn in range(turns.max_turns):
      [answer] = sampler.generate(prompt, num_answers=1, stream=1 + index * turns.max_turns + turn, episode=index)
      t = await answer
      completions.append(Completion(response_id=str(turn), prompt_ids=prompt, tokens=t.response_ids,
                                    logprobs=t.logprobs, versions=t.versions, finish_reason=t.finish_reason,
                                    text=t.response_text))
      verdict = await sampler.verify(item, t.response_text, index=index, turn=turn)
      reward = float(verdict.reward)
      if reward > 0 or turn + 1 == turns.max_turns:
        break
      after = prompts.follow_up(feedback(verdict.reason), turns.tokenizer, turns.template,
                                ended=t.finish_reason == "eos")
      nxt = np.concatenate([prompt, t.response_ids, np.asarray(turns.tokenizer.encode(after), np.int32)])
      if turns.max_prompt_len is not None and len(nxt) > turns.max_prompt_len:
        break  # no room for another try
      prompt = nxt
    final = reward * turns.discount ** (len(completions) - 1)
    rewards = assign_rewards(completions, final, turns.discount)
    return to_trajectories(completions, rewards, group_id=sampler.group_id), final, len(completions)

  results = await asyncio.gather(*(episode(i) for i in range(sampler.group_size)))
  return Episodes(trajectories=tuple(t for trajs, _, _ in results for t in trajs),
                  rewards=tuple(r for _, r, _ in results), turns=tuple(n for _, _, n in results))
