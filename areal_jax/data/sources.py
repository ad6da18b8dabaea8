"""Reading problems from JSONL and Parquet files (local or `gs://`) and local TFDS datasets, with bad rows raised or
skipped and counted. Rows take any layout `areal_jax.data.rows` knows (GSM8K, MATH, DeepScaleR, code)."""

from __future__ import annotations

import json
import logging
from typing import Any, Iterable

from etils import epath

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


def read_file(path: str, *, skip_bad_rows: bool = False, field: str = "") -> tuple[list[Problem], int]:
  """(problems, number of bad rows skipped) from a Parquet file (a name ending in `.parquet`, as datasets are released
  on the HF hub), a JSON array (a `.json` file starting with `[`, as DeepScaleR is released) or a JSON-lines file
  (any other), local or `gs://`. `field` names the setting the path came from (`data.eval_path`) in the error for a
  missing file."""
  if path.endswith(".parquet"):
    return read_parquet(path, skip_bad_rows=skip_bad_rows, field=field)
  if path.endswith(".json"):
    with _existing(path, field).open("rb") as f:
      if f.read(4096).lstrip().startswith(b"["):
        return read_json_array(path, skip_bad_rows=skip_bad_rows, field=field)
  return read_jsonl(path, skip_bad_rows=skip_bad_rows, field=field)


def _existing(path: str, field: str) -> epath.Path:
  file = epath.Path(path)
  if not file.is_file():
    raise DataError(f"{field + ': ' if field else ''}data file {path!r} does not exist")
  return file


def read_jsonl(path: str, *, skip_bad_rows: bool = False, field: str = "") -> tuple[list[Problem], int]:
  """(problems, number of bad rows skipped) from a JSON-lines file, local or `gs://`; blank lines are ignored."""
  file = _existing(path, field)

  def rows():
    with file.open("rb") as f:
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
        yield where, f"{file.name}:{lineno}", row

  return _collect(rows(), source=path, skip_bad_rows=skip_bad_rows)


def read_json_array(path: str, *, skip_bad_rows: bool = False, field: str = "") -> tuple[list[Problem], int]:
  """(problems, number of bad rows skipped) from a file holding one JSON array of rows; row i (from 0) is named
  `PATH row i` in errors."""
  file = _existing(path, field)
  try:
    rows = json.loads(file.read_bytes().decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise DataError(f"{path}: not a JSON array of rows ({e})") from None
  if not isinstance(rows, list):
    raise DataError(f"{path}: not a JSON array of rows (a {type(rows).__name__})")
  return _collect(((f"{path} row {i}", f"{file.name}:{i}", row) for i, row in enumerate(rows)), source=path,
                  skip_bad_rows=skip_bad_rows)


def read_parquet(path: str, *, skip_bad_rows: bool = False, field: str = "") -> tuple[list[Problem], int]:
  """(problems, number of bad rows skipped) from a Parquet file, local or `gs://`, read whole (released math sets
  are megabytes); row i (from 0, as `datasets` counts) is named `PATH row i` in errors."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top  (only when used)
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  file = _existing(path, field)
  try:
    table = pq.read_table(pa.BufferReader(file.read_bytes()))
  except (pa.ArrowException, OSError) as e:
    raise DataError(f"{path}: not a readable Parquet file ({e})") from None

  def rows():
    i = 0
    for batch in table.to_batches():
      for row in batch.to_pylist():
        yield f"{path} row {i}", f"{file.name}:{i}", row
        i += 1

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
