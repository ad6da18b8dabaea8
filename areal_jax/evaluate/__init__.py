"""Evaluating checkpoints (local or gs://) and model directories on JSONL or Parquet benchmarks: pass@k, greedy
accuracy, watch mode. `tools/evaluate.py` is the command line; `evaluate` is the library entry point."""

from areal_jax.evaluate.passk import mean_pass_at_k, pass_at_k
from areal_jax.evaluate.results import Settings
from areal_jax.evaluate.runner import evaluate

__all__ = ["Settings", "evaluate", "mean_pass_at_k", "pass_at_k"]
