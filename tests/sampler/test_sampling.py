"""Token sampling: greedy, temperature, top-k, top-p in one program; logprobs under the temperature-scaled
distribution; draws fixed by (key, index)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.sampler.sampling import filter_logits, request_key, sample

V = 16
LOGITS = np.log(np.array([0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.04, 0.03, 0.02, 0.01, 0.005, 0.003, 0.001, 0.0005,
                          0.0003, 0.0002]))


def draw(n, *, temperature, top_p=1.0, top_k=-1, index=0, logits=LOGITS, vocab_limit=0):
  keys = np.stack([request_key(0, i) for i in range(n)])
  full = lambda x, dt: jnp.full((n,), x, dt)
  fn = jax.jit(functools.partial(sample, vocab_limit=vocab_limit))
  tokens, logp = fn(jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, V)), jnp.asarray(keys),
                                 full(index, jnp.int32), full(temperature, jnp.float32), full(top_p, jnp.float32),
                                 full(top_k, jnp.int32))
  return np.asarray(tokens), np.asarray(logp)


def test_filter_keeps_top_k_and_the_nucleus():
  rows = jnp.asarray(np.stack([LOGITS] * 3), jnp.float32)
  out = np.asarray(filter_logits(rows, jnp.array([1.0, 0.6, 0.6]), jnp.array([3, -1, 2])))
  kept = np.isfinite(out)
  assert kept[0].tolist() == [True] * 3 + [False] * 13  # top-3
  assert kept[1].tolist() == [True] * 3 + [False] * 13  # 0.3 + 0.2 < 0.6 <= 0.3 + 0.2 + 0.15
  assert kept[2].tolist() == [True] * 2 + [False] * 14  # both: the tighter one wins
  np.testing.assert_array_equal(out[kept], rows[np.asarray(kept)])


def test_temperature_sampling_matches_the_distribution():
  n, t = 20000, 0.7
  tokens, logp = draw(n, temperature=t)
  want = np.exp(LOGITS / t) / np.exp(LOGITS / t).sum()
  freq = np.bincount(tokens, minlength=V) / n
  assert np.abs(freq - want).max() < 0.015
  np.testing.assert_allclose(logp, np.log(want)[tokens], atol=1e-5)


def test_top_k_top_p_restrict_draws_but_not_the_logprob():
  tokens, logp = draw(4000, temperature=1.0, top_k=4)
  assert set(tokens.tolist()) == {0, 1, 2, 3}
  np.testing.assert_allclose(logp, LOGITS[tokens], atol=1e-5)  # unfiltered distribution (what the learner sees)
  tokens, _ = draw(4000, temperature=1.0, top_p=0.6)
  assert set(tokens.tolist()) == {0, 1, 2}


def test_greedy_and_reproducibility():
  tokens, logp = draw(8, temperature=0.0, top_k=3)
  assert np.all(tokens == 0)
  np.testing.assert_allclose(logp, LOGITS[0], atol=1e-6)
  a, _ = draw(64, temperature=1.0, index=5)
  b, _ = draw(64, temperature=1.0, index=5)
  c, _ = draw(64, temperature=1.0, index=6)
  np.testing.assert_array_equal(a, b)
  assert (a != c).any()
  assert not np.array_equal(request_key(0, 1, 2), request_key(0, 2, 1))


def test_ids_beyond_the_vocab_limit_are_never_drawn():
  padded = LOGITS[::-1]  # the likeliest ids last, where a padded vocabulary's unused rows are
  for temperature in (0.0, 1.0):
    tokens, logp = draw(4000, temperature=temperature, logits=padded, vocab_limit=12)
    assert tokens.max() < 12 and (temperature or np.all(tokens == 11))
    np.testing.assert_allclose(logp, padded[tokens], atol=1e-5)  # the logprob as the learner computes it: all ids
