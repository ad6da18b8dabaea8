"""PPO with a critic: GAE and the value loss against numpy references, the zero-critic reduction, learning."""

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.learner import critic as critic_lib
from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.learner import Learner
from areal_jax.learner.microbatch import assemble, plan_packed
from areal_jax.learner.step import BATCH_INT_KEYS, make_learner_mesh
from areal_jax.models import lora
from learner_batches import CFG, make_trajectories


def _reference_gae(values, rewards, steps, gamma, lam):
  """Textbook GAE over one answer's steps (the positions in `steps`, in order; the value after the last is 0)."""
  adv = np.zeros(len(steps))
  running = 0.0
  for i in range(len(steps) - 1, -1, -1):
    t = steps[i]
    next_value = values[steps[i + 1]] if i + 1 < len(steps) else 0.0
    delta = rewards[t] + gamma * next_value - values[t]
    running = delta + gamma * lam * running
    adv[i] = running
  return adv


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_on_packed_rows_matches_textbook_gae_per_answer(gamma, lam):
  rng = np.random.default_rng(0)
  # Two rows; row 0 packs three answers, the second with a masked gap (a tool's output in a merged multi-turn answer).
  segment_ids = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 0], [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
  loss_mask = np.array([[0, 1, 1, 0, 0, 1, 0, 0, 1, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]],
                       np.float32)
  values = rng.normal(size=segment_ids.shape).astype(np.float32)
  seq_adv = np.where(loss_mask > 0, rng.normal(size=segment_ids.shape), 0).astype(np.float32)
  for r in range(2):  # one advantage per answer, as the critic-free path lays them out
    for s in np.unique(segment_ids[r][segment_ids[r] > 0]):
      seq_adv[r, (segment_ids[r] == s) & (loss_mask[r] > 0)] = rng.normal()
  adv, returns = map(np.asarray, critic_lib.gae(values, seq_adv, loss_mask, segment_ids, gamma=gamma, lam=lam))
  for r in range(2):
    for s in np.unique(segment_ids[r][segment_ids[r] > 0]):
      steps = np.flatnonzero((segment_ids[r] == s) & (loss_mask[r] > 0))
      rewards = np.zeros(segment_ids.shape[1])
      rewards[steps[-1]] = seq_adv[r, steps[-1]]  # the answer's reward at its last step
      want = _reference_gae(values[r], rewards, steps, gamma, lam)
      np.testing.assert_allclose(adv[r, steps], want, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(returns[r, steps], want + values[r, steps], rtol=1e-5, atol=1e-6)
  assert not adv[loss_mask == 0].any() and not returns[loss_mask == 0].any()


def test_value_loss_matches_numpy():
  rng = np.random.default_rng(1)
  v, old, ret = (rng.normal(size=(2, 9)).astype(np.float32) for _ in range(3))
  mask = rng.random((2, 9)) > 0.3
  loss, clipped = critic_lib.value_loss(v, old, ret, mask, 0.2)
  held = old + np.clip(v - old, -0.2, 0.2)
  want = np.where(mask, 0.5 * np.maximum((v - ret) ** 2, (held - ret) ** 2), 0)
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  np.testing.assert_array_equal(clipped, mask & ((held - ret) ** 2 > (v - ret) ** 2))


def _learner(critic, model_cfg=CFG, **kw):
  cfg = LearnerConfig(lr=1e-3, max_tokens_per_mb=64, min_bucket=64, ppo_n_minibatches=2, critic=critic, **kw)
  learner = Learner(model_cfg=model_cfg, config=cfg, mesh=make_learner_mesh(jax.devices()[:1]), seed=4)
  learner.init_critic()
  return learner


@pytest.mark.slow
def test_a_zero_critic_with_gamma_and_lambda_one_is_the_critic_free_step():
  trajs = make_trajectories(3)
  plain, with_critic = _learner(""), _learner("copy")
  s0, s1 = plain.train_step(trajs), with_critic.train_step(trajs)
  for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(with_critic.params)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(s1["learner/loss"], s0["learner/loss"], rtol=1e-6)
  assert s1["critic/value_loss"] > 0 and s1["critic/grad_norm"] > 0
  # The critic's body started as the policy's weights.
  body = with_critic.critic.from_policy(plain.params)["body"]
  assert jax.tree.structure(body) == jax.tree.structure(plain.params)


def test_the_critic_learns_the_returns():
  trajs = make_trajectories(5)
  learner = _learner("copy", gae_lambda=0.95, critic_lr=3e-3)
  losses = [learner.train_step(trajs)["critic/value_loss"] for _ in range(8)]
  assert losses[-1] < 0.5 * losses[0], losses


def _batch(trajs) -> dict:
  """The int arrays of the first packed micro-batch of `trajs`."""
  layout = plan_packed([t.num_tokens for t in trajs], max_tokens=64, rows=1, min_bucket=64)[0]
  mb = assemble(layout, trajs, [np.zeros(len(t.response_ids), np.float32) for t in trajs])
  return {k: getattr(mb, k) for k in BATCH_INT_KEYS}


@pytest.mark.slow
def test_a_lora_branch_critic_shares_the_policys_quantized_base_and_learns():
  trajs = make_trajectories(5)
  qlora = CFG.replace(lora_rank=4, lora_alpha=8.0, lora_base_quant="nf4")
  learner = _learner("lora", qlora, gae_lambda=0.95, critic_lr=3e-3)
  names = {path[-1] for path, _ in nnx.to_flat_state(learner.critic_params)}
  assert names == {"head"} | {f"{t}_lora_{ab}" for t in qlora.lora_targets for ab in "ab"}
  before = jax.tree.map(np.asarray, lora.split(learner.params)[1])  # (the policy's update donates its arrays)
  losses = [learner.train_step(trajs)["critic/value_loss"] for _ in range(8)]
  assert losses[-1] < 0.5 * losses[0], losses
  base = lora.split(learner.params)[1]
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(base)):
    np.testing.assert_array_equal(a, b)
  # Its values are those of a full value model whose body is the base with the critic's adapters merged in.
  critic, c = learner.critic, learner.critic_params
  full = critic_lib.ValueModel(qlora.without_lora(), rngs=nnx.Rngs(0))
  body = lora.merged(nnx.merge_state(base, c["body"]), qlora)
  nnx.update(full, nnx.State({"body": body, "head": c["head"]}))
  b = _batch(trajs)
  want = full(b["tokens"], b["positions"], b["segment_ids"])
  got = critic.values(c, critic.base_of(learner.params), b)
  np.testing.assert_allclose(got, want, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("field, value, message", [
    ("critic", "value", r"learner.critic='value': choose one of \('', 'copy', 'lora'\)"),
    ("gae_lambda", 1.5, r"learner.gae_lambda=1.5: must lie in \[0, 1\]"),
    ("value_clip", 0.0, "learner.value_clip=0.0: must be positive"),
])
def test_bad_critic_settings_name_the_field(field, value, message):
  with pytest.raises(ValueError, match=message):
    LearnerConfig(**{field: value})
