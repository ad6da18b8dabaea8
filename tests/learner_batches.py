"""Shared by the learner tests: a tiny model config, random trajectories, and reference batches."""

import jax
import numpy as np

from areal_jax.learner.microbatch import assemble
from areal_jax.learner.step import BATCH_FLOAT_KEYS, BATCH_INT_KEYS, make_learner_mesh
from areal_jax.models.config import ModelConfig
from areal_jax.types import Trajectory

CFG = ModelConfig(family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, attention_bias=True)


def one_device_mesh():
  return make_learner_mesh(jax.devices()[:1])


def make_trajectories(seed, n=16, group_size=4, max_prompt=10, max_response=40):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    p, r = int(rng.integers(2, max_prompt)), int(rng.integers(1, max_response))
    out.append(Trajectory(
        prompt_ids=rng.integers(0, CFG.vocab_size, p).astype(np.int32),
        response_ids=rng.integers(0, CFG.vocab_size, r).astype(np.int32),
        logprobs=(np.log(1 / CFG.vocab_size) + rng.normal(0, 0.5, r)).astype(np.float32),
        versions=np.zeros(r, np.int32), finish_reason="eos", group_id=i // group_size,
        reward=float(i % 2 if i // group_size != 1 else 1)))  # group 1 is uniform
  return out


def padded_batch(trajs, adv):
  """One sequence per row, right-padded: tokens, valid [n, T]; loss mask, behaviour logprobs, advantages [n, T-1]."""
  t_max = max(t.num_tokens for t in trajs)
  tokens, valid = np.zeros((len(trajs), t_max), np.int32), np.zeros((len(trajs), t_max), np.int32)
  mask, behav, adv_bt = (np.zeros((len(trajs), t_max - 1), np.float32) for _ in range(3))
  for i, t in enumerate(trajs):
    p, r = len(t.prompt_ids), len(t.response_ids)
    tokens[i, :p + r] = np.concatenate([t.prompt_ids, t.response_ids])
    valid[i, :p + r] = 1
    mask[i, p - 1:p + r - 1], behav[i, p - 1:p + r - 1], adv_bt[i, p - 1:p + r - 1] = 1, t.logprobs, adv[i]
  return tokens, valid, mask, behav, adv_bt


def accumulate_packed(fns, params, layouts, trajs, tok_adv, inv_denominator, weights=None):
  """Gradients and statistics accumulated over the packed micro-batches of `layouts` (proximal = current)."""
  grads, stats = fns.zero_accumulators()
  inv = jax.device_put(np.float32(inv_denominator), fns.replicated)
  for layout in layouts:
    mb = assemble(layout, trajs, tok_adv, weights)
    b = jax.device_put({k: getattr(mb, k) for k in BATCH_INT_KEYS + BATCH_FLOAT_KEYS}, fns.batch_sharding)
    b["proximal_logprobs"] = fns.logprobs(params, {k: b[k] for k in BATCH_INT_KEYS})
    grads, stats = fns.accumulate(params, grads, stats, b, inv)
  return grads, stats
