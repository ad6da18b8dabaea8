import jax.numpy as jnp
import numpy as np
import optax

from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.optimizer import learning_rate, make_optimizer


def test_warmup_counts_learner_steps_then_holds():
  lr = learning_rate(LearnerConfig(lr=2e-5, warmup_steps=2, ppo_n_minibatches=4))
  np.testing.assert_allclose([lr(0), lr(4), lr(8), lr(1000)], [0.0, 1e-5, 2e-5, 2e-5], rtol=1e-6)
  assert float(learning_rate(LearnerConfig(lr=3e-4, warmup_steps=0))(0)) == np.float32(3e-4)


def test_weight_decay_skips_norms_and_biases():
  cfg = LearnerConfig(lr=0.1, weight_decay=0.5, warmup_steps=0)
  tx = make_optimizer(cfg)
  params = {"w": jnp.ones((2, 3)), "b": jnp.ones((3,))}
  zeros = {"w": jnp.zeros((2, 3)), "b": jnp.zeros((3,))}
  updates, _ = tx.update(zeros, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_allclose(new["w"], 1 - 0.1 * 0.5, rtol=1e-6)  # decoupled decay, lr-scaled
  np.testing.assert_allclose(new["b"], 1.0)


def test_gradients_are_clipped_by_global_norm():
  cfg = LearnerConfig(lr=1.0, weight_decay=0.0, grad_clip=1.0, b1=0.0, b2=0.0, adam_eps=1e-8, warmup_steps=0)
  tx = make_optimizer(cfg)
  params = {"w": jnp.zeros(4)}
  state = tx.init(params)
  # clip_by_global_norm runs first: its output (g / |g| * 1.0) is what Adam sees, visible in Adam's first moment.
  _, state = tx.update({"w": jnp.array([3.0, 4.0, 0.0, 0.0])}, state, params)
  mu = state[1][0].mu["w"]
  np.testing.assert_allclose(mu, [0.6, 0.8, 0.0, 0.0], rtol=1e-6)
