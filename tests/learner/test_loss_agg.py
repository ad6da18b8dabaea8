"""Loss aggregation (`learner.loss_agg`) and non-finite logprobs: packed, micro-batched and sharded steps against
references written out by hand."""

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.learner.config import LOSS_AGGS, LearnerConfig
from areal_jax.learner.learner import Learner
from areal_jax.learner.microbatch import plan_packed
from areal_jax.learner.objectives import token_terms
from areal_jax.learner.step import build_step, make_learner_mesh
from areal_jax.models.logprobs import logprobs_of
from areal_jax.models.transformer import create
from learner_batches import CFG, accumulate_packed, make_trajectories, one_device_mesh, padded_batch

MAX_TOKENS = 48  # the Dr. GRPO constant in these tests


def _reference_loss(token_loss: np.ndarray, mask: np.ndarray, agg: str) -> float:
  """Aggregation of [sequences, time] token losses, straight from each method's definition."""
  per_seq_sum, per_seq_len = (token_loss * mask).sum(1), mask.sum(1)
  if agg == "token-mean":
    return float(per_seq_sum.sum() / per_seq_len.sum())
  if agg == "seq-mean-token-mean":
    return float(np.mean(per_seq_sum / per_seq_len))
  return float(np.mean(per_seq_sum / MAX_TOKENS))


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_host_weights_reproduce_each_aggregation_over_any_split(agg):
  cfg = LearnerConfig(loss_agg=agg, loss_agg_max_tokens=MAX_TOKENS)
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 40, size=13)
  token_loss = rng.normal(size=(13, 40))
  mask = (np.arange(40)[None] < lengths[:, None]).astype(np.float64)
  weights, denominator = cfg.loss_weighting(list(lengths))
  # Any split of the sequences into micro-batches and shards adds up to the same sum over the one denominator.
  for parts in ([list(range(13))], [[0, 5, 7], [1, 2, 3, 4], [6, 8, 9, 10, 11, 12]], [[i] for i in range(13)]):
    total = sum(weights[i] * (token_loss[i] * mask[i]).sum() for part in parts for i in part)
    np.testing.assert_allclose(total / denominator, _reference_loss(token_loss, mask, agg), rtol=1e-12)


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_packed_microbatch_gradients_equal_the_padded_reference(agg):
  cfg = LearnerConfig(max_tokens_per_mb=64, min_bucket=64, loss_agg=agg, loss_agg_max_tokens=MAX_TOKENS)
  fns = build_step(CFG, cfg, one_device_mesh(), temperature=1.0)
  params = fns.init_params(3)
  trajs = make_trajectories(0, n=12)
  adv = np.random.default_rng(1).normal(size=len(trajs)).astype(np.float32)
  tok_adv = [np.full(len(t.response_ids), a, np.float32) for t, a in zip(trajs, adv)]
  weights, denominator = cfg.loss_weighting([len(t.response_ids) for t in trajs])

  layouts = plan_packed([t.num_tokens for t in trajs], max_tokens=64, rows=1, min_bucket=64)
  assert len(layouts) >= 4
  grads, _ = accumulate_packed(fns, params, layouts, trajs, tok_adv, 1 / denominator, weights)

  tokens, valid, mask, behav, adv_bt = padded_batch(trajs, adv)

  def padded_loss(params):
    logits = nnx.merge(fns.graphdef, params)(tokens, segment_ids=valid)
    lp = logprobs_of(logits[:, :-1], tokens[:, 1:], 1.0)
    token_loss, _ = token_terms(logprobs=lp, proximal_logprobs=jax.lax.stop_gradient(lp), behavior_logprobs=behav,
                                advantages=adv_bt, mask=mask, eps_clip=0.2)
    per_seq_sum, per_seq_len = token_loss.sum(1), mask.sum(1)
    if agg == "token-mean":
      return per_seq_sum.sum() / per_seq_len.sum()
    if agg == "seq-mean-token-mean":
      return (per_seq_sum / per_seq_len).mean()
    return (per_seq_sum / MAX_TOKENS).mean()

  want = jax.tree.leaves(jax.jit(jax.grad(padded_loss))(params))
  got = jax.tree.leaves(grads)
  num = np.sqrt(sum(np.sum((np.asarray(g) - np.asarray(w)) ** 2) for g, w in zip(got, want)))
  den = np.sqrt(sum(np.sum(np.asarray(w) ** 2) for w in want))
  assert den > 0 and num / den <= 1e-5, num / den


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_sharded_minibatched_step_matches_one_device(agg):
  cfg = LearnerConfig(lr=1e-3, max_tokens_per_mb=64, min_bucket=64, ppo_n_minibatches=2, warmup_steps=0,
                      loss_agg=agg, loss_agg_max_tokens=MAX_TOKENS)
  init = nnx.split(create(CFG, 5))[1]
  trajs = make_trajectories(2)
  one = Learner(model_cfg=CFG, config=cfg, mesh=one_device_mesh(), params=init)
  eight = Learner(model_cfg=CFG, config=cfg, mesh=make_learner_mesh(jax.devices(), tensor=2), params=init)
  one.train_step(trajs)
  eight.train_step(trajs)
  for p1, p8 in zip(jax.tree.leaves(one.params), jax.tree.leaves(eight.params)):
    np.testing.assert_allclose(p8, p1, rtol=0, atol=2e-6)


def test_loss_agg_choices_are_checked():
  with pytest.raises(ValueError, match="learner.loss_agg='seq-mean'"):
    LearnerConfig(loss_agg="seq-mean")
  assert LearnerConfig.from_config({"loss_agg": "seq-mean-token-sum-norm"}, max_new_tokens=64).loss_agg_max_tokens == 64


def test_nonfinite_logprobs_never_reach_the_loss():
  lp = np.log(np.full((2, 4), 0.25, np.float32))
  behav = lp.copy()
  prox = lp.copy()
  behav[0, 1] = -np.inf  # w := 1
  prox[1, 2] = np.nan  # left out of the loss
  adv = np.ones((2, 4), np.float32)
  mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)

  def loss(lp):
    token_loss, terms = token_terms(logprobs=lp, proximal_logprobs=prox, behavior_logprobs=behav, advantages=adv, mask=mask,
                                      eps_clip=0.2)
    return token_loss.sum(), terms

  (value, terms), grad = jax.value_and_grad(loss, has_aux=True)(jax.numpy.asarray(lp))
  assert np.isfinite(value) and np.all(np.isfinite(grad))
  assert float(terms["nonfinite"].sum()) == 2
  assert float(terms["importance_weight"][0, 1]) == 1.0
  assert float(grad[1, 2]) == 0.0 and float(terms["tokens"].sum()) == 6  # 7 loss tokens, one left out
  np.testing.assert_allclose(value, -6.0, rtol=1e-6)  # u = 1, A = 1, w = 1 on the six tokens that count


def test_a_nan_step_stops_naming_the_step():
  cfg = LearnerConfig(lr=1e-3, max_tokens_per_mb=64, min_bucket=64, ppo_n_minibatches=1, warmup_steps=0)
  params = jax.tree.map(lambda x: x * np.nan if x.ndim == 2 else x, nnx.split(create(CFG, 5))[1])  # a diverged model
  learner = Learner(model_cfg=CFG, config=cfg, mesh=one_device_mesh(), params=params)
  trajs = make_trajectories(2)
  with pytest.raises(FloatingPointError, match=r"learner step 1: (loss|grad_norm) is nan.*last checkpoint is intact"):
    learner.train_step(trajs)
