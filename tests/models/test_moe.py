"""Qwen3-MoE: exact against `transformers` (logits, gradients, the load-balancing loss, HF files both ways), the
grouped expert matmuls against a dense per-expert loop, and the sharded forward against the unsharded one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from areal_jax.models import ModelConfig, hf_io, moe
from areal_jax.sharding import LEARNER_RULES, SAMPLER_RULES, make_mesh, state_shardings, use_rules
from tests.helpers import tiny_model

# Four experts, top-2, layer 1 dense among sparse ones.
CFG = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=(1,))


def _hf(path):
  from transformers import AutoModelForCausalLM
  return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _batch(rows=2, length=9, pad=3):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, CFG.vocab_size, size=(rows, length)).astype(np.int32)
  mask = np.ones((rows, length), np.int32)
  mask[1, length - pad:] = 0
  return tokens, mask


def test_layer_groups_follow_hf_rule():
  assert CFG.sparse_layers() == (True, False, True)
  assert CFG.layer_groups() == {"layers": (0, 2), "dense_layers": (1,)}
  step = CFG.replace(num_layers=4, mlp_only_layers=(), decoder_sparse_step=2)
  assert step.sparse_layers() == (False, True, False, True)
  assert CFG.replace(mlp_only_layers=()).layer_groups() == {"layers": (0, 1, 2)}
  with pytest.raises(ValueError, match="model.num_experts_per_tok=5"):
    CFG.replace(num_experts_per_tok=5)
  with pytest.raises(ValueError, match="model.mlp_only_layers=\\(3,\\)"):
    CFG.replace(mlp_only_layers=(3,))


@pytest.mark.parametrize("scan", [True, False])
def test_logits_and_loss_match_transformers_through_hf_files(scan, tmp_path):
  model = tiny_model(CFG.replace(scan_layers=scan), seed=1)
  hf_io.save_hf(model, str(tmp_path))
  hf = _hf(str(tmp_path))
  tokens, mask = _batch()
  with torch.no_grad():
    out = hf(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask), output_router_logits=True)
  logits = model(jnp.asarray(tokens), segment_ids=jnp.asarray(mask))
  keep = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(logits)[keep], out.logits.numpy()[keep], atol=1e-5, rtol=0)

  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  from areal_jax.models.packed_attention import packed_attention
  attend = packed_attention(jnp.asarray(mask))
  _, _, routing = model.run_layers(model.embed_tokens(jnp.asarray(tokens)), positions,
                                   lambda i, q, k, v: attend(q, k, v), valid=jnp.asarray(mask) != 0, routing=True)
  assert routing["counts"].shape == (2, CFG.num_experts)  # the two sparse layers
  np.testing.assert_allclose(float(moe.load_balancing_loss(routing)), float(out.aux_loss), rtol=1e-5)

  again = hf_io.load_hf(str(tmp_path))
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again))):
    np.testing.assert_array_equal(a, b)


def test_gradients_match_transformers(tmp_path):
  model = tiny_model(CFG, seed=2)
  hf_io.save_hf(model, str(tmp_path))
  hf = _hf(str(tmp_path))
  tokens, _ = _batch(pad=0)
  target = np.random.default_rng(1).normal(size=(*tokens.shape, CFG.vocab_size)).astype(np.float32)
  (hf(torch.tensor(tokens, dtype=torch.long)).logits * torch.tensor(target)).sum().backward()

  graphdef, params = nnx.split(model)
  grads = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(jnp.asarray(tokens)) * target))(params)
  mlp = hf.model.layers[2].mlp
  np.testing.assert_allclose(grads["layers"]["mlp"]["router"][...][1].T, mlp.gate.weight.grad.numpy(), atol=1e-5)
  f = CFG.moe_intermediate_size
  gate_up = mlp.experts.gate_up_proj.grad.numpy()  # [E, 2F, D]: gate rows, then up rows
  np.testing.assert_allclose(grads["layers"]["mlp"]["gate"][...][1], gate_up[:, :f].transpose(0, 2, 1), atol=1e-5)
  np.testing.assert_allclose(grads["layers"]["mlp"]["up"][...][1], gate_up[:, f:].transpose(0, 2, 1), atol=1e-5)
  np.testing.assert_allclose(grads["layers"]["mlp"]["down"][...][1],
                             mlp.experts.down_proj.grad.numpy().transpose(0, 2, 1), atol=1e-5)
  dense = hf.model.layers[1].mlp
  np.testing.assert_allclose(grads["dense_layers"]["mlp"]["up"][...][0], dense.up_proj.weight.grad.numpy().T,
                             atol=1e-5)
  want = hf.model.embed_tokens.weight.grad.numpy()  # sums over every path: float32 error relative to its largest
  np.testing.assert_allclose(grads["embed"][...], want, atol=1e-5 * np.abs(want).max())


def _dense_reference(x, experts, weights, gate, up, down):
  """Every expert on every token, masked to each token's chosen ones: the definition, not a fast path."""
  out = jnp.zeros_like(x)
  for e in range(gate.shape[0]):
    y = (jax.nn.silu(x @ gate[e]) * (x @ up[e])) @ down[e]
    w = jnp.sum(jnp.where(experts == e, weights, 0.0), axis=-1)
    out = out + w[:, None] * y
  return out


def _experts_case(n=40, d=16, f=24, e=6, k=2, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d)).astype(np.float32)
  experts = np.stack([rng.choice(e - 1, size=k, replace=False) for _ in range(n)]).astype(np.int32)  # e-1: one idle
  weights = rng.uniform(size=(n, k)).astype(np.float32)
  params = [rng.normal(size=s).astype(np.float32) / np.sqrt(s[1]) for s in ((e, d, f), (e, d, f), (e, f, d))]
  return x, experts, weights, params


@pytest.mark.parametrize("impl,n", [("ragged_dot", 40), ("tiled", 40), ("tiled", 300), ("megablox", 40)])
def test_grouped_experts_equal_dense_reference(impl, n):
  x, experts, weights, params = _experts_case(n=n)
  fast = functools.partial(moe.experts_mlp, impl=impl, interpret=True)
  cot = np.random.default_rng(3).normal(size=x.shape).astype(np.float32)

  def loss(f, x, weights, *params):
    return jnp.sum(f(x, experts, weights, *params) * cot)

  np.testing.assert_allclose(fast(x, experts, weights, *params), _dense_reference(x, experts, weights, *params),
                             atol=1e-5)
  g_fast = jax.grad(functools.partial(loss, fast), argnums=(0, 1, 2, 3, 4))(x, weights, *params)
  g_ref = jax.grad(functools.partial(loss, _dense_reference), argnums=(0, 1, 2, 3, 4))(x, weights, *params)
  for a, b in zip(g_fast, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-4)
  assert not np.any(g_fast[2][-1])  # the idle expert gets no gradient


def test_routing_replay_fixes_the_experts_and_recomputes_the_weights():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(12, 8)).astype(np.float32))
  router = jnp.asarray(rng.normal(size=(8, 5)).astype(np.float32))
  weights, experts, probs = moe.route(x, router, 2, norm_topk=True)
  again = moe.route(x, router, 2, norm_topk=True, routes=experts)
  np.testing.assert_array_equal(again[1], experts)
  np.testing.assert_allclose(again[0], weights, rtol=1e-6)
  other = (experts + 1) % 5
  w, e, _ = moe.route(x, router, 2, norm_topk=True, routes=other)
  np.testing.assert_array_equal(e, other)
  picked = np.take_along_axis(np.asarray(probs), np.asarray(other), axis=-1)
  np.testing.assert_allclose(w, picked / picked.sum(-1, keepdims=True), rtol=1e-5)
  partial = jnp.where(jnp.arange(12)[:, None] < 5, other, -1)  # tokens 5.. recorded nothing: their own routing
  _, e, _ = moe.route(x, router, 2, norm_topk=True, routes=partial)
  np.testing.assert_array_equal(e, np.concatenate([other[:5], experts[5:]]))


@pytest.mark.parametrize("axes", [{"data": 2, "fsdp": 2, "tensor": 2}, {"fsdp": 2, "expert": 2, "tensor": 2}])
def test_sharded_forward_and_gradients_equal_unsharded(axes):
  model = tiny_model(CFG.replace(moe_intermediate_size=32), seed=3)
  tokens, mask = _batch(rows=4, length=8, pad=2)
  target = np.random.default_rng(1).normal(size=(*tokens.shape, CFG.vocab_size)).astype(np.float32)
  graphdef, params = nnx.split(model)

  def loss(params):
    return jnp.sum(nnx.merge(graphdef, params)(jnp.asarray(tokens), segment_ids=jnp.asarray(mask)) * target)

  want_loss, want = jax.value_and_grad(loss)(params)
  mesh = make_mesh(jax.devices()[:8], axes)
  placed = jax.device_put(params, state_shardings(params, mesh, LEARNER_RULES))
  if "expert" in axes:  # expert parallelism: each device holds its experts only
    assert placed["layers"]["mlp"]["gate"][...].sharding.spec[1] == "expert"
  with use_rules(mesh, LEARNER_RULES):
    got_loss, got = jax.jit(jax.value_and_grad(loss))(placed)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, atol=1e-4)


def test_sampler_sharding_with_expert_parallelism_equals_unsharded():
  """The sampler's rules: slots over data, replicated over the expert axis (the expert outputs summed with a psum)."""
  model = tiny_model(CFG.replace(moe_intermediate_size=32), seed=5)
  tokens, mask = _batch(rows=4, length=8, pad=2)
  graphdef, params = nnx.split(model)
  forward = lambda p: nnx.merge(graphdef, p)(jnp.asarray(tokens), segment_ids=jnp.asarray(mask))
  want = forward(params)
  mesh = make_mesh(jax.devices()[:8], {"data": 2, "expert": 2, "tensor": 2})
  with use_rules(mesh, SAMPLER_RULES):
    got = jax.jit(forward)(jax.device_put(params, state_shardings(params, mesh, SAMPLER_RULES)))
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_active_parameters_and_flops_count_k_experts():
  total, active = CFG.num_params(), CFG.num_params(active=True)
  per_expert = 3 * CFG.hidden_size * CFG.moe_intermediate_size
  assert total - active == 2 * (CFG.num_experts - CFG.num_experts_per_tok) * per_expert  # two sparse layers
  model = tiny_model(CFG)
  assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == total


def test_sampler_logprobs_equal_the_learner_forward():
  """The sampler's prefill and paged decode route as the packed training forward does (fp32: within 1e-5)."""
  from areal_jax.learner.step import packed_logprobs
  from areal_jax.sampler import generate
  model = tiny_model(CFG, seed=4)
  prompts = [np.array(p, np.int32) for p in ([5], [7, 3, 9, 2, 1], list(range(2, 15)))]
  out = generate(model, prompts, max_new_tokens=8, temperature=1.0, n=2, seed=1, page_size=4)
  rows = [(p, c.tokens) for p, cs in zip(prompts, out) for c in cs]
  tokens = np.concatenate([np.concatenate(r) for r in rows])[None]
  seg = np.concatenate([np.full(len(p) + len(a), i + 1) for i, (p, a) in enumerate(rows)])[None]
  pos = np.concatenate([np.arange(len(p) + len(a)) for p, a in rows])[None]
  (lp,) = packed_logprobs(model, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg), temperature=1.0)
  start = 0
  for (p, a), c in zip(rows, [c for cs in out for c in cs]):
    np.testing.assert_allclose(c.logprobs, np.asarray(lp)[0, start + len(p) - 1:start + len(p) + len(a) - 1],
                               atol=1e-5)
    start += len(p) + len(a)


@pytest.mark.parametrize("num_pages", [33, 10])  # 10: answers preempted and resumed by re-prefill
def test_sampler_records_routes_that_the_learner_replays(num_pages):
  """With `record_routes` each answer carries the experts of every trained position; the learner's forward with them
  replayed gives the sampler's logprobs (fp32: within 1e-5), and it follows the replayed experts, not its own."""
  from areal_jax.learner.microbatch import Layout, assemble
  from areal_jax.learner.step import packed_logprobs
  from areal_jax.sampler import Engine, Request, SamplerConfig, SamplingParams
  from areal_jax.sampler.sampler import Sampler
  model = tiny_model(CFG, seed=4)
  cfg = SamplerConfig(num_slots=4, page_size=4, num_pages=num_pages, max_seq_len=32, decode_steps=3,
                      record_routes=True)
  engine = Engine(model=model, config=cfg)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=1)
  prompts = ([5], [7, 3, 9, 2, 1], list(range(2, 15)))
  sampler = Sampler(engine=engine, params=engine.load_params(model))
  answers = sampler.run([Request(group_id=j, prompt_ids=p, num_answers=2, sampling=sampling)
                        for j, p in enumerate(prompts)])
  assert (sampler.scheduler.counters["preemptions"] > 0) == (num_pages == 10)
  trajs = [seq.trajectory() for row in answers for seq in row]
  for t in trajs:
    assert t.routes.shape == (t.num_tokens - 1, 2, 2) and t.routes.dtype == np.int16
  layout = Layout(rows=(tuple(range(len(trajs))),), length=sum(t.num_tokens for t in trajs))
  mb = assemble(layout, trajs, [np.zeros(len(t.response_ids), np.float32) for t in trajs], routes=(2, 2))
  args = [jnp.asarray(mb.tokens), jnp.asarray(mb.positions), jnp.asarray(mb.segment_ids)]
  lp, routing = packed_logprobs(model, *args, temperature=1.0, with_routing=True, routes=jnp.asarray(mb.routes))
  mask = mb.loss_mask > 0
  np.testing.assert_allclose(np.asarray(lp)[mask], mb.behavior_logprobs[mask], atol=1e-5)
  recorded = mb.routes >= 0
  assert recorded.sum() == sum(t.num_tokens - 1 for t in trajs) * 2 * 2
  used = np.moveaxis(np.asarray(routing["experts"]), 0, 2)  # [rows, length, sparse layers, k]
  np.testing.assert_array_equal(used[recorded], mb.routes[recorded])
  # Other experts replayed: the learner follows them.
  other = np.where(recorded, (mb.routes + 1) % CFG.num_experts, -1).astype(np.int16)
  lp2, routing2 = packed_logprobs(model, *args, temperature=1.0, with_routing=True, routes=jnp.asarray(other))
  np.testing.assert_array_equal(np.moveaxis(np.asarray(routing2["experts"]), 0, 2)[recorded], other[recorded])
  assert np.abs(np.asarray(lp2) - np.asarray(lp))[mask].max() > 1e-3
