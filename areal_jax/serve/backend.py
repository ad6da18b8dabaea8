"""The server's one sampler thread: every HTTP request becomes a scheduler `Request`, and all requests share the
continuous batch (a decode call advances every running answer, whichever request it belongs to).

    backend = Backend(engine=engine, params=params, version=3, eos_ids=[tok.eos_id], max_queue=256).start()
    future = backend.submit(Request(group_id=0, prompt_ids=ids, num_answers=2, sampling=SamplingParams(...)))
    answers = future.result()  # the request's finished `Sequence`s, in answer order
    futures = backend.submit_many(requests, on_tokens=callback)  # all or none; callback(i, Tokens) as they come
    backend.update_params(new_params, version=4)  # from any thread; applied between two decode calls
    backend.stop()

`submit` is safe from any thread (an asyncio handler awaits `asyncio.wrap_future(future)`); the `Scheduler` is only
touched by the backend's thread. A request waits in the queue until its first answer gets a decode slot; `submit`
raises `QueueFull` once `max_queue` requests wait beyond the decode slots free now (a burst on an idle server fills
the free slots and then the queue). A request whose future is cancelled before it reaches the scheduler is dropped;
once it runs it runs to the end (the scheduler has no abort), its answers unread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Sequence as Seq

from areal_jax.sampler.engine import Engine
from areal_jax.sampler.requests import Request, Sequence
from areal_jax.sampler.scheduler import Scheduler
from areal_jax.serve.scoring import Scorer, Scores


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
class _Pending:
  future: concurrent.futures.Future
  answers: list[Sequence | None]
  started: bool = False
  on_tokens: Callable[[Tokens], None] | None = None
  sent: list[int] | None = None  # tokens reported per answer


class Backend:

  def __init__(self, *, engine: Engine, params, version: int = 0, eos_ids: Iterable[int] = (), max_queue: int = 256,
               idle_wait_s: float = 0.005):
    if max_queue < 1:
      raise ValueError(f"max_queue={max_queue}: must be >= 1")
    self.scheduler = Scheduler(engine=engine, params=params, version=version, eos_ids=eos_ids)
    self.max_queue = max_queue  # may be changed while serving
    self.idle_wait_s = idle_wait_s
    self.error: BaseException | None = None
    self._inbox: queue.Queue[tuple[Request, concurrent.futures.Future, Callable | None]] = queue.Queue()
    self._lock = threading.Lock()
    self._waiting = 0  # accepted requests without a decode slot yet (under _lock)
    self._pending: dict[int, _Pending] = {}  # id(request) -> its future and answers (the thread's own)
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._counts = collections.Counter(dict.fromkeys(("requests", "rejected", "finished", "max_batch_answers",
                                                      "max_batch_requests"), 0))
    self._stats = self._snapshot()
    self._scorer: Scorer | None = None

  # --- any thread -----------------------------------------------------------------------------------------------

  def submit(self, request: Request) -> concurrent.futures.Future:
    """Queues `request`; the future's result is its finished answers (`Sequence`s, in answer order).

    Raises ValueError for a prompt the sampler cannot hold (naming the limit), `QueueFull` when `max_queue` requests
    wait beyond the free decode slots already, RuntimeError if the thread stopped on an error.
    """
    return self.submit_many([request])[0]

  def submit_many(self, requests: Seq[Request],
                  on_tokens: Callable[[int, Tokens], None] | None = None) -> list[concurrent.futures.Future]:
    """Queues all of `requests` or none (as `submit`). `on_tokens(i, tokens)`, if given, is called from the sampler
    thread after each decode call with the new tokens of request i's answers; it must return quickly."""
    self.check()
    for request in requests:
      self.scheduler.validate(request)
    with self._lock:
      free = max(0, self.scheduler.engine.cfg.num_slots - self._stats["running"])
      if self._waiting + len(requests) > self.max_queue + free:
        self._counts["rejected"] += 1
        raise QueueFull(f"{self._waiting} requests are waiting for a decode slot and {free} slots are free "
                        f"(max_queue={self.max_queue}): no room for {len(requests)} more; retry later")
      self._waiting += len(requests)
      self._counts["requests"] += len(requests)
    futures = []
    for i, request in enumerate(requests):
      future = concurrent.futures.Future()
      report = None if on_tokens is None else functools.partial(on_tokens, i)
      self._inbox.put((request, future, report))
      futures.append(future)
    return futures

  def update_params(self, params, version: int) -> None:
    """New weights (on the engine's shardings) from the next decode call on; tokens after it record `version`."""
    self.check()
    self.scheduler.update_params(params, version)

  @property
  def version(self) -> int:
    return self.scheduler.version

  @property
  def limits(self) -> dict[str, int]:
    """What a request is checked against: `max_seq_len` (prompt + answer), `vocab_size` (the model's)."""
    engine = self.scheduler.engine
    return {"max_seq_len": engine.cfg.max_seq_len, "vocab_size": engine.model_cfg.vocab_size}

  def score(self, token_ids, temperature: float) -> Scores:
    """Logprobs and top alternatives of `token_ids` under the weights served now (see `scoring`)."""
    if self._scorer is None:
      self._scorer = Scorer(self.scheduler.engine)
    return self._scorer(self.scheduler.params, token_ids, temperature=temperature,
                        vocab_limit=self.scheduler.engine.cfg.vocab_limit)

  def stats(self) -> dict[str, int | float]:
    """The scheduler's counters and answers running (published after each step), policy version, requests waiting,
    accepted, rejected and finished, and the most answers and requests one decode call has advanced."""
    with self._lock:
      return {**self._stats, **self._counts, "waiting": self._waiting, "version": self.version}

  def check(self) -> None:
    if self.error is not None:
      raise RuntimeError("the sampler thread stopped on an error") from self.error

  def start(self) -> Backend:
    if self._thread is not None:
      raise RuntimeError("backend already started")
    self._thread = threading.Thread(target=self._run, name="serve-sampler", daemon=True)
    self._thread.start()
    return self

  def stop(self, timeout: float | None = 60.0) -> None:
    """Stops after the current step; requests still in flight fail with RuntimeError."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout)
    if self._thread is None or not self._thread.is_alive():
      self._fail_all(RuntimeError("the server is shutting down"))

  # --- the sampler thread ---------------------------------------------------------------------------------------

  def _snapshot(self) -> dict[str, int]:
    return {**self.scheduler.counters, "running": len(self.scheduler.running)}

  def _drain(self, block: bool) -> None:
    try:
      request, future, report = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
      while True:
        if future.set_running_or_notify_cancel():  # False: cancelled (the client left) before it started
          self.scheduler.submit(request)
          n = request.num_answers
          self._pending[id(request)] = _Pending(future=future, answers=[None] * n, on_tokens=report,
                                                sent=[0] * n if report else None)
        else:
          with self._lock:
            self._waiting -= 1
        request, future, report = self._inbox.get_nowait()
    except queue.Empty:
      pass

  def _report(self, batch: list[Sequence]) -> None:
    """New tokens of streamed requests' answers to their `on_tokens`."""
    for seq in batch:
      p = self._pending.get(id(seq.request))
      if p is None or p.on_tokens is None:
        continue
      sent = p.sent[seq.answer]
      if len(seq.tokens) > sent or seq.finish_reason:
        p.sent[seq.answer] = len(seq.tokens)
        try:
          p.on_tokens(Tokens(answer=seq.answer, tokens=seq.tokens[sent:], logprobs=seq.logprobs[sent:],
                             versions=seq.versions[sent:], finish_reason=seq.finish_reason))
        except Exception:  # pylint: disable=broad-except  # e.g. the reader's event loop closed: stop reporting
          _log.exception("on_tokens of a streamed request failed; its answers run on unreported")
          p.on_tokens = None

  def _record(self, finished: list[Sequence]) -> None:
    """Reports new tokens, resolves finished requests and counts those that got their first slot in this step."""
    sched = self.scheduler
    batch = list(sched.running.values()) + finished  # every answer the step's decode call advanced
    self._report(batch)
    waiting = {id(group[0].request) for group in sched.waiting}
    started = [p for key, p in self._pending.items() if not p.started and key not in waiting]
    for p in started:
      p.started = True
    done = []
    for seq in finished:
      p = self._pending[id(seq.request)]
      p.answers[seq.answer] = seq
      if all(a is not None for a in p.answers):
        del self._pending[id(seq.request)]
        done.append(p)
    with self._lock:
      self._waiting -= len(started)
      c = self._counts
      c["finished"] += len(done)
      c["max_batch_answers"] = max(c["max_batch_answers"], len(batch))
      c["max_batch_requests"] = max(c["max_batch_requests"], len({id(s.request) for s in batch}))
      self._stats = self._snapshot()  # with `_waiting`: `submit_many` counts free slots from both
    for p in done:
      p.future.set_result(p.answers)

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        sched = self.scheduler
        self._drain(block=sched.idle and not sched.has_update)
        if not (sched.idle and not sched.has_update):
          self._record(sched.step())
    except BaseException as e:  # surfaced by check() and by every pending future
      self.error = e
      self._fail_all(e)

  def _fail_all(self, error: BaseException) -> None:
    for p in self._pending.values():
      if not p.future.done():
        p.future.set_exception(error)
    self._pending.clear()
    while True:
      try:
        _, future, _ = self._inbox.get_nowait()
      except queue.Empty:
        return
      if future.set_running_or_notify_cancel():
        future.set_exception(error)
