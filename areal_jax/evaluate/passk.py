"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

With n answers to a question of which c are correct, the chance that at least one of k answers drawn without
replacement is correct is 1 - C(n-c, k) / C(n, k). The binomials overflow floats for AReaL-sized n, so the ratio is
computed as the product prod_{i=n-c+1..n} (1 - k / i). pass@1 is c / n: the mean accuracy over the samples.
"""

from __future__ import annotations

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k for one question with `n` answers of which `c` are correct (1 <= k <= n)."""
  if not 0 <= c <= n:
    raise ValueError(f"correct answers c={c} must lie in [0, n={n}]")
  if not 1 <= k <= n:
    raise ValueError(f"pass@k with k={k} needs 1 <= k <= n={n} answers per question")
  if n - c < k:  # every draw of k answers holds a correct one
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(correct: np.ndarray, k: int) -> float:
  """pass@k averaged over questions, from `correct` [questions, n] (1 = correct; rewards above 0.5 count)."""
  correct = np.asarray(correct)
  if correct.ndim != 2 or correct.shape[0] == 0:
    raise ValueError(f"correct must be [questions, samples] with at least one question, got shape {correct.shape}")
  n = correct.shape[1]
  return float(np.mean([pass_at_k(n, int(c), k) for c in (correct > 0.5).sum(axis=1)]))
