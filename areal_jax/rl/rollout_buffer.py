"""The rollout buffer: the one owner of the staleness bound η (paper Eq. 3) and of the finished groups.

    capacity(version) ─► admit(gid, version) ─► generating ─► finish(gid, group | None) ─► take_batch(n, version)
                                                           └─► withdraw(gid)   (its sampler was lost: admitted again)

- `capacity(version)`: how many new prompt groups may start generating when the sampler runs policy `version`:
  min(max_concurrent - running, ⌊(a + version + 1) * B⌋ - (accepted + running)), where `accepted` counts finished
  groups that were kept (not filtered), `running` those in flight, and the lookahead a is η, or a target staleness
  t ≤ η (`rollout.target_staleness`, fractional allowed). η = 0 is synchronous RL: B groups per version.
  A sampler faster than the learner runs a versions ahead, so batches are trained at staleness ≈ a: t paces it
  below the bound, while a slow group may still finish up to η versions late.
- `take_batch(n, version)`: the n oldest finished groups (by the policy version their answers started from; ties by
  arrival) for the learner step after `version`. A group admitted under version − η or earlier is trained in this
  step or never within the bound, so it waits for every such group still out.

The version is always an argument: the learner's counter is its only owner. The bound also bounds the buffer: it
never holds more than (η + 1) * B groups, so `finish` never waits. One condition variable wakes the learner; nothing
polls.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import threading
from typing import Any

from areal_jax.config_records import from_group


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
  """The `rollout` group as a frozen, validated record; field meanings as in configs/math.py."""

  batch_size: int = 16  # B: prompt groups per learner step
  group_size: int = 8  # G: answers per prompt
  max_head_offpolicyness: int = 4  # eta
  max_concurrent_rollouts: int = 16
  target_staleness: float | None = None  # None = eta
  stall_timeout_s: float = 300.0
  workflow: str = ""  # rl/workflows.py: a registered name or module:function; "" = agent with agent.path, else rlvr
  max_turns: int = 2  # multi-turn workflows: answers per episode
  turn_discount: float = 0.9  # multi-turn workflows: a later turn's reward is scaled by this per turn before it

  def __post_init__(self):
    def bad(field, why):
      raise ValueError(f"rollout.{field}={getattr(self, field)!r}: {why}")

    for f in ("batch_size", "group_size", "max_concurrent_rollouts", "stall_timeout_s", "max_turns"):
      if not getattr(self, f) > 0:
        bad(f, "must be positive")
    eta = self.max_head_offpolicyness
    if eta < 0:
      bad("max_head_offpolicyness", "must be >= 0 (0 = synchronous RL)")
    if not 0 <= self.turn_discount <= 1:
      bad("turn_discount", "must lie in [0, 1]")
    if self.target_staleness is not None and not 0 <= self.target_staleness <= eta:
      bad("target_staleness", f"must lie in [0, rollout.max_head_offpolicyness={eta}] (None = the bound)")

  @classmethod
  def from_config(cls, c) -> RolloutConfig:
    """From the `rollout` group of an ml_collections config; unknown keys raise."""
    return from_group(cls, c, "rollout")


class RolloutBuffer:

  def __init__(self, *, batch_size: int, max_offpolicyness: int, max_concurrent: int, accepted: int = 0,
               target_staleness: float | None = None):
    if target_staleness is not None and not 0 <= target_staleness <= max_offpolicyness:
      raise ValueError(f"target_staleness={target_staleness} must lie in [0, max_offpolicyness={max_offpolicyness}]")
    self.batch_size, self.eta, self.max_concurrent = batch_size, max_offpolicyness, max_concurrent
    self.lookahead = max_offpolicyness if target_staleness is None else target_staleness
    self.accepted = accepted  # finished and kept, since the start of training (restored from the version on resume)
    self._out: dict[int, int] = {}  # generating: group id -> version it was admitted under
    self._heap: list[tuple[int, int, Any]] = []  # finished: (version, arrival, group)
    self._arrival = itertools.count()
    self._closed = False
    self._cond = threading.Condition()

  @classmethod
  def from_config(cls, r: RolloutConfig, *, version: int) -> RolloutBuffer:
    """From the run's rollout settings, resuming at policy `version` (every earlier version took one batch)."""
    return cls(batch_size=r.batch_size, max_offpolicyness=r.max_head_offpolicyness,
               max_concurrent=r.max_concurrent_rollouts, accepted=version * r.batch_size,
               target_staleness=r.target_staleness)

  @property
  def running(self) -> int:
    return len(self._out)

  def __len__(self) -> int:
    with self._cond:
      return len(self._heap)

  def capacity(self, version: int) -> int:
    with self._cond:
      return self._capacity(version)

  def _capacity(self, version: int) -> int:
    running = len(self._out)
    return max(0, min(self.max_concurrent - running,
                      math.floor((self.lookahead + version + 1) * self.batch_size + 1e-9)
                      - (self.accepted + running)))

  def admit(self, group_id: int, version: int) -> None:
    """Group `group_id` starts generating under `version` (the caller checked `capacity(version)`)."""
    with self._cond:
      if self._capacity(version) <= 0:
        raise RuntimeError(f"group {group_id} admitted beyond the staleness bound at version {version}")
      self._out[group_id] = version

  def finish(self, group_id: int, group=None, *, version: int = 0) -> None:
    """Group `group_id` is done: `group` (generated from policy `version` on) is kept for training, None drops it
    (filtered)."""
    with self._cond:
      if group is not None:
        heapq.heappush(self._heap, (version, next(self._arrival), group))
        self.accepted += 1
      del self._out[group_id]
      self._cond.notify_all()

  def withdraw(self, group_id: int) -> None:
    """Group `group_id` stops generating without finishing (its sampler was lost): its admission is undone, so it
    neither counts as accepted nor holds back a batch; the controller admits its prompt again as a new group."""
    with self._cond:
      del self._out[group_id]
      self._cond.notify_all()

  def take_batch(self, n: int, version: int, *, timeout: float | None = None) -> list | None:
    """The n oldest finished groups for the learner step after `version`; None if `timeout` passes or the buffer
    closes first."""
    def ready():
      return self._closed or (len(self._heap) >= n and not any(v <= version - self.eta for v in self._out.values()))

    with self._cond:
      if not self._cond.wait_for(ready, timeout) or self._closed:
        return None
      batch = [heapq.heappop(self._heap)[2] for _ in range(n)]
      self._cond.notify_all()
      return batch

  def close(self) -> None:
    """Ends the learner's wait: `take_batch` returns None from now on."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()
