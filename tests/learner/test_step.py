"""The learner's jitted step: packed = padded gradients, sharded = single-device updates, bounded compiles."""

import dataclasses
import gc
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.config import load_config, presets
from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.learner import Learner
from areal_jax.learner.microbatch import assemble, bucket_lengths, plan_packed
from areal_jax.learner import objectives
from areal_jax.learner.ppo import Rejection, loglinear_alpha
from areal_jax.learner.step import BATCH_INT_KEYS, build_step, make_learner_mesh, packed_logprobs
from areal_jax.models.logprobs import logprobs_of
from areal_jax.models.transformer import create

from learner_batches import CFG, accumulate_packed, make_trajectories, one_device_mesh, padded_batch


@pytest.mark.slow
def test_packed_microbatch_gradients_equal_one_padded_batch():
  cfg = LearnerConfig(max_tokens_per_mb=64, min_bucket=64, eps_clip_higher=0.28, behav_imp_weight_cap=1.3)
  temperature = 0.7
  # Rematerialised layers, so remat is exercised too (the padded reference shares the module graph).
  fns = build_step(CFG.replace(remat="full"), cfg, one_device_mesh(), temperature=temperature)
  params = fns.init_params(3)
  trajs = make_trajectories(0, n=12)
  adv = np.random.default_rng(1).normal(size=len(trajs)).astype(np.float32)
  tok_adv = [np.full(len(t.response_ids), a, np.float32) for t, a in zip(trajs, adv)]
  n_loss = sum(len(t.response_ids) for t in trajs)

  layouts = plan_packed([t.num_tokens for t in trajs], max_tokens=64, rows=1, min_bucket=64)
  assert len(layouts) >= 4
  grads, stats = accumulate_packed(fns, params, layouts, trajs, tok_adv, 1 / n_loss)

  # Reference: one sequence per row, right-padded, the loss straight from Eq. 5 on [batch, time].
  tokens, valid, mask, behav, adv_bt = padded_batch(trajs, adv)

  def padded_loss(params):
    logits = nnx.merge(fns.graphdef, params)(tokens, segment_ids=valid)
    lp = logprobs_of(logits[:, :-1], tokens[:, 1:], temperature)
    loss, _ = objectives.loss(logprobs=lp, proximal_logprobs=jax.lax.stop_gradient(lp), behavior_logprobs=behav,
                              advantages=adv_bt, mask=mask, eps_clip=0.2, eps_clip_higher=0.28,
                              rejection=Rejection(upper=1.3))
    return loss

  loss, want = jax.jit(jax.value_and_grad(padded_loss))(params)
  got, want = jax.tree.leaves(grads), jax.tree.leaves(want)
  num = np.sqrt(sum(np.sum((np.asarray(g) - np.asarray(w)) ** 2) for g, w in zip(got, want)))
  den = np.sqrt(sum(np.sum(np.asarray(w) ** 2) for w in want))
  assert den > 0 and num / den <= 1e-5, num / den
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * np.abs(w).max())
  np.testing.assert_allclose(stats["loss"] / stats["tokens"], loss, rtol=1e-5)
  assert 0 < stats["capped"] < stats["tokens"]


@pytest.mark.slow
def test_sharded_step_matches_single_device():
  cfg = LearnerConfig(lr=1e-3, max_tokens_per_mb=64, min_bucket=64, ppo_n_minibatches=2, warmup_steps=0,
                      vocab_chunk=16)  # the chunked vocabulary projection, under vocab-sharding on 8 devices
  init = nnx.split(create(CFG, 5))[1]
  trajs = make_trajectories(2)
  one = Learner(model_cfg=CFG, config=cfg, mesh=one_device_mesh(), params=init)
  mesh8 = make_learner_mesh(jax.devices(), tensor=2)
  assert dict(mesh8.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
  eight = Learner(model_cfg=CFG, config=cfg, mesh=mesh8, params=init)
  q = eight.params["layers"]["attn"]["q"][...]
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)  # [layers, embed, heads, dim]
  mirrors = [x for x in jax.tree.leaves(eight.opt_state) if x.shape == q.shape]
  assert len(mirrors) == 2 and all(x.sharding.spec == q.sharding.spec for x in mirrors)  # Adam mu, nu
  assert eight.fns.rows == 4

  s1, s8 = one.train_step(trajs), eight.train_step(trajs)
  moved = 0.0
  for p0, p1, p8 in zip(jax.tree.leaves(init), jax.tree.leaves(one.params), jax.tree.leaves(eight.params)):
    np.testing.assert_allclose(p8, p1, rtol=0, atol=2e-6)
    moved = max(moved, float(np.abs(np.asarray(p1) - np.asarray(p0)).max()))
  assert moved > 1e-3  # two Adam updates of lr 1e-3 happened
  for k in ("learner/loss", "learner/importance_weight_max", "learner/grad_norm", "learner/entropy"):
    np.testing.assert_allclose(s8[k], s1[k], rtol=1e-4, err_msg=k)


@pytest.mark.slow
def test_compiles_once_per_bucket_and_no_implicit_transfers():
  cfg = LearnerConfig(lr=1e-3, max_tokens_per_mb=64, min_bucket=32, ppo_n_minibatches=2)
  learner = Learner(model_cfg=CFG, config=cfg, mesh=one_device_mesh(), peak_flops=1e9)
  seen = set()
  for step, (n, max_response) in enumerate([(2, 8), (16, 50), (4, 20), (3, 40)]):
    plan = learner.prepare(make_trajectories(step, n=n, max_response=max_response))
    mbs = [mb for minibatch in plan.minibatches for mb in minibatch]
    seen |= {mb.layout.length for mb in mbs}
    # π_prox/π_behav with the parameters at the start of the step, for every minibatch (not just the first).
    inputs = [jax.device_put({k: getattr(mb, k) for k in BATCH_INT_KEYS}, learner.fns.batch_sharding) for mb in mbs]
    w = np.concatenate([np.exp(np.asarray(learner.fns.logprobs(learner.params, x)) - mb.behavior_logprobs)
                        [mb.loss_mask > 0] for x, mb in zip(inputs, mbs)])
    with jax.transfer_guard("disallow"):
      stats = learner.update(plan)
    assert stats["learner/version"] == step + 1 == learner.version
    np.testing.assert_allclose(stats["learner/importance_weight_mean"], w.mean(), rtol=1e-5)
    np.testing.assert_allclose(stats["learner/importance_weight_max"], w.max(), rtol=1e-5)
    if len(plan.minibatches) > 1:
      assert stats["learner/approx_kl"] > 0  # later minibatches see updated parameters against π_prox
  assert seen == set(bucket_lengths(64, 32)) == {32, 48, 64}
  assert learner.fns.accumulate._cache_size() == len(seen)
  assert learner.fns.logprobs._cache_size() == len(seen)
  assert learner.fns.apply._cache_size() == 1
  for k in ("loss", "clip_fraction", "importance_weight_mean", "importance_weight_max", "capped_fraction",
            "approx_kl", "entropy", "grad_norm", "tokens_per_s", "mfu"):
    assert np.isfinite(stats[f"learner/{k}"]), k
  assert stats["learner/tokens_per_s"] > 0 and stats["learner/mfu"] > 0


def test_training_moves_probability_towards_positive_advantages():
  cfg = LearnerConfig(lr=3e-3, max_tokens_per_mb=128, min_bucket=128, ppo_n_minibatches=1, weight_decay=0.0)
  learner = Learner(model_cfg=CFG, config=cfg, mesh=one_device_mesh())
  trajs = [t for t in make_trajectories(7) if t.group_id != 1]

  def mean_logprob(sign):
    plan = learner.prepare(trajs)
    out = []
    for mb in plan.minibatches[0]:
      lp = np.asarray(learner.fns.logprobs(learner.params, {k: getattr(mb, k) for k in BATCH_INT_KEYS}))
      sel = (mb.loss_mask > 0) & (np.sign(mb.advantages) == sign)
      out.append(lp[sel])
    return np.concatenate(out).mean()

  before = mean_logprob(1), mean_logprob(-1)
  for _ in range(3):
    stats = learner.train_step(trajs)
  after = mean_logprob(1), mean_logprob(-1)
  assert after[0] > before[0] + 0.05 and after[1] < before[1] - 0.05, (before, after)
  # One minibatch: the update sees the parameters the proximal pass used, so u = 1 on every token.
  assert abs(stats["learner/approx_kl"]) < 1e-6 and stats["learner/clip_fraction"] == 0.0


def test_kl_entropy_standard_ppo_and_bf16_compute():
  cfg = LearnerConfig(lr=1e-2, max_tokens_per_mb=128, min_bucket=64, ppo_n_minibatches=1, use_decoupled_loss=False,
                      kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01)
  model_cfg = CFG.replace(dtype="bfloat16")
  learner = Learner(model_cfg=model_cfg, config=cfg, mesh=one_device_mesh(), peak_flops=1e9)
  trajs = make_trajectories(3)
  first, second = learner.train_step(trajs), learner.train_step(trajs)
  assert first["learner/ref_kl"] < 1e-4 < second["learner/ref_kl"]
  assert first["learner/importance_weight_mean"] == 1.0  # π_prox := π_behav
  assert learner.fns.logprobs._cache_size() == 1  # the reference pass only; no proximal pass
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(learner.params))  # fp32 master weights


def test_batch_of_uniform_groups_advances_version_without_update():
  learner = Learner(model_cfg=CFG, config=LearnerConfig(max_tokens_per_mb=128), mesh=one_device_mesh(),
                    peak_flops=1e9)
  before = jax.tree.map(np.asarray, learner.params)
  trajs = [t.replace(reward=1.0) for t in make_trajectories(0, n=8)]
  stats = learner.train_step(trajs)
  assert learner.version == 1 and stats["learner/num_filtered"] == 8 and stats["learner/micro_batches"] == 0
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(learner.params)):
    np.testing.assert_array_equal(a, b)


def test_chunked_vocab_projection_matches_whole():
  model = create(CFG, 1)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 64, (2, 40)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(40), (2, 40))
  seg = jnp.ones((2, 40), jnp.int32)

  def f(model, chunk):
    lp, ent = packed_logprobs(model, tokens, pos, seg, temperature=1.3, chunk=chunk, with_entropy=True)
    return lp.sum() + 0.1 * ent.sum(), (lp, ent)

  (_, whole), g_whole = nnx.jit(nnx.value_and_grad(lambda m: f(m, 0), has_aux=True))(model)
  (_, chunked), g_chunked = nnx.jit(nnx.value_and_grad(lambda m: f(m, 16), has_aux=True))(model)
  for a, b in zip(whole + tuple(jax.tree.leaves(g_whole)), chunked + tuple(jax.tree.leaves(g_chunked))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_aot_lowering_from_abstract_shapes():
  cfg = LearnerConfig(max_tokens_per_mb=256, kl_coef=0.05)
  fns = build_step(CFG.replace(num_layers=3), cfg, make_learner_mesh(jax.devices(), tensor=2))
  gc.collect()
  before = {id(a) for a in jax.live_arrays()}
  compiled = {k: v.compile() for k, v in fns.lower(256).items()}
  assert not {id(a) for a in jax.live_arrays()} - before  # nothing materialised
  assert set(compiled) == {"logprobs", "accumulate", "apply"}
  assert compiled["accumulate"].memory_analysis() is not None
  with pytest.raises(ValueError, match="learner.c_clip=0.5"):
    LearnerConfig(c_clip=0.5)


def test_config_presets_give_valid_learner_configs():
  path = str(pathlib.Path(__file__).parent.parent.parent / "configs" / "math.py")
  assert len(presets(path)) == 6
  for preset in presets(path):
    cfg = LearnerConfig.from_config(load_config(f"{path}:{preset}").learner)
    assert cfg.max_tokens_per_mb in bucket_lengths(cfg.max_tokens_per_mb, cfg.min_bucket)
  with pytest.raises(ValueError, match="unknown learner config keys \\['typo'\\]"):
    LearnerConfig.from_config({"typo": 1})


def test_loglinear_alpha_by_version():
  """α = (v_prox - v) / (v_prox + 1 - v): 0 for tokens of the step's starting policy, towards 1 for older ones."""
  np.testing.assert_allclose(loglinear_alpha(np.array([5, 4, 2, 0, 6]), 5), [0, 1 / 2, 3 / 4, 5 / 6, 0])


def _versioned(trajs, versions):
  return [t.replace(versions=np.full(len(t.response_ids), v, np.int32)) for t, v in zip(trajs, versions)]


def test_loglinear_proximal_matches_numpy_reference():
  """One minibatch of tokens drawn 0-3 versions ago: the step's loss and importance weights equal a numpy
  evaluation of the decoupled loss with log π_prox = log π_behav + α (log π_θ - log π_behav)."""
  cfg = LearnerConfig(lr=1e-3, max_tokens_per_mb=128, min_bucket=64, ppo_n_minibatches=1, prox_logp_method="loglinear")
  learner = Learner(model_cfg=CFG, config=cfg, mesh=one_device_mesh(), peak_flops=1e9)
  learner.restore_counters(version=7, updates=0)
  trajs = _versioned(make_trajectories(4), [7 - i % 4 for i in range(16)])
  plan = learner.prepare(trajs)
  lp, behav, adv, alpha = [], [], [], []
  for mb in plan.minibatches[0]:
    sel = mb.loss_mask > 0
    lp.append(np.asarray(learner.fns.logprobs(learner.params, {k: getattr(mb, k) for k in BATCH_INT_KEYS}))[sel])
    behav.append(mb.behavior_logprobs[sel])
    adv.append(mb.advantages[sel])
    alpha.append(loglinear_alpha(mb.versions[sel], 7))
  lp, behav, adv, alpha = (np.concatenate(x).astype(np.float64) for x in (lp, behav, adv, alpha))
  assert set(np.round(alpha, 4)) == {0.0, 0.5, 0.6667, 0.75}
  prox = behav + alpha * (lp - behav)
  u, w = np.exp(lp - prox), np.exp(prox - behav)
  loss = w * np.maximum(-adv * u, -adv * np.clip(u, 0.8, 1.2))
  stats = learner.update(plan)
  assert learner.fns.logprobs._cache_size() == 1  # only this test's own calls: the step ran no proximal pass
  np.testing.assert_allclose(stats["learner/loss"], loss.mean(), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(stats["learner/importance_weight_mean"], w.mean(), rtol=1e-5)


def test_loglinear_equals_recompute_on_policy():
  """Where the interpolation is exact (every token drawn by the step's starting parameters, behaviour logprobs =
  the learner's own), loglinear trains exactly as recompute, over several minibatches."""
  base = dict(lr=1e-2, max_tokens_per_mb=64, min_bucket=32, ppo_n_minibatches=3, weight_decay=0.0)
  params = Learner(model_cfg=CFG, config=LearnerConfig(**base), mesh=one_device_mesh(), seed=3).params
  trajs = make_trajectories(5)
  probe = Learner(model_cfg=CFG, config=LearnerConfig(**base), mesh=one_device_mesh(), params=params)
  on_policy = []
  for t in trajs:  # behaviour logprobs := the starting parameters' own
    mb = assemble(plan_packed([t.num_tokens], max_tokens=64, rows=1, min_bucket=32)[0], [t],
                  [np.zeros(len(t.response_ids), np.float32)])
    lp = np.asarray(probe.fns.logprobs(params, {k: getattr(mb, k) for k in BATCH_INT_KEYS}))[mb.loss_mask > 0]
    on_policy.append(t.replace(logprobs=lp.astype(np.float32), versions=np.full(len(lp), 2, np.int32)))
  out = {}
  for method in ("recompute", "loglinear"):
    learner = Learner(model_cfg=CFG, config=LearnerConfig(**base, prox_logp_method=method), mesh=one_device_mesh(),
                      params=params, peak_flops=1e9)
    learner.restore_counters(version=2, updates=0)
    stats = learner.train_step(on_policy)
    out[method] = stats, jax.tree.map(np.asarray, learner.params)
    assert (learner.fns.logprobs._cache_size() > 0) == (method == "recompute")  # loglinear: no proximal pass
  (s_r, p_r), (s_l, p_l) = out["recompute"], out["loglinear"]
  for k in ("learner/loss", "learner/importance_weight_mean", "learner/approx_kl", "learner/clip_fraction"):
    np.testing.assert_allclose(s_l[k], s_r[k], rtol=1e-5, atol=1e-7, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p_l, p_r)


def test_prox_logp_method_errors_name_the_field():
  with pytest.raises(ValueError, match=r"learner.prox_logp_method='exact'.*recompute"):
    LearnerConfig(prox_logp_method="exact")
  with pytest.raises(ValueError, match=r"learner.prox_logp_method='loglinear'.*use_decoupled_loss=True"):
    LearnerConfig(prox_logp_method="loglinear", use_decoupled_loss=False)


def test_statistics_by_staleness():
  """`staleness/<s>/...`: each loss token counted under its own staleness (learner version - the version that drew
  it); the per-staleness clip and drop fractions add up to the step's; log-ratio and weight statistics equal numpy's
  over the proximal logprobs of the step's starting parameters."""
  cfg = LearnerConfig(lr=1e-3, max_tokens_per_mb=64, min_bucket=32, ppo_n_minibatches=2,
                      rejection=Rejection(upper=1.2))
  learner = Learner(model_cfg=CFG, config=cfg, mesh=one_device_mesh(), peak_flops=1e9)
  learner.restore_counters(version=3, updates=6)
  rng = np.random.default_rng(5)
  trajs = [dataclasses.replace(t, versions=np.sort(rng.integers(0, 4, len(t.response_ids))).astype(np.int32))
           for t in make_trajectories(11)]
  plan = learner.prepare(trajs)
  by = {}
  for mb in (mb for minibatch in plan.minibatches for mb in minibatch):
    lp = np.asarray(learner.fns.logprobs(learner.params, {k: getattr(mb, k) for k in BATCH_INT_KEYS}))
    for s in range(4):
      sel = (mb.loss_mask > 0) & (3 - mb.versions == s)
      by.setdefault(s, []).append((lp - mb.behavior_logprobs)[sel])
  stats = learner.update(plan)
  total = stats["learner/loss_tokens"]
  assert sum(stats[f"staleness/{s}/tokens"] for s in range(4)) == total
  for name in ("clip_fraction", "capped_fraction"):
    per = "clip_fraction" if name == "clip_fraction" else "dropped_fraction"
    got = sum(stats[f"staleness/{s}/{per}"] * stats[f"staleness/{s}/tokens"] for s in range(4)) / total
    np.testing.assert_allclose(got, stats[f"learner/{name}"], rtol=1e-5)
  assert stats["learner/capped_fraction"] > 0  # the rule bites
  for s in range(4):
    r = np.concatenate(by[s]).astype(np.float64)
    assert stats[f"staleness/{s}/tokens"] == len(r)
    np.testing.assert_allclose(stats[f"staleness/{s}/log_ratio_mean"], r.mean(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(stats[f"staleness/{s}/log_ratio_max"], r.max(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(stats[f"staleness/{s}/weight_p90"], np.quantile(np.exp(r), 0.9), rtol=1e-4)
  assert "staleness/4/tokens" not in stats
