"""The synthetic arithmetic generator: seeded, levelled, short enough for the tiny model, and verifiable."""

import re

import numpy as np
import pytest

from areal_jax.data import synthetic
from areal_jax.data.records import DataError
from areal_jax.reward.math import verify_math
from areal_jax.tokenizer import CharTokenizer


def test_seeded_and_deterministic():
  a = synthetic.generate(200, difficulty=2, seed=3)
  b = synthetic.generate(200, difficulty=2, seed=3)
  c = synthetic.generate(200, difficulty=2, seed=4)
  assert a == b
  assert [p.question for p in a] != [p.question for p in c]
  assert synthetic.generate(50, difficulty=2, seed=3) == a[:50]  # a prefix of the same stream


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_levels_fit_the_tiny_model_and_verify(difficulty):
  tok = CharTokenizer()
  problems = synthetic.generate(2000, difficulty=difficulty, seed=0)
  ops = {1: "+", 2: "+-", 3: "+-*", 4: "+-*"}[difficulty]
  seen_ops = set()
  for p in problems:
    expr = re.fullmatch(r"what is ([0-9+\-*]+)\?", p.question).group(1)
    used = re.findall(r"[+\-*]", expr)
    assert len(used) == difficulty and set(used) <= set(ops), p.question
    seen_ops.update(used)
    assert eval(expr) == int(p.reference)  # pylint: disable=eval-used  (digits and + - * only, checked above)
    assert len(tok.encode(f"Q: {p.question}\nA: ")) <= 48  # every character is in the char vocabulary
    assert len(tok.encode(p.solution)) + 1 <= 64  # with eos
    assert p.solution.endswith(f"\\boxed{{{p.reference}}}")
  assert seen_ops == set(ops)
  for p in problems[:100]:
    assert verify_math(p.solution, p.reference)
    assert not verify_math(p.solution, str(int(p.reference) + 1))


def test_worked_solution_does_products_first():
  class Scripted:
    """Replays a fixed problem: `3+4*5-2`."""

    def __init__(self):
      self.ops, self.nums = ["+", "*", "-"], [3, 4, 5, 2]

    def choice(self, options):
      return self.ops.pop(0)

    def integers(self, low, high):
      return self.nums.pop(0)

  expr, solution, answer = synthetic.make_problem(Scripted(), 3)
  assert expr == "3+4*5-2" and answer == 21
  assert solution == "4*5=20\n3+20=23\n23-2=21\n\\boxed{21}"


def test_level_one_works_the_sum_in_columns():
  assert synthetic.column_sum(17, 25) == "7+5=12\n1+2+1=4\n\\boxed{42}"
  assert synthetic.column_sum(3, 40) == "3+0=3\n0+4+0=4\n\\boxed{43}"
  assert synthetic.column_sum(49, 49) == "9+9=18\n4+4+1=9\n\\boxed{98}"
  for p in synthetic.generate(200, difficulty=1, seed=1):
    a, b = map(int, re.fullmatch(r"what is (\d+)\+(\d+)\?", p.question).groups())
    assert p.solution == synthetic.column_sum(a, b)


def test_exclusion_and_distinct():
  held = synthetic.generate(128, difficulty=1, seed=0, split="eval", distinct=True)
  assert len({p.question for p in held}) == 128
  train = synthetic.generate(5000, difficulty=1, seed=0, exclude=frozenset(p.question for p in held))
  assert not {p.question for p in held} & {p.question for p in train}
  with pytest.raises(DataError, match="cannot draw"):
    synthetic.generate(3000, difficulty=1, seed=0, split="eval", distinct=True)  # only 2500 a+b problems exist


def test_bad_difficulty():
  with pytest.raises(DataError, match="synthetic_difficulty=7"):
    synthetic.generate(1, difficulty=7, seed=0)


def test_mix_long_tail_and_bad_mix():
  mix = synthetic.parse_mix("1:9,4:1")
  assert mix == pytest.approx({1: 0.9, 4: 0.1})
  problems = synthetic.generate(2000, difficulty=mix, seed=0)
  assert problems[0].uid == "synthetic-mix/train:0"
  ops = np.array([sum(p.question.count(o) for o in "+-*") for p in problems])
  assert set(ops) == {1, 4} and abs((ops == 4).mean() - 0.1) < 0.03
  lengths = np.array([len(p.solution) for p in problems])
  assert lengths.max() > 2 * lengths.mean()  # the long tail the async benchmark needs
  assert synthetic.generate(5, difficulty=1, seed=0)[0].uid == "synthetic-1/train:0"  # plain difficulty unchanged
  for bad in ("1:9,4", "5:1", "1:0", "1:1,1:2", "a:1", ""):
    with pytest.raises(DataError, match="data.synthetic_mix"):
      synthetic.parse_mix(bad)


def test_products_are_two_digit_factors_held_out_and_short():
  tok = CharTokenizer()
  held = synthetic.generate(64, difficulty=1, seed=0, split="eval", distinct=True, task="products")
  train = synthetic.generate(3000, difficulty=1, seed=0, task="products", exclude=frozenset(p.question for p in held))
  assert train[:10] == synthetic.generate(10, difficulty=4, seed=0, task="products",
                                          exclude=frozenset(p.question for p in held))  # difficulty plays no part
  assert not {p.question for p in held} & {p.question for p in train}
  for p in held + train:
    a, b = map(int, re.fullmatch(r"what is (\d+)\*(\d+)\?", p.question).groups())
    assert 10 <= a < 100 and 10 <= b < 100 and int(p.reference) == a * b
    assert p.solution == f"\\boxed{{{a * b}}}" and len(tok.encode(f"Q: {p.question}\nA: ")) <= 48
  with pytest.raises(DataError, match="synthetic_task='sums'"):
    synthetic.generate(1, difficulty=1, seed=0, task="sums")
