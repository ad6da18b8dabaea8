"""Evaluation results: one JSON file per (benchmark, checkpoint), beside the run and never inside a checkpoint.

    <output>/<benchmark>/step_<N>.json     a run's checkpoint at learner step N
    <output>/<benchmark>/model.json        a policy or HF model directory (a baseline; logged at step 0)
    <output>/tensorboard/                  the same numbers as TensorBoard scalars `<benchmark>/pass_at_1`, ...

`<output>` defaults to `<run>/eval`. A file whose `settings` equal the current ones (and, for a model directory, whose
`source` is the same) means "already evaluated": it is skipped. A file with other settings is left alone unless
`overwrite` is set. A local file is written under a temporary name and renamed, so a half-written file never counts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any

import numpy as np
from etils import epath

from areal_jax.evaluate.benchmarks import Benchmark
from areal_jax.evaluate.passk import mean_pass_at_k
from areal_jax.rl.evaluation import EvalResult

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  """How answers are generated, prompted and scored; a stored result is reused only under equal settings."""

  num_samples: int = 32  # n answers per question at `temperature` / `top_p`
  temperature: float = 0.6
  top_p: float = 0.95
  max_new_tokens: int = 1024
  pass_k: tuple[int, ...] = ()  # k values of pass@k; () = (1, num_samples)
  greedy: bool = True  # also one greedy answer per question (greedy accuracy)
  seed: int = 0
  prompt_template: str = "chat"
  instruct: bool = True  # append the \boxed{} (math) / code-block instruction to each question
  max_prompt_len: int = 2048

  def __post_init__(self):
    if self.num_samples < 1:
      raise ValueError(f"num_samples={self.num_samples} must be >= 1")
    if self.temperature < 0 or not 0 < self.top_p <= 1:
      raise ValueError(f"temperature={self.temperature} must be >= 0 and top_p={self.top_p} in (0, 1]")
    if self.max_new_tokens < 1 or self.max_prompt_len < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens} and max_prompt_len={self.max_prompt_len} must be >= 1")
    bad = [k for k in self.pass_k if not 1 <= k <= self.num_samples]
    if bad:
      raise ValueError(f"pass_k={list(self.pass_k)}: k={bad[0]} must lie in [1, num_samples={self.num_samples}]")
    object.__setattr__(self, "pass_k", tuple(sorted(set(self.pass_k or (1, self.num_samples)))))

  def to_json(self) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def result_path(output: epath.Path, benchmark: str, step: int | None) -> epath.Path:
  return output / benchmark / ("model.json" if step is None else f"step_{step}.json")


def read_result(path: epath.Path) -> dict[str, Any] | None:
  """A stored result, or None when there is none (or it is not valid JSON: it is then evaluated again)."""
  if not path.exists():
    return None
  try:
    d = json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    _log.warning("%s is not valid JSON (%s); evaluating again", path, e)
    return None
  return d if isinstance(d, dict) else None


def is_done(path: epath.Path, settings: Settings, *, source: str | None, overwrite: bool) -> bool:
  """Whether `path` already holds this evaluation (see the module docstring); logs why a result is kept."""
  old = read_result(path)
  if old is None:
    return False
  same = old.get("settings") == settings.to_json() and (source is None or old.get("source") == source)
  if same:
    return True
  if overwrite:
    return False
  _log.warning("%s holds a result with other settings or source (%s); keeping it. Pass --overwrite to replace it or "
               "--output_dir to write elsewhere", path, {"settings": old.get("settings"), "source": old.get("source")})
  return True


def summarize(*, benchmark: Benchmark, settings: Settings, sampled: EvalResult, greedy: EvalResult | None,
              source: str, step: int | None, version: int) -> dict[str, Any]:
  """The result record of one (benchmark, checkpoint) from the sampled (and greedy) `EvalResult`s."""
  metrics = {f"pass@{k}": mean_pass_at_k(sampled.correct, k) for k in settings.pass_k}
  metrics["mean_length"] = sampled.mean_length
  if greedy is not None:
    metrics["greedy_accuracy"] = greedy.accuracy
    metrics["greedy_mean_length"] = greedy.mean_length
  correct = (np.asarray(sampled.correct) > 0.5).sum(axis=1)
  questions = [{"uid": r.uid, "correct": int(c), "samples": settings.num_samples,
                "mean_length": float(np.mean(sampled.lengths[i]))}
               for i, (r, c) in enumerate(zip(benchmark.records, correct))]
  if greedy is not None:
    for q, g in zip(questions, greedy.correct[:, 0]):
      q["greedy_correct"] = bool(g > 0.5)
  return {"benchmark": benchmark.name, "file": benchmark.path, "source": source, "step": step, "version": version,
          "settings": settings.to_json(), "num_questions": len(benchmark.records),
          "dropped_too_long": benchmark.too_long, "metrics": metrics,
          "seconds": sampled.seconds + (greedy.seconds if greedy is not None else 0.0),
          "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "questions": questions}


def write_result(path: epath.Path, result: dict[str, Any]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  text = json.dumps(result, indent=1)
  if "://" in os.fspath(path):
    path.write_text(text)  # an object appears whole or not at all
  else:
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text(text)
    tmp.rename(path)
