"""The supervised warm-start: it learns, and it stops once the recent mean loss or the held-out match probability
reaches its target."""

import jax
import numpy as np
import pytest
import scipy.special
from flax import nnx

from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.step import build_step, make_learner_mesh
from areal_jax.rl import warmstart
from areal_jax.types import Trajectory
from helpers import TINY, tiny_model


def _setup():
  fns = build_step(TINY, LearnerConfig(max_tokens_per_mb=64, min_bucket=64), make_learner_mesh(jax.devices()[:2]))
  rng = np.random.default_rng(0)
  # "copy the prompt": a response the model can learn in a few dozen steps
  pairs = [(p, np.concatenate([p, [1]])) for p in (rng.integers(2, 12, size=6) for _ in range(64))]
  return fns, pairs


@pytest.mark.slow
def test_warmstart_learns_and_stops_at_the_target_loss():
  fns, pairs = _setup()
  params = jax.device_put(nnx.state(tiny_model(), nnx.Param), fns.param_shardings)
  sft = lambda **kw: warmstart.sft(fns, fns.copy_params(params), pairs, batch_size=8, lr=3e-3, max_tokens=64, **kw)
  _, first, _ = sft(steps=1)
  _, last, taken = sft(steps=60)  # no target: every step runs
  assert taken == 60 and last < 0.5 * first
  _, _, taken = sft(steps=60, target_loss=1e6)
  assert taken == 10  # the first full window of 10 steps is below any loss
  _, loss, taken = sft(steps=60, target_loss=0.7 * first)
  assert 10 < taken < 60 and taken % 10 == 0 and loss < first  # reached midway
  _, _, taken = sft(steps=60, target_loss=1e-9)
  assert taken == 60  # never reached


def test_match_probability_is_the_mean_probability_of_each_response_from_a_dense_forward():
  """(prompt, response) pairs, and a merged transcript whose loss mask leaves out the context between its answers."""
  fns, pairs = _setup()
  model = tiny_model(seed=1)
  params = jax.device_put(nnx.state(model, nnx.Param), fns.param_shardings)
  pairs = pairs[:9] + [(np.asarray([3, 4]), np.asarray([5, 1])), (np.asarray([7]), np.asarray([7, 7, 7, 1]))]
  # A merged transcript: two answers with context between them, which the match leaves out.
  merged = Trajectory(prompt_ids=np.asarray([3, 4], np.int32), response_ids=np.asarray([5, 1, 8, 9, 6, 1], np.int32),
                      logprobs=np.zeros(6, np.float32), versions=np.zeros(6, np.int32), finish_reason="eos",
                      loss_mask=np.asarray([1, 1, 0, 0, 1, 1], np.float32))
  expected = []
  for prompt, response, mask in [(p, r, np.ones(len(r))) for p, r in pairs] + [
      (merged.prompt_ids, merged.response_ids, merged.loss_mask)]:  # one unpacked sequence at a time, in float64
    tokens = np.concatenate([prompt, response])[None]
    logits = np.asarray(model(tokens), np.float64)[0]
    logp = scipy.special.log_softmax(logits, axis=-1)
    p = len(prompt)
    expected.append(np.exp(sum(logp[p - 1 + j, t] * m for j, (t, m) in enumerate(zip(response, mask)))))
  got = warmstart.match_probability(fns, params, pairs + [merged], max_tokens=64)
  np.testing.assert_allclose(got, np.mean(expected), rtol=1e-4)


def test_warmstart_stops_at_the_target_match():
  fns, pairs = _setup()
  params = jax.device_put(nnx.state(tiny_model(), nnx.Param), fns.param_shardings)
  sft = lambda **kw: warmstart.sft(fns, fns.copy_params(params), pairs[:48], batch_size=8, lr=3e-3, max_tokens=64,
                                   heldout=pairs[48:], **kw)
  trained, _, taken = sft(steps=60, target_match=1.0 + 1e-9)
  assert taken == 60  # never reached
  reached = warmstart.match_probability(fns, trained, pairs[48:], max_tokens=64)
  start = warmstart.match_probability(fns, params, pairs[48:], max_tokens=64)
  assert reached > 1e3 * start  # held-out copies got likelier (60 steps: far from likely yet)
  target = np.sqrt(start * reached)
  stopped, _, taken = sft(steps=60, target_match=target)
  assert 10 <= taken < 60 and taken % 10 == 0
  assert warmstart.match_probability(fns, stopped, pairs[48:], max_tokens=64) >= target
  with pytest.raises(ValueError, match="held-out"):
    warmstart.sft(fns, params, pairs, steps=10, batch_size=8, lr=3e-3, max_tokens=64, target_match=0.5)
