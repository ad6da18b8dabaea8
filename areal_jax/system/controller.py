"""The rollout controller: admits prompt groups under the staleness bound, scores answers, queues finished groups.

It runs in its own thread beside the sampler loop and the learner:

    prompts ─(capacity > 0)─► SamplerLoop ─► answers ─► RewardService ─► whole groups ─► RolloutBuffer ─► learner

A group is finished when its G answers are scored. Groups whose answers all score the same are dropped (they carry
no learning signal) when `filter_uniform` is set, and then do not count as accepted (paper Eq. 3).

For exact resumption the controller tracks which drawn prompts are not yet done (trained on or filtered): a checkpoint
saves them with the dataset's iterator state, and a restarted run generates them again before drawing new ones.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence

import numpy as np

from areal_jax import cli
from areal_jax.data.records import PromptRecord
from areal_jax.reward.service import RewardResult, RewardService
from areal_jax.sampler.loop import SamplerLoop
from areal_jax.sampler.requests import Request, SamplingParams
from areal_jax.system.rollout_buffer import RolloutBuffer
from areal_jax.types import Trajectory

_SHOWN_REWARD_FAILURES = 5  # reward failures logged one by one; after that every 100th


class RewardChannels:
  """One reward pool shared by several consumers (rollouts, evaluation): results are routed by channel name."""

  def __init__(self, service_factory):
    self._queues: dict[str, queue.SimpleQueue] = collections.defaultdict(queue.SimpleQueue)
    self.service: RewardService = service_factory(on_result=self._route)

  def _route(self, result: RewardResult) -> None:
    channel, key = result.item_id
    self._queues[channel].put(dataclasses.replace(result, item_id=key))

  def submit(self, channel: str, key, kind: str, completion: str, reference) -> None:
    self.service.submit((channel, key), kind, completion, reference)

  def poll(self, channel: str) -> list[RewardResult]:
    out, q = [], self._queues[channel]
    while True:
      try:
        out.append(q.get_nowait())
      except queue.Empty:
        return out

  def get(self, channel: str, timeout: float | None = None) -> RewardResult:
    return self._queues[channel].get(timeout=timeout)

  def close(self) -> None:
    self.service.close()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Group:
  """A finished, scored prompt group."""

  record: PromptRecord
  trajectories: tuple[Trajectory, ...]

  @property
  def rewards(self) -> np.ndarray:
    return np.array([t.reward for t in self.trajectories])


@dataclasses.dataclass
class _Pending:
  record: PromptRecord
  answers: dict[int, Trajectory] = dataclasses.field(default_factory=dict)
  rewards: dict[int, float] = dataclasses.field(default_factory=dict)


class RolloutController:

  def __init__(self, *, dataset, loop: SamplerLoop, rewards: RewardChannels, buffer: RolloutBuffer, group_size: int, sampling: SamplingParams, filter_uniform: bool,
               next_group_id: int = 0, replay: Sequence[PromptRecord] = ()):
    self.dataset, self.loop, self.rewards, self.buffer = dataset, loop, rewards, buffer
    self.group_size, self.sampling, self.filter_uniform = group_size, sampling, filter_uniform
    self._next_id = next_group_id
    self._replay = collections.deque(replay)
    self._inflight: dict[int, _Pending] = {}
    self._undone: dict[int, PromptRecord] = {}  # drawn, not yet trained on or filtered (group id -> record)
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self.error: BaseException | None = None
    self.counters = collections.Counter()
    self.finished_rewards: list[float] = []  # every scored answer since the last `take_rewards()`
    self._filtered: list[Group] = []

  # --- learner-facing ---------------------------------------------------------------------------------------------

  def start(self) -> RolloutController:
    self._thread = threading.Thread(target=self._run, name="rollout-controller", daemon=True)
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    self.buffer.close()  # a group waiting for room in a full buffer gives up
    if self._thread is not None:
      self._thread.join(timeout=30)

  def check(self) -> None:
    if isinstance(self.error, cli.Stopped):
      raise self.error  # a sampler process was signalled: this process stops the same way
    if self.error is not None:
      raise RuntimeError("rollout controller failed") from self.error

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

  # --- the thread -------------------------------------------------------------------------------------------------

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        busy = self._admit()
        busy |= self._collect_answers()
        busy |= self._collect_rewards()
        if not busy:
          time.sleep(0.002)
    except cli.Stopped as e:
      self.error = e
    except BaseException as e:  # surfaced to the learner thread through check()
      logging.exception("rollout controller failed")
      self.error = e

  def _admit(self) -> bool:
    version = self.loop.version  # the policy the sampler generates from now
    n = self.buffer.capacity(version)
    for _ in range(n):
      record = self._replay.popleft() if self._replay else next(self.dataset)
      with self._lock:
        gid, self._next_id = self._next_id, self._next_id + 1
        self._inflight[gid] = _Pending(record=record)
        self._undone[gid] = record
      self.buffer.admit(gid, version)
      self.loop.submit(Request(group_id=gid, prompt_ids=record.prompt_ids, num_answers=self.group_size,
                               sampling=self.sampling))
    return n > 0

  def _collect_answers(self) -> bool:
    self.loop.check()
    n = 0
    while True:
      try:
        t = self.loop.output_queue.get_nowait()
      except queue.Empty:
        return n > 0
      n += 1
      pending = self._inflight[t.group_id]
      index = len(pending.answers)
      pending.answers[index] = t
      self.rewards.submit("rollout", (t.group_id, index), pending.record.kind, t.response_text,
                          pending.record.reference)

  def _collect_rewards(self) -> bool:
    results = self.rewards.poll("rollout")
    for r in results:
      gid, index = r.item_id
      pending = self._inflight[gid]
      pending.rewards[index] = r.reward
      if r.reason.startswith(("timed out", "worker crashed")):
        self.counters["reward_failures"] += 1  # scored 0; the service has already replaced the worker
        n = self.counters["reward_failures"]
        if n <= _SHOWN_REWARD_FAILURES or n % 100 == 0:
          logging.warning("reward of answer %d to prompt %s: %s; scored 0 (%d such answers so far: "
                          "rollout/reward_failures)", index, pending.record.uid, r.reason, n)
      if len(pending.rewards) == self.group_size:
        self._finish(gid, pending)
    return bool(results)

  def _finish(self, gid: int, pending: _Pending) -> None:
    del self._inflight[gid]
    trajs = tuple(pending.answers[i].replace(reward=float(pending.rewards[i])) for i in range(self.group_size))
    group = Group(record=pending.record, trajectories=trajs)
    rewards = group.rewards
    keep = not (self.filter_uniform and np.all(rewards == rewards[0]))
    with self._lock:
      self.finished_rewards.extend(rewards.tolist())
      if not keep:
        self._undone.pop(gid, None)
        self._filtered.append(group)
    self.counters["groups_kept" if keep else "groups_filtered"] += 1
    self.buffer.finish(gid, group if keep else None, version=min(t.version_start for t in trajs))
