"""The sampler's background loop in a run: prompt groups in, futures of finished `Trajectory`s out, weights
swappable from any thread.

    loop = SamplerLoop(engine=engine, params=params, version=0, eos_ids=[tok.eos_id], detokenize=tok.decode)
    loop.start()
    futures = loop.submit(Request(group_id=7, prompt_ids=ids, num_answers=16, sampling=SamplingParams(...)))
    traj = futures[0].result()  # answer 0 of group 7, once it has finished
    loop.update_params(new_params, version=1)  # e.g. from the learner thread; applied between two decode calls
    loop.stop()

A `Driver` runs the scheduler in one thread, gathering requests that arrive in a burst and holding a group until the
loop generates from policy `request.min_version` or newer; a second thread detokenises finished answers and completes
their futures (callbacks run there: they must not block), so tokenizer work never delays a decode step. An exception
in either thread stops the loop and fails every future still open; `check()` and `stop()` re-raise it; `stop()`
cancels the futures of answers still in flight.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from collections.abc import Callable, Iterable, Sequence

from areal_jax.sampler.driver import Driver
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.requests import Request

_log = logging.getLogger(__name__)


def end_futures(futures: Iterable[Future], error: BaseException | None) -> None:
  """Fails every future with `error`; with None, cancels them (answers abandoned at a stop)."""
  for f in futures:
    if error is None:
      f.cancel()
    elif not f.done():
      f.set_exception(error)


class SamplerLoop:

  def __init__(self, *, engine: Engine, params, version: int = 0, eos_ids: Iterable[int] = (),
               detokenize: Callable[[Sequence[int]], str] | None = None, idle_wait_s: float = 0.005):
    self.driver = Driver(engine=engine, params=params, version=version, eos_ids=eos_ids, gather=True,
                         idle_wait_s=idle_wait_s, name="sampler-loop")
    if engine.cfg.warmup:
      start = time.perf_counter()
      self.driver.scheduler.state = engine.warmup(params, self.driver.scheduler.state)
      _log.info("sampler.warmup: compiled the sampler's programs in %.1f s", time.perf_counter() - start)
    self.detokenize = detokenize
    self._futures: dict[int, dict[int, Future]] = {}  # group id -> answer -> its future, until finished
    self._futures_lock = threading.Lock()
    self.error: BaseException | None = None
    self._finished: queue.Queue = queue.Queue()
    self._detok: threading.Thread | None = None

  @property
  def scheduler(self):
    return self.driver.scheduler

  # --- controller-facing API --------------------------------------------------------------------------------------

  def submit(self, request: Request) -> list[Future]:
    """Queues a prompt group (checked here: a bad prompt raises in the caller's thread); returns one future per
    answer, in answer order. Group ids must be unique among the groups in flight."""
    self.scheduler.validate(request)
    futures = [Future() for _ in range(request.num_answers)]
    with self._futures_lock:
      if request.group_id in self._futures:  # an answer of it still open
        raise ValueError(f"group {request.group_id} is already in flight")
      self._futures[request.group_id] = dict(enumerate(futures))
    [whole] = self.driver.submit_many([request], on_answer=lambda _, seq: self._finished.put(seq))
    whole.add_done_callback(lambda f: self._failed(f, request.group_id))
    return futures

  def update_params(self, params, version: int) -> None:
    """New weights (already on the sampler's shardings) used from the next decode call on; every running answer's
    cache is recomputed under them and its next tokens record `version`."""
    self.check()
    self.driver.update_params(params, version)

  @property
  def version(self) -> int:
    return self.driver.version

  def stats(self) -> dict[str, float]:
    """Counters (tokens, decode_steps, preemptions, weight_updates, ...), answers running and waiting, version,
    `busy_s` (seconds spent stepping); a snapshot the driver publishes after each step (safe from any thread)."""
    return self.driver.stats()

  def check(self) -> None:
    self.driver.check()
    if self.error is not None:
      raise RuntimeError("sampler loop stopped on an error") from self.error

  def start(self) -> SamplerLoop:
    if self._detok is not None:
      raise RuntimeError("sampler loop already started")
    self.driver.start()
    self._detok = threading.Thread(target=self._detokenize, name="sampler-detok", daemon=True)
    self._detok.start()
    return self

  def stop(self, timeout: float | None = 60.0) -> None:
    """Stops after the current step; answers still in flight are abandoned (their futures cancelled)."""
    self.driver.stop(timeout)
    self._finished.put(None)
    if self._detok is not None:
      self._detok.join(timeout)
    self._end_futures(None)
    self.check()

  def __enter__(self) -> SamplerLoop:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  # --- the detokeniser ------------------------------------------------------------------------------------------

  def _failed(self, whole: Future, group_id: int) -> None:
    """The driver failed a group's request (its thread stopped on an error): so do the group's open answers."""
    error = whole.exception() if not whole.cancelled() else None
    if error is None or self.driver.error is None:
      return  # finished, or abandoned at a stop
    with self._futures_lock:
      futures = list(self._futures.pop(group_id, {}).values())
    end_futures(futures, error)

  def _end_futures(self, error: BaseException | None) -> None:
    with self._futures_lock:
      futures, self._futures = [f for group in self._futures.values() for f in group.values()], {}
    end_futures(futures, error)

  def drain(self) -> None:
    """Completes the futures of the answers finished so far, in the caller's thread: for a loop whose threads never
    start (the simulator steps `driver` itself)."""
    while True:
      try:
        seq = self._finished.get_nowait()
      except queue.Empty:
        return
      self._complete(seq)

  def _complete(self, seq) -> None:
    text = self.detokenize(seq.tokens) if self.detokenize else ""
    with self._futures_lock:
      group = self._futures.get(seq.request.group_id, {})
      future = group.pop(seq.answer, None)
      if not group:
        self._futures.pop(seq.request.group_id, None)
    if future is not None:  # None: cancelled by stop()
      future.set_result(seq.trajectory(text))

  def _detokenize(self) -> None:
    try:
      while (seq := self._finished.get()) is not None:
        self._complete(seq)
    except BaseException as e:  # pylint: disable=broad-except  # surfaced by check()/stop() and the open futures
      self.error = e
      self.driver.stop(timeout=0, error=e)
      self._end_futures(e)
