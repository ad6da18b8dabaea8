"""The objectives by name (`objectives.loss`) and M2PO's mask against AReaL's own released functions (PPO, GSPO,
SAPO, rejection sampling, M2PO), CISPO against a torch transcription of MiniMax-M1's formula, and the default `ppo`
against the loss as it was before the objectives were pluggable, bit for bit."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.config import load_config, validate
from areal_jax.learner import objectives
from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.learner import Learner
from areal_jax.learner.ppo import Rejection
from areal_jax.models.transformer import create
from areal_functions import load, torch
from learner_batches import CFG, make_trajectories, one_device_mesh

DATA = pathlib.Path(__file__).parent / "data"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def packed_inputs(seed, rows=3, seqs_per_row=4, length=8, pad=3):
  """[rows, T] packed rows of several sequences (1-based segment ids, 0 = padding), a masked prefix per sequence
  (its prompt) and random logprobs: π_prox/π_behav and π_θ/π_prox both far enough from 1 for every clip to bite."""
  rng = np.random.default_rng(seed)
  t = seqs_per_row * length + pad
  seg = np.zeros((rows, t), np.int32)
  seg[:, :seqs_per_row * length] = np.repeat(np.arange(1, seqs_per_row + 1), length)
  lb = -rng.uniform(0.1, 4.0, (rows, t))
  lp = lb + rng.normal(0, 0.3, (rows, t))
  lt = lp + rng.normal(0, 0.3, (rows, t))
  adv = np.repeat(rng.normal(0, 1.5, (rows, seqs_per_row)), length, axis=1)  # one advantage per sequence
  adv = np.concatenate([adv, np.zeros((rows, pad))], axis=1) + rng.normal(0, 0.2, (rows, t))
  mask = (seg > 0) & (np.tile(np.arange(t) % length, (rows, 1)) >= 2)
  f32 = lambda x: x.astype(np.float32)
  return f32(lt), f32(lp), f32(lb), f32(adv), mask, seg


def to_areal(x, seg):
  """Our packed [rows, T] as AReaL's 1D packed format: the sequences one after another, and their cu_seqlens."""
  parts = [x[r][seg[r] == s] for r in range(seg.shape[0]) for s in np.unique(seg[r][seg[r] > 0])]
  lengths = [len(p) for p in parts]
  return torch.tensor(np.concatenate(parts)), torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)


def ours(name, lt, lp, lb, adv, mask, seg, rejection=None, **params):
  """(loss, d loss / d log π_θ, per-token loss) of `objectives`."""
  def f(lt):
    per_token, _ = objectives.token_terms(name, logprobs=lt, proximal_logprobs=lp, behavior_logprobs=lb,
                                          advantages=adv, mask=mask, segment_ids=seg, rejection=rejection, **params)
    total, _ = objectives.loss(name, logprobs=lt, proximal_logprobs=lp, behavior_logprobs=lb, advantages=adv,
                               mask=mask, segment_ids=seg, rejection=rejection, **params)
    return total, per_token

  (total, per_token), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lt))
  return float(total), np.asarray(grad), np.asarray(per_token)


def areal_config(rejection):
  if rejection is None:
    return None
  return load().RejectionSamplingConfig(level=rejection.level, action=rejection.action, metric=rejection.metric,
                                        agg=rejection.agg, upper=rejection.upper, lower=rejection.lower)


def theirs(fn, lt, lp, lb, adv, mask, seg, **kw):
  """(loss, d loss / d log π_θ in our layout, per-token loss) of AReaL's `fn` on the same sequences, in float64."""
  (t_lt, cu), (t_lp, _), (t_lb, _), (t_adv, _), (t_mask, _) = (
      to_areal(x.astype(np.float64) if x.dtype != bool else x, seg) for x in (lt, lp, lb, adv, mask))
  t_lt.requires_grad_(True)
  loss, stat = fn(logprobs=t_lt, advantages=t_adv, loss_mask=t_mask, cu_seqlens=cu, **(
      {"old_logprobs": t_lb, "proximal_logprobs": t_lp} if fn is load().ppo_actor_loss_fn else {"old_logprobs": t_lp}),
      **kw)
  loss.backward()
  packed = np.flatnonzero(seg > 0)  # where AReaL's tokens sit in our rows (sequences in order, row by row)
  grad, per_token = np.zeros(lt.size), np.zeros(lt.size)
  grad[packed] = t_lt.grad.numpy()
  per_token[packed] = torch.where(t_mask, stat["loss"], 0.0).detach().numpy()
  return float(loss.detach()), grad.reshape(lt.shape), per_token.reshape(lt.shape)


TOKEN_MASK = Rejection(level="token", action="mask", upper=1.3, lower=0.7)  # IcePop
SEQUENCE_CLAMP = Rejection(level="sequence", action="clamp", upper=1.1, lower=0.9)
CASES = [
    ("ppo", TOKEN_MASK, dict(eps_clip=0.2)),
    ("ppo", TOKEN_MASK, dict(eps_clip=0.2, eps_clip_higher=0.28, c_clip=3.0)),
    ("ppo", SEQUENCE_CLAMP, dict(eps_clip=0.2, eps_clip_higher=0.28)),
    ("ppo", Rejection(level="sequence", action="mask", metric="kl_k3", upper=0.05), dict(eps_clip=0.1)),
    ("gspo", TOKEN_MASK, dict(eps_clip=0.02, eps_clip_higher=0.03)),
    ("gspo", SEQUENCE_CLAMP, dict(eps_clip=0.02, c_clip=2.0)),
    ("gspo", None, dict(eps_clip=0.02)),  # standard (not decoupled): π_prox = π_behav
    ("sapo", None, dict(tau_pos=1.0, tau_neg=1.05)),
    ("sapo", None, dict(tau_pos=2.0, tau_neg=4.0, importance_sampling_level="sequence")),
]


@pytest.mark.parametrize("name, rejection, params", CASES)
def test_objective_matches_areal_s_own_function(name, rejection, params):
  lt, lp, lb, adv, mask, seg = packed_inputs(0)
  if rejection is None:  # AReaL applies π_prox/π_behav only through its rejection rule, and SAPO never
    lp = lb
  got = ours(name, lt, lp, lb, adv, mask, seg, rejection, **params)
  fns = load()
  if name == "sapo":
    want = theirs(fns.sapo_loss_fn, lt, lp, lb, adv, mask, seg, **params)
  else:
    kw = dict(eps_clip=params["eps_clip"], eps_clip_higher=params.get("eps_clip_higher"),
              c_clip=params.get("c_clip"), rejection_sampling=areal_config(rejection),
              importance_sampling_level="sequence" if name == "gspo" else "token")
    want = theirs(fns.ppo_actor_loss_fn, lt, lp, lb, adv, mask, seg, **kw)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)  # the gradient
  np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-6)  # the per-token terms
  assert np.abs(got[1]).max() > 1e-3


def test_the_clips_bite_in_these_cases():
  """The cases above leave PPO's trust region, the dual clip and the corrections' bounds on some tokens."""
  lt, lp, lb, adv, mask, seg = packed_inputs(0)
  _, stats = objectives.loss("ppo", logprobs=lt, proximal_logprobs=lp, behavior_logprobs=lb, advantages=adv,
                             mask=mask, segment_ids=seg, rejection=TOKEN_MASK, eps_clip=0.2, c_clip=3.0)
  assert stats["clip_fraction"] > 0.05 and stats["capped_fraction"] > 0.05
  _, stats = objectives.loss("gspo", logprobs=lt, proximal_logprobs=lp, behavior_logprobs=lb, advantages=adv,
                             mask=mask, segment_ids=seg, rejection=SEQUENCE_CLAMP, eps_clip=0.02)
  assert 0.05 < stats["clip_fraction"] < 0.95 and stats["capped_fraction"] > 0.05


def cispo_reference(lt, lp, lb, adv, mask, eps_low, eps_high, rejection_upper):
  """MiniMax-M1 (arXiv:2506.13585) Eq. 4 in torch, float64: J = 1/Σ|o| Σ sg(r̂)·A·log π_θ with
  r̂ = clip(π_θ/π_old, 1 - ε_low, 1 + ε_high); π_old is π_prox, and each token is weighed by π_prox/π_behav,
  0 above `rejection_upper` (the decoupled loss's correction). Returns (loss, gradient)."""
  t = {k: torch.tensor(v.astype(np.float64)) for k, v in dict(lt=lt, lp=lp, lb=lb, adv=adv).items()}
  m = torch.tensor(mask)
  logp = t["lt"].clone().requires_grad_(True)
  r_hat = torch.clamp(torch.exp(logp - t["lp"]), 1 - eps_low, 1 + eps_high).detach()
  w = torch.exp(t["lp"] - t["lb"])
  w = torch.where(w > rejection_upper, 0.0, w)
  loss = -(torch.where(m, w * r_hat * t["adv"] * logp, 0.0)).sum() / m.sum()
  loss.backward()
  return float(loss.detach()), logp.grad.numpy()


@pytest.mark.parametrize("eps_clip, eps_clip_higher", [(0.2, 0.28), (1.0, 4.0)])
def test_cispo_matches_minimax_s_formula(eps_clip, eps_clip_higher):
  lt, lp, lb, adv, mask, seg = packed_inputs(1)
  got = ours("cispo", lt, lp, lb, adv, mask, seg, Rejection(upper=1.3), eps_clip=eps_clip,
             eps_clip_higher=eps_clip_higher)
  want = cispo_reference(lt, lp, lb, adv, mask, eps_clip, eps_clip_higher, 1.3)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
  # Unlike PPO's, CISPO's clip keeps every token's gradient.
  assert np.all(got[1][mask & (np.exp(lp - lb) <= 1.3)] != 0)


@pytest.mark.parametrize("case", ["plain", "full"])
def test_default_ppo_is_the_loss_before_objectives_were_pluggable(case):
  """tests/learner/data/ppo_at_7000430.npz holds `ppo.ppo_token_terms` of commit 7000430 (the last before
  `objectives`) on these inputs: its per-token loss and statistics and the gradient of their token mean, all
  elementwise, so they are compared bit for bit (a sum's last bit follows XLA's reduction order, which the forced
  device count changes)."""
  d = np.load(DATA / "ppo_at_7000430.npz")
  kw = (dict(eps_clip=0.2) if case == "plain" else
        dict(eps_clip=0.2, eps_clip_higher=0.28, c_clip=3.0,
             rejection=Rejection(level="sequence", action="clamp", upper=1.3, lower=0.8)))

  def f(lt):
    loss, terms = objectives.token_terms(logprobs=lt, proximal_logprobs=d["lp"], behavior_logprobs=d["lb"],
                                         advantages=d["adv"], mask=d["mask"], segment_ids=d["seg"], **kw)
    return loss.sum() / d["mask"].sum(), (loss, terms)

  (total, (loss, terms)), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(d["lt"]))
  np.testing.assert_allclose(total, d[f"{case}/total"], rtol=2e-7)
  np.testing.assert_array_equal(loss, d[f"{case}/loss"])
  np.testing.assert_array_equal(grad, d[f"{case}/grad"])
  for k, v in terms.items():
    np.testing.assert_array_equal(v, d[f"{case}/{k}"], err_msg=k)


@pytest.mark.parametrize("threshold", [0.01, 0.04, 0.08])
def test_m2po_mask_matches_areal_s(threshold):
  lt, lp, lb, adv, mask, seg = packed_inputs(2)
  lb = lb + np.random.default_rng(3).normal(0, 0.3, lb.shape).astype(np.float32) * (np.arange(lb.size) % 7 == 0).reshape(lb.shape)
  got = np.asarray(objectives.m2po_mask(lb, lp, mask, threshold))
  want = load()._apply_m2po_masking(torch.tensor(lb), torch.tensor(lp), torch.tensor(mask), threshold).numpy()
  np.testing.assert_array_equal(got, want)
  assert 0 < (mask & ~got).sum() < mask.sum()
  assert not np.any(got & ~mask)


def test_m2po_keeps_one_token_when_none_is_below_the_threshold():
  lb, lp = np.zeros((1, 4), np.float32), np.full((1, 4), -1.0, np.float32)
  keep = np.asarray(objectives.m2po_mask(lb, lp, np.array([[True, True, False, True]]), 0.5))
  assert keep.sum() == 1 and not keep[0, 2]


def test_m2po_s_choice_does_not_change_with_the_micro_batches():
  """One minibatch cut into 1 micro-batch or into several: the same tokens are masked, so the update is the same."""
  init = nnx.split(create(CFG, 7))[1]
  trajs = make_trajectories(4, n=8)  # behaviour logprobs are noise around log(1/vocab): far from the learner's
  results = []
  for max_tokens in (512, 64):
    cfg = LearnerConfig(lr=1e-3, max_tokens_per_mb=max_tokens, min_bucket=64, ppo_n_minibatches=1, warmup_steps=0,
                        m2_threshold=0.04, filter_uniform_groups=False)
    learner = Learner(model_cfg=CFG, config=cfg, mesh=one_device_mesh(), params=init)
    stats = learner.train_step(trajs)
    results.append((stats, jax.tree.leaves(jax.device_get(learner.params))))
  (one, p1), (many, p4) = results
  assert one["learner/micro_batches"] == 1 and many["learner/micro_batches"] >= 4
  assert 0.05 < one["learner/m2po_masked_fraction"] < 0.9
  assert one["learner/m2po_masked_fraction"] == many["learner/m2po_masked_fraction"]
  assert one["learner/loss_tokens"] == many["learner/loss_tokens"]
  for a, b in zip(p1, p4):
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)


def test_bad_objectives_and_parameters_are_named():
  lt, lp, lb, adv, mask, seg = packed_inputs(0)
  arrays = dict(logprobs=lt, proximal_logprobs=lp, behavior_logprobs=lb, advantages=adv, mask=mask)
  with pytest.raises(ValueError, match="objective 'grpo'"):
    objectives.loss("grpo", **arrays)
  with pytest.raises(ValueError, match=r"'sapo' has no parameters \['eps_clip'\]"):
    objectives.loss("sapo", **arrays, eps_clip=0.2)
  with pytest.raises(ValueError, match="importance_sampling_level='seq'"):
    objectives.loss("ppo", **arrays, importance_sampling_level="seq")
  with pytest.raises(ValueError, match="learner.loss='sapo'.*use_decoupled_loss=False"):
    LearnerConfig(loss="sapo")
  with pytest.raises(ValueError, match="learner.loss='dpo'"):
    LearnerConfig(loss="dpo")
  with pytest.raises(ValueError, match="learner.m2_threshold=0.1.*prox_logp_method='recompute'"):
    LearnerConfig(m2_threshold=0.1, prox_logp_method="loglinear")
  with pytest.raises(ValueError, match="learner.m2_threshold=0.1.*token-mean"):
    LearnerConfig(m2_threshold=0.1, loss_agg="seq-mean-token-mean")
  assert LearnerConfig(loss="sapo", use_decoupled_loss=False, tau_neg=2.0).objective_kwargs == dict(
      tau_pos=1.0, tau_neg=2.0, importance_sampling_level="token")
  assert set(LearnerConfig(loss="cispo").objective_kwargs) == {"eps_clip", "eps_clip_higher"}


def test_a_new_objective_s_parameter_is_set_from_the_config_by_its_name(monkeypatch):
  """An objective registered here, with a parameter no `learner` field names: `--config.learner.pg_scale` (or
  `objective_params`) sets it, the default holds otherwise, and the loss is computed with it."""
  monkeypatch.setattr(objectives, "OBJECTIVES", dict(objectives.OBJECTIVES))  # registered for this test only

  @objectives.register("scaled_pg")
  def scaled_pg(t: objectives.Tokens, *, pg_scale: float = 1.0):
    u, adv = objectives.ratio(t, "token")
    return -pg_scale * u * adv, {}

  config = load_config(str(ROOT / "configs/math.py:tiny"), **{"learner.loss": "scaled_pg", "learner.pg_scale": 0.5})
  cfg = validate(config, data=False).learner
  assert cfg.objective_params == {"pg_scale": 0.5} and cfg.objective_kwargs == {"pg_scale": 0.5}
  assert LearnerConfig.from_config(load_config(str(ROOT / "configs/math.py:tiny")).learner).objective_params == {
      "pg_scale": 1.0}  # the config holds the declared default
  assert LearnerConfig(loss="scaled_pg").objective_kwargs == {}  # the function's own default
  assert LearnerConfig(loss="scaled_pg", objective_params={"pg_scale": 2.0}).objective_kwargs == {"pg_scale": 2.0}
  assert LearnerConfig(objective_params={"pg_scale": 2.0}).objective_kwargs == LearnerConfig().objective_kwargs
  lt, lp, lb, adv, mask, _ = packed_inputs(4)
  arrays = dict(logprobs=lt, proximal_logprobs=lp, behavior_logprobs=lb, advantages=adv, mask=mask)
  half, _ = objectives.loss("scaled_pg", **arrays, **cfg.objective_kwargs)
  whole, _ = objectives.loss("scaled_pg", **arrays)
  np.testing.assert_allclose(half, 0.5 * whole, rtol=1e-6)
  with pytest.raises(ValueError, match="objective_params=.*'eps_clip', a field of its own: set learner.eps_clip"):
    LearnerConfig(loss="scaled_pg", objective_params={"eps_clip": 0.1})
  with pytest.raises(ValueError, match="no registered objective takes 'beta'; they take .*'pg_scale'"):
    LearnerConfig(loss="scaled_pg", objective_params={"beta": 0.1})
  with pytest.raises(ValueError, match=r"parameters \['beta'\] need defaults"):
    objectives.register("no_default")(lambda t, *, beta: (t.logprobs, {}))
