"""The one loop that drives a `Scheduler`: requests in from any thread, finished answers out, weights swappable.
The run's sampler (`loop.SamplerLoop`), the server (`serve.backend.Backend`), `generate()` and evaluation all drive
the scheduler through it.

    driver = Driver(engine=engine, params=params, version=3, eos_ids=[tok.eos_id], max_queue=256).start()
    [future] = driver.submit_many([request], on_tokens=stream, on_answer=done)
    answers = future.result()                 # the request's finished `Sequence`s, in answer order
    driver.update_params(new_params, version=4)  # from any thread; applied between two decode calls
    driver.stop()
    answers = Driver(...).run([request, ...])  # no thread: stepped in the caller's until every answer is done

Options, each for whoever needs it:
- `gather`: an idle driver that gets a request gathers the ones arriving right behind it (each within
  `GATHER_GAP_S` of the last, for at most `GATHER_SHARE` of the last step's time) before it steps, so that a burst (an
  agent's next turns, a batch of groups) shares one prefill and one decode call;
- version holds: a request waits until the driver generates from policy `request.min_version` or newer;
- `on_tokens(i, Tokens)`: request i's new tokens after each decode call (streaming); `on_answer(i, seq)`: each
  answer as it finishes. Both run on the driver's thread and must return quickly;
- `max_queue`: `submit_many` raises `QueueFull` once that many requests wait beyond the decode slots free now.

A request whose future is cancelled before it reaches the scheduler is dropped; once it runs it runs to the end
(the scheduler has no abort), its answers unread. An exception in the driver's thread fails every open future;
`check()` re-raises it. `stop()` ends the thread after the current step and fails what is still open
(`stop_error`, default: cancelled).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence as Seq

from areal_jax import faults
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.requests import Request, Sequence
from areal_jax.sampler.scheduler import Scheduler

GATHER_GAP_S = 0.01  # an idle driver gathers requests arriving within this of each other...
GATHER_SHARE = 0.25  # ... for at most this share of the last step's time

_log = logging.getLogger(__name__)


class QueueFull(Exception):
  """`max_queue` requests are waiting for a decode slot already."""


@dataclasses.dataclass(frozen=True)
class Tokens:
  """An answer's tokens drawn since the last report (`finish_reason` set on its last report)."""

  answer: int
  tokens: list[int]
  logprobs: list[float]
  versions: list[int]
  finish_reason: str | None


@dataclasses.dataclass(eq=False)
class _Entry:
  request: Request
  future: concurrent.futures.Future
  answers: list[Sequence | None]
  on_tokens: Callable[[Tokens], None] | None = None
  on_answer: Callable[[Sequence], None] | None = None
  sent: list[int] | None = None  # tokens reported per answer
  started: bool = False


class Driver:

  def __init__(self, *, engine: Engine, params, version: int = 0, eos_ids: Iterable[int] = (),
               max_queue: int | None = None, gather: bool = False, idle_wait_s: float = 0.005, name: str = "sampler"):
    if max_queue is not None and max_queue < 1:
      raise ValueError(f"max_queue={max_queue}: must be >= 1")
    self.scheduler = Scheduler(engine=engine, params=params, version=version, eos_ids=eos_ids)
    self.max_queue, self.gather, self.idle_wait_s, self.name = max_queue, gather, idle_wait_s, name
    self.error: BaseException | None = None
    self._inbox: queue.Queue[_Entry] = queue.Queue()
    self._held: list[_Entry] = []  # waiting for weights of their min_version (the driver's thread only)
    self._entries: dict[int, _Entry] = {}  # id(request) -> entry, from the scheduler's submit to its last answer
    self._lock = threading.Lock()
    self._queued = 0  # accepted requests without a decode slot yet (under _lock)
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._busy_s, self._last_step_s = 0.0, 0.0
    self._counts = collections.Counter(dict.fromkeys(("requests", "rejected", "finished", "max_batch_answers",
                                                      "max_batch_requests"), 0))
    self._stats = self._snapshot()

  # --- any thread -----------------------------------------------------------------------------------------------

  def submit_many(self, requests: Seq[Request], *, on_tokens: Callable[[int, Tokens], None] | None = None,
                  on_answer: Callable[[int, Sequence], None] | None = None) -> list[concurrent.futures.Future]:
    """Queues all of `requests` or none; one future per request, its result the finished answers in answer order.
    Raises ValueError for a prompt the sampler cannot hold (naming the limit), `QueueFull` past `max_queue`,
    RuntimeError if the thread stopped on an error."""
    self.check()
    for request in requests:
      self.scheduler.validate(request)
    with self._lock:
      if self.max_queue is not None:
        free = max(0, self.scheduler.engine.cfg.num_slots - self._stats["running"])
        if self._queued + len(requests) > self.max_queue + free:
          self._counts["rejected"] += 1
          raise QueueFull(f"{self._queued} requests are waiting for a decode slot and {free} slots are free "
                          f"(max_queue={self.max_queue}): no room for {len(requests)} more; retry later")
      self._queued += len(requests)
      self._counts["requests"] += len(requests)
    entries = [self._entry(i, r, on_tokens, on_answer) for i, r in enumerate(requests)]
    for entry in entries:
      self._inbox.put(entry)
    return [e.future for e in entries]

  @staticmethod
  def _entry(i: int, request: Request, on_tokens, on_answer) -> _Entry:
    n = request.num_answers
    return _Entry(request=request, future=concurrent.futures.Future(), answers=[None] * n,
                  on_tokens=None if on_tokens is None else lambda t: on_tokens(i, t),
                  on_answer=None if on_answer is None else lambda s: on_answer(i, s),
                  sent=[0] * n if on_tokens else None)

  def update_params(self, params, version: int) -> None:
    """New weights (on the engine's shardings) from the next decode call on; every running answer's cache is
    recomputed under them and its next tokens record `version`."""
    self.check()
    self.scheduler.update_params(params, version)

  @property
  def version(self) -> int:
    return self.scheduler.version

  @property
  def queued(self) -> int:
    """Requests accepted that have no decode slot yet."""
    with self._lock:
      return self._queued

  def stats(self) -> dict[str, float]:
    """The scheduler's counters, answers running and waiting, `busy_s` (seconds spent stepping), published after each
    step; requests accepted, rejected and finished; the most answers and requests one decode call advanced."""
    with self._lock:
      return {**self._stats, **self._counts, "version": self.version}

  def check(self) -> None:
    if self.error is not None:
      raise RuntimeError(f"the {self.name} thread stopped on an error") from self.error

  def start(self) -> Driver:
    if self._thread is not None:
      raise RuntimeError(f"{self.name} driver already started")
    self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
    self._thread.start()
    return self

  def stop(self, timeout: float | None = 60.0, error: BaseException | None = None) -> None:
    """Stops after the current step; what is still open is failed with `error` (None: cancelled)."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout)
    if self._thread is None or not self._thread.is_alive():
      self._end_all(error)

  def run(self, requests: Seq[Request]) -> list[list[Sequence]]:
    """Every request's answers, stepping the scheduler in the caller's thread (a driver never started)."""
    futures = self.submit_many(requests)
    self._take(block=False)
    if self._held:
      raise ValueError(f"request of group {self._held[0].request.group_id} waits for policy version "
                       f"{self._held[0].request.min_version}; this driver holds {self.version}")
    while not self.scheduler.idle:
      self._step()
    return [f.result() for f in futures]

  def poll(self) -> None:
    """Hands the requests submitted so far to the scheduler (each once the next step generates from its
    `min_version`). With `record`, for a caller that steps `scheduler` itself (the simulator, which sleeps on a
    virtual clock between a step and its results)."""
    self._take(block=False)

  def record(self, finished: list[Sequence]) -> None:
    """A step's results, as the driver's own loop reports them: streams, finished answers, finished requests."""
    self._record(finished)

  # --- the driver's thread ----------------------------------------------------------------------------------------

  def _loop(self) -> None:
    try:
      while not self._stop.is_set():
        sched = self.scheduler
        idle = sched.idle and not sched.has_update
        self._take(block=idle)
        if not (sched.idle and not sched.has_update):
          self._step()
          faults.reach("generation")
    except BaseException as e:  # pylint: disable=broad-except  # surfaced by check() and every open future
      self.error = e
      self._end_all(e)

  def _step(self) -> None:
    start = time.perf_counter()
    finished = self.scheduler.step()
    self._last_step_s = time.perf_counter() - start
    self._busy_s += self._last_step_s
    self._record(finished)

  def _take(self, block: bool) -> None:
    """New requests to the scheduler, each once the next step generates from its `min_version` or newer; with
    `gather`, a blocking take waits for the requests right behind the first."""
    try:
      entry = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
      deadline = time.perf_counter() + (GATHER_SHARE * self._last_step_s if block and self.gather else 0.0)
      while True:
        if entry.future.set_running_or_notify_cancel():  # False: cancelled before it started
          self._held.append(entry)
        else:
          with self._lock:
            self._queued -= 1
        wait = min(deadline - time.perf_counter(), GATHER_GAP_S)
        entry = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
    except queue.Empty:
      pass
    if self._held:
      version = self.scheduler.next_version
      ready = [e for e in self._held if e.request.min_version <= version]
      self._held = [e for e in self._held if e.request.min_version > version]
      for e in ready:
        self.scheduler.submit(e.request)
        self._entries[id(e.request)] = e
      with self._lock:
        self._stats = self._snapshot()

  def _report(self, batch: list[Sequence]) -> None:
    """New tokens of streamed requests' answers to their `on_tokens`."""
    for seq in batch:
      e = self._entries.get(id(seq.request))
      if e is None or e.on_tokens is None:
        continue
      sent = e.sent[seq.answer]
      if len(seq.tokens) > sent or seq.finish_reason:
        e.sent[seq.answer] = len(seq.tokens)
        try:
          e.on_tokens(Tokens(answer=seq.answer, tokens=seq.tokens[sent:], logprobs=seq.logprobs[sent:],
                             versions=seq.versions[sent:], finish_reason=seq.finish_reason))
        except Exception:  # pylint: disable=broad-except  # e.g. the reader's event loop closed: stop reporting
          _log.exception("on_tokens of a streamed request failed; its answers run on unreported")
          e.on_tokens = None

  def _record(self, finished: list[Sequence]) -> None:
    """Reports new tokens, hands on finished answers, resolves finished requests and counts the requests that got
    their first slot in this step."""
    sched = self.scheduler
    batch = list(sched.running.values()) + finished  # every answer the step's decode call advanced
    self._report(batch)
    waiting = {id(group[0].request) for group in sched.waiting}
    started = [e for key, e in self._entries.items() if not e.started and key not in waiting]
    for e in started:
      e.started = True
    done = []
    for seq in finished:
      e = self._entries[id(seq.request)]
      e.answers[seq.answer] = seq
      if e.on_answer is not None:
        e.on_answer(seq)
      if all(a is not None for a in e.answers):
        del self._entries[id(seq.request)]
        done.append(e)
    with self._lock:
      self._queued -= len(started)
      c = self._counts
      c["finished"] += len(done)
      c["max_batch_answers"] = max(c["max_batch_answers"], len(batch))
      c["max_batch_requests"] = max(c["max_batch_requests"], len({id(s.request) for s in batch}))
      self._stats = self._snapshot()
    for e in done:
      e.future.set_result(e.answers)

  def _snapshot(self) -> dict[str, float]:
    s = self.scheduler
    waiting = sum(map(len, s.waiting)) + len(s.resume) + sum(e.request.num_answers for e in self._held)
    return {**s.counters, "running": len(s.running), "waiting": waiting, "busy_s": self._busy_s}

  def _end_all(self, error: BaseException | None) -> None:
    """Fails (or, with None, cancels) the future of every request still open: running, held or still queued."""
    entries = list(self._entries.values()) + self._held
    self._entries, self._held = {}, []
    while True:
      try:
        entry = self._inbox.get_nowait()
      except queue.Empty:
        break
      if entry.future.set_running_or_notify_cancel():
        entries.append(entry)
    for e in entries:
      if e.future.done():
        continue
      if error is None:
        e.future.set_exception(concurrent.futures.CancelledError())
      else:
        e.future.set_exception(error)
