"""An asyncio event loop in a daemon thread of its own, for code that awaits while the caller's thread blocks on
other work (the learner's step, a test's assertions).

    thread = AsyncThread("rollout")
    future = thread.submit(some_coroutine())  # a concurrent.futures.Future, safe from any thread
    thread.call(event.set)                    # a plain callable, run on the loop
    thread.stop()                             # cancels every task still running, then ends the thread
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine


def awaitable(future: concurrent.futures.Future) -> asyncio.Future:
  """`future` (completed by another thread: a sampler's, the reward service's) to await on the running loop.
  Cancelling the task that awaits it leaves `future` alone: its producer completes it as usual, unheard."""
  return asyncio.shield(asyncio.wrap_future(future))


class AsyncThread:

  def __init__(self, name: str):
    self.loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
    self._thread.start()

  def submit(self, coro: Coroutine) -> concurrent.futures.Future:
    return asyncio.run_coroutine_threadsafe(coro, self.loop)

  def call(self, fn: Callable[..., object], *args) -> None:
    self.loop.call_soon_threadsafe(fn, *args)

  def stop(self, timeout: float = 30.0) -> None:
    """Cancels the tasks still running, lets them unwind (one loop pass), and ends the thread."""
    async def cancel_all():
      tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
      for task in tasks:
        task.cancel()
      if tasks:
        await asyncio.wait(tasks, timeout=timeout / 2)  # a task that swallows its cancellation is left behind
      self.loop.stop()

    if self._thread.is_alive():
      self.submit(cancel_all())
      self._thread.join(timeout)
