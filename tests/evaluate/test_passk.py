"""The unbiased pass@k estimator against its closed form, and its edge cases."""

import math

import numpy as np
import pytest

from areal_jax.evaluate import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize("n", [1, 2, 5, 16, 32, 64])
def test_pass_at_k_matches_closed_form(n):
  for c in range(n + 1):
    for k in range(1, n + 1):
      exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
      assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_pass_at_1_is_the_fraction_correct_and_pass_at_k_grows_with_k():
  assert pass_at_k(32, 8, 1) == pytest.approx(0.25)
  values = [pass_at_k(32, 3, k) for k in range(1, 33)]
  assert all(a < b for a, b in zip(values, values[1:30]))  # strictly increasing until it reaches 1
  assert values[-1] == 1.0 and pass_at_k(32, 0, 32) == 0.0


def test_large_n_stays_finite_where_binomials_overflow_floats():
  n, c, k = 2000, 37, 500  # C(2000, 500) is far beyond float range
  exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # exact rational arithmetic on Python ints
  assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-9)


def test_mean_over_questions():
  correct = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], np.float32)
  assert mean_pass_at_k(correct, 1) == pytest.approx((0.5 + 0 + 1) / 3)
  expected = np.mean([1 - math.comb(4 - c, 2) / math.comb(4, 2) for c in (2, 0, 4)])
  assert mean_pass_at_k(correct, 2) == pytest.approx(expected)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_out_of_range_arguments_raise_naming_them(n, c, k):
  with pytest.raises(ValueError, match=f"c={c}|k={k}"):
    pass_at_k(n, c, k)
