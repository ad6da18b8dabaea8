"""Released datasets to a run's files (`tools/prepare_data.py`): train and eval files in one layout, duplicates and
evaluation benchmarks' questions taken out of both.

    split = prepare(["/data/gsm8k/train-00000-of-00001.parquet"], eval_size=200,
                    exclude=["/data/gsm8k/test-00000-of-00001.parquet"])
    write(split, "/data/gsm8k", fmt="jsonl")   # train.jsonl, eval.jsonl: data.path and data.eval_path

Input rows take any layout `data.rows` knows (GSM8K, MATH, DeepScaleR, AReaL-boba, code), from JSONL or Parquet files,
local or gs://. Output rows are `{"id", "problem", "answer", "solution"}` (math) or `{"id", "question", "tests",
"solution"}` (code): rows the run (`data.source=files`) and the evaluation (`tools/evaluate.py --benchmarks`) read
back to the same problems.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence

import numpy as np
from etils import epath

from areal_jax.data import sources
from areal_jax.data.records import DataError, Problem

FORMATS = ("jsonl", "parquet")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Split:
  train: list[Problem]
  eval: list[Problem]
  counts: dict[str, int]  # read, bad_rows, duplicates, in_benchmarks, train, eval


def question_key(question: str) -> str:
  """What two questions share when they are the same problem: lower case, whitespace and `$` signs dropped."""
  return re.sub(r"[\s$]+", "", question.lower())


def prepare(inputs: Sequence[str], *, eval_size: int, exclude: Sequence[str] = (), seed: int = 0,
            skip_bad_rows: bool = False) -> Split:
  """The problems of `inputs` (in file order), each question once and none asked by an `exclude` file (the
  evaluation benchmarks), split into train and `eval_size` held out by a seeded permutation (eval in file order)."""
  if not inputs:
    raise ValueError("no input files: pass --inputs=FILE[,FILE...]")
  if eval_size < 0:
    raise ValueError(f"eval_size={eval_size}: must be >= 0")
  problems, bad = [], 0
  for path in inputs:
    read, skipped = sources.read_file(path, skip_bad_rows=skip_bad_rows)
    problems += read
    bad += skipped
  benchmark = {question_key(p.question) for path in exclude for p in sources.read_file(path)[0]}
  seen, kept, duplicates, in_benchmarks = set(), [], 0, 0
  for p in problems:
    key = question_key(p.question)
    if key in benchmark:
      in_benchmarks += 1
    elif key in seen:
      duplicates += 1
    else:
      seen.add(key)
      kept.append(p)
  if eval_size >= len(kept):
    raise DataError(f"eval_size={eval_size} leaves nothing to train on ({len(kept)} problems after "
                    f"{duplicates} duplicates and {in_benchmarks} benchmark questions were taken out)")
  held = set(np.random.default_rng([seed, 11]).permutation(len(kept))[:eval_size].tolist())
  train = [p for i, p in enumerate(kept) if i not in held]
  heldout = [p for i, p in enumerate(kept) if i in held]
  return Split(train=train, eval=heldout, counts={
      "read": len(problems) + bad, "bad_rows": bad, "duplicates": duplicates, "in_benchmarks": in_benchmarks,
      "train": len(train), "eval": len(heldout)})


def to_row(p: Problem) -> dict:
  """One output row: a layout `data.rows` reads back to `p`."""
  if p.kind == "code":
    return {"id": p.uid, "question": p.question, "tests": json.loads(p.reference), "solution": p.solution}
  return {"id": p.uid, "problem": p.question, "answer": p.reference, "solution": p.solution}


def write_file(problems: Sequence[Problem], path: str) -> None:
  """`problems` as rows in a JSONL or (a name ending in `.parquet`) Parquet file, local or gs://."""
  rows = [to_row(p) for p in problems]
  out = epath.Path(path)
  out.parent.mkdir(parents=True, exist_ok=True)
  if path.endswith(".parquet"):
    import pyarrow as pa  # pylint: disable=g-import-not-at-top  (only when used)
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

    if len({p.kind for p in problems}) > 1:
      raise DataError(f"{path}: math and code problems differ in columns; write them to JSONL (--format=jsonl)")
    # Code tests vary in shape from row to row: kept as JSON text, as the released code sets keep them.
    table = pa.Table.from_pylist([r | {"tests": json.dumps(r["tests"])} if "tests" in r else r for r in rows])
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    out.write_bytes(sink.getvalue().to_pybytes())
  else:
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def write(split: Split, out_dir: str, *, fmt: str = "jsonl") -> dict[str, str]:
  """`train.FMT` and (when anything is held out) `eval.FMT` in `out_dir`: {"train": path, "eval": path}."""
  if fmt not in FORMATS:
    raise ValueError(f"format {fmt!r}: choose one of {FORMATS}")
  paths = {"train": f"{out_dir.rstrip('/')}/train.{fmt}"}
  write_file(split.train, paths["train"])
  if split.eval:
    paths["eval"] = f"{out_dir.rstrip('/')}/eval.{fmt}"
    write_file(split.eval, paths["eval"])
  return paths
