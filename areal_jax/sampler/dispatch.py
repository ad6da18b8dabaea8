"""Which sampler takes the next prompt group: one rule for the engine replicas of a process (`rl.rollout`) and the
sampler processes of a job (`distributed.sampler_hub`). A group goes whole to one sampler, so its answers share the
prompt's pages there."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping


@dataclasses.dataclass(frozen=True)
class Load:
  """What a sampler holds: answers submitted to it and not finished, and KV pages free (0 where unknown)."""

  answers: int
  free_pages: int = 0


def least_loaded(loads: Mapping[Hashable, Load]):
  """The key of the sampler with the fewest answers outstanding, then the most free pages, then the lowest key."""
  if not loads:
    raise ValueError("no sampler to dispatch to")
  return min(loads, key=lambda k: (loads[k].answers, -loads[k].free_pages, k))
