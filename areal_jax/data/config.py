"""The `data` group as one frozen, validated record: where the prompts come from and how they are rendered."""

from __future__ import annotations

import dataclasses

from areal_jax.config_records import from_group
from areal_jax.data import prompts, synthetic

# data.source: "files" reads data.path and data.eval_path, each JSONL or Parquet (`.parquet`), local or gs://;
# "jsonl" is its former name (saved configs and commands still load).
SOURCES = ("synthetic", "files", "jsonl", "tfds")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """Field meanings as in configs/math.py. `check_source` (run by `from_config` unless told not to) asks that a
  files or tfds source names its data; a compile check reads none."""

  source: str = "synthetic"
  path: str = ""
  eval_path: str = ""
  tfds_name: str = ""
  tfds_data_dir: str = ""
  split: str = "train"
  eval_split: str = ""
  prompt_template: str = "plain"
  max_prompt_len: int = 48
  skip_bad_rows: bool = False
  shuffle_seed: int = 0
  synthetic_task: str = "arithmetic"
  synthetic_difficulty: int = 1
  synthetic_mix: str = ""
  synthetic_size: int = 20000
  eval_size: int = 128

  def _bad(self, field: str, why: str):
    raise ValueError(f"data.{field}={getattr(self, field)!r}: {why}")

  def __post_init__(self):
    for field, choices in (("source", SOURCES), ("prompt_template", prompts.TEMPLATES),
                           ("synthetic_task", synthetic.TASKS)):
      if getattr(self, field) not in choices:
        self._bad(field, f"choose one of {choices}")
    if self.source == "jsonl":
      object.__setattr__(self, "source", "files")  # one name below the config
    if not self.max_prompt_len > 0:
      self._bad("max_prompt_len", "must be positive")

  def check_source(self) -> DataConfig:
    """This record, once a files source has a path and a tfds source a dataset name."""
    if self.source == "files" and not self.path:
      self._bad("path", "data.source='files' needs a path to a .jsonl or .parquet file (local or gs://)")
    if self.source == "tfds" and not self.tfds_name:
      self._bad("tfds_name", "data.source='tfds' needs a dataset name")
    return self

  @classmethod
  def from_config(cls, c, *, source: bool = True) -> DataConfig:
    """From the `data` group of an ml_collections config; unknown keys raise. `source=False` skips
    `check_source`."""
    out = from_group(cls, c, "data")
    return out.check_source() if source else out
