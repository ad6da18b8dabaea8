"""The sampler's background loop: prompt groups in, futures of finished `Trajectory`s out, weights swappable from
any thread.

    loop = SamplerLoop(engine=engine, params=params, version=0, eos_ids=[tok.eos_id], detokenize=tok.decode)
    loop.start()
    futures = loop.submit(Request(group_id=7, prompt_ids=ids, num_answers=16, sampling=SamplingParams(...)))
    traj = futures[0].result()  # answer 0 of group 7, once it has finished
    loop.update_params(new_params, version=1)  # e.g. from the learner thread; applied between two decode calls
    loop.stop()

An idle loop that gets a request gathers the ones arriving right behind it (each within `GATHER_GAP_S` of the last,
for at most a quarter of the last step's time) before it steps: requests that come in a burst (an agent's next turns,
a batch of groups) then share one prefill and one decode call instead of waiting out a call of `decode_steps` steps
that started with the first of them.

One thread runs the scheduler (admission, decode steps, weight swaps); a second one detokenises finished answers and
completes their futures (callbacks run there: they must not block), so tokenizer work never delays a decode step. A
group waits until the loop generates from policy `request.min_version` or newer. An exception in either thread stops
the loop and fails every future still open; `check()` and `stop()` re-raise it; `stop()` cancels the futures of
answers still in flight.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from collections.abc import Callable, Iterable, Sequence

from areal_jax import faults
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.requests import Request
from areal_jax.sampler.scheduler import Scheduler


GATHER_GAP_S = 0.01  # an idle loop gathers requests arriving within this of each other...
GATHER_SHARE = 0.25  # ... for at most this share of the last step's time


def end_futures(futures: Iterable[Future], error: BaseException | None) -> None:
  """Fails every future with `error`; with None, cancels them (answers abandoned at a stop)."""
  for f in futures:
    if error is None:
      f.cancel()
    else:
      f.set_exception(error)


class SamplerLoop:

  def __init__(self, *, engine: Engine, params, version: int = 0, eos_ids: Iterable[int] = (),
               detokenize: Callable[[Sequence[int]], str] | None = None, idle_wait_s: float = 0.005):
    self.scheduler = Scheduler(engine=engine, params=params, version=version, eos_ids=eos_ids)
    self.detokenize = detokenize
    self.input_queue: queue.Queue[Request] = queue.Queue()
    self.idle_wait_s = idle_wait_s
    self._held: list[Request] = []  # waiting for weights of their min_version (loop thread only)
    self._futures: dict[tuple[int, int], Future] = {}  # (group id, answer) -> its future, until finished
    self._futures_lock = threading.Lock()
    self.error: BaseException | None = None
    self._finished: queue.Queue = queue.Queue()
    self._stop = threading.Event()
    self._threads: list[threading.Thread] = []
    self._busy_s = 0.0  # wall time spent in scheduler steps (prefill, decode, weight swaps)
    self._last_step_s = 0.0
    self._publish_stats()

  # --- controller-facing API --------------------------------------------------------------------------------------

  def submit(self, request: Request) -> list[Future]:
    """Queues a prompt group (checked here: a bad prompt raises in the caller's thread); returns one future per
    answer, in answer order. Group ids must be unique among the groups in flight."""
    self.scheduler.validate(request)
    futures = [Future() for _ in range(request.num_answers)]
    with self._futures_lock:
      if any(gid == request.group_id for gid, _ in self._futures):  # any answer of it still open
        raise ValueError(f"group {request.group_id} is already in flight")
      self._futures.update({(request.group_id, i): f for i, f in enumerate(futures)})
    self.input_queue.put(request)
    return futures

  def update_params(self, params, version: int) -> None:
    """New weights (already on the sampler's shardings) used from the next decode call on; every running answer's
    cache is recomputed under them and its next tokens record `version`."""
    self.check()
    self.scheduler.update_params(params, version)

  @property
  def version(self) -> int:
    return self.scheduler.version

  def stats(self) -> dict[str, float]:
    """Counters (tokens, decode_steps, preemptions, weight_updates, ...), answers running and waiting, version,
    `busy_s` (seconds spent stepping); a snapshot the loop thread publishes after each step (safe from any thread)."""
    return dict(self._stats)

  def _publish_stats(self) -> None:
    s = self.scheduler
    waiting = sum(map(len, s.waiting)) + len(s.resume) + sum(r.num_answers for r in self._held)
    self._stats = {**s.counters, "running": len(s.running), "waiting": waiting,
                   "version": s.version, "busy_s": self._busy_s}

  def check(self) -> None:
    if self.error is not None:
      raise RuntimeError("sampler loop stopped on an error") from self.error

  def start(self) -> SamplerLoop:
    if self._threads:
      raise RuntimeError("sampler loop already started")
    self._threads = [threading.Thread(target=self._run, name="sampler-loop", daemon=True),
                     threading.Thread(target=self._detokenize, name="sampler-detok", daemon=True)]
    for t in self._threads:
      t.start()
    return self

  def stop(self, timeout: float | None = 60.0) -> None:
    """Stops after the current step; answers still in flight are abandoned (their futures cancelled)."""
    self._stop.set()
    for t in self._threads:
      t.join(timeout)
    self._end_futures(None)
    self.check()

  def __enter__(self) -> SamplerLoop:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  # --- threads --------------------------------------------------------------------------------------------------

  def _drain(self, block: bool) -> None:
    """New requests to the scheduler, each once the next step generates from its `min_version` or newer."""
    try:
      request = self.input_queue.get(timeout=self.idle_wait_s) if block else self.input_queue.get_nowait()
      deadline = time.perf_counter() + (GATHER_SHARE * self._last_step_s if block else 0.0)
      while True:
        self._held.append(request)
        wait = min(deadline - time.perf_counter(), GATHER_GAP_S)
        request = self.input_queue.get(timeout=wait) if wait > 0 else self.input_queue.get_nowait()
    except queue.Empty:
      pass
    if self._held:
      version = self.scheduler.next_version
      ready = [r for r in self._held if r.min_version <= version]
      self._held = [r for r in self._held if r.min_version > version]
      for r in ready:
        self.scheduler.submit(r)

  def _end_futures(self, error: BaseException | None) -> None:
    with self._futures_lock:
      futures, self._futures = list(self._futures.values()), {}
    end_futures(futures, error)

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        sched = self.scheduler
        self._drain(block=sched.idle and not sched.has_update)
        if not (sched.idle and not sched.has_update):
          start = time.perf_counter()
          for seq in sched.step():
            self._finished.put(seq)
          faults.reach("generation")
          self._last_step_s = time.perf_counter() - start
          self._busy_s += self._last_step_s
        self._publish_stats()
    except BaseException as e:  # surfaced by check()/stop() and the open futures
      self.error = e
      self._end_futures(e)
    finally:
      self._finished.put(None)

  def _detokenize(self) -> None:
    try:
      while (seq := self._finished.get()) is not None:
        text = self.detokenize(seq.tokens) if self.detokenize else ""
        with self._futures_lock:
          future = self._futures.pop((seq.request.group_id, seq.answer), None)
        if future is not None:  # None: cancelled by stop()
          future.set_result(seq.trajectory(text))
    except BaseException as e:
      self.error = e
      self._stop.set()
      self._end_futures(e)
