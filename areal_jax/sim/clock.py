"""An asyncio event loop on a virtual clock: `await asyncio.sleep(s)` takes no wall time, and when nothing is ready
the clock jumps to the next timer. Code written for the real loop (the rollout controller's coroutines, futures
completed with `call_soon_threadsafe`) runs on it unchanged, in one thread, deterministically.

    loop = virtual_loop()
    loop.run_until_complete(main())   # loop.time() is the virtual seconds since the start
"""

from __future__ import annotations

import asyncio
import selectors


class Stuck(RuntimeError):
  """Nothing is ready and no timer is set: every task waits on something that cannot happen."""


class _Selector(selectors.DefaultSelector):
  """Polls the real selector without blocking (the loop's self-pipe); a wait of `timeout` advances the clock."""

  def __init__(self, clock: list[float]):
    super().__init__()
    self._clock = clock

  def select(self, timeout=None):
    events = super().select(0)
    if events or timeout == 0:
      return events
    if timeout is None:
      raise Stuck("the simulation has nothing to run and no timer to wait for")
    self._clock[0] += timeout
    return []


class _VirtualLoop(asyncio.SelectorEventLoop):

  def __init__(self):
    self._now = [0.0]
    super().__init__(_Selector(self._now))

  def time(self) -> float:
    return self._now[0]


def virtual_loop() -> asyncio.AbstractEventLoop:
  """A new event loop on a virtual clock starting at 0 (not set as the thread's current loop)."""
  return _VirtualLoop()
