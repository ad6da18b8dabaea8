"""Benchmarks from JSONL or Parquet files, local or `gs://`, the files training reads (`data.source=files`): GSM8K
(`question`, `answer` ending in `#### 72`), MATH-500 / AIME-style (`problem`, `answer`), or code problems with tests
-- any layout `areal_jax.data.rows` knows; `tools/prepare_data.py` writes them from the released files.

A benchmark is named on the command line as `NAME=PATH` or as a bare `PATH` (named after the file):
`gsm8k=/data/gsm8k_test.jsonl`, `gs://bucket/data/aime24.parquet`. Prompts are rendered as in training
(`areal_jax.data.dataset.to_records`); prompts longer than `max_prompt_len` tokens are dropped and counted.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

from areal_jax.data import sources
from areal_jax.data.dataset import to_records
from areal_jax.data.records import DataError, PromptRecord

_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Benchmark:
  name: str
  path: str
  records: list[PromptRecord]
  too_long: int  # questions dropped because their prompt exceeds max_prompt_len


def parse_spec(spec: str) -> tuple[str, str]:
  """(name, path) from `NAME=PATH` or `PATH` (name: the file name without `.jsonl` or `.parquet`)."""
  name, sep, path = spec.partition("=")
  if not sep or "://" in name:
    path = spec
    name = os.path.basename(spec.rstrip("/"))
    name = next((name[:-len(end)] for end in (".jsonl", ".parquet") if name.endswith(end)), name)
  if not _NAME.fullmatch(name):
    raise ValueError(f"benchmark {spec!r}: name {name!r} may only hold letters, digits, '_', '.' and '-' "
                     "(write NAME=PATH)")
  return name, path


def load_benchmarks(specs: Sequence[str], tokenizer, *, template: str, instruct: bool,
                    max_prompt_len: int) -> list[Benchmark]:
  """Reads and renders every benchmark; a bad row raises DataError naming the file and line."""
  if not specs:
    raise ValueError("no benchmarks given: pass --benchmarks=NAME=PATH[,NAME=PATH...]")
  out, names = [], set()
  for spec in specs:
    name, path = parse_spec(spec)
    if name in names:
      raise ValueError(f"benchmark name {name!r} given twice ({spec!r}); write NAME=PATH to tell them apart")
    names.add(name)
    records, too_long = to_records(sources.read_file(path)[0], tokenizer, template=template, instruct=instruct,
                                   max_prompt_len=max_prompt_len, name=name)
    if not records:
      raise DataError(f"benchmark {name!r} ({path}): every prompt is longer than max_prompt_len={max_prompt_len}")
    out.append(Benchmark(name=name, path=path, records=records, too_long=too_long))
  return out
