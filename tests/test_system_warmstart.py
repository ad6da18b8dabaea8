"""The supervised warm-start: it learns, and with a loss target it stops once the recent mean loss reaches it."""

import jax
import numpy as np
from flax import nnx

from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.step import build_step, make_learner_mesh
from areal_jax.rl import warmstart
from helpers import TINY, tiny_model


def _setup():
  fns = build_step(TINY, LearnerConfig(max_tokens_per_mb=64, min_bucket=64), make_learner_mesh(jax.devices()[:2]))
  rng = np.random.default_rng(0)
  # "copy the prompt": a response the model can learn in a few dozen steps
  pairs = [(p, np.concatenate([p, [1]])) for p in (rng.integers(2, 12, size=6) for _ in range(64))]
  return fns, pairs


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
