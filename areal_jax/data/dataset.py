"""Prompt datasets for the controller: a seeded, epoch-shuffled, resumable stream of PromptRecords.

    train = build_dataset(settings.data, tokenizer, split="train")   # settings = config.validate(config)
    record = next(train)                 # PromptRecord(uid, prompt, prompt_ids, reference, kind, solution)
    state = train.state()                # {"epoch": 3, "index": 17, "seed": 0, "size": 20000}: save with checkpoints
    train.restore(state)                 # after a restart: continues exactly where it stopped
    evalset = build_dataset(settings.data, tokenizer, split="eval")   # held out; `evalset.records` in fixed order

Sources (`data.source`): "synthetic" (`data.synthetic.generate`), "files" (`data.path`: JSONL or Parquet, local or
gs://), "tfds" (`data.tfds_name` from `data.tfds_data_dir`, split `data.split`). The eval set is `data.eval_path` /
`data.eval_split` when given, else `data.eval_size` problems held out of the training data (never trained on).
Prompts longer than `data.max_prompt_len` tokens are dropped and counted with a warning, never truncated.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import numpy as np

from areal_jax.data import prompts, sources, synthetic
from areal_jax.data.config import SOURCES, DataConfig
from areal_jax.data.records import DataError, Problem, PromptRecord

_log = logging.getLogger(__name__)
SPLITS = ("train", "eval")


class PromptDataset:
  """A fixed list of records read as an endless stream: epoch e visits them in the order of a permutation seeded by
  (seed, e). `state()` / `restore()` make the stream resumable; `next()` is thread-safe."""

  def __init__(self, records: Sequence[PromptRecord], *, seed: int = 0, shuffle: bool = True, name: str = "",
               stats: dict[str, int] | None = None):
    if not records:
      raise DataError(f"dataset {name!r} has no records")
    self.records = list(records)
    self.seed, self.shuffle, self.name = seed, shuffle, name
    self.stats = dict(stats or {})
    self._lock = threading.Lock()
    self._epoch, self._index = 0, 0
    self._order = self._permutation(0)

  def _permutation(self, epoch: int) -> np.ndarray:
    n = len(self.records)
    return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

  def __len__(self) -> int:
    return len(self.records)

  def __iter__(self) -> PromptDataset:
    return self

  def __next__(self) -> PromptRecord:
    with self._lock:
      if self._index == len(self.records):
        self._epoch, self._index = self._epoch + 1, 0
        self._order = self._permutation(self._epoch)
      record = self.records[self._order[self._index]]
      self._index += 1
      return record

  @property
  def epoch(self) -> int:
    return self._epoch

  def state(self) -> dict[str, int]:
    """Where the stream stands: small and JSON-serialisable."""
    with self._lock:
      return {"epoch": self._epoch, "index": self._index, "seed": self.seed, "size": len(self.records)}

  def restore(self, state: dict) -> None:
    """Continues from `state()` of a dataset built the same way (same seed and size, else DataError)."""
    for key in ("epoch", "index", "seed", "size"):
      if key not in state:
        raise DataError(f"dataset {self.name!r}: iterator state {state!r} lacks {key!r}")
    if int(state["seed"]) != self.seed or int(state["size"]) != len(self.records):
      raise DataError(f"dataset {self.name!r}: iterator state was saved for seed {state['seed']} and "
                      f"{state['size']} records, this dataset has seed {self.seed} and {len(self.records)}")
    epoch, index = int(state["epoch"]), int(state["index"])
    if epoch < 0 or not 0 <= index <= len(self.records):
      raise DataError(f"dataset {self.name!r}: iterator state {state!r} is out of range")
    with self._lock:
      self._epoch, self._index = epoch, index
      self._order = self._permutation(epoch)


def _hold_out(problems: list[Problem], n: int, seed: int, where: str) -> tuple[list[Problem], list[Problem]]:
  """(train, eval): `n` problems chosen by a seeded permutation go to eval; eval keeps file order."""
  if n >= len(problems):
    raise DataError(f"{where}: data.eval_size={n} leaves nothing to train on ({len(problems)} problems); "
                    "lower it or set data.eval_path")
  held = set(np.random.default_rng([seed, 7]).permutation(len(problems))[:n].tolist())
  return ([p for i, p in enumerate(problems) if i not in held], [p for i, p in enumerate(problems) if i in held])


def load_problems(data: DataConfig, *, split: str) -> tuple[list[Problem], dict[str, int]]:
  """The problems of `split` ("train" | "eval") for the run's `data` settings, and counts of what was skipped."""
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: choose one of {SPLITS}")
  stats = {"bad_rows": 0}
  if data.source == "synthetic":
    difficulty = synthetic.parse_mix(data.synthetic_mix) if data.synthetic_mix else data.synthetic_difficulty
    task = data.synthetic_task
    held = synthetic.generate(data.eval_size, difficulty=difficulty, seed=data.shuffle_seed, split="eval",
                              distinct=True, task=task)
    if split == "eval":
      return held, stats
    return synthetic.generate(data.synthetic_size, difficulty=difficulty, seed=data.shuffle_seed, split="train",
                              exclude=frozenset(p.question for p in held), task=task), stats
  if data.source == "files":
    if split == "eval" and data.eval_path:
      problems, stats["bad_rows"] = sources.read_file(data.eval_path, skip_bad_rows=data.skip_bad_rows,
                                                      field="data.eval_path")
      return problems, stats
    problems, stats["bad_rows"] = sources.read_file(data.path, skip_bad_rows=data.skip_bad_rows, field="data.path")
    where = data.path
  elif data.source == "tfds":
    if split == "eval" and data.eval_split:
      problems, stats["bad_rows"] = sources.read_tfds(data.tfds_name, data_dir=data.tfds_data_dir,
                                                      split=data.eval_split, skip_bad_rows=data.skip_bad_rows)
      return problems, stats
    problems, stats["bad_rows"] = sources.read_tfds(data.tfds_name, data_dir=data.tfds_data_dir, split=data.split,
                                                    skip_bad_rows=data.skip_bad_rows)
    where = f"tfds {data.tfds_name}/{data.split}"
  else:
    raise ValueError(f"data.source={data.source!r}: choose one of {SOURCES}")
  held_out_elsewhere = data.eval_path if data.source == "files" else data.eval_split
  if held_out_elsewhere or data.eval_size == 0:
    return problems, stats
  train, held = _hold_out(problems, data.eval_size, data.shuffle_seed, where)
  return (held if split == "eval" else train), stats


def to_records(problems: Sequence[Problem], tokenizer, *, template: str, instruct: bool, max_prompt_len: int,
               name: str = "") -> tuple[list[PromptRecord], int]:
  """(records, number dropped because the prompt exceeds `max_prompt_len` tokens)."""
  records, too_long, longest = [], [], 0
  for p in problems:
    text = prompts.render_prompt(p, tokenizer, template, instruct=instruct)
    try:
      ids = np.asarray(tokenizer.encode(text), np.int32)
    except ValueError as e:
      raise DataError(f"problem {p.uid}: {e}") from None
    if len(ids) > max_prompt_len:
      too_long.append(p.uid)
      longest = max(longest, len(ids))
      continue
    records.append(PromptRecord(uid=p.uid, prompt=text, prompt_ids=ids, reference=p.reference, kind=p.kind,
                                solution=p.solution, question=p.question))
  if too_long:
    _log.warning("%s: dropped %d of %d prompts longer than data.max_prompt_len=%d tokens (longest %d; e.g. %s)",
                 name or "data", len(too_long), len(problems), max_prompt_len, longest, ", ".join(too_long[:3]))
  return records, len(too_long)


def build_dataset(data: DataConfig, tokenizer, *, split: str = "train") -> PromptDataset:
  """The train stream (shuffled by `data.shuffle_seed`, epoch after epoch) or the eval set (fixed order)."""
  problems, stats = load_problems(data, split=split)
  name = f"{data.source}:{split}"
  records, stats["too_long"] = to_records(problems, tokenizer, template=data.prompt_template,
                                          instruct=data.source != "synthetic", max_prompt_len=data.max_prompt_len,
                                          name=name)
  if not records:
    raise DataError(f"{name}: all {len(problems)} prompts are longer than data.max_prompt_len={data.max_prompt_len}")
  stats["records"] = len(records)
  return PromptDataset(records, seed=data.shuffle_seed, shuffle=split == "train", name=name, stats=stats)


def warmstart_pairs(records: Sequence[PromptRecord], tokenizer, *,
                    max_response_len: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
  """(prompt ids, worked-solution ids + eos) for the supervised warm-start, from records that have a solution;
  solutions longer than `max_response_len` tokens (eos included) are left out and counted in a warning."""
  pairs, too_long = [], 0
  for r in records:
    if not r.solution:
      continue
    ids = np.asarray(list(tokenizer.encode(r.solution)) + [tokenizer.eos_id], np.int32)
    if max_response_len is not None and len(ids) > max_response_len:
      too_long += 1
      continue
    pairs.append((r.prompt_ids, ids))
  if too_long:
    _log.warning("warm-start: left out %d solutions longer than %d tokens", too_long, max_response_len)
  return pairs
