"""The rollout controller: each prompt group is one coroutine, from its admission to the buffer.

    admission ─(capacity > 0)─► group(record):  episodes = await workflow(GroupSampler, record)
                                                 buffer.finish(group)   ─► RolloutBuffer ─► learner

Everything runs on one asyncio loop in a thread of its own (`AsyncThread`): one admission task starts as many groups
as the buffer's capacity allows and then awaits a wake-up (a group finished, or the learner stepped: `admit()`);
each group is a task that runs the run's episode workflow (`rl/workflows.py`, `rollout.workflow`: by default `rlvr`,
G answers each scored by the verifier as it finishes; `agent` with an agent) and hands its scored group to the
buffer. The sampler's and the reward service's threads only complete futures; no controller code runs on them. A
group's exception stops the controller and is raised to the learner by `check()`. Groups whose answers all score the
same are dropped (they carry no learning signal) when `filter_uniform` is set, and then do not count as accepted
(paper Eq. 3). Staleness counts from a group's first token.

Every group is admitted under the learner's current version and asks the sampler for weights of that version or
newer, so a group admitted just after a learner step waits for that step's weights.

A group whose sampler process is lost (an answer fails with `SamplerLost`) is withdrawn and its prompt drawn again
first, as a new group admitted under the version of that moment (`rollout/regenerated_groups`).

For exact resumption the controller tracks which drawn prompts are not yet done (trained on or filtered): a checkpoint
saves them with the dataset's iterator state, and a restarted run generates them again before drawing new ones.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from areal_jax import cli
from areal_jax.async_thread import AsyncThread
from areal_jax.data.records import PromptRecord
from areal_jax.errors import SamplerLost
from areal_jax.reward.service import RewardResult, RewardService
from areal_jax.rl import workflows
from areal_jax.rl.rollout_buffer import RolloutBuffer
from areal_jax.sampler.requests import SamplingParams
from areal_jax.types import Trajectory

if TYPE_CHECKING:
  from areal_jax.agents.runner import EpisodeRunner

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


class Stalled(RuntimeError):
  """No prompt group was accepted for `rollout.stall_timeout_s`: the run cannot learn as configured."""


def _why_stalled(dropped: int, samplers: dict[str, float]) -> str:
  if samplers.get("samplers/live", 1) == 0:
    return (f"no sampler process is live ({samplers['samplers/lost']:.0f} lost since the start, see their errors "
            "above): start one against this job (or use launch/local.py --restart_samplers)")
  if dropped:
    return (f"the {dropped} groups that finished were all dropped because every answer scored the same "
            "(learner.filter_uniform_groups): the policy solves none of these prompts (or all of them). Warm-start "
            "longer (warmstart.steps), lower rollout.max_head_offpolicyness, or use an easier data mix")
  return "no group finished at all: if answers take this long, raise rollout.stall_timeout_s"


class RolloutController:
  """See the module docstring. `rollout` is a `Rollout` (`submit` returns one future per answer); `version` is the
  policy version published to it (`admit` moves it on); `workflow` makes each group (`workflows.rlvr` by default),
  `turns` what a multi-turn one needs; `episodes`, with an agent, is its episode runner (the `agent` workflow's;
  the controller shares its `thread`). `thread`: the loop to run on (the simulator's virtual-time loop; by default a
  thread of the controller's own)."""

  def __init__(self, *, dataset, rollout, rewards: RewardService, buffer: RolloutBuffer, version: int,
               group_size: int, sampling: SamplingParams, filter_uniform: bool, next_group_id: int = 0,
               replay: Sequence[PromptRecord] = (), workflow: workflows.Workflow = workflows.rlvr,
               turns: workflows.Turns = workflows.Turns(), episodes: EpisodeRunner | None = None,
               thread: AsyncThread | None = None):
    self.dataset, self.rollout, self.rewards, self.buffer = dataset, rollout, rewards, buffer
    self.version = version  # the samplers' newest policy version: groups are admitted under it
    self.workflow, self.turns, self.episodes = workflow, turns, episodes
    self.group_size, self.sampling, self.filter_uniform = group_size, sampling, filter_uniform
    self._next_id = next_group_id
    self._replay = collections.deque(replay)
    self._undone: dict[int, PromptRecord] = {}  # drawn, not yet trained on or filtered (group id -> record)
    self._lock = threading.Lock()  # the state the learner's thread reads: undone, filtered, rewards, counters
    self.error: BaseException | None = None
    self.counters = collections.Counter()
    self.finished_rewards: list[float] = []  # every scored answer since the last `take_rewards()`
    self._filtered: list[Group] = []
    self._own_thread = episodes is None and thread is None
    self.thread = thread or (AsyncThread("rollout") if episodes is None else episodes.thread)
    self._wake: asyncio.Event | None = None
    self._admission = None

  # --- learner-facing ---------------------------------------------------------------------------------------------

  def start(self) -> RolloutController:
    self._admission = self.thread.submit(self._admit())
    return self

  def stop(self) -> None:
    """No more admissions; groups in flight are abandoned (their tasks cancelled)."""
    self.buffer.close()
    if self._admission is not None:
      self._admission.cancel()
    if self._own_thread:
      self.thread.stop()

  def check(self) -> None:
    if self.error is not None:
      raise RuntimeError("rollout controller failed") from self.error

  def admit(self, version: int | None = None) -> None:
    """Capacity may have grown: the admission task looks again, under `version` once the learner has published
    that version's weights. Safe from any thread."""
    if version is not None:
      self.version = version  # one writer (the learner's thread); the admission task reads it when woken
    self.thread.call(self._wake_up)

  def next_batch(self, n: int, step: int, stall_timeout_s: float) -> list[Group]:
    """The learner's next n groups; raises what stopped the controller or the samplers meanwhile, or `Stalled` when
    no group has been accepted for `stall_timeout_s`; warns every 2 minutes."""
    buffer = self.buffer
    waiting_since = last_accept = time.time()
    accepted, filtered = buffer.accepted, self.counters["groups_filtered"]
    while True:
      cli.check_stopped()
      self.check()
      self.rollout.check()
      groups = buffer.take_batch(n, self.version, timeout=1.0)
      if groups is not None:
        return groups
      if buffer.accepted != accepted:
        accepted, filtered, last_accept = buffer.accepted, self.counters["groups_filtered"], time.time()
      if time.time() - last_accept > stall_timeout_s:
        raise Stalled(f"step {step + 1}: no prompt group accepted for {stall_timeout_s:.0f} s "
                      f"(rollout.stall_timeout_s; {len(buffer)} of the batch's {n} groups are ready); "
                      f"{_why_stalled(self.counters['groups_filtered'] - filtered, self._samplers())}")
      if time.time() - waiting_since > 120:
        logging.warning("step %d: no batch of %d groups after %.0fs (%d finished; %s); groups whose answers all "
                        "score the same are dropped (learner.filter_uniform_groups)", step + 1, n,
                        time.time() - waiting_since, len(buffer), dict(self.counters))
        waiting_since = time.time()

  def _samplers(self) -> dict[str, float]:
    return getattr(self.rollout, "sampler_metrics", dict)()  # a bare Sampler (tests, the simulator) has none

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

  # --- on the loop ------------------------------------------------------------------------------------------------

  def _wake_up(self) -> None:
    if self._wake is not None:
      self._wake.set()

  async def _admit(self) -> None:
    """The admission task: starts groups while the buffer has capacity at the learner's version, then waits."""
    self._wake = asyncio.Event()
    groups: set[asyncio.Task] = set()
    try:
      while self.error is None:
        version = self.version
        while self.buffer.capacity(version) > 0:
          gid, record = self._draw()
          self.buffer.admit(gid, version)
          task = asyncio.create_task(self._group(gid, record, version), name=f"group-{gid}")
          groups.add(task)
          task.add_done_callback(groups.discard)
        await self._wake.wait()
        self._wake.clear()
    except BaseException as e:  # pylint: disable=broad-except  # surfaced by check()
      if not isinstance(e, asyncio.CancelledError):
        self._fail(e)
      for task in groups:
        task.cancel()
      raise

  def _draw(self) -> tuple[int, PromptRecord]:
    with self._lock:  # drawn and recorded as undone at once: a snapshot never sees one without the other
      record = self._replay.popleft() if self._replay else next(self.dataset)
      gid, self._next_id = self._next_id, self._next_id + 1
      self._undone[gid] = record
    return gid, record

  async def _group(self, gid: int, record: PromptRecord, version: int) -> None:
    """One prompt group's life: the workflow's episodes and their rewards, then the buffer."""
    try:
      sampler = workflows.GroupSampler(rollout=self.rollout, rewards=self.rewards, group_id=gid,
                                       group_size=self.group_size, min_version=version, sampling=self.sampling,
                                       turns=self.turns, agent=self.episodes, on_reward_failure=self._reward_failed)
      out = await self.workflow(sampler, record)
      if not isinstance(out, workflows.Episodes):
        raise TypeError(f"workflow {getattr(self.workflow, '__name__', self.workflow)!r} returned "
                        f"{type(out).__name__}, not workflows.Episodes")
      if out.failures or out.retokenized:
        with self._lock:
          self.counters["episode_failures"] += out.failures
          self.counters["retokenized_turns"] += out.retokenized
      trajs = tuple(t if t.group_id == gid else t.replace(group_id=gid) for t in out.trajectories)
      self._finish(gid, record, version, trajs, list(out.rewards), turns=out.turns)
    except asyncio.CancelledError:
      raise
    except SamplerLost:
      self._regenerate(gid, record)
    except BaseException as e:  # pylint: disable=broad-except  # surfaced by check()
      self._fail(e)
    self._wake_up()

  def _regenerate(self, gid: int, record: PromptRecord) -> None:
    """Group `gid` lost its sampler: withdrawn, and its prompt is the next one drawn (answers it already had are
    dropped with it, so none is trained twice)."""
    with self._lock:
      del self._undone[gid]
      self._replay.appendleft(record)
      self.counters["regenerated_groups"] += 1
    self.buffer.withdraw(gid)

  def _reward_failed(self, record: PromptRecord, index: int, r: RewardResult) -> None:
    """A reward worker failed on answer `index` of `record` (scored 0; the service replaced the worker)."""
    with self._lock:
      self.counters["reward_failures"] += 1
      n = self.counters["reward_failures"]
    if n <= _SHOWN_REWARD_FAILURES or n % 100 == 0:
      logging.warning("reward of answer %d to prompt %s: %s; scored 0 (%d such answers so far: "
                      "rollout/reward_failures)", index, record.uid, r.reason, n)

  def _fail(self, e: BaseException) -> None:
    if self.error is None:
      logging.error("rollout controller failed", exc_info=e)
      self.error = e
      self._wake_up()

  def _finish(self, gid: int, record: PromptRecord, version: int, trajs: tuple[Trajectory, ...],
              rewards: list[float], turns: tuple[int, ...] = ()) -> None:
    """Hands the group to the buffer (None when it is filtered, or when none of its episodes drew a token)."""
    group = Group(record=record, trajectories=trajs, turns=turns)
    scores = group.rewards
    keep = bool(trajs) and not (self.filter_uniform and np.all(scores == scores[0]))
    with self._lock:
      self.finished_rewards.extend(rewards)
      if not keep:
        self._undone.pop(gid, None)
        self._filtered.append(group)
      self.counters["groups_kept" if keep else "groups_filtered"] += 1
    self.buffer.finish(gid, group if keep else None, version=min((t.version_start for t in trajs), default=version))
