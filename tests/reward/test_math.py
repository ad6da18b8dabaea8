"""verify_math on a table of tricky answer pairs, plus answer extraction and the complexity screen."""

import time

import pytest

from areal_jax.reward import math as math_reward
from areal_jax.reward.math import verify_math
from helpers import SLOW_MATH
from waiting import wait_until

GSM8K = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
MATH_SOLUTION = r"The sum is $\frac{1}{2} + \frac{1}{4} = \boxed{\frac{3}{4}}$."

# (completion, reference, expected verdict, what it exercises)
TABLE = [
    # references: plain, LaTeX, GSM8K `####`, MATH solutions with \boxed
    (r"So she sold \boxed{72} clips.", GSM8K, True, "gsm8k reference"),
    (r"\boxed{27}", GSM8K, False, "gsm8k digits swapped"),
    (r"\boxed{0.75}", MATH_SOLUTION, True, "math solution reference, decimal vs fraction"),
    (r"\boxed{\frac{4}{3}}", MATH_SOLUTION, False, "inverted fraction"),
    # thousands separators
    (r"\boxed{1,234}", "1234", True, "comma thousands"),
    (r"\boxed{1{,}234}", "1234", True, "braced comma thousands"),
    (r"\boxed{1\,000}", "1000", True, "thin-space thousands"),
    (r"\boxed{12\,345\,678}", "12345678", True, "several thin spaces"),
    (r"\boxed{1 000 000}", "1000000", True, "space thousands"),
    (r"\boxed{1.234}", "1,234", False, "decimal point is not a separator"),
    (r"\boxed{12}", r"1,2", False, "a two-element list is not twelve"),
    # money, units, \text
    (r"\boxed{\$18}", "18", True, "escaped dollar"),
    (r"\boxed{\$18.00}", "18", True, "dollar and cents"),
    (r"\boxed{18 \text{ dollars}}", "18", True, "unit in text"),
    (r"\boxed{5\text{ cm}}", "5", True, "unit"),
    (r"\boxed{\text{5 cm}}", "5", True, "number inside text"),
    (r"\boxed{5 \mathrm{cm}^2}", "5", True, "mathrm unit with power"),
    (r"\boxed{15 \text{ cm}}", "5", False, "unit does not hide a wrong number"),
    (r"\boxed{\text{Monday}}", "Monday", True, "word answer"),
    (r"\boxed{silent}", "listen", False, "anagram is a different word"),
    # degrees and percent
    (r"\boxed{90^\circ}", "90", True, "degree sign"),
    (r"\boxed{90^{\circ}}", "90", True, "braced degree"),
    (r"\boxed{45°}", "45", True, "unicode degree"),
    (r"\boxed{9}", r"90^\circ", False, "a digit short"),
    (r"\boxed{75\%}", "0.75", True, "percent vs decimal"),
    (r"\boxed{100}", r"10\%", False, "percent is not 100"),
    # equations
    (r"\boxed{x=5}", "5", True, "x=5 vs 5"),
    (r"\boxed{5}", "x = 5", True, "5 vs x=5"),
    (r"\boxed{x=-5}", "x=5", False, "sign"),
    (r"\boxed{y = 2x+1}", "2x+1", True, "function definition"),
    # intervals and sets
    (r"\boxed{(1,3]}", "(1,3]", True, "half-open interval"),
    (r"\boxed{(1,3)}", "(1,3]", False, "open vs half-open"),
    (r"\boxed{[1,3]}", "(1,3)", False, "closed vs open"),
    (r"\boxed{(-\infty, 1) \cup (2, \infty)}", r"(-\infty,1)\cup(2,\infty)", True, "union of intervals"),
    (r"\boxed{x < 1}", r"(-\infty, 1)", True, "inequality vs interval"),
    (r"\boxed{x \le 1}", r"(-\infty, 1)", False, "closed inequality vs open interval"),
    (r"\boxed{x > 3}", r"(3, \infty)", True, "inequality vs unbounded interval"),
    (r"\boxed{(3, \infty)}", "x > 3", True, "unbounded interval vs inequality"),
    (r"\boxed{\infty + 72}", r"\infty", True, "infinity vs infinity"),
    (r"\boxed{\infty!}", "0", False, "infinite answer, finite reference"),
    (r"\boxed{\frac{1}{0}}", "0", False, "zoo is not a number"),
    (r"\boxed{\{2, 1\}}", r"\{1,2\}", True, "set order"),
    (r"\boxed{\{1,2\}}", r"\{1,2,3\}", False, "missing element"),
    (r"\boxed{2, 3}", r"\{3, 2\}", True, "list vs set"),
    (r"\boxed{(3, 5)}", "(5, 3)", False, "ordered pair order"),
    # fractions, decimals, radicals
    (r"\boxed{\frac{1}{2}}", "0.5", True, "fraction vs decimal"),
    (r"\boxed{\dfrac12}", "0.5", True, "dfrac without braces"),
    (r"\boxed{1/2}", r"\frac{1}{2}", True, "slash fraction"),
    (r"\boxed{-\frac{1}{2}}", "-0.5", True, "negative fraction"),
    (r"\boxed{0.33}", r"\frac{1}{3}", False, "rounded decimal is not a third"),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", True, "radical simplification"),
    (r"\boxed{\sqrt{2}}", "2", False, "root vs number"),
    (r"\boxed{3.0}", "3", True, "trailing zero"),
    (r"\boxed{5.}", "5", True, "trailing full stop"),
    (r"\boxed{10^6}", "1000000", True, "power of ten"),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", True, "expanded polynomial"),
    # extraction: last box, fallbacks, truncation
    (r"First \boxed{5}, but on reflection \boxed{6}.", "5", False, "the last box counts"),
    (r"First \boxed{6}, but on reflection \boxed{5}.", "5", True, "the last box counts (2)"),
    (r"\boxed{5} and then \boxed{6", "5", False, "truncated last box is no answer"),
    (r"Final Answer: The final answer is $\frac{1}{2}$. I hope it is correct.", "0.5", True, "minerva fallback"),
    ("So the answer is 42.", "42", True, "answer-is fallback"),
    ("Total: 18 + 54 = 72.\n#### 72", GSM8K, True, "gsm8k-style completion"),
    ("I think it is 72 clips.", GSM8K, False, "no committed answer"),
    (r"\boxed{\boxed{7}}", "7", True, "nested box"),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", True, "left/right delimiters"),
]


def test_table_is_big_enough():
  assert len(TABLE) >= 40
  assert sum(not t[2] for t in TABLE) >= 15  # plenty of wrong answers that look right


@pytest.mark.parametrize("completion,reference,expected,what", TABLE, ids=[t[3] for t in TABLE])
def test_verdicts(completion, reference, expected, what):
  ok, reason = math_reward.check_math(completion, reference)
  assert ok is expected, f"{what}: {completion!r} vs {reference!r} -> {reason}"
  assert verify_math(completion, reference) is expected


# sympy's simplify of an unevaluated expression with oo in it is not deterministic: `72 - oo**oo` simplified to 0 in
# 2 of 30 fresh caches, `72 - 72**oo` in 5 of 30 (CI scored `\infty^{\infty}` correct for 72 once).
INFINITE_ANSWERS = [r"\infty^{\infty}", r"\sqrt{\infty}", r"\infty \cdot 72", r"72^{\infty}", r"x = \infty^{\infty}",
                    r"(72, \infty^{\infty})", r"\{72, \sqrt{\infty}\}", r"72 \cdot \infty^{0}"]


@pytest.mark.parametrize("answer", INFINITE_ANSWERS)
def test_infinite_answers_are_wrong_for_finite_references_every_time(answer):
  from sympy.core.cache import clear_cache  # pylint: disable=g-import-not-at-top

  verdicts = set()
  for _ in range(30):
    clear_cache()  # each draw as in a fresh worker
    math_reward._parse_reference.cache_clear()
    for reference in ("72", "1", "(72, 1)", r"\{72, 1\}"):
      verdicts.add(math_reward.check_math(rf"\boxed{{{answer}}}", reference))
  assert all(ok is False for ok, _ in verdicts), verdicts


def test_last_boxed_nesting_and_escapes():
  assert math_reward.last_boxed(r"a \boxed{\frac{1}{2}} b") == r"\frac{1}{2}"
  assert math_reward.last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"  # escaped braces do not close
  assert math_reward.last_boxed(r"\boxed{1} \fbox{2}") == "2"
  assert math_reward.last_boxed(r"\boxed 7 apples") == "7"
  assert math_reward.last_boxed(r"\boxed{1} \boxed{2") is None
  assert math_reward.last_boxed("no box") is None


def test_reference_answer_forms():
  assert math_reward.reference_answer(GSM8K) == "72"
  assert math_reward.reference_answer(MATH_SOLUTION) == r"\frac{3}{4}"
  assert math_reward.reference_answer("  42 ") == "42"


@pytest.mark.parametrize("answer,reason", [
    (r"9^{9^{9^{9}}}", "tower"),
    (r"10^{10^{10}}", "tower"),
    (r"2^{100000000}", "exponent"),
    (r"100000!", "factorial"),
    ("{" * 100 + "1" + "}" * 100, "nested"),
    ("1" * 5000, "too long"),
])
def test_too_complex_answers_are_refused_fast(answer, reason):
  assert reason in math_reward.too_complex(answer)
  t0 = time.monotonic()
  assert math_reward.check_math(rf"\boxed{{{answer}}}", "5") == (False, math_reward.too_complex(answer))
  assert time.monotonic() - t0 < 0.5


def test_ordinary_powers_are_not_refused():
  assert math_reward.too_complex(r"e^{x^2}") is None
  assert math_reward.too_complex(r"2^{10}") is None
  assert verify_math(r"\boxed{2^{10}}", "1024")


def test_soft_timeout_bounds_slow_sympy():
  t0 = time.monotonic()
  ok, reason = math_reward.check_math(SLOW_MATH, "5", timeout_s=1.0)
  assert not ok and reason == "timed out after 1.0 s"
  assert time.monotonic() - t0 < 3.0


def test_soft_timeout_keeps_an_outer_alarm():
  import signal  # pylint: disable=g-import-not-at-top

  fired = []
  previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
  try:
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    assert verify_math(r"\boxed{3}", "3")
    assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.5
    wait_until(lambda: fired, timeout_s=10, what="the outer alarm")
    assert fired == [1]
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)
