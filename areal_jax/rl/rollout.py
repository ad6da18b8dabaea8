"""The sampler side as the learner sees it: one `Rollout` protocol, in one process or across processes.

    futures = rollout.submit(request)   # one future per answer, generated from request.min_version or newer
    rollout.publish(params, version)    # the learner's new weights (its local copy), swapped in between decode steps
    rollout.stats(), rollout.sync_metrics(), rollout.sampler_metrics(), rollout.check(), rollout.stop()

An answer whose sampler process was lost fails with `SamplerLost`: the controller generates its group again.

`LocalRollout` runs a `SamplerLoop` on this process's sampler slice and moves weights device-to-device;
`SamplerHub` (sampler_hub.py) drives sampler processes and moves weights over `jax.experimental.transfer`.
Under LoRA both move the whole model once, at the start, and then only the adapters: the samplers keep their copy
of the frozen base and join each version's adapters to it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from areal_jax import faults
from flax import nnx

from areal_jax.distributed import weight_transfer
from areal_jax.models import lora
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

  def sampler_metrics(self) -> dict[str, float]:
    """Sampler processes coming and going (`samplers/...`; {} in one process)."""
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
    params = self._move(params, self.engine.param_shardings)
    self._base = lora.split(params)[1] if lora.has_adapters(params) else None  # held under LoRA
    self._bytes = 0
    self.loop = SamplerLoop(engine=self.engine, params=params, version=version, eos_ids=eos_ids,
                            detokenize=detokenize).start()

  def _move(self, params, shardings):
    """Onto the sampler's shardings, device-to-device, cast to `sampler.param_dtype` on the learner's devices first
    (so the narrower copy is what crosses over)."""
    moved = weight_transfer.transfer(params, shardings, dtype=self.engine.param_dtype)
    self._bytes = lora.nbytes(moved)
    return moved

  def submit(self, request: Request) -> list[Future]:
    return self.loop.submit(request)

  def publish(self, params, version: int) -> None:
    if self._base is None:
      moved = self._move(params, self.engine.param_shardings)
    else:
      adapters = self._move(lora.split(params)[0], lora.split(self.engine.param_shardings)[0])
      moved = nnx.merge_state(self._base, adapters)
    faults.reach("weight_update")
    self.loop.update_params(moved, version)

  def stats(self) -> dict[str, float]:
    return self.loop.stats()

  def sync_metrics(self) -> dict[str, float]:
    return {"sync/bytes": float(self._bytes)}

  def sampler_metrics(self) -> dict[str, float]:
    return {}

  def check(self) -> None:
    self.loop.check()

  def stop(self) -> None:
    self.loop.stop()
