"""The sampler side as the learner sees it: one `Rollout` protocol, in one process or across processes.

    futures = rollout.submit(request)   # one future per answer, generated from request.min_version or newer
    rollout.publish(params, version)    # the learner's new weights (its local copy), swapped in between decode steps
    rollout.stats(), rollout.sync_metrics(), rollout.sampler_metrics(), rollout.check(), rollout.stop()

An answer whose sampler process was lost fails with `SamplerLost`: the controller generates its group again.

`LocalRollout` (distributed/replicas.py) runs a `Sampler` per engine replica of this process's sampler slice
(`mesh.sampler_replicas`) and moves weights device-to-device;
`SamplerHub` (sampler_hub.py) drives sampler processes and moves weights over `jax.experimental.transfer`.
Under LoRA both move the whole model once, at the start, and then only the adapters: the samplers keep their copy
of the frozen base and join each version's adapters to it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

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
