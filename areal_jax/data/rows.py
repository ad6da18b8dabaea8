"""One row (a JSON object or a TFDS record) to a Problem, for the common math and code dataset layouts.

* GSM8K: `question`, `answer` ending in `#### 72`. The reference is `72`; the worked solution is the answer with its
  `<<48/2=24>>` calculator notes removed and the `####` line turned into `\\boxed{72}`.
* MATH / DeepScaleR: `problem` with `answer` (the reference) and/or `solution` (a worked solution; without `answer`
  its last `\\boxed{}` is the reference).
* AReaL-boba (AReaL's released RL data): `prompt` already in DeepSeek-R1's chat format (`<｜User｜>...<｜Assistant｜>
  <think>`), `solutions` a list whose first entry's last `\\boxed{}` (or its whole text) is the reference, `query_id`;
  the chat markers and the math instruction are taken off the question (the run renders its own prompt).
* Code (TACO, APPS, LiveCodeBench): a question (`question`, `problem`, `prompt` or `question_content`) and tests
  (`input_output`, `tests`, `test_cases` or `public_test_cases`, with `fn_name` or `metadata.func_name` for
  function-call tests). See `areal_jax.reward.code` for the test layouts.

A row's own `id` / `uid` / `unique_id` / `task_id` becomes its uid.
"""

from __future__ import annotations

import json
import re
from typing import Any

from areal_jax.data.records import DataError, Problem

QUESTION_FIELDS = ("question", "problem", "prompt", "question_content")
TEST_FIELDS = ("input_output", "tests", "test_cases", "public_test_cases")
ID_FIELDS = ("id", "uid", "unique_id", "task_id", "question_id", "query_id")
# DeepSeek-R1's chat markers (`<｜User｜>`, `<｜Assistant｜>`, ...) and its opened thought, in AReaL-boba prompts.
_CHAT_MARKERS = re.compile(r"<｜[^｜]*｜>|<think>\s*$")


def _text(row: dict, field: str, where: str) -> str:
  value = row[field]
  if isinstance(value, bool) or not isinstance(value, (str, int, float)):
    raise DataError(f"{where}: field {field!r} must be text, got {type(value).__name__}")
  text = str(value).strip()
  if not text:
    raise DataError(f"{where}: field {field!r} is empty")
  return text


def gsm8k_solution(answer: str) -> tuple[str, str]:
  """(reference, worked solution) from a GSM8K answer ending in `#### 72`."""
  body, _, final = answer.rpartition("####")
  final = final.strip().replace(",", "")
  body = re.sub(r"<<[^>]*>>", "", body).strip()
  return final, (f"{body}\n\\boxed{{{final}}}" if body else f"\\boxed{{{final}}}")


def _code_problem(row: dict, question: str, uid: str, where: str) -> Problem:
  from areal_jax.reward.code import parse_tests  # pylint: disable=g-import-not-at-top

  field = next(f for f in TEST_FIELDS if f in row)
  spec: Any = row[field]
  if isinstance(spec, str):
    try:
      spec = json.loads(spec)
    except json.JSONDecodeError as e:
      raise DataError(f"{where}: field {field!r} is not valid JSON ({e.msg})") from None
  meta = row.get("metadata")
  if isinstance(meta, str):
    try:
      meta = json.loads(meta)
    except json.JSONDecodeError:
      meta = None
  fn_name = row.get("fn_name") or (meta.get("func_name") if isinstance(meta, dict) else None) or ""
  if fn_name and isinstance(spec, list):
    spec = {"tests": spec, "fn_name": fn_name}
  elif fn_name and isinstance(spec, dict) and "inputs" in spec and not spec.get("fn_name"):
    spec = {**spec, "fn_name": fn_name}
  try:
    tests = parse_tests(spec, where=f"{where}: field {field!r}")
  except ValueError as e:
    raise DataError(str(e)) from None
  if not tests:
    raise DataError(f"{where}: field {field!r} holds no tests")
  solution = row.get("solution") if isinstance(row.get("solution"), str) else ""
  return Problem(uid=uid, question=question, reference=json.dumps(spec), solution=solution, kind="code")


def _untemplated(prompt: str, where: str) -> str:
  """An AReaL-boba prompt's question: DeepSeek-R1's chat markers and the math instruction taken off."""
  from areal_jax.data.prompts import INSTRUCTIONS  # pylint: disable=g-import-not-at-top

  text = _CHAT_MARKERS.sub("", prompt).strip()
  text = text.removesuffix(INSTRUCTIONS["math"]).strip()
  if not text:
    raise DataError(f"{where}: field 'prompt' holds no question once its chat markers are taken off")
  return text


def _boba_reference(solutions: Any, where: str) -> str:
  """The reference in an AReaL-boba row's `solutions`: the first entry's last `\\boxed{}`, or the entry itself."""
  from areal_jax.reward.math import last_boxed  # pylint: disable=g-import-not-at-top

  first = solutions[0] if isinstance(solutions, list) and solutions else solutions
  if isinstance(first, bool) or not isinstance(first, (str, int, float)) or not str(first).strip():
    raise DataError(f"{where}: field 'solutions' must be a list whose first entry is the answer's text")
  boxed = last_boxed(str(first))
  return (boxed if boxed and boxed.strip() else str(first)).strip()


def parse_row(row: Any, *, where: str, default_uid: str) -> Problem:
  """A Problem from one row; DataError naming `where` and the field otherwise."""
  if not isinstance(row, dict):
    raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
  qfield = next((f for f in QUESTION_FIELDS if f in row), None)
  if qfield is None:
    raise DataError(f"{where}: missing field 'question' (or 'problem'); the row has fields {sorted(row)}")
  question = _text(row, qfield, where)
  uid = next((str(row[f]) for f in ID_FIELDS if row.get(f) not in (None, "")), default_uid)
  boba = "solutions" in row and "answer" not in row and not isinstance(row.get("solution"), str)
  if boba:
    question = _untemplated(question, where)
  if any(f in row for f in TEST_FIELDS):
    return _code_problem(row, question, uid, where)
  if boba:
    return Problem(uid=uid, question=question, reference=_boba_reference(row["solutions"], where))
  solution = row["solution"].strip() if isinstance(row.get("solution"), str) else ""
  if "answer" in row:
    answer = _text(row, "answer", where)
    if "####" in answer:
      reference, worked = gsm8k_solution(answer)
      if not reference:
        raise DataError(f"{where}: field 'answer' has nothing after '####'")
      return Problem(uid=uid, question=question, reference=reference, solution=solution or worked)
    return Problem(uid=uid, question=question, reference=answer, solution=solution)
  if solution:
    from areal_jax.reward.math import last_boxed  # pylint: disable=g-import-not-at-top

    boxed = last_boxed(solution)
    if not boxed or not boxed.strip():
      raise DataError(f"{where}: field 'solution' has no \\boxed{{}} answer and the row has no 'answer' field")
    return Problem(uid=uid, question=question, reference=boxed.strip(), solution=solution)
  raise DataError(f"{where}: missing field 'answer' (or 'solution', or tests for code); "
                  f"the row has fields {sorted(row)}")
