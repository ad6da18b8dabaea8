"""The `reward` group as one frozen, validated record: the reward workers and the code sandbox's limits."""

from __future__ import annotations

import dataclasses

from areal_jax.config_records import from_group
from areal_jax.reward.sandbox import ISOLATIONS, Limits


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
  """Field meanings as in configs/math.py."""

  num_workers: int = 2
  timeout_s: float = 5.0
  code_test_timeout_s: float = 2.0
  code_memory_mb: int = 1024
  code_isolation: str = "bwrap"

  def __post_init__(self):
    def bad(field, why):
      raise ValueError(f"reward.{field}={getattr(self, field)!r}: {why}")

    if self.code_isolation not in ISOLATIONS:
      bad("code_isolation", f"choose one of {ISOLATIONS}")
    for f in ("num_workers", "timeout_s"):
      if not getattr(self, f) > 0:
        bad(f, "must be positive")

  @property
  def code_limits(self) -> Limits:
    """The sandbox's limits on each code test."""
    return Limits(wall_s=self.code_test_timeout_s, cpu_s=self.code_test_timeout_s, memory_mb=self.code_memory_mb,
                  isolation=self.code_isolation)

  @classmethod
  def from_config(cls, c) -> RewardConfig:
    """From the `reward` group of an ml_collections config; unknown keys raise."""
    return from_group(cls, c, "reward")
