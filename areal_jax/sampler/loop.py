"""The sampler's background loop: prompt groups in, finished `Trajectory`s out, weights swappable from any thread.

    loop = SamplerLoop(engine=engine, params=params, version=0, eos_ids=[tok.eos_id], detokenize=tok.decode)
    loop.start()
    loop.submit(Request(group_id=7, prompt_ids=ids, num_answers=16, sampling=SamplingParams(max_new_tokens=512)))
    traj = loop.output_queue.get()  # one per finished answer, group_id 7, ...
    loop.update_params(new_params, version=1)  # e.g. from the learner thread; applied between two decode calls
    loop.stop()

One thread runs the scheduler (admission, decode steps, weight swaps); a second one detokenises finished answers and
puts them on `output_queue`, so tokenizer work never delays a decode step. An exception in either thread stops the
loop; `check()`, `stop()` and `get()` re-raise it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from areal_jax import faults
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.requests import Request
from areal_jax.sampler.scheduler import Scheduler
from areal_jax.types import Trajectory


class SamplerLoop:

  def __init__(self, *, engine: Engine, params, version: int = 0, eos_ids: Iterable[int] = (),
               detokenize: Callable[[Sequence[int]], str] | None = None, input_queue: queue.Queue | None = None,
               output_queue: queue.Queue | None = None, idle_wait_s: float = 0.005):
    self.scheduler = Scheduler(engine=engine, params=params, version=version, eos_ids=eos_ids)
    self.detokenize = detokenize
    self.input_queue: queue.Queue[Request] = input_queue or queue.Queue()
    self.output_queue: queue.Queue[Trajectory] = output_queue or queue.Queue()
    self.idle_wait_s = idle_wait_s
    self.error: BaseException | None = None
    self._finished: queue.Queue = queue.Queue()
    self._stop = threading.Event()
    self._threads: list[threading.Thread] = []
    self._busy_s = 0.0  # wall time spent in scheduler steps (prefill, decode, weight swaps)
    self._publish_stats()

  # --- controller-facing API --------------------------------------------------------------------------------------

  def submit(self, request: Request) -> None:
    """Queues a prompt group (checked here: a bad prompt raises in the caller's thread)."""
    self.scheduler.validate(request)
    self.input_queue.put(request)

  def update_params(self, params, version: int) -> None:
    """New weights (already on the sampler's shardings) used from the next decode call on; every running answer's
    cache is recomputed under them and its next tokens record `version`."""
    self.check()
    self.scheduler.update_params(params, version)

  @property
  def version(self) -> int:
    return self.scheduler.version

  def get(self, timeout: float | None = None) -> Trajectory:
    """The next finished answer; raises the loop's error if it stopped on one, queue.Empty after `timeout`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      self.check()
      wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
      try:
        return self.output_queue.get(timeout=wait)
      except queue.Empty:
        if deadline is not None and time.monotonic() >= deadline:
          raise

  def stats(self) -> dict[str, float]:
    """Counters (tokens, decode_steps, preemptions, weight_updates, ...), answers running and waiting, version,
    `busy_s` (seconds spent stepping); a snapshot the loop thread publishes after each step (safe from any thread)."""
    return dict(self._stats)

  def _publish_stats(self) -> None:
    s = self.scheduler
    self._stats = {**s.counters, "running": len(s.running), "waiting": sum(map(len, s.waiting)) + len(s.resume),
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
    """Stops after the current step; answers still in flight are abandoned."""
    self._stop.set()
    for t in self._threads:
      t.join(timeout)
    self.check()

  def __enter__(self) -> SamplerLoop:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  # --- threads --------------------------------------------------------------------------------------------------

  def _drain(self, block: bool) -> None:
    try:
      request = self.input_queue.get(timeout=self.idle_wait_s) if block else self.input_queue.get_nowait()
      while True:
        self.scheduler.submit(request)
        request = self.input_queue.get_nowait()
    except queue.Empty:
      pass

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
          self._busy_s += time.perf_counter() - start
        self._publish_stats()
    except BaseException as e:  # surfaced by check()/get()/stop()
      self.error = e
    finally:
      self._finished.put(None)

  def _detokenize(self) -> None:
    try:
      while (seq := self._finished.get()) is not None:
        text = self.detokenize(seq.tokens) if self.detokenize else ""
        self.output_queue.put(seq.trajectory(text))
    except BaseException as e:
      self.error = e
      self._stop.set()
