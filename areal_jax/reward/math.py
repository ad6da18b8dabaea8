r"""Math answer checking: the completion's last `\boxed{...}` against a reference, equal through `math-verify`.

`verify_math(completion, reference)` is the reward; `check_math` returns the same verdict with a reason.

* The answer is the content of the completion's *last* `\boxed{...}` (nested braces allowed). Without one, the last
  "final answer is ...", "answer: ..." or "#### ..." line is taken. A last `\boxed{` that never closes (a truncated
  completion) is no answer.
* A reference may be a plain answer (`72`, `\frac{1}{2}`), a GSM8K solution ending in `#### 72`, or a MATH solution
  with a `\boxed{}` answer.
* Equivalence is math-verify's (numbers, fractions vs decimals, `\$`, units and `\text{}`, `^\circ`, percentages,
  `x=5` vs `5`, intervals, sets, relations vs intervals). On top of it, a few normalisations it lacks: thin-space and
  space thousands separators (`1\,000`, `1 000`), `°`, a trailing full stop, a number inside `\text{5 cm}`, and a
  word answer compared as text (plain `Monday` is otherwise parsed as a product of letters, equal to its anagrams).
* An answer holding an infinity (`\infty`, `\frac{1}{0}`, `0/0`) outside an interval is wrong for a finite
  reference: sympy's simplify of such expressions is not deterministic (`\infty^{\infty}` sometimes equals 72) and
  `\infty!` equals 0.
* Answers that would make sympy work for minutes (over `MAX_ANSWER_CHARS`, nesting deeper than `MAX_NESTING`,
  towers of numeric powers, huge numeric exponents or factorials) score 0 before any parsing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import signal
import threading
import time

MAX_ANSWER_CHARS = 1000  # longer extracted answers score 0 ("answer too long")
MAX_NESTING = 40  # deeper {} / () / [] nesting scores 0
_FALLBACK_WINDOW = 4096  # the fallback patterns look at this many trailing characters

# math-verify logs every timed-out input in full at WARNING (megabytes for adversarial completions).
logging.getLogger("math_verify").setLevel(logging.ERROR)


class _Timeout(BaseException):
  """Raised by the soft timeout (a BaseException so math-verify's `except Exception` does not swallow it)."""


def last_boxed(text: str) -> str | None:
  r"""The content of the last `\boxed{...}` / `\fbox{...}` in `text` (escaped braces do not count), else None."""
  start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
  if start < 0:
    return None
  after = start + (6 if text.startswith("\\boxed", start) else 5)
  i, n = after, len(text)
  while i < n and text[i] == " ":
    i += 1
  if i >= n:
    return None
  if text[i] != "{":  # `\boxed 5`: one token after the space
    m = re.match(r"[^\s$]+", text[i:i + 200])
    return m.group(0) if m and i > after else None
  depth, body = 0, i + 1
  while i < n:
    c = text[i]
    if c == "\\":
      i += 2
      continue
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return text[body:i]
    i += 1
  return None  # unterminated: a truncated completion


_ANSWER_ANCHOR = re.compile(r"####|(?i:final answer is|final answer:|the answer is|answer is|answer:)")


def extract_answer(completion: str) -> str | None:
  r"""The answer a completion commits to: its last `\boxed{}` content, else what follows the last "answer is"."""
  if "\\boxed" in completion or "\\fbox" in completion:
    return last_boxed(completion)
  tail = completion[-_FALLBACK_WINDOW:]
  last = None
  for last in _ANSWER_ANCHOR.finditer(tail):
    pass
  if last is None:
    return None
  rest = tail[last.end():].lstrip(" \t:")
  ans = rest.split("\n", 1)[0].strip() or rest.strip().split("\n", 1)[0]
  ans = re.split(r"\.\s|\s+I hope\b", ans, maxsplit=1)[0]  # "3.5. I hope it is correct." -> "3.5"
  ans = ans.strip().strip("*").strip()
  return ans or None


def reference_answer(reference: str) -> str:
  r"""The answer inside a reference: after a GSM8K `####`, a MATH solution's last `\boxed{}`, else the whole text."""
  if "####" in reference:
    return reference.rsplit("####", 1)[1].strip()
  if "\\boxed" in reference or "\\fbox" in reference:
    boxed = last_boxed(reference)
    if boxed is not None:
      return boxed.strip()
  return reference.strip()


_MATH_DELIMS = ((r"$$", r"$$"), (r"\[", r"\]"), (r"\(", r"\)"), ("$", "$"))
_SEPARATED_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:(?:\\,|\\ |\\;|~| )\d{3})+(?![\d])")
_TEXT_NUMBER = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\{\s*(-?\d[\d.,]*)\s*([^{}]*)\}$")
_WORD = re.compile(r"^[A-Za-z][A-Za-z ]*[A-Za-z]$")


def normalize_answer(ans: str) -> str:
  """What math-verify does not already normalise (see the module docstring); the rest is left to it."""
  ans = ans.strip()
  for left, right in _MATH_DELIMS:
    if len(ans) > len(left) + len(right) and ans.startswith(left) and ans.endswith(right):
      ans = ans[len(left):-len(right)].strip()
      break
  ans = ans.replace("\\displaystyle", "").replace("°", "^\\circ").replace("−", "-").strip()
  ans = _SEPARATED_THOUSANDS.sub(lambda m: re.sub(r"\\,|\\ |\\;|~| ", "", m.group(0)), ans)
  ans = ans.rstrip(".").strip()
  m = _TEXT_NUMBER.match(ans)
  if m:
    ans = m.group(1) + (f"\\text{{ {m.group(2).strip()}}}" if m.group(2).strip() else "")
  if len(ans) >= 3 and _WORD.match(ans):
    ans = f"\\text{{{ans}}}"
  return ans


def _exponents(ans: str):
  """Yields each exponent of `ans` (the braced group or single token after `^`)."""
  for m in re.finditer(r"\^\s*", ans):
    i = m.end()
    if i < len(ans) and ans[i] == "{":
      depth = 0
      for j in range(i, len(ans)):
        depth += {"{": 1, "}": -1}.get(ans[j], 0)
        if depth == 0:
          yield ans[i + 1:j]
          break
    else:
      t = re.match(r"\d+|\\?[A-Za-z]+|.", ans[i:])
      if t:
        yield t.group(0)


def too_complex(ans: str) -> str | None:
  """Why checking `ans` could take unbounded time (a reason), or None."""
  if len(ans) > MAX_ANSWER_CHARS:
    return f"answer too long ({len(ans)} characters > {MAX_ANSWER_CHARS})"
  depth = deepest = 0
  for c in ans:
    if c in "{([":
      depth += 1
      deepest = max(deepest, depth)
    elif c in "})]":
      depth -= 1
  if deepest > MAX_NESTING:
    return f"answer nested {deepest} deep (> {MAX_NESTING})"
  for e in _exponents(ans):
    if "^" in e and re.fullmatch(r"[\d\s^{}()+\-*.,]+", e):
      return f"tower of numeric powers (exponent {e[:40]!r})"
    digits = re.sub(r"[\s{},]", "", e)
    if digits.isdigit() and len(digits) > 5:
      return f"numeric exponent too large ({digits[:40]})"
  if re.search(r"\d{5,}\s*!|\\binom\s*\{\s*\d{5,}", ans):
    return "factorial or binomial of a huge number"
  return None


@contextlib.contextmanager
def _soft_timeout(seconds: float | None):
  """Raises _Timeout after `seconds`, and again every 0.1 s until the block ends (SIGALRM; only in the main thread,
  otherwise the caller bounds the time).
  An alarm the caller had set is re-armed afterwards with what remains of it."""
  if not seconds or threading.current_thread() is not threading.main_thread():
    yield
    return
  armed = [True]

  def on_alarm(signum, frame):
    if armed[0]:  # a late delivery after the block has ended is ignored
      raise _Timeout()

  start = time.monotonic()
  previous = signal.signal(signal.SIGALRM, on_alarm)
  # Repeats every 0.1 s: library code with a bare `except:` may swallow one _Timeout, not all of them.
  outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds, 0.1)
  try:
    yield
  finally:
    try:
      armed[0] = False
      signal.setitimer(signal.ITIMER_REAL, 0)
    finally:  # runs even when the alarm fires during the lines above
      signal.signal(signal.SIGALRM, previous)
      if outer:
        signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer - (time.monotonic() - start)))


def _parse(ans: str):
  import math_verify  # pylint: disable=g-import-not-at-top  (sympy: ~1 s to import; workers import it once)

  config = math_verify.LatexExtractionConfig(boxed_match_priority=0)
  return math_verify.parse(f"\\boxed{{{ans}}}", extraction_config=[config], parsing_timeout=None)


def _infinite(parsed) -> bool:
  """Whether a parsed answer holds oo, -oo, zoo or nan outside an interval's endpoints: sympy's simplify of such an
  unevaluated expression is not deterministic (`72 - oo**oo` is sometimes 0) and `oo!` equals 0, so these are only
  compared with answers that hold them too. (`(3, \\infty)` still equals `x > 3`.)"""
  import sympy  # pylint: disable=g-import-not-at-top

  if not isinstance(parsed, sympy.Basic) or isinstance(parsed, sympy.Interval):
    return False
  if parsed in (sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
    return True
  return any(map(_infinite, parsed.args))


@functools.lru_cache(maxsize=1024)
def _parse_reference(ref: str):
  return tuple(_parse(ref))  # G answers share one reference: parse it once


def check_math(completion: str, reference: str, *, timeout_s: float | None = 5.0) -> tuple[bool, str]:
  """(correct, reason). `timeout_s` bounds the sympy work when called from the main thread (soft; SIGALRM)."""
  import math_verify  # pylint: disable=g-import-not-at-top

  completion, reference = str(completion), str(reference)
  ans = extract_answer(completion)
  if ans is None:
    return False, "no answer found"
  ref = normalize_answer(reference_answer(reference))
  if not ref:
    return False, "empty reference"
  ans = normalize_answer(ans)
  if not ans:
    return False, "empty answer"
  why = too_complex(ans)
  if why:
    return False, why
  try:
    with _soft_timeout(timeout_s):
      gold = _parse_reference(ref)
      if not gold:
        return False, f"reference {ref[:80]!r} could not be parsed"
      pred = _parse(ans)
      if not pred:
        return False, f"answer {ans[:80]!r} could not be parsed"
      if any(map(_infinite, pred)) and not any(map(_infinite, gold)):
        return False, "infinite answer for a finite reference"
      ok = math_verify.verify(list(gold), pred, allow_set_relation_comp=True, timeout_seconds=None)
  except _Timeout:
    return False, f"timed out after {timeout_s} s"
  except (RecursionError, MemoryError, ValueError, OverflowError) as e:
    return False, f"{type(e).__name__} while checking"
  return (True, "correct") if ok else (False, "wrong answer")


def verify_math(completion: str, reference: str) -> bool:
  r"""True iff the completion's final answer (last `\boxed{}`, or "the final answer is ...") equals the reference."""
  return check_math(completion, reference)[0]


__all__ = ["check_math", "extract_answer", "last_boxed", "normalize_answer", "reference_answer", "too_complex",
           "verify_math", "MAX_ANSWER_CHARS", "MAX_NESTING"]
