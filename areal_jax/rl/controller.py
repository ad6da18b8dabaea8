"""The rollout controller: admits prompt groups under the staleness bound and chains each one to the buffer.

    admit ─(capacity > 0)─► sampler (one future per answer) ─► reward service (a future per answer) ─► whole group
          ─► RolloutBuffer ─► learner

It has no thread of its own. `admit()` runs wherever capacity may have grown: at the start, after each learner step
and when a group finishes; each answer's future starts its scoring, and the last score of a group hands the group to
the buffer, in the thread that completed the future (the sampler's, the reward dispatcher's). A group is finished
when its G answers are scored. Groups whose answers all score the same are dropped (they carry no learning signal)
when `filter_uniform` is set, and then do not count as accepted (paper Eq. 3).

With an agent (`agent.path`), a group is G episodes of the agent on the prompt's problem (`agents.EpisodeRunner`),
and each episode's reward comes from the agent; an episode may give several trajectories (its turns, where they do
not merge), all with the group's id. Staleness counts from an episode's first token.

Every group is admitted under the learner's current version and asks the sampler for weights of that version or
newer, so a group admitted just after a learner step waits for that step's weights.

For exact resumption the controller tracks which drawn prompts are not yet done (trained on or filtered): a checkpoint
saves them with the dataset's iterator state, and a restarted run generates them again before drawing new ones.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np

from areal_jax import cli
from areal_jax.agents.runner import EpisodeResult, EpisodeRunner
from areal_jax.data.records import PromptRecord
from areal_jax.reward.service import RewardService
from areal_jax.rl.rollout_buffer import RolloutBuffer
from areal_jax.sampler.requests import Request, SamplingParams
from areal_jax.types import Trajectory

_SHOWN_REWARD_FAILURES = 5  # reward failures logged one by one; after that every 100th


@dataclasses.dataclass(frozen=True, kw_only=True)
class Group:
  """A finished, scored prompt group."""

  record: PromptRecord
  trajectories: tuple[Trajectory, ...]
  turns: tuple[int, ...] = ()  # completions per episode (agents only)

  @property
  def rewards(self) -> np.ndarray:
    return np.array([t.reward for t in self.trajectories])


@dataclasses.dataclass
class _Pending:
  record: PromptRecord
  version: int  # the learner's when admitted
  answers: dict[int, Trajectory] = dataclasses.field(default_factory=dict)
  rewards: dict[int, float] = dataclasses.field(default_factory=dict)
  episodes: dict[int, EpisodeResult] = dataclasses.field(default_factory=dict)


def problem(record: PromptRecord) -> dict:
  """What an agent is handed for a prompt record."""
  return {"uid": record.uid, "question": record.question, "reference": record.reference, "kind": record.kind,
          "solution": record.solution, "prompt": record.prompt}


class RolloutController:
  """See the module docstring. `loop` is a `Rollout` (`submit` returns one future per answer); `version()` is the
  learner's policy version; `episodes`, with an agent, runs its episodes instead."""

  def __init__(self, *, dataset, loop, rewards: RewardService, buffer: RolloutBuffer, version: Callable[[], int],
               group_size: int, sampling: SamplingParams, filter_uniform: bool, next_group_id: int = 0,
               replay: Sequence[PromptRecord] = (), episodes: EpisodeRunner | None = None):
    self.dataset, self.loop, self.rewards, self.buffer, self.version = dataset, loop, rewards, buffer, version
    self.episodes = episodes
    self.group_size, self.sampling, self.filter_uniform = group_size, sampling, filter_uniform
    self._next_id = next_group_id
    self._replay = collections.deque(replay)
    self._inflight: dict[int, _Pending] = {}
    self._undone: dict[int, PromptRecord] = {}  # drawn, not yet trained on or filtered (group id -> record)
    self._lock = threading.Lock()
    self._admitting, self._admit_again = False, False
    self._stopped = False
    self.error: BaseException | None = None
    self.counters = collections.Counter()
    self.finished_rewards: list[float] = []  # every scored answer since the last `take_rewards()`
    self._filtered: list[Group] = []

  # --- learner-facing ---------------------------------------------------------------------------------------------

  def start(self) -> RolloutController:
    self.admit()
    return self

  def stop(self) -> None:
    """No more admissions; groups in flight are abandoned (the loop cancels their futures)."""
    self._stopped = True
    self.buffer.close()

  def check(self) -> None:
    if isinstance(self.error, cli.Stopped):
      raise self.error  # a sampler process was signalled: this process stops the same way
    if self.error is not None:
      raise RuntimeError("rollout controller failed") from self.error

  def admit(self) -> None:
    """Starts as many groups as the buffer allows at the learner's version. Safe from any thread: a call made while
    another one runs (e.g. from a future completed inside it) makes that one look again instead."""
    with self._lock:
      if self._admitting:
        self._admit_again = True
        return
      self._admitting = True
    try:
      while True:
        self._admit_all()
        with self._lock:  # the same lock as the check above: a call from now on runs itself
          if not self._admit_again:
            self._admitting = False
            return
          self._admit_again = False
    except BaseException as e:  # pylint: disable=broad-except  # surfaced by check()
      with self._lock:
        self._admitting = False
      self._fail(e)

  def mark_trained(self, groups: Sequence[Group]) -> None:
    with self._lock:
      for g in groups:
        self._undone.pop(g.trajectories[0].group_id, None)

  def snapshot(self) -> tuple[dict, list[Group]]:
    """(checkpoint state, groups filtered since the last snapshot), taken together so no group falls between.

    The state holds the dataset position, the prompts drawn but not yet done (in draw order) and the next group id.
    """
    with self._lock:
      undone = [r.uid for _, r in sorted(self._undone.items())] + [r.uid for r in self._replay]
      filtered, self._filtered = self._filtered, []
      return {"dataset": self.dataset.state(), "undone": undone, "next_group_id": self._next_id}, filtered

  def take_rewards(self) -> list[float]:
    with self._lock:
      out, self.finished_rewards = self.finished_rewards, []
    return out

  # --- one group's chain ------------------------------------------------------------------------------------------

  def _admit_all(self) -> None:
    version = self.version()
    while not self._stopped and self.error is None and self.buffer.capacity(version) > 0:
      with self._lock:  # drawn and recorded as undone at once: a snapshot never sees one without the other
        record = self._replay.popleft() if self._replay else next(self.dataset)
        gid, self._next_id = self._next_id, self._next_id + 1
        self._inflight[gid] = _Pending(record=record, version=version)
        self._undone[gid] = record
      self.buffer.admit(gid, version)
      if self.episodes is not None:
        futures = [self.episodes.submit(problem(record), group_id=gid, index=i, min_version=version)
                   for i in range(self.group_size)]
        done = self._episode_done
      else:
        futures = self.loop.submit(Request(group_id=gid, prompt_ids=record.prompt_ids, num_answers=self.group_size,
                                           sampling=self.sampling, min_version=version))
        done = self._answered
      for index, future in enumerate(futures):
        future.add_done_callback(self._guarded(functools.partial(done, gid, index)))

  def _guarded(self, fn):
    """A future's callback whose failure stops the run (concurrent.futures would only log it)."""
    def run(future: Future) -> None:
      if self._stopped or future.cancelled():
        return
      try:
        fn(future)
      except BaseException as e:  # pylint: disable=broad-except  # surfaced by check()
        self._fail(e)
    return run

  def _fail(self, e: BaseException) -> None:
    if self.error is None:
      if not isinstance(e, cli.Stopped):
        logging.error("rollout controller failed", exc_info=e)
      self.error = e

  def _answered(self, gid: int, index: int, future: Future) -> None:
    traj: Trajectory = future.result()  # the sampler's error, if it failed
    with self._lock:
      pending = self._inflight[gid]
      pending.answers[index] = traj
    scored = self.rewards.submit((gid, index), pending.record.kind, traj.response_text, pending.record.reference)
    scored.add_done_callback(self._guarded(functools.partial(self._scored, gid, index)))

  def _scored(self, gid: int, index: int, future: Future) -> None:
    r = future.result()
    failed = r.reason.startswith(("timed out", "worker crashed"))  # scored 0; the service replaced the worker
    with self._lock:
      pending = self._inflight[gid]
      pending.rewards[index] = r.reward
      self.counters["reward_failures"] += failed
      n = self.counters["reward_failures"]
      done = len(pending.rewards) == self.group_size
      if done:
        del self._inflight[gid]
    if failed and (n <= _SHOWN_REWARD_FAILURES or n % 100 == 0):
      logging.warning("reward of answer %d to prompt %s: %s; scored 0 (%d such answers so far: "
                      "rollout/reward_failures)", index, pending.record.uid, r.reason, n)
    if done:
      self._finish_answers(gid, pending)
      self.admit()

  def _episode_done(self, gid: int, index: int, future: Future) -> None:
    result: EpisodeResult = future.result()
    with self._lock:
      pending = self._inflight[gid]
      pending.episodes[index] = result
      self.counters["episode_failures"] += result.failure is not None
      done = len(pending.episodes) == self.group_size
      if done:
        del self._inflight[gid]
    if done:
      episodes = [pending.episodes[i] for i in range(self.group_size)]
      self._finish(gid, pending, tuple(t for e in episodes for t in e.trajectories), [e.reward for e in episodes],
                   turns=tuple(e.turns for e in episodes))
      self.admit()

  def _finish_answers(self, gid: int, pending: _Pending) -> None:
    trajs = tuple(pending.answers[i].replace(reward=float(pending.rewards[i])) for i in range(self.group_size))
    self._finish(gid, pending, trajs, [t.reward for t in trajs])

  def _finish(self, gid: int, pending: _Pending, trajs: tuple[Trajectory, ...], rewards: list[float],
              turns: tuple[int, ...] = ()) -> None:
    """Hands the group to the buffer (None when it is filtered, or when none of its episodes drew a token)."""
    group = Group(record=pending.record, trajectories=trajs, turns=turns)
    scores = group.rewards
    keep = bool(trajs) and not (self.filter_uniform and np.all(scores == scores[0]))
    with self._lock:
      self.finished_rewards.extend(rewards)
      if not keep:
        self._undone.pop(gid, None)
        self._filtered.append(group)
      self.counters["groups_kept" if keep else "groups_filtered"] += 1
    self.buffer.finish(gid, group if keep else None,
                       version=min((t.version_start for t in trajs), default=pending.version))
