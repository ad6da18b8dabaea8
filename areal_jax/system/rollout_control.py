"""Staleness-bounded admission of new prompt groups (paper Eq. 3) and the host-side trajectory queue."""

from __future__ import annotations

import heapq
import itertools
import threading

from typing import Any


class StalenessControl:
  """Decides how many new prompt groups may start generating.

  capacity = min(max_concurrent - running, (eta + v + 1) * B - (accepted + running)), where v is the learner's policy
  version, `accepted` counts completed groups that were kept (not filtered) and `running` those in flight. eta = 0 is
  synchronous RL: exactly B groups are generated per policy version.
  """

  def __init__(self, *, batch_size: int, max_offpolicyness: int, max_concurrent: int, accepted: int = 0):
    self.batch_size, self.eta, self.max_concurrent = batch_size, max_offpolicyness, max_concurrent
    self.running, self.accepted, self.version = 0, accepted, 0
    self._lock = threading.Lock()

  def capacity(self) -> int:
    with self._lock:
      return max(0, min(self.max_concurrent - self.running,
                        (self.eta + self.version + 1) * self.batch_size - (self.accepted + self.running)))

  def started(self, n: int = 1) -> None:
    with self._lock:
      self.running += n

  def finished(self, *, kept: bool) -> None:
    with self._lock:
      self.running -= 1
      self.accepted += int(kept)

  def set_version(self, version: int) -> None:
    with self._lock:
      self.version = version


class TrajectoryQueue:
  """Bounded queue of finished, scored prompt groups; the oldest policy version is consumed first (ties: arrival)."""

  def __init__(self, maxsize: int):
    self.maxsize = maxsize
    self._heap: list[tuple[int, int, Any]] = []
    self._seq = itertools.count()
    self._cond = threading.Condition()

  def __len__(self) -> int:
    with self._cond:
      return len(self._heap)

  def full(self) -> bool:
    with self._cond:
      return len(self._heap) >= self.maxsize

  def put(self, group, *, version: int, stop: threading.Event | None = None) -> bool:
    """Queues `group`, generated from policy `version` on; blocks while full; False if `stop` was set first."""
    with self._cond:
      while len(self._heap) >= self.maxsize:
        if stop is not None and stop.is_set():
          return False
        self._cond.wait(0.1)
      heapq.heappush(self._heap, (version, next(self._seq), group))
      self._cond.notify_all()
      return True

  def get_batch(self, n: int, *, stop: threading.Event | None = None, timeout: float | None = None
                ) -> list | None:
    """The n oldest groups, waiting until there are n; None if `stop` is set or `timeout` passes first."""
    with self._cond:
      ok = self._cond.wait_for(lambda: len(self._heap) >= n or (stop is not None and stop.is_set()), timeout)
      if not ok or len(self._heap) < n:
        return None
      batch = [heapq.heappop(self._heap)[2] for _ in range(n)]
      self._cond.notify_all()
      return batch
