"""The sampler side as the learner sees it: one `Rollout` protocol, in one process or across processes.

    futures = rollout.submit(request)   # one future per answer, generated from request.min_version or newer
    rollout.publish(params, version)    # the learner's new weights (its local copy), swapped in between decode steps
    rollout.stats(), rollout.sync_metrics(), rollout.check(), rollout.stop()

`LocalRollout` runs a `SamplerLoop` on this process's sampler slice and moves weights device-to-device;
`SamplerHub` (sampler_hub.py) drives sampler processes and moves weights over `jax.experimental.transfer`.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from areal_jax import faults
from areal_jax.distributed import weight_transfer
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.loop import SamplerLoop
from areal_jax.sampler.requests import Request


class Rollout(Protocol):

  def submit(self, request: Request) -> list[Future]:
    ...

  def publish(self, params, version: int) -> None:
    ...

  def stats(self) -> dict[str, float]:
    """Counters summed over the samplers: tokens, busy_s, running, waiting, ..."""
    ...

  def sync_metrics(self) -> dict[str, float]:
    """The latest weight transfers' `sync/...` metrics beyond the publish time ({} when there is nothing more)."""
    ...

  def check(self) -> None:
    """Raises the samplers' error, if one failed."""
    ...

  def stop(self) -> None:
    ...


class LocalRollout:
  """A `SamplerLoop` on this process's sampler slice, running from construction."""

  def __init__(self, *, abstract_model, config: SamplerConfig, mesh, params, version: int, eos_ids, detokenize):
    self.engine = Engine(model=abstract_model, config=config, mesh=mesh)
    self.loop = SamplerLoop(engine=self.engine, params=self._move(params), version=version, eos_ids=eos_ids,
                            detokenize=detokenize).start()

  def _move(self, params):
    """Onto the sampler's shardings, device-to-device, cast to `sampler.param_dtype` on the learner's devices first
    (so the narrower copy is what crosses over)."""
    return weight_transfer.transfer(params, self.engine.param_shardings, dtype=self.engine.param_dtype)

  def submit(self, request: Request) -> list[Future]:
    return self.loop.submit(request)

  def publish(self, params, version: int) -> None:
    moved = self._move(params)
    faults.reach("weight_update")
    self.loop.update_params(moved, version)

  def stats(self) -> dict[str, float]:
    return self.loop.stats()

  def sync_metrics(self) -> dict[str, float]:
    return {}

  def check(self) -> None:
    self.loop.check()

  def stop(self) -> None:
    self.loop.stop()
