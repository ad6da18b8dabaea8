"""The run's own config groups as frozen, validated records: evaluation, checkpoints, metrics, weight updates and the
supervised warm-start (field meanings as in configs/math.py). Each `from_config` takes its group of an ml_collections
config; unknown keys raise."""

from __future__ import annotations

import dataclasses

from areal_jax.config_records import from_group


def _bad(record, field: str, why: str):
  raise ValueError(f"{record.GROUP}.{field}={getattr(record, field)!r}: {why}")


def _positive(record, *fields: str) -> None:
  for f in fields:
    if not getattr(record, f) > 0:
      _bad(record, f, "must be positive")


class _Group:
  GROUP = ""  # the config group's name

  @classmethod
  def from_config(cls, c):
    return from_group(cls, c, cls.GROUP)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig(_Group):
  GROUP = "eval"
  every_steps: int = 30  # learner steps between held-out evaluations
  num_samples: int = 4  # 1 = greedy; k > 1 = pass@1 averaged over k samples at `temperature`
  temperature: float = 1.0

  def __post_init__(self):
    _positive(self, "every_steps", "num_samples")
    if self.temperature < 0:
      _bad(self, "temperature", "must be >= 0")
    if self.num_samples == 1 and self.temperature != EvalConfig.temperature:
      _bad(self, "temperature", f"unused: eval.num_samples=1 answers greedily; set eval.num_samples > 1 to sample "
           f"at this temperature (pass@1 over the samples), or leave it at {EvalConfig.temperature}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig(_Group):
  GROUP = "checkpoint"
  every_steps: int = 30
  max_to_keep: int = 3

  def __post_init__(self):
    _positive(self, "every_steps", "max_to_keep")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetricsConfig(_Group):
  GROUP = "metrics"
  tensorboard: bool = True  # TensorBoard event files beside metrics.jsonl
  save_batches: bool = False  # every trained batch to <workdir>/batches/step_N.npz


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncConfig(_Group):
  """Weight updates from the learner to sampler processes (a multi-process run: `distributed/sampler_hub.py`)."""

  GROUP = "sync"
  delta: bool = False  # a sampler holding the version before gets only the elements whose bits changed (lossless)
  overlap: bool = True  # the learner trains on while the copy is staged and offered (one version in flight)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmstartConfig(_Group):
  """`steps` = 0: no warm-start. `heldout` is checked against the examples when they are known
  (`run/initial_weights.py`)."""

  GROUP = "warmstart"
  steps: int = 500
  lr: float = 2e-3
  batch_size: int = 16
  target_match: float = 0.6  # 0 = off
  heldout: int = 128
  target_loss: float = 0.0  # 0 = off
  accumulate: bool = False
  cache_dir: str = ""  # runs share warm-starts here, keyed by what decides them; "" = only <workdir>/warmstart
  on_init_from: bool = False  # also warm-start `model.init_from`'s weights (fine-tune a checkpoint before RL)

  def __post_init__(self):
    _positive(self, "lr", "batch_size")
    for f in ("steps", "heldout", "target_loss"):
      if getattr(self, f) < 0:
        _bad(self, f, "must be >= 0")
    if not 0 <= self.target_match <= 1:
      _bad(self, "target_match", "must lie in [0, 1] (0 = off)")
