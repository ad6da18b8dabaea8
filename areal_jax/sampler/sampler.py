"""The sampler: one `Scheduler` driven by one loop, requests in from any thread, futures of finished answers out,
weights swappable. The run (one per engine replica), a sampler process, the server, evaluation, `generate()` and the
simulator all hold one.

    sampler = Sampler(engine=engine, params=params, version=3, eos_ids=[tok.eos_id], detokenize=tok.decode).start()
    futures = sampler.submit(request)        # one future per answer: its `Trajectory` (text detokenised)
    [whole] = sampler.submit_many([request], on_tokens=stream)  # one per request: its finished `Sequence`s
    sampler.update_params(new_params, version=4)  # from any thread; swapped in between two decode calls
    sampler.stop()
    answers = Sampler(...).run([request, ...])  # no thread: stepped in the caller's until every answer is done

The loop is plain and synchronous, on the wall clock: in a thread of its own (`start`) or in the caller's (`run`).
Its pieces are public, so that the simulator drives them from outside on its virtual clock (`sim/job.py`, where a
decode call lasts what the cost model says):

    sampler.take(block=False)                 # new requests in (blocking: an idle loop's wait)
    if not sampler.idle:
      finished = sampler.step()               # one scheduler step: the answers its call finished
      sampler.record(finished)                # their futures completed, streams reported
      sampler.account(seconds)                # the step's seconds into `busy_s`; stats published

With `start()` a second thread detokenises finished answers and completes their futures (callbacks run there and
must not block), so tokenizer work never delays a decode call.

Options, each for whoever needs it:
- `gather`: an idle sampler that gets a request gathers the ones arriving right behind it (each within `GATHER_GAP_S`
  of the last, for at most `GATHER_SHARE` of the last step's time) before it steps, so that a burst (an agent's next
  turns, a batch of groups) shares one prefill and one decode call;
- version holds: a request waits until the sampler generates from policy `request.min_version` or newer;
- `on_tokens(i, Tokens)` (`submit_many`): request i's new tokens after each decode call (streaming), on the loop's
  thread, returning quickly;
- `max_queue`: `submit_many` raises `QueueFull` once that many requests wait beyond the decode slots free now;
- `warmup` (default `sampler.warmup`): compile every program before the first request;
- `drafter` (with `sampler.speculation="suffix"`): a `SuffixDrafter` kept from an earlier sampler, whose finished
  answers draft this one's (the evaluation's, between evaluations of the same prompts).

A request whose future is cancelled before it reaches the scheduler is dropped; once it runs it runs to the end (the
scheduler has no abort), its answers unread. An exception in the loop fails every open future; `check()` re-raises
it. `stop()` ends the loop after the current step and fails what is still open (`error`, default: cancelled).
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
from areal_jax.sampler.drafts import SuffixDrafter
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.requests import Request, Sequence
from areal_jax.sampler.scheduler import Scheduler
from areal_jax.sampler.scoring import Scorer, Scores

GATHER_GAP_S = 0.01  # an idle sampler gathers requests arriving within this of each other...
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


def end_futures(futures: Iterable[concurrent.futures.Future], error: BaseException | None) -> None:
  """Fails every future not done with `error`; with None, cancels them (answers abandoned at a stop)."""
  for f in futures:
    if error is None:
      f.cancel()
    elif not f.done():
      f.set_exception(error)


@dataclasses.dataclass(eq=False)
class _Entry:
  request: Request
  future: concurrent.futures.Future  # the request's finished answers
  answers: list[Sequence | None]
  on_tokens: Callable[[Tokens], None] | None = None
  sent: list[int] | None = None  # tokens reported per answer
  each: bool = False  # `submit`'s: every answer completes a future of its own (`Sampler._answers`)
  started: bool = False


class Sampler:

  def __init__(self, *, engine: Engine, params, version: int = 0, eos_ids: Iterable[int] = (),
               detokenize: Callable[[Seq[int]], str] | None = None, max_queue: int | None = None,
               gather: bool = False, warmup: bool | None = None, idle_wait_s: float = 0.005, name: str = "sampler",
               drafter: SuffixDrafter | None = None):
    if max_queue is not None and max_queue < 1:
      raise ValueError(f"max_queue={max_queue}: must be >= 1")
    self.engine = engine
    self.scheduler = Scheduler(engine=engine, params=params, version=version, eos_ids=eos_ids, drafter=drafter)
    self.detokenize, self.max_queue, self.gather = detokenize, max_queue, gather
    self.idle_wait_s, self.name = idle_wait_s, name
    self.error: BaseException | None = None
    self._inbox: queue.Queue[_Entry] = queue.Queue()
    self._held: list[_Entry] = []  # waiting for weights of their min_version (the loop's thread only)
    self._entries: dict[int, _Entry] = {}  # id(request) -> entry, from the scheduler's submit to its last answer
    self._answers: dict[int, dict[int, concurrent.futures.Future]] = {}  # `submit`'s: group -> answer -> future
    self._lock = threading.Lock()
    self._queued = 0  # accepted requests without a decode slot yet (under _lock)
    self._stop = threading.Event()
    self._threads: list[threading.Thread] = []
    self._finished: queue.Queue[Sequence | None] | None = None  # to the detokeniser, while its thread runs
    self._busy_s, self._last_step_s = 0.0, 0.0
    self._counts = collections.Counter(dict.fromkeys(("requests", "rejected", "finished", "max_batch_answers",
                                                      "max_batch_requests"), 0))
    self._scorer: Scorer | None = None
    if engine.cfg.warmup if warmup is None else warmup:
      start = time.perf_counter()
      self.scheduler.state = engine.warmup(params, self.scheduler.state)
      _log.info("%s: compiled the sampler's programs in %.1f s", name, time.perf_counter() - start)
    self._stats = self._snapshot()

  # --- any thread -----------------------------------------------------------------------------------------------

  def submit(self, request: Request) -> list[concurrent.futures.Future]:
    """Queues a prompt group; one future per answer, in answer order, its result the answer's `Trajectory`. Group
    ids must be unique among the groups in flight. Raises as `submit_many`."""
    futures = [concurrent.futures.Future() for _ in range(request.num_answers)]
    with self._lock:
      if request.group_id in self._answers:  # an answer of it still open
        raise ValueError(f"group {request.group_id} is already in flight")
      self._answers[request.group_id] = dict(enumerate(futures))
    try:
      self._enqueue([_Entry(request=request, future=concurrent.futures.Future(),
                            answers=[None] * request.num_answers, each=True)])
    except BaseException:
      with self._lock:
        del self._answers[request.group_id]
      raise
    return futures

  def submit_many(self, requests: Seq[Request], *,
                  on_tokens: Callable[[int, Tokens], None] | None = None) -> list[concurrent.futures.Future]:
    """Queues all of `requests` or none; one future per request, its result the finished `Sequence`s in answer order.
    Raises ValueError for a prompt the sampler cannot hold (naming the limit), `QueueFull` past `max_queue`,
    RuntimeError if the loop stopped on an error."""
    entries = []
    for i, r in enumerate(requests):
      n = r.num_answers
      entries.append(_Entry(request=r, future=concurrent.futures.Future(), answers=[None] * n,
                            on_tokens=None if on_tokens is None else (lambda t, i=i: on_tokens(i, t)),
                            sent=[0] * n if on_tokens else None))
    self._enqueue(entries)
    return [e.future for e in entries]

  def _enqueue(self, entries: list[_Entry]) -> None:
    self.check()
    for e in entries:
      self.scheduler.validate(e.request)
    with self._lock:
      if self.max_queue is not None:
        free = max(0, self.engine.cfg.num_slots - self._stats["running"])
        if self._queued + len(entries) > self.max_queue + free:
          self._counts["rejected"] += 1
          raise QueueFull(f"{self._queued} requests are waiting for a decode slot and {free} slots are free "
                          f"(max_queue={self.max_queue}): no room for {len(entries)} more; retry later")
      self._queued += len(entries)
      self._counts["requests"] += len(entries)
    for e in entries:
      self._inbox.put(e)

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

  @property
  def limits(self) -> dict[str, int]:
    """What a request is checked against: `max_seq_len` (prompt + answer), `vocab_size` (the model's)."""
    return {"max_seq_len": self.engine.cfg.max_seq_len, "vocab_size": self.engine.model_cfg.vocab_size}

  def score(self, token_ids, temperature: float) -> Scores:
    """Logprobs and top alternatives of `token_ids` under the weights served now (see `scoring`)."""
    if self._scorer is None:
      self._scorer = Scorer(self.engine)
    return self._scorer(self.scheduler.params, token_ids, temperature=temperature,
                        vocab_limit=self.engine.cfg.vocab_limit)

  def stats(self) -> dict[str, float]:
    """The scheduler's counters (tokens, decode_steps, preemptions, weight_updates, ...), answers running and
    waiting, `busy_s` (seconds spent stepping), published after each step; requests accepted, rejected, finished and
    `queued` (without a decode slot yet); the most answers and requests one decode call advanced; the version."""
    with self._lock:
      return {**self._stats, **self._counts, "queued": self._queued, "version": self.version}

  def check(self) -> None:
    if self.error is not None:
      raise RuntimeError(f"the {self.name} loop stopped on an error") from self.error

  def start(self) -> Sampler:
    """The loop in a thread of its own on the wall clock, and the detokeniser beside it."""
    if self._threads:
      raise RuntimeError(f"{self.name} already started")
    self._finished = queue.Queue()
    self._threads = [threading.Thread(target=self._loop, name=self.name, daemon=True),
                     threading.Thread(target=self._detokenize, name=f"{self.name}-detok", daemon=True)]
    for t in self._threads:
      t.start()
    return self

  def stop(self, timeout: float | None = 60.0, error: BaseException | None = None) -> None:
    """Stops after the current step; what is still open fails with `error` (None: cancelled). Re-raises the loop's
    error, if it stopped on one."""
    self._stop.set()
    if self._threads:
      self._threads[0].join(timeout)
      self._finished.put(None)
      self._threads[1].join(timeout)
    if not any(t.is_alive() for t in self._threads):
      self._end_all(error)
    self.check()

  def __enter__(self) -> Sampler:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  def run(self, requests: Seq[Request]) -> list[list[Sequence]]:
    """Every request's answers, stepping the scheduler in the caller's thread (a sampler never started)."""
    futures = self.submit_many(requests)
    self.take(block=False)
    if self._held:
      raise ValueError(f"request of group {self._held[0].request.group_id} waits for policy version "
                       f"{self._held[0].request.min_version}; this sampler holds {self.version}")
    self._serve(until_idle=True)
    return [f.result() for f in futures]

  # --- the loop's pieces (the loop's thread, or whoever drives the sampler instead) --------------------------------

  def take(self, block: bool) -> None:
    """New requests to the scheduler, each once the next step generates from its `min_version` or newer. A
    blocking take (an idle loop's wait) waits up to `idle_wait_s` for one and, with `gather`, for the requests right
    behind it."""
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

  @property
  def idle(self) -> bool:
    """Nothing to step: no answer in the scheduler and no new weights to swap in."""
    return self.scheduler.idle and not self.scheduler.has_update

  def step(self) -> list[Sequence]:
    """One scheduler step; the answers finished in the call it read: its own (read once the call has run) or, with
    `sampler.overlap`, the previous step's (done when this one's call was dispatched). Hand them to `record`."""
    return self.scheduler.step()

  def record(self, finished: list[Sequence]) -> None:
    """After a step: reports new tokens, hands on finished answers, resolves finished requests and counts the
    requests that got their first slot in this step."""
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
      if e.each:
        if self._finished is not None:
          self._finished.put(seq)
        else:
          self._complete(seq)
      if all(a is not None for a in e.answers):
        del self._entries[id(seq.request)]
        done.append(e)
    with self._lock:
      self._queued -= len(started)
      c = self._counts
      c["finished"] += len(done)
      c["max_batch_answers"] = max(c["max_batch_answers"], len(batch))
      c["max_batch_requests"] = max(c["max_batch_requests"], len({id(s.request) for s in batch}))
    for e in done:
      e.future.set_result(e.answers)

  def account(self, seconds: float) -> None:
    """A step's seconds (from its `step` to its results recorded) into `busy_s`; publishes the stats."""
    self._last_step_s = seconds
    self._busy_s += seconds
    with self._lock:
      self._stats = self._snapshot()

  def fail(self, error: BaseException) -> None:
    """The loop failed: `error` is kept (`check()` re-raises it) and every open future fails with it."""
    self.error = error
    self._end_all(error)

  # --- the loop -------------------------------------------------------------------------------------------------

  def _serve(self, *, until_idle: bool = False) -> None:
    """The loop, until `stop()` (or, `until_idle`, until nothing is left to do); an idle loop blocks on the inbox.
    On the wall clock a step's call has run once `step` returns its results. An error fails every open future and
    is raised."""
    try:
      while not self._stop.is_set():
        self.take(block=False)
        if self.idle:
          if until_idle:
            return
          self.take(block=True)
          continue
        start = time.perf_counter()
        self.record(self.step())
        self.account(time.perf_counter() - start)
        faults.reach("generation")
    except BaseException as e:  # pylint: disable=broad-except  # surfaced by check() and every open future
      self.fail(e)
      raise

  def _loop(self) -> None:
    """The thread's body: the loop until `stop()` or an error (kept in `error`)."""
    try:
      self._serve()
    except BaseException:  # pylint: disable=broad-except  # kept in self.error
      pass
    if self.error is not None:  # e.g. the detokeniser's: the requests still open fail with it
      self._end_all(self.error)

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

  def _snapshot(self) -> dict[str, float]:
    s = self.scheduler
    waiting = sum(map(len, s.waiting)) + len(s.resume) + sum(e.request.num_answers for e in self._held)
    return {**s.counters, "running": len(s.running), "waiting": waiting, "busy_s": self._busy_s}

  # --- finished answers -----------------------------------------------------------------------------------------

  def _complete(self, seq: Sequence) -> None:
    """An answer `submit` asked for: its future's `Trajectory`, text detokenised."""
    text = self.detokenize(seq.tokens) if self.detokenize else ""
    gid = seq.request.group_id
    with self._lock:
      group = self._answers.get(gid, {})
      future = group.pop(seq.answer, None)
      if not group:
        self._answers.pop(gid, None)
    if future is not None:  # None: ended by stop()
      future.set_result(seq.trajectory(text))

  def _detokenize(self) -> None:
    try:
      while (seq := self._finished.get()) is not None:
        self._complete(seq)
    except BaseException as e:  # pylint: disable=broad-except  # surfaced by check() and the open futures
      self.error = self.error or e
      self._stop.set()
      self._end_answers(e)

  def _end_answers(self, error: BaseException | None) -> None:
    with self._lock:
      futures, self._answers = [f for group in self._answers.values() for f in group.values()], {}
    end_futures(futures, error)

  def _end_all(self, error: BaseException | None) -> None:
    """Fails (or, with None, cancels) every open future: of requests running, held or still queued, and of answers."""
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
      if not e.future.done():
        e.future.set_exception(concurrent.futures.CancelledError() if error is None else error)
    self._end_answers(error)
