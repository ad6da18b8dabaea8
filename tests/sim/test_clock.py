"""The virtual-time event loop: sleeps take no wall time, timers fire in order, a deadlock is an error."""

import asyncio
import concurrent.futures
import time

import pytest

from areal_jax.sim.clock import Stuck, virtual_loop


def test_sleeps_advance_the_virtual_clock_not_the_wall_clock():
  order = []

  async def sleeper(name, s):
    await asyncio.sleep(s)
    order.append((name, asyncio.get_running_loop().time()))

  async def main():
    await asyncio.gather(sleeper("b", 3600.0), sleeper("a", 60.0), sleeper("c", 7200.0))

  loop = virtual_loop()
  start = time.monotonic()
  loop.run_until_complete(main())
  loop.close()
  assert order == [("a", 60.0), ("b", 3600.0), ("c", 7200.0)]
  assert time.monotonic() - start < 5


def test_a_future_completed_on_the_loop_wakes_its_awaiter():
  """The rollout controller awaits concurrent futures (`async_thread.awaitable`) that the simulator completes from
  a timer on the same thread."""
  async def main():
    loop = asyncio.get_running_loop()
    future = concurrent.futures.Future()
    loop.call_later(5.0, future.set_result, 42)
    return await asyncio.wrap_future(future), loop.time()

  loop = virtual_loop()
  assert loop.run_until_complete(main()) == (42, 5.0)
  loop.close()


def test_waiting_on_what_cannot_happen_raises():
  async def main():
    await asyncio.Event().wait()

  loop = virtual_loop()
  with pytest.raises(Stuck, match="nothing to run"):
    loop.run_until_complete(main())
  loop.close()
