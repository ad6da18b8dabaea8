"""A pool of reward worker processes that never blocks its caller.

    service = RewardService(num_workers=2, timeout_s=5.0)    # or RewardService.from_config(settings.reward)
    future = service.submit(item_id, "math", completion, reference)   # at once (kind "math" or "code")
    r = future.result()                                       # r.item_id, r.reward, r.reason, r.latency_s
    service.close()                                           # no process left behind

One dispatcher thread hands items to idle workers and collects their answers. An item that runs past `timeout_s` on
its worker scores 0 ("timed out") and that worker is killed with everything it started, then replaced; a worker that
dies scores its item 0 ("worker crashed") and is replaced too. Workers are fresh interpreters
(`python -m areal_jax.reward.worker`), each in its own session: they import neither the caller's `__main__` nor JAX,
and a terminal's Ctrl-C does not reach them. A worker takes about a second to start (math-verify and sympy);
`wait_ready()` waits for all of them, and items are only timed once on a ready worker.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import logging
import multiprocessing.connection
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Hashable

import areal_jax
from areal_jax.reward import sandbox
from areal_jax.reward.config import RewardConfig

_log = logging.getLogger(__name__)
_MAX_FAILED_STARTS = 5  # workers in a row that die before saying "ready": the service gives up
_START_TIMEOUT_S = 120.0  # a worker not ready by then is killed (and counts as a failed start)


class Failure(enum.Enum):
  """Why an item scored 0 without a verdict of its verifier."""
  TIMED_OUT = "timed out"  # its worker ran past `timeout_s` and was replaced
  CRASHED = "worker crashed"  # its worker died on it and was replaced
  CLOSED = "service closed"
  BROKEN = "service broken"  # workers kept dying while starting

  @property
  def of_worker(self) -> bool:
    """The item's worker failed on it: the item itself may be what broke it."""
    return self in (Failure.TIMED_OUT, Failure.CRASHED)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardResult:
  item_id: Hashable
  reward: float  # 1.0 or 0.0
  reason: str  # "correct", "wrong answer", "timed out after 5.0 s", "worker crashed (exit code -9)", ...
  latency_s: float  # submit -> result, queueing included
  run_s: float  # time on a worker
  failure: Failure | None = None  # None: the verifier scored it


@dataclasses.dataclass
class _Item:
  seq: int
  item_id: Hashable
  kind: str
  completion: str
  reference: Any
  submitted: float
  future: Future


@dataclasses.dataclass
class _Worker:
  proc: subprocess.Popen
  conn: multiprocessing.connection.Connection
  ready: bool = False
  item: _Item | None = None
  started: float = 0.0  # when its item was dispatched
  spawned: float = dataclasses.field(default_factory=time.monotonic)


def score_all(service: RewardService, items, *, what: str = "evaluation") -> list[float]:
  """Rewards of (kind, completion, reference) items, in order: submitted together, then awaited. An item that timed
  out or crashed its worker counts as wrong; how many did is logged once, naming `what`."""
  futures = [service.submit(i, kind, text, reference) for i, (kind, text, reference) in enumerate(items)]
  wait_s = 120.0 + service.timeout_s * -(-len(items) // service.num_workers)  # every item once on a worker, serially
  results = [f.result(timeout=wait_s) for f in futures]
  failed = [r.reason for r in results if r.failure is not None and r.failure.of_worker]
  if failed:
    n, failed = len(failed), sorted(set(failed))
    _log.warning("%s: %d of %d answers could not be scored and count as wrong (%s)", what, n, len(items),
                 "; ".join(failed))
  return [r.reward for r in results]


class RewardService:
  """Scores (kind, completion, reference) items in worker processes; see the module docstring.

  Each `submit` returns a `concurrent.futures.Future` of its `RewardResult`, completed on the dispatcher thread (so
  its callbacks must not block). `timeout_s` is the hard limit per item once on a worker; workers get a soft budget
  a little shorter
  (`soft_timeout_s`: the math check's own timeout, the code tests' total time) so that most slow items end without
  a kill. `memory_mb` caps each worker's address space (0: no cap).
  """

  def __init__(self, *, num_workers: int = 2, timeout_s: float = 5.0, soft_timeout_s: float | None = None,
               code_limits: sandbox.Limits | None = None, memory_mb: int = 4096):
    if num_workers < 1:
      raise ValueError(f"num_workers={num_workers} must be >= 1")
    if timeout_s <= 0:
      raise ValueError(f"timeout_s={timeout_s} must be positive")
    self.num_workers, self.timeout_s = num_workers, timeout_s
    self._soft_s = soft_timeout_s or max(0.1, timeout_s - min(2.0, 0.4 * timeout_s))
    self._code_limits, self._memory_mb = code_limits, memory_mb
    self._lock = threading.Lock()
    self._queue: collections.deque[_Item] = collections.deque()
    self._seq = itertools.count()
    self._stats = collections.Counter()
    self._closing = False
    self._broken = ""
    self._failed_starts = 0
    self._wake_r, self._wake_w = os.pipe()
    os.set_blocking(self._wake_r, False)
    os.set_blocking(self._wake_w, False)
    self._workers = [self._spawn() for _ in range(num_workers)]
    self._thread = threading.Thread(target=self._loop, name="reward-dispatch", daemon=True)
    self._thread.start()

  @classmethod
  def from_config(cls, reward: RewardConfig, **kw) -> RewardService:
    """From the run's reward settings (`config.Settings.reward`)."""
    return cls(num_workers=reward.num_workers, timeout_s=reward.timeout_s, code_limits=reward.code_limits, **kw)

  # ---- caller side: nothing here waits for a worker

  def submit(self, item_id: Hashable, kind: str, completion: str, reference: Any) -> Future[RewardResult]:
    """Queues one item and returns at once; the future completes when it is scored (always with a result: a timeout,
    crash or close scores 0 and says why)."""
    future = Future()
    with self._lock:
      if self._closing:
        raise RuntimeError("RewardService.submit after close()")
      if self._broken:
        raise RuntimeError(f"RewardService is broken: {self._broken}")
      self._queue.append(_Item(seq=next(self._seq), item_id=item_id, kind=kind, completion=completion,
                               reference=reference, submitted=time.monotonic(), future=future))
      self._stats["submitted"] += 1
    self._wake()
    return future

  @property
  def pending(self) -> int:
    """Items submitted and not yet scored."""
    with self._lock:
      return self._stats["submitted"] - self._stats["finished"]

  def stats(self) -> dict[str, int]:
    """Counts: submitted, finished, timeouts, crashes, restarts."""
    with self._lock:
      return {k: self._stats[k] for k in ("submitted", "finished", "timeouts", "crashes", "restarts")}

  def wait_ready(self, timeout: float = 60.0) -> None:
    """Waits until every worker has finished its imports (items are only timed once on a ready worker)."""
    deadline = time.monotonic() + timeout
    while not all(w.ready for w in self._workers):
      if self._broken or time.monotonic() > deadline:
        raise TimeoutError(f"reward workers not ready after {timeout} s{': ' + self._broken if self._broken else ''}")
      time.sleep(0.01)

  def worker_pids(self) -> list[int]:
    return [w.proc.pid for w in self._workers]

  def in_flight(self) -> list[Hashable]:
    """The ids of the items on a worker now, in worker order (read without the dispatcher's lock: a snapshot)."""
    return [item.item_id for item in [w.item for w in self._workers] if item is not None]

  @property
  def healthy(self) -> bool:
    """Every worker alive and the dispatcher running."""
    return (not self._broken and self._thread.is_alive()
            and all(w.proc.poll() is None for w in self._workers))

  def close(self) -> None:
    """Stops the workers (killing any mid-item) and the dispatcher. Unscored items finish as "service closed"."""
    with self._lock:
      if self._closing:
        return
      self._closing = True
    self._wake()
    self._thread.join()
    for w in self._workers:
      try:
        w.conn.send(None)
      except OSError:
        pass
    deadline = time.monotonic() + 2.0
    for w in self._workers:
      if w.item is None:
        try:
          w.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
          pass
      self._stop(w)
      if w.item is not None:
        self._finish(w.item, 0.0, "service closed", 0.0, Failure.CLOSED)
    while self._queue:
      self._finish(self._queue.popleft(), 0.0, "service closed", 0.0, Failure.CLOSED)
    os.close(self._wake_r)
    os.close(self._wake_w)

  def __enter__(self) -> RewardService:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---- workers

  def _spawn(self) -> _Worker:
    ours, theirs = socket.socketpair()
    root = os.path.dirname(os.path.dirname(os.path.abspath(areal_jax.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    with theirs:
      proc = subprocess.Popen([sys.executable, "-m", "areal_jax.reward.worker", str(theirs.fileno()),
                               str(self._memory_mb)], pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                              start_new_session=True)
    return _Worker(proc=proc, conn=multiprocessing.connection.Connection(ours.detach()))

  def _stop(self, w: _Worker) -> None:
    """Kills a worker with everything it started (its sandboxed programs) and reaps it."""
    if w.proc.poll() is None or sandbox.descendants(w.proc.pid):
      sandbox.kill_tree(w.proc.pid)
    w.proc.wait()
    w.conn.close()

  def _replace(self, w: _Worker) -> None:
    self._stop(w)
    fresh = self._spawn()
    w.proc, w.conn, w.ready, w.item, w.spawned = fresh.proc, fresh.conn, False, None, fresh.spawned
    with self._lock:
      self._stats["restarts"] += 1

  # ---- dispatcher thread

  def _wake(self) -> None:
    try:
      os.write(self._wake_w, b"x")
    except (BlockingIOError, OSError):
      pass  # a full pipe wakes the dispatcher just as well

  def _finish(self, item: _Item, reward: float, reason: str, run_s: float, failure: Failure | None = None) -> None:
    result = RewardResult(item_id=item.item_id, reward=reward, reason=reason,
                          latency_s=time.monotonic() - item.submitted, run_s=run_s, failure=failure)
    with self._lock:
      self._stats["finished"] += 1
    item.future.set_result(result)  # a callback that raises is logged by concurrent.futures

  def _dispatch(self) -> None:
    for w in self._workers:
      if not w.ready or w.item is not None or w.proc.poll() is not None:
        continue  # (a dead worker is replaced once the loop sees its socket close)
      with self._lock:
        if not self._queue:
          return
        item = self._queue.popleft()
      try:
        w.conn.send((item.seq, item.kind, item.completion, item.reference, self._soft_s, self._code_limits))
      except OSError:  # it died while idle: requeue the item; the loop sees the closed socket
        with self._lock:
          self._queue.appendleft(item)
        continue
      w.item, w.started = item, time.monotonic()

  def _on_dead(self, w: _Worker) -> None:
    w.proc.wait()
    code = w.proc.returncode
    with self._lock:
      self._stats["crashes"] += 1
    if w.item is not None:
      self._finish(w.item, 0.0, f"worker crashed (exit code {code})", time.monotonic() - w.started, Failure.CRASHED)
      w.item = None
    if not w.ready:
      self._failed_starts += 1
      if self._failed_starts >= _MAX_FAILED_STARTS:
        self._broken = f"{self._failed_starts} reward workers in a row died while starting (last exit code {code})"
        _log.error("RewardService: %s", self._broken)
        return
    self._replace(w)

  def _loop(self) -> None:
    while not self._closing and not self._broken:
      self._dispatch()
      deadlines = [w.started + self.timeout_s for w in self._workers if w.item is not None]
      deadlines += [w.spawned + _START_TIMEOUT_S for w in self._workers if not w.ready]
      wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
      ready = multiprocessing.connection.wait([w.conn for w in self._workers] + [self._wake_r], wait_s)
      if self._wake_r in ready:
        try:
          while os.read(self._wake_r, 4096):
            pass
        except BlockingIOError:
          pass
      for w in self._workers:
        if w.conn not in ready:
          continue
        try:
          msg = w.conn.recv()
        except (EOFError, OSError):
          self._on_dead(w)
          if self._broken:
            break
          continue
        if msg == ("ready",):
          w.ready, self._failed_starts = True, 0
        elif w.item is not None and w.item.seq == msg[0]:
          _, reward, reason, run_s = msg
          self._finish(w.item, reward, reason, run_s)
          w.item = None
      now = time.monotonic()
      for w in self._workers:
        if not w.ready and now >= w.spawned + _START_TIMEOUT_S and w.proc.poll() is None:
          _log.error("RewardService: worker %d not ready after %.0f s; killing it", w.proc.pid, _START_TIMEOUT_S)
          sandbox.kill_tree(w.proc.pid)  # the loop sees its socket close and counts a failed start
        if w.item is not None and now >= w.started + self.timeout_s:
          item, run_s = w.item, now - w.started
          with self._lock:
            self._stats["timeouts"] += 1
          self._replace(w)
          self._finish(item, 0.0, f"timed out after {self.timeout_s} s", run_s, Failure.TIMED_OUT)
    if self._broken:
      with self._lock:
        items, self._queue = list(self._queue), collections.deque()
      for w in self._workers:
        if w.item is not None:
          items.append(w.item)
          w.item = None
      for item in items:
        self._finish(item, 0.0, f"reward service broken: {self._broken}", 0.0, Failure.BROKEN)
