"""Code rewards: the completion's last ```python block must pass every test of the problem, each run sandboxed.

Tests come as JSON (a string or already decoded), in either common layout:

* TACO / APPS `input_output`: `{"inputs": [...], "outputs": [...], "fn_name": "f"?}`. Without `fn_name` every input
  is a stdin string and every output the expected stdout; with it, each input is the argument list of a call.
* LiveCodeBench: a list of `{"input": str, "output": str, "testtype": "stdin" | "functional"}`, or
  `{"tests": [...], "fn_name": "f"}`. A functional input holds one JSON argument per line; its output is JSON.

A function is looked up at module level, else as a method of a `Solution` class (LeetCode style). Stdout matches when
the lines agree after trailing whitespace is dropped, or token by token with numbers equal to 1e-6. Each test runs
in its own `sandbox.run_python`; the first failure ends the check.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from typing import Any

from areal_jax.reward import sandbox

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodeTest:
  kind: str  # "stdin" | "call"
  input: Any  # stdin text, or the argument list of a call
  output: Any  # expected stdout text, or the expected return value
  fn_name: str = ""


def extract_code(completion: str) -> str | None:
  """The body of the last closed ```python (or ```py) block, else None."""
  last = None
  for last in _FENCE.finditer(completion):
    pass
  return last.group(1) if last else None


def _as_text(x) -> str:
  return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def parse_tests(spec: str | dict | list, *, where: str = "reference") -> list[CodeTest]:
  """Normalises a test specification (see the module docstring). Raises ValueError naming `where` and the field."""
  if isinstance(spec, str):
    try:
      spec = json.loads(spec)
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}: tests are not valid JSON ({e})") from None
  fn_name = ""
  if isinstance(spec, dict) and "tests" in spec:
    fn_name, spec = spec.get("fn_name") or "", spec["tests"]
  if isinstance(spec, dict):
    if "inputs" not in spec or "outputs" not in spec:
      raise ValueError(f"{where}: test dict needs 'inputs' and 'outputs' (has {sorted(spec)})")
    ins, outs, fn_name = spec["inputs"], spec["outputs"], spec.get("fn_name") or ""
    if len(ins) != len(outs):
      raise ValueError(f"{where}: {len(ins)} inputs but {len(outs)} outputs")
    if fn_name:
      return [CodeTest(kind="call", input=i if isinstance(i, list) else [i], output=o, fn_name=fn_name)
              for i, o in zip(ins, outs)]
    return [CodeTest(kind="stdin", input=_as_text(i), output=_as_text(o)) for i, o in zip(ins, outs)]
  if isinstance(spec, list):
    tests = []
    for n, t in enumerate(spec):
      if not isinstance(t, dict) or "input" not in t or "output" not in t:
        raise ValueError(f"{where}: test {n} needs 'input' and 'output' fields")
      if t.get("testtype", "stdin") == "functional":
        name = t.get("fn_name") or fn_name
        if not name:
          raise ValueError(f"{where}: functional test {n} has no fn_name")
        try:
          args = [json.loads(line) for line in str(t["input"]).splitlines() if line.strip()]
          out = json.loads(t["output"]) if isinstance(t["output"], str) else t["output"]
        except json.JSONDecodeError as e:
          raise ValueError(f"{where}: functional test {n} is not JSON ({e})") from None
        tests.append(CodeTest(kind="call", input=args, output=out, fn_name=name))
      else:
        tests.append(CodeTest(kind="stdin", input=_as_text(t["input"]), output=_as_text(t["output"])))
    return tests
  raise ValueError(f"{where}: tests must be a dict or a list, got {type(spec).__name__}")


def _number(tok: str) -> float | None:
  try:
    return float(tok)
  except ValueError:
    return None


def _close(a, b) -> bool:
  return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


def stdout_matches(got: str, expected: str) -> bool:
  g = [line.rstrip() for line in got.strip().splitlines()]
  e = [line.rstrip() for line in expected.strip().splitlines()]
  if g == e:
    return True
  gt, et = got.split(), expected.split()
  if len(gt) != len(et):
    return False
  for a, b in zip(gt, et):
    if a != b:
      x, y = _number(a), _number(b)
      if x is None or y is None or not _close(x, y):
        return False
  return True


def value_matches(got, expected) -> bool:
  """JSON values equal, floats to 1e-6; a one-element list around the expected value is accepted (TACO)."""

  def eq(a, b):
    if isinstance(a, bool) or isinstance(b, bool):
      return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
      return a == b or _close(a, b)
    if isinstance(a, list) and isinstance(b, list):
      return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
      return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)
    return a == b

  return eq(got, expected) or (isinstance(expected, list) and len(expected) == 1 and eq(got, expected[0]))


def run_test(code: str, test: CodeTest, *, limits: sandbox.Limits) -> tuple[bool, str]:
  """(passed, reason) for one test."""
  if test.kind == "stdin":
    r = sandbox.run_python(code, stdin=test.input, limits=limits)
    if not r.ok:
      return False, r.status
    return (True, "passed") if stdout_matches(r.stdout, test.output) else (False, "wrong output")
  r = sandbox.run_python(code, call={"fn_name": test.fn_name, "args": test.input}, limits=limits)
  if not r.ok:
    return False, r.status
  lines = r.stdout.strip().splitlines()
  try:
    got = json.loads(lines[-1]) if lines else None
  except json.JSONDecodeError:
    return False, "unreadable return value"
  return (True, "passed") if value_matches(got, test.output) else (False, "wrong return value")


def check_code(completion: str, reference: str | dict | list, *, limits: sandbox.Limits = sandbox.Limits(),
               time_budget_s: float | None = None) -> tuple[bool, str]:
  """(all tests passed, reason). `time_budget_s` bounds the whole check; tests left when it runs out fail it."""
  code = extract_code(completion)
  if code is None:
    return False, "no ```python block"
  tests = parse_tests(reference)
  if not tests:
    return False, "problem has no tests"
  deadline = None if time_budget_s is None else time.monotonic() + time_budget_s
  for n, test in enumerate(tests):
    if deadline is not None:
      left = deadline - time.monotonic()
      if left <= 0.05:
        return False, f"time budget spent after {n} of {len(tests)} tests"
      if left < limits.wall_s:
        limits = dataclasses.replace(limits, wall_s=left, cpu_s=min(limits.cpu_s, left))
    ok, why = run_test(code, test, limits=limits)
    if not ok:
      return False, f"test {n + 1}/{len(tests)}: {why}"
  return True, f"all {len(tests)} tests passed"
