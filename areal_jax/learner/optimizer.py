"""AdamW with global-norm gradient clipping and a linear warmup to a constant learning rate (paper Table 3)."""

from __future__ import annotations

import jax
import optax

from areal_jax.learner.config import LearnerConfig


def learning_rate(cfg: LearnerConfig) -> optax.Schedule:
  """Learning rate per optimizer update: linear warmup over `warmup_steps` learner steps, then constant."""
  warmup = cfg.warmup_steps * cfg.ppo_n_minibatches
  if warmup == 0:
    return optax.constant_schedule(cfg.lr)
  return optax.warmup_constant_schedule(init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup)


def _decay_mask(params):
  """Weight decay on matrices only; norms and biases (rank < 2) are not decayed."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: LearnerConfig) -> optax.GradientTransformation:
  tx = optax.adamw(learning_rate(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                   mask=_decay_mask)
  if cfg.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)
  return tx
