"""Waiting in tests: for the condition or event a test means, with a deadline, never for a fixed time."""

import asyncio
import time


def wait_until(condition, *, timeout_s: float = 30.0, what: str = "the condition", poll_s: float = 0.01):
  """`condition()`'s first truthy value, asked every `poll_s` until `timeout_s` has passed; then fails naming `what`.
  `what` may be a callable, for a message that shows the state at the deadline. An exception from `condition` (a job
  that ended, a watcher that failed) ends the wait at once."""
  deadline = time.monotonic() + timeout_s
  while not (value := condition()):
    if time.monotonic() > deadline:
      raise AssertionError(f"not within {timeout_s:g} s: {what() if callable(what) else what}")
    time.sleep(poll_s)
  return value


def settle(loop: asyncio.AbstractEventLoop, passes: int = 2, timeout_s: float = 30.0) -> None:
  """Returns once `loop` (running in another thread) has run everything queued on it before this call, and what that
  woke: each pass is a no-op task, queued behind the callbacks already there."""
  for _ in range(passes):
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout_s)
