"""Shared test fixtures: a tiny model config and fast random weights."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models import ModelConfig, create

TINY = ModelConfig(family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, attention_bias=True, max_position_embeddings=256)


def tiny_model(cfg: ModelConfig = TINY, seed: int = 0):
  """Random weights from numpy (eager NNX init compiles one RNG program per shape: slow on CPU)."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: create(cfg)))
  rng = np.random.default_rng(seed)

  def fill(path, x):
    if "scale" in jax.tree_util.keystr(path):
      return jnp.asarray(1 + 0.1 * rng.normal(size=x.shape), x.dtype)
    return jnp.asarray(rng.normal(size=x.shape) / np.sqrt(x.shape[0]), x.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


# An answer sympy grinds on for ~15 s (each (n!)! about 1.4 s), far longer than any timeout in the tests; a single
# (9999!)! finishes in about a second, so racing it against a 1 s timeout was flaky.
SLOW_MATH = r"\boxed{" + "+".join(f"({n}!)!" for n in range(9999, 9989, -1)) + "}"


# configs/math.py overrides for end-to-end runs: a small, fast variant of the tiny default, every mechanism on.
FAST = {
    "model.hidden_size": 64, "model.intermediate_size": 128, "model.num_layers": 2, "model.num_heads": 2,
    "model.num_kv_heads": 1, "model.head_dim": 32,
    "warmstart.steps": 30, "warmstart.batch_size": 32, "data.eval_size": 8, "data.synthetic_size": 2000,
    "rollout.batch_size": 4, "rollout.group_size": 4, "rollout.max_concurrent_rollouts": 8,
    "learner.ppo_n_minibatches": 2, "learner.max_tokens_per_mb": 256, "learner.min_bucket": 64,
    "sampler.num_slots": 32, "sampler.num_pages": 256, "sampler.max_new_tokens": 40, "sampler.max_seq_len": 96,
    "data.max_prompt_len": 40, "checkpoint.every_steps": 2, "eval.every_steps": 2, "reward.num_workers": 1,
    "metrics.tensorboard": False,
    # The fast model barely learns in 30 warm-start steps; with filtering on, nearly every group (all wrong) would
    # be dropped and a step could take minutes. Filtering is covered by the controller tests.
    "learner.filter_uniform_groups": False,
}
