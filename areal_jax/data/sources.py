"""Reading problems from JSONL files and local TFDS datasets, with bad rows raised or skipped and counted."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterable

from areal_jax.data.records import DataError, Problem
from areal_jax.data.rows import parse_row

_log = logging.getLogger(__name__)
_SHOWN_BAD_ROWS = 5  # with skip_bad_rows, the first few bad rows are logged one by one


def _collect(rows: Iterable[tuple[str, str, Any]], *, source: str, skip_bad_rows: bool) -> tuple[list[Problem], int]:
  """Parses (where, default uid, row-or-DataError) triples; raises on the first bad row unless skipping."""
  problems, bad, total = [], 0, 0
  for where, uid, row in rows:
    total += 1
    try:
      if isinstance(row, DataError):
        raise row
      problems.append(parse_row(row, where=where, default_uid=uid))
    except DataError as e:
      if not skip_bad_rows:
        raise DataError(f"{e} (set data.skip_bad_rows=True to skip and count bad rows)") from None
      bad += 1
      if bad <= _SHOWN_BAD_ROWS:
        _log.warning("skipping bad row: %s", e)
  if total == 0:
    raise DataError(f"{source}: no rows (empty)")
  if not problems:
    raise DataError(f"{source}: all {total} rows are bad")
  if bad:
    _log.warning("%s: skipped %d of %d rows as bad (data.skip_bad_rows=True)", source, bad, total)
  return problems, bad


def read_jsonl(path: str, *, skip_bad_rows: bool = False, field: str = "") -> tuple[list[Problem], int]:
  """(problems, number of bad rows skipped) from a JSON-lines file; blank lines are ignored. `field` names the
  setting the path came from (`data.eval_path`) in the error for a missing file."""
  if not os.path.isfile(path):
    raise DataError(f"{field + ': ' if field else ''}data file {path!r} does not exist")
  name = os.path.basename(path)

  def rows():
    with open(path, "rb") as f:
      for lineno, raw in enumerate(f, 1):
        where = f"{path}:{lineno}"
        try:
          line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
          yield where, "", DataError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})")
          continue
        if not line.strip():
          continue
        try:
          row = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as e:
          row = DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})")
        yield where, f"{name}:{lineno}", row

  return _collect(rows(), source=path, skip_bad_rows=skip_bad_rows)


def read_tfds(name: str, *, data_dir: str, split: str, skip_bad_rows: bool = False) -> tuple[list[Problem], int]:
  """(problems, bad rows skipped) from a prepared TFDS dataset (array_record) through `tfds.data_source`.

  Text features arrive as bytes and are decoded as UTF-8. No TensorFlow is needed.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  (half a second; only when used)

  try:
    source = tfds.data_source(name, split=split, data_dir=data_dir or None)
  except Exception as e:  # pylint: disable=broad-except  (tfds raises several types; name what was asked)
    raise DataError(f"tfds dataset {name!r} split {split!r} in data_dir {data_dir!r}: {e}".splitlines()[0]) from e
  label = f"tfds {name}/{split}"

  def decode(value):
    if isinstance(value, bytes):
      return value.decode("utf-8")
    return value.tolist() if hasattr(value, "tolist") else value

  def rows():
    for i in range(len(source)):
      where = f"{label} record {i}"
      try:
        row = {k: decode(v) for k, v in source[i].items()}
      except UnicodeDecodeError as e:
        row = DataError(f"{where}: a text field is not UTF-8 ({e.reason})")
      yield where, f"{name}/{split}:{i}", row

  return _collect(rows(), source=label, skip_bad_rows=skip_bad_rows)
