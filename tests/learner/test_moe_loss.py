"""A mixture-of-experts learner step: the load-balancing loss enters the gradient with `learner.aux_loss_coef`, the
step's statistics hold it and each sparse layer's expert load, and `learner.routing_replay` routes the proximal pass
as the sampler did."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.learner import Learner
from areal_jax.learner.microbatch import assemble, plan_packed, unpack
from areal_jax.learner.step import build_step, packed_logprobs
from areal_jax.models import moe

from learner_batches import CFG, accumulate_packed, make_trajectories, one_device_mesh

MOE = CFG.replace(family="qwen3_moe", attention_bias=False, qk_norm=True, num_layers=3, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(1,))


def test_load_balancing_loss_gradient_and_statistics():
  trajs = make_trajectories(0, n=8)
  adv = np.random.default_rng(1).normal(size=len(trajs)).astype(np.float32)
  tok_adv = [np.full(len(t.response_ids), a, np.float32) for t, a in zip(trajs, adv)]
  n_loss = sum(len(t.response_ids) for t in trajs)
  layouts = plan_packed([t.num_tokens for t in trajs], max_tokens=512, rows=1, min_bucket=64)
  assert len(layouts) == 1  # one micro-batch: its load-balancing loss is the minibatch's
  grads, stats = {}, {}
  for coef in (0.0, 0.5):
    fns = build_step(MOE, LearnerConfig(max_tokens_per_mb=512, min_bucket=64, aux_loss_coef=coef), one_device_mesh())
    params = fns.init_params(3)
    grads[coef], stats[coef] = accumulate_packed(fns, params, layouts, trajs, tok_adv, 1 / n_loss)

  mb = assemble(layouts[0], trajs, tok_adv)

  def aux(params):
    model = nnx.merge(fns.graphdef, params)
    _, routing = model.hidden(mb.tokens, positions=mb.positions, segment_ids=mb.segment_ids, routing=True)
    return moe.load_balancing_loss(routing), routing["counts"]

  (want, counts), g = jax.value_and_grad(aux, has_aux=True)(params)
  s = stats[0.5]
  np.testing.assert_allclose(s["aux_loss"] / s["tokens"], want, rtol=1e-5)
  np.testing.assert_allclose(s["expert_counts"], counts, rtol=1e-6)
  valid = int((mb.segment_ids != 0).sum())
  np.testing.assert_allclose(np.asarray(s["expert_counts"]).sum(-1), [2 * valid] * 2)  # k per token, 2 sparse layers
  # Token-mean over one micro-batch: the term's weight is the coefficient itself.
  for path in (("layers", "mlp", "router"), ("layers", "mlp", "gate"), ("dense_layers", "mlp", "up")):
    get = lambda tree: np.asarray(tree[path[0]][path[1]][path[2]][...])
    np.testing.assert_allclose(get(grads[0.5]) - get(grads[0.0]), 0.5 * get(g), atol=1e-6, rtol=1e-4,
                               err_msg=str(path))
  assert np.abs(np.asarray(g["layers"]["mlp"]["router"][...])).max() > 0


def test_routing_replay_routes_the_proximal_pass_as_recorded():
  """Behaviour logprobs drawn under recorded experts other than the learner's own choice: with replay, the proximal
  pass recomputes them exactly (`sampler/logprob_gap` ~ 0); without, it routes its own way and differs."""
  rng = np.random.default_rng(5)
  trajs = make_trajectories(3, n=8)
  cfg = LearnerConfig(lr=1e-4, max_tokens_per_mb=512, min_bucket=64, ppo_n_minibatches=1, filter_uniform_groups=False)
  model = Learner(model_cfg=MOE, config=cfg, mesh=one_device_mesh(), seed=3).model()
  trajs = [t.replace(routes=np.array([rng.permutation(4)[:2] for _ in range(2 * (t.num_tokens - 1))],
                                     np.int16).reshape(t.num_tokens - 1, 2, 2)) for t in trajs]
  layout = plan_packed([t.num_tokens for t in trajs], max_tokens=512, rows=1, min_bucket=64)[0]
  mb = assemble(layout, trajs, [np.zeros(len(t.response_ids), np.float32) for t in trajs], routes=(2, 2))
  (lp,) = packed_logprobs(model, jnp.asarray(mb.tokens), jnp.asarray(mb.positions), jnp.asarray(mb.segment_ids),
                          temperature=1.0, routes=jnp.asarray(mb.routes))
  drawn = unpack(layout, np.asarray(lp), trajs)
  recorded = [t.replace(logprobs=drawn[i]) for i, t in enumerate(trajs)]
  learner = Learner(model_cfg=MOE, config=cfg.replace(routing_replay=True), mesh=one_device_mesh(), seed=3)
  stats = learner.train_step(recorded)
  assert stats["sampler/logprob_gap"] < 1e-6
  own, routing = packed_logprobs(model, jnp.asarray(mb.tokens), jnp.asarray(mb.positions),
                                 jnp.asarray(mb.segment_ids), temperature=1.0, with_routing=True)
  mask = mb.loss_mask > 0
  assert np.abs(np.asarray(own) - np.asarray(lp))[mask].mean() > 1e-3  # without replay: its own routing differs
  # The training pass (one minibatch: the proximal weights) counts the recorded pairs its router would reroute.
  mine = np.sort(np.moveaxis(np.asarray(routing["experts"]), 0, 2), axis=-1)  # [rows, length, sparse layers, k]
  recorded_pairs = mb.routes[..., 0] >= 0
  rerouted = np.any(mine != np.sort(mb.routes, axis=-1), axis=-1) & recorded_pairs
  assert 0.5 < stats["learner/rerouted_fraction"] < 1
  # Within a pair or two: a near-tie in a router's top-2 may fall either way in another program's float order.
  assert abs(stats["learner/rerouted_fraction"] * recorded_pairs.sum() - rerouted.sum()) <= 2
