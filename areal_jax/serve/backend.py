"""The server's sampler: every HTTP request becomes a scheduler `Request`, and all requests share the continuous batch
(a decode call advances every running answer, whichever request it belongs to).

    backend = Backend(engine=engine, params=params, version=3, eos_ids=[tok.eos_id], max_queue=256).start()
    future = backend.submit(Request(group_id=0, prompt_ids=ids, num_answers=2, sampling=SamplingParams(...)))
    answers = future.result()  # the request's finished `Sequence`s, in answer order
    futures = backend.submit_many(requests, on_tokens=callback)  # all or none; callback(i, Tokens) as they come
    backend.update_params(new_params, version=4)  # from any thread; applied between two decode calls
    backend.stop()

A `Driver` runs the scheduler in one thread. `submit` is safe from any thread (an asyncio handler awaits
`asyncio.wrap_future(future)`). A request waits in the queue until its first answer gets a decode slot; `submit`
raises `QueueFull` once `max_queue` requests wait beyond the decode slots free now (a burst on an idle server fills
the free slots and then the queue). A request whose future is cancelled before it reaches the scheduler is dropped;
once it runs it runs to the end (the scheduler has no abort), its answers unread.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable, Sequence as Seq

from areal_jax.sampler.driver import Driver, QueueFull, Tokens
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.requests import Request
from areal_jax.serve.scoring import Scorer, Scores

__all__ = ["Backend", "QueueFull", "Tokens"]


class Backend:

  def __init__(self, *, engine: Engine, params, version: int = 0, eos_ids: Iterable[int] = (), max_queue: int = 256,
               idle_wait_s: float = 0.005):
    self.driver = Driver(engine=engine, params=params, version=version, eos_ids=eos_ids, max_queue=max_queue,
                         idle_wait_s=idle_wait_s, name="serve-sampler")
    self._scorer: Scorer | None = None

  @property
  def scheduler(self):
    return self.driver.scheduler

  @property
  def max_queue(self) -> int:
    return self.driver.max_queue

  @max_queue.setter
  def max_queue(self, value: int) -> None:  # may be changed while serving
    self.driver.max_queue = value

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
    return self.driver.submit_many(requests, on_tokens=on_tokens)

  def update_params(self, params, version: int) -> None:
    """New weights (on the engine's shardings) from the next decode call on; tokens after it record `version`."""
    self.driver.update_params(params, version)

  @property
  def version(self) -> int:
    return self.driver.version

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
    """The scheduler's counters and answers running (published after each step), policy version, requests waiting
    for a decode slot, accepted, rejected and finished, and the most answers and requests one decode call has
    advanced."""
    return {**self.driver.stats(), "waiting": self.driver.queued}

  @property
  def error(self) -> BaseException | None:
    return self.driver.error

  def check(self) -> None:
    self.driver.check()

  def start(self) -> Backend:
    self.driver.start()
    return self

  def stop(self, timeout: float | None = 60.0) -> None:
    """Stops after the current step; requests still in flight fail with RuntimeError."""
    self.driver.stop(timeout, error=RuntimeError("the server is shutting down"))
