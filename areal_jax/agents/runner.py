"""Agents' episodes in training: each gets an OpenAI client whose requests reach the training sampler, recorded.

    runner = EpisodeRunner(agent=load("my_agents:MathAgent"), config=AgentConfig(...), rollout=rollout,
                           tokenizer=tok, sampling=SamplingParams(temperature=1.0, seed=0), limits=...,
                           version=lambda: learner.version)
    future = runner.submit(data, group_id=7, index=0, min_version=3)  # an `EpisodeResult` once the agent returns
    runner.stop()

The client is a real `openai.AsyncOpenAI` (chat completions, completions, the Responses API), or a real
`anthropic.AsyncAnthropic` (the Messages API) for an agent whose client parameter is annotated so
(`async def run(data, client: anthropic.AsyncAnthropic)`). Its HTTP transport calls the server's own routes in process
(`httpx2.ASGITransport` over `serve.create_app`), so an agent meets exactly what `tools/serve.py` serves: the chat
template, tools and tool calls, streaming. Every request made from the episode's task carries the episode's id in a
header, whichever client makes it (the one handed over, another from `client()` / `anthropic_client()`, or one set as
a global default such as the Agents SDK's `set_default_openai_client`); the routes hand them to this runner, which
sends them to the `Rollout` (a `LocalRollout` here, or sampler processes through the hub) and records every answer as
drawn: prompt token ids, answer tokens, behaviour logprobs, policy versions. A chat turn (in any of the APIs) whose
history holds an earlier answer is prompted with that answer's drawn ids (`turns.TurnHistory`).

In training the run's sampling settings hold (`sampler.temperature`, `top_p`, `top_k`, the run's seed): the learner's
importance ratios assume them. An agent's own `temperature` etc. are ignored; its `max_tokens`, `stop`, `n` and
`ignore_eos` are kept, and any model name is served. Top alternatives and `echo` are not served here (400).

An episode fails, losing only itself, when the agent raises (an HTTP error it did not catch included: past
`agent.max_turns`, a prompt longer than the cache), runs past `agent.timeout_s`, or returns something other than a
finite number or a dict of them: its completions are scored 0, and the reason is logged with the problem's uid.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import copy
import dataclasses
import inspect
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import httpx2
import numpy as np
import openai

from areal_jax.agents.agent import AgentConfig, AgentFn
from areal_jax.agents.episodes import Completion, assign_rewards, to_trajectories
from areal_jax.agents.turns import TurnHistory
from areal_jax.async_thread import AsyncThread
from areal_jax.errors import SamplerLost
from areal_jax.sampler.requests import Request, SamplingParams
from areal_jax.sampler.sampler import Tokens
from areal_jax.serve import openai_api, responses_api
from areal_jax.serve.server import EPISODE_HEADER, create_app
from areal_jax.tokenizer import Tokenizer
from areal_jax.types import Trajectory

_log = logging.getLogger(__name__)
_SHOWN_FAILURES = 5  # episode failures logged one by one; after that every 100th
MODEL_NAME = "policy"
_GROUP_IDS = itertools.count(1 << 40)  # sampler group ids of agents' requests, apart from the controller's
# The episode whose task makes a request: whichever client the agent uses (the one it was handed, another made from
# `EpisodeRunner.client()`, a global default), its requests are that episode's.
_EPISODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("areal_episode", default=None)


@dataclasses.dataclass(frozen=True)
class Drawn:
  """An answer as the routes shape it (the fields they read of a scheduler `Sequence`)."""

  tokens: list[int]
  logprobs: list[float]
  versions: list[int]
  finish_reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeResult:
  trajectories: tuple[Trajectory, ...]
  reward: float  # the last completion's (0 when the episode failed)
  turns: int  # completions the agent received
  failure: str | None = None
  lost: bool = False  # a sampler process generating one of its completions was lost: the group is generated again
  completions: tuple[Completion, ...] = ()  # as recorded, in order
  retokenized: int = 0  # turns whose history held an answer that had to be re-encoded (`turns.TurnHistory`)


class RolloutSampling:
  """The routes' sampler side in training (`serve.server.Sampling`): requests go to `rollout` under the run's
  sampling settings, each as a sampler group of its own."""

  error = None

  def __init__(self, rollout, *, sampling: SamplingParams, limits: dict[str, int], version: Callable[[], int],
               lost: Callable[[str], None] = lambda key: None):
    self.rollout, self.sampling, self._version = rollout, sampling, version
    self._limits = dict(limits)
    self._lost = lost  # told the episode (its key) whose request failed with `SamplerLost`

  @property
  def version(self) -> int:
    return self._version()

  @property
  def limits(self) -> dict[str, int]:
    return self._limits

  def submit_many(self, requests: list[Request], on_tokens=None) -> list[concurrent.futures.Future]:
    return [self._submit(i, r, on_tokens) for i, r in enumerate(requests)]

  def _submit(self, i: int, request: Request, on_tokens) -> concurrent.futures.Future:
    sampling = dataclasses.replace(self.sampling, max_new_tokens=request.sampling.max_new_tokens,
                                   stop=request.sampling.stop, ignore_eos=request.sampling.ignore_eos)
    episode = _EPISODE.get()  # the route runs in the episode's task; its turns go to one sampler replica
    answers = self.rollout.submit(dataclasses.replace(request, group_id=next(_GROUP_IDS), sampling=sampling,
                                                      episode=episode))
    out = concurrent.futures.Future()
    out.set_running_or_notify_cancel()
    left = [len(answers)]
    lock = threading.Lock()

    def one_done(_):
      with lock:
        left[0] -= 1
        if left[0]:
          return
      try:
        trajs = [f.result() for f in answers]
      except BaseException as e:  # pylint: disable=broad-except  # cancelled (the run stops) or the sampler failed
        if isinstance(e, SamplerLost) and episode is not None:
          self._lost(episode)
        out.set_exception(e)
        return
      drawn = [Drawn(tokens=t.response_ids.tolist(), logprobs=t.logprobs.tolist(), versions=t.versions.tolist(),
                     finish_reason=t.finish_reason) for t in trajs]
      for j, d in enumerate(drawn):  # a stream gets each answer whole, once it is drawn
        if on_tokens is not None:
          on_tokens(i, Tokens(answer=j, tokens=d.tokens, logprobs=d.logprobs, versions=d.versions,
                              finish_reason=d.finish_reason))
      out.set_result(drawn)

    for f in answers:
      f.add_done_callback(one_done)
    return out

  def score(self, token_ids, temperature: float):
    raise openai_api.ApiError(400, "top alternatives and echo are not served to agents in training")

  def stats(self) -> dict[str, float]:
    return self.rollout.stats()


@dataclasses.dataclass(eq=False)
class _Episode:
  min_version: int
  history: TurnHistory
  completions: list[Completion] = dataclasses.field(default_factory=list)
  turns: int = 0
  retokenized: int = 0
  lost: bool = False


class _EpisodeTransport(httpx2.ASGITransport):
  """The routes in process; a request made from an episode's task is tagged with that episode (`_EPISODE`)."""

  async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
    key = _EPISODE.get()
    if key is not None and EPISODE_HEADER not in request.headers:
      request.headers[EPISODE_HEADER] = key
    return await super().handle_async_request(request)


def wants_anthropic(agent: AgentFn) -> bool:
  """Whether `agent`'s client parameter (its second) is annotated as an Anthropic client."""
  params = list(inspect.signature(agent).parameters.values())
  hint = params[1].annotation if len(params) > 1 else inspect.Parameter.empty
  name = hint if isinstance(hint, str) else getattr(hint, "__name__", "")
  return name.rsplit(".", 1)[-1] in ("AsyncAnthropic", "Anthropic")


class EpisodeRunner:
  """Runs episodes on one asyncio loop in a thread of its own (`thread`); `submit` is safe from any thread, and a
  coroutine on that loop (the rollout controller's groups) awaits `episode` directly."""

  def __init__(self, *, agent: AgentFn, config: AgentConfig, rollout, tokenizer: Tokenizer, sampling: SamplingParams,
               limits: dict[str, int], version: Callable[[], int]):
    self.agent, self.config, self.tokenizer = agent, config, tokenizer
    self.sampling = RolloutSampling(rollout, sampling=sampling, limits=limits, version=version, lost=self._lost)
    # The Responses API's stored responses go with their episode: the bound only guards against a leak.
    self.responses = responses_api.ResponseStore(max_items=1 << 20)
    self.app = create_app(sampler=self.sampling, tokenizer=tokenizer, model_name=MODEL_NAME, episodes=self,
                          any_model=True, responses=self.responses)
    self.failures = 0
    self._episodes: dict[str, _Episode] = {}
    self._lock = threading.Lock()
    self.thread = AsyncThread("agent-episodes")

  def submit(self, data: dict[str, Any], *, group_id: int, index: int,
             min_version: int) -> concurrent.futures.Future:
    """Starts answer `index` of group `group_id`: a future of its `EpisodeResult` (it never raises for the agent's
    faults; see the module docstring)."""
    return self.thread.submit(self.episode(data, group_id=group_id, index=index, min_version=min_version))

  def client(self) -> openai.AsyncOpenAI:
    """An OpenAI client whose transport calls the routes in process: from an episode's task (the agent's code, and
    any task it starts), its requests are that episode's and recorded; from elsewhere, plain requests to the same
    sampler. `await client.close()` when done."""
    return openai.AsyncOpenAI(base_url="http://policy/v1", api_key="training", http_client=self._http(),
                              max_retries=0)

  def anthropic_client(self):
    """The same as `client`, as an `anthropic.AsyncAnthropic` (the Messages API)."""
    import anthropic  # pylint: disable=import-outside-toplevel

    return anthropic.AsyncAnthropic(base_url="http://policy", api_key="training", http_client=self._http(),
                                    max_retries=0)

  def _http(self) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(transport=_EpisodeTransport(app=self.app), base_url="http://policy", timeout=None)

  def stop(self) -> None:
    """Cancels the episodes in flight and ends the loop's thread."""
    self.thread.stop()

  # --- one episode ----------------------------------------------------------------------------------------------

  async def episode(self, data: dict[str, Any], *, group_id: int, index: int, min_version: int) -> EpisodeResult:
    """Answer `index` of group `group_id`, awaited on `self.thread`'s loop (what `submit` runs)."""
    key = f"{group_id}-{index}"
    episode = _Episode(min_version=min_version, history=TurnHistory(self.tokenizer))
    with self._lock:
      self._episodes[key] = episode
    client = self.anthropic_client() if wants_anthropic(self.agent) else self.client()
    failure = None
    tag = _EPISODE.set(key)  # the agent's task (wait_for's) starts with this context
    try:
      reward = await asyncio.wait_for(self.agent(copy.deepcopy(data), client), self.config.timeout_s)
      rewards = assign_rewards(episode.completions, reward, self.config.turn_discount)
    except asyncio.TimeoutError:
      failure = f"timed out after agent.timeout_s={self.config.timeout_s:g} s"
    except Exception as e:  # pylint: disable=broad-except  # the agent's fault: this episode only
      failure = f"{type(e).__name__}: {e}"
    finally:
      _EPISODE.reset(tag)
      await client.close()
      self.responses.drop(key)
      with self._lock:
        del self._episodes[key]
    completions = episode.completions
    if failure is not None:
      rewards = [0.0] * len(completions)
      with self._lock:
        self.failures += 1
        n = self.failures
      if n <= _SHOWN_FAILURES or n % 100 == 0:
        _log.warning("episode %d of prompt %s failed after %d completions, scored 0 (%d failures so far: "
                     "agent/episode_failures): %s", index, data.get("uid"), len(completions), n, failure)
    trajs = to_trajectories(completions, rewards, group_id=group_id)
    return EpisodeResult(trajectories=tuple(trajs), reward=rewards[-1] if rewards else 0.0, turns=len(completions),
                         failure=failure, lost=episode.lost, completions=tuple(completions),
                         retokenized=episode.retokenized)

  # --- the routes' hooks (`serve.server.Episodes`) ----------------------------------------------------------------

  def _lost(self, key: str) -> None:
    with self._lock:
      if key in self._episodes:
        self._episodes[key].lost = True

  def _episode(self, key: str) -> _Episode:
    with self._lock:
      episode = self._episodes.get(key)
    if episode is None:
      raise openai_api.ApiError(400, f"{EPISODE_HEADER}={key!r}: no such episode is running", param=EPISODE_HEADER)
    return episode

  def prepare(self, key: str, prepared: openai_api.Prepared) -> openai_api.Prepared:
    episode = self._episode(key)
    with self._lock:
      if episode.turns >= self.config.max_turns:
        raise openai_api.ApiError(400, f"agent.max_turns={self.config.max_turns} completions reached in this "
                                       f"episode", param="messages")
      episode.turns += 1
    requests = [dataclasses.replace(r, min_version=episode.min_version) for r in prepared.requests]
    if prepared.conversation is not None:  # token in, token out: the history's answers as drawn
      ids, retokenized = episode.history.prompt(prepared.conversation)
      episode.retokenized += retokenized
      if ids is not None:
        requests = [self._reprompted(r, ids) for r in requests]
    return dataclasses.replace(prepared, requests=requests)

  def _reprompted(self, request: Request, ids: list[int]) -> Request:
    """`request` with prompt `ids` (a few tokens longer or shorter than the re-encoding it replaces)."""
    room = self.sampling.limits["max_seq_len"] - len(ids)
    if room < 1:
      raise openai_api.ApiError(400, f"messages too long: {len(ids)} tokens with the drawn answers kept > max "
                                     f"{room + len(ids) - 1}", param="messages")
    sampling = dataclasses.replace(request.sampling, max_new_tokens=min(request.sampling.max_new_tokens, room))
    return dataclasses.replace(request, prompt_ids=ids, sampling=sampling)

  def record(self, key: str, prepared: openai_api.Prepared, answers: list[list[Drawn]], response_id: str) -> None:
    episode = self._episode(key)
    for request, group in zip(prepared.requests, answers):
      for drawn in group:
        shaped = openai_api.shape_answer(drawn, prepared.stops, self.tokenizer)  # through a stop string's cut
        n = len(shaped.token_ids)
        if prepared.conversation is not None:
          episode.history.add(prepared.conversation, request.prompt_ids, shaped.token_ids, shaped.text,
                              eos=bool(n) and shaped.token_ids[-1] == self.tokenizer.eos_id)
        episode.completions.append(Completion(
            response_id=response_id, prompt_ids=request.prompt_ids, tokens=np.asarray(shaped.token_ids, np.int32),
            logprobs=np.asarray(drawn.logprobs[:n], np.float32), versions=np.asarray(drawn.versions[:n], np.int32),
            finish_reason=drawn.finish_reason, text=shaped.text))
