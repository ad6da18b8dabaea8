r"""Seeded synthetic arithmetic with worked solutions: what the tiny CPU default trains on.

Difficulty d is the number of operations: 1 `a+b`; 2 adds `-`; 3 and 4 add `*` (single-digit factors; products
are worked out first). Questions and solutions use only `CharTokenizer.CHARS` and stay short (question <= 23
characters, solution <= 56) so that the tiny model's 48-token prompts and 64-token answers hold them:

    what is 12+7*3?        ->   7*3=21
                                12+21=33
                                \boxed{33}

Difficulty 1 (the CPU default) works the sum in columns, ones then tens with the carry: a model trained from scratch
learns single-digit facts in a few hundred steps, where the one-line sum `17+25=42` takes thousands (measured: 400
warm-start steps of 16 reach 0.34 pass@1 in columns, 0.04 in one line).

    what is 17+25?         ->   7+5=12
                                1+2+1=4
                                \boxed{42}

The answer is `\boxed{}`ed like real math data, and the reference is checked by `verify_math` like any other.

A mix of difficulties (`data.synthetic_mix="1:9,4:1"`: difficulty:weight pairs) gives the long-tail answer lengths
of chain-of-thought workloads (most answers short, a few ~3x the mean), e.g. for `tools/bench_async.py`.

`task="products"` draws products of two two-digit numbers instead (`what is 37*48?` -> `\\boxed{1776}`): too hard
for the tiny model to work out in its head, what the bundled calculator agent (`agents/calculator.py`) learns on.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from areal_jax.data.records import DataError, Problem

# difficulty -> (operators, +/- operand bound); factors of `*` are drawn from [2, 10)
LEVELS = {1: ("+", 50), 2: ("+-", 50), 3: ("+-*", 30), 4: ("+-*", 30)}
_SPLITS = {"train": 0, "eval": 1}
TASKS = ("arithmetic", "products")
_PRODUCTS_STREAM = 100  # the products' rng stream (arithmetic uses its difficulty, the mixes 0)


def column_sum(a: int, b: int) -> str:
  """`a+b` (0 <= a, b < 100) worked in columns: ones, then tens plus the carry, then the boxed sum."""
  ones, carry = a % 10 + b % 10, (a % 10 + b % 10) // 10
  tens = a // 10 + b // 10 + carry
  return f"{a % 10}+{b % 10}={ones}\n{a // 10}+{b // 10}+{carry}={tens}\n\\boxed{{{a + b}}}"


def make_problem(rng: np.random.Generator, difficulty: int) -> tuple[str, str, int]:
  """(expression, worked solution, answer) for one random problem."""
  ops, bound = LEVELS[difficulty]
  chosen = [str(rng.choice(list(ops))) for _ in range(difficulty)]
  nums = []
  for i in range(difficulty + 1):
    near_mul = (i > 0 and chosen[i - 1] == "*") or (i < difficulty and chosen[i] == "*")
    nums.append(int(rng.integers(2, 10)) if near_mul else int(rng.integers(0, bound)))
  expr = str(nums[0]) + "".join(f"{o}{n}" for o, n in zip(chosen, nums[1:]))
  if difficulty == 1:
    return expr, column_sum(*nums), sum(nums)
  steps = []
  terms, signs = [nums[0]], []  # products first, left to right
  for o, n in zip(chosen, nums[1:]):
    if o == "*":
      product = terms[-1] * n
      steps.append(f"{terms[-1]}*{n}={product}")
      terms[-1] = product
    else:
      terms.append(n)
      signs.append(o)
  acc = terms[0]
  for o, n in zip(signs, terms[1:]):  # then sums and differences, left to right
    new = acc + n if o == "+" else acc - n
    steps.append(f"{acc}{o}{n}={new}")
    acc = new
  steps.append(f"\\boxed{{{acc}}}")
  return expr, "\n".join(steps), acc


def make_product(rng: np.random.Generator) -> tuple[str, str, int]:
  """(expression, one-line solution, answer) for a product of two numbers in [10, 100)."""
  a, b = (int(x) for x in rng.integers(10, 100, size=2))
  return f"{a}*{b}", f"\\boxed{{{a * b}}}", a * b


def parse_mix(text: str) -> dict[int, float]:
  """"1:9,4:1" -> {1: 0.9, 4: 0.1} (weights normalised); raises DataError naming `data.synthetic_mix`."""
  mix = {}
  for part in text.split(","):
    d, sep, w = part.partition(":")
    try:
      d, w = int(d), float(w)
    except ValueError:
      d = w = None
    if not sep or d not in LEVELS or not w or w < 0 or d in mix:
      raise DataError(f"data.synthetic_mix={text!r}: expected distinct difficulty:weight pairs like '1:9,4:1' with "
                      f"difficulties in {sorted(LEVELS)} and positive weights (at {part!r})")
    mix[d] = w
  total = sum(mix.values())
  return {d: w / total for d, w in mix.items()}


def generate(n: int, *, difficulty: int | Mapping[int, float], seed: int, split: str = "train",
             distinct: bool = False, exclude: frozenset[str] = frozenset(), task: str = "arithmetic") -> list[Problem]:
  """`n` problems from the (seed, difficulty, split) stream; `exclude` questions are never produced (held-out sets),
  and with `distinct` no question repeats. `difficulty` may be a {difficulty: probability} mix (see `parse_mix`);
  `task="products"` ignores it."""
  if task not in TASKS:
    raise DataError(f"data.synthetic_task={task!r}: choose one of {TASKS}")
  if split not in _SPLITS:
    raise DataError(f"synthetic split {split!r}: choose one of {sorted(_SPLITS)}")
  if task == "products":
    rng = np.random.default_rng([seed, _PRODUCTS_STREAM, _SPLITS[split]])
    return _draw(n, lambda: make_product(rng), "products", split, distinct, exclude)
  mixed = isinstance(difficulty, Mapping)
  levels = sorted(difficulty) if mixed else [difficulty]
  if any(d not in LEVELS for d in levels):
    raise DataError(f"data.synthetic_difficulty={difficulty}: choose one of {sorted(LEVELS)}")
  if mixed:
    rng = np.random.default_rng([seed, 0, _SPLITS[split]])  # difficulty 0: the mixes' stream
    weights = np.array([difficulty[d] for d in levels])
    draw = lambda: levels[int(rng.choice(len(levels), p=weights / weights.sum()))]
    name = "mix"
  else:
    rng = np.random.default_rng([seed, difficulty, _SPLITS[split]])
    draw = lambda: difficulty
    name = str(difficulty)
  return _draw(n, lambda: make_problem(rng, draw()), name, split, distinct, exclude)


def _draw(n: int, make, name: str, split: str, distinct: bool, exclude: frozenset[str]) -> list[Problem]:
  problems, seen, misses = [], set(exclude), 0
  while len(problems) < n:
    expr, solution, answer = make()
    question = f"what is {expr}?"
    if question in seen:
      misses += 1
      if misses > 10_000:  # in a row: (nearly) every allowed question is taken
        raise DataError(f"synthetic difficulty {name}: cannot draw {n} problems outside the {len(exclude)} "
                        f"excluded{' and distinct' if distinct else ''} ones; lower data.eval_size")
      continue
    misses = 0
    if distinct:
      seen.add(question)
    problems.append(Problem(uid=f"synthetic-{name}/{split}:{len(problems)}", question=question,
                            reference=str(answer), solution=solution))
  return problems
