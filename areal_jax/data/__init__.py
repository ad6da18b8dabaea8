"""Problems and prompts: JSONL / TFDS / synthetic sources, prompt templates, and the resumable prompt stream."""

from areal_jax.data.config import DataConfig
from areal_jax.data.dataset import PromptDataset, build_dataset, load_problems, to_records, warmstart_pairs
from areal_jax.data.records import DataError, Problem, PromptRecord

__all__ = ["DataConfig", "DataError", "Problem", "PromptDataset", "PromptRecord", "build_dataset", "load_problems",
           "to_records", "warmstart_pairs"]
