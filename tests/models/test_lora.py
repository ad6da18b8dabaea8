"""LoRA: adapters on the model (against PEFT on the HF model), the learner training only them, bad settings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.learner import Learner
from areal_jax.learner.microbatch import plan_packed
from areal_jax.learner.step import build_step, make_learner_mesh
from areal_jax.models import create, lora
from areal_jax.models.config import LORA_TARGETS
from helpers import TINY
from learner_batches import accumulate_packed, make_trajectories

LORA = TINY.replace(lora_rank=4, lora_alpha=8.0)


def random_adapters(state, seed=1, scale=0.1):
  """`state` with every adapter (B too) random, so the adapters change the function."""
  adapters, base = lora.split(state)
  leaves, treedef = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  return nnx.merge_state(base, jax.tree.unflatten(treedef, leaves))


@pytest.mark.slow
def test_adapters_start_as_identity_and_merge_exactly():
  model = create(LORA, 0)
  graphdef, state = nnx.split(model)
  adapters, base = lora.split(state)
  names = {path[-1] for path, _ in nnx.to_flat_state(adapters)}
  assert names == {f"{t}_lora_{ab}" for t in ("q", "k", "v", "o", "gate", "up", "down") for ab in "ab"}
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(adapters))
  plain = nnx.graphdef(nnx.eval_shape(lambda: create(TINY, 0)))
  for got, want in zip(jax.tree.leaves(base), jax.tree.leaves(nnx.state(create(TINY, 0), nnx.Param))):
    np.testing.assert_array_equal(got, want)  # the base is the plain model of the same seed (a run's warm-start too)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)
  np.testing.assert_array_equal(model(tokens), nnx.merge(plain, base)(tokens))  # B = 0: the base model
  adapted = random_adapters(state)
  got = nnx.merge(graphdef, adapted)(tokens)
  assert float(jnp.abs(got - model(tokens)).max()) > 1e-2
  np.testing.assert_allclose(nnx.merge(plain, lora.merged(adapted, LORA))(tokens), got, atol=2e-5)


def test_targets_limit_the_adapted_projections():
  cfg = TINY.replace(lora_rank=2, lora_targets=("q", "down"))
  adapters, _ = lora.split(nnx.state(nnx.eval_shape(lambda: create(cfg, 0))))
  assert {path[-1] for path, _ in nnx.to_flat_state(adapters)} == {"q_lora_a", "q_lora_b", "down_lora_a",
                                                                     "down_lora_b"}


@pytest.mark.parametrize("field, value, message", [
    ("lora_targets", ("q", "qkv"), "learner.lora.targets=['q', 'qkv']: ['qkv'] name no projection"),
    ("lora_targets", (), "learner.lora.targets=[]: names no projection"),
    ("lora_rank", 40, "learner.lora.rank=40: exceeds the q projection's 32"),
    ("lora_alpha", 0.0, "learner.lora.alpha=0.0: must be positive"),
    ("lora_base_quant", "fp3", "learner.lora.quantize_base='fp3': choose one of"),
])
def test_bad_lora_settings_name_the_field(field, value, message):
  with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
    LORA.replace(**{field: value})


def _scored_batch(rows: int):
  """8 trajectories, their per-token advantages, and their packed layouts in `rows` rows of 64 tokens."""
  trajs = make_trajectories(0, n=8)
  adv = np.random.default_rng(1).normal(size=len(trajs)).astype(np.float32)
  tok_adv = [np.full(len(t.response_ids), a, np.float32) for t, a in zip(trajs, adv)]
  return trajs, tok_adv, plan_packed([t.num_tokens for t in trajs], max_tokens=64, rows=rows, min_bucket=64)


@pytest.mark.slow
def test_learner_trains_only_the_adapters_with_the_merged_models_gradient():
  cfg = LearnerConfig(lr=1e-2, max_tokens_per_mb=64, min_bucket=64, ppo_n_minibatches=1)
  fns = build_step(LORA, cfg, make_learner_mesh(jax.devices()[:1]))
  params = random_adapters(fns.init_params(3))
  trajs, tok_adv, layouts = _scored_batch(rows=1)
  grads, _ = accumulate_packed(fns, params, layouts, trajs, tok_adv, 1.0)
  adapters, base = lora.split(params)
  assert jax.tree.structure(grads) == jax.tree.structure(adapters)

  # Reference: the same loss through the merged weights (no adapter in the forward), differentiated in A and B.
  plain = build_step(TINY, cfg, make_learner_mesh(jax.devices()[:1]))

  def loss(adapters):
    merged = lora.merged(nnx.merge_state(base, adapters), LORA)
    g, _ = accumulate_packed(plain, merged, layouts, trajs, tok_adv, 1.0)
    return g

  # d loss / dA and dB by the chain rule through W + s·A·B, from the plain learner's gradient in W.
  dw = loss(adapters)
  s = lora.scale(LORA)
  flat = dict(nnx.to_flat_state(adapters))
  for path, g in nnx.to_flat_state(grads):
    name = path[-1][:-len("_lora_a")]
    a, b = flat[(*path[:-1], f"{name}_lora_a")][...], flat[(*path[:-1], f"{name}_lora_b")][...]
    w_grad = dw
    for key in (*path[:-1], name):
      w_grad = w_grad[key]
    w_grad = w_grad[...].reshape(a.shape[0], int(np.prod(a.shape[1:-1])), -1)  # [layers, in, out]
    a2, b2 = a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(b.shape[0], b.shape[1], -1)
    if path[-1].endswith("_lora_a"):
      want = s * jnp.einsum("lio,lro->lir", w_grad, b2).reshape(a.shape)
    else:
      want = s * jnp.einsum("lir,lio->lro", a2, w_grad).reshape(b.shape)
    np.testing.assert_allclose(g[...], want, rtol=2e-4, atol=1e-6 * float(jnp.abs(want).max()))

  learner = Learner(model_cfg=LORA, config=cfg, mesh=make_learner_mesh(jax.devices()[:1]), params=params)
  assert jax.tree.structure(learner.opt_state) == jax.tree.structure(fns.optimizer.init(adapters))
  learner.train_step(trajs)
  new_adapters, new_base = lora.split(learner.params)
  for old, new in zip(jax.tree.leaves(base), jax.tree.leaves(new_base)):
    np.testing.assert_array_equal(old, new)
  assert max(float(jnp.abs(o - n).max()) for o, n in zip(jax.tree.leaves(adapters),
                                                          jax.tree.leaves(new_adapters))) > 1e-3


def _quantized(state) -> dict:
  return {path[-1]: v.get_value() for path, v in nnx.to_flat_state(state) if isinstance(v.get_value(), qwix.QArray)}


# Worst |W - dequantized| per block, as a fraction of the block's absmax: half an int8 step (1/127.5 of it), half of
# NF4's widest gap between code points (-1 and -0.696).
@pytest.mark.parametrize("qtype, bits, max_error", [("int8", 8, 0.5 / 127.5), ("nf4", 4, 0.153)])
def test_qlora_base_is_stored_quantized_and_dequantized_where_used(qtype, bits, max_error):
  cfg = LORA.replace(lora_base_quant=qtype)
  graphdef, state = nnx.split(create(cfg, 0))
  float_base = lora.split(nnx.state(create(LORA, 0), nnx.Param))[1]  # the same init before quantization
  quantized = _quantized(state)
  assert set(quantized) == set(LORA_TARGETS)
  for name, q in quantized.items():
    assert jax.dtypes.itemsize_bits(q.qvalue.dtype) == bits, name
  # `quantize_base` turns the float weights into exactly what the QLoRA model holds (a warm-start, HF weights).
  for got, want in zip(jax.tree.leaves(lora.quantize_base(float_base, cfg)), jax.tree.leaves(lora.split(state)[1])):
    np.testing.assert_array_equal(got, want)
  for path, w in nnx.to_flat_state(float_base):
    if path[-1] in quantized:  # blocks span the whole input axis in the tiny model: absmax over it
      w, q = w.get_value(), quantized[path[-1]]
      axis = 2 if path[-1] == "o" else 1
      absmax = jnp.max(jnp.abs(w), axis=axis, keepdims=True)
      assert float(jnp.max(jnp.abs(w - lora.dequantized(q)) / absmax)) <= max_error + 1e-6, path
  # The forward: the LoRA model holding the dequantized weights, adapters included.
  adapted = random_adapters(state)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)
  plain = nnx.graphdef(nnx.eval_shape(lambda: create(LORA, 0)))
  dequantized = lora.dequantize_base(adapted)
  np.testing.assert_allclose(nnx.merge(graphdef, adapted)(tokens), nnx.merge(plain, dequantized)(tokens), atol=1e-6)
  merged = nnx.graphdef(nnx.eval_shape(lambda: create(cfg.without_lora(), 0)))
  np.testing.assert_allclose(nnx.merge(merged, lora.merged(adapted, cfg))(tokens),
                             nnx.merge(graphdef, adapted)(tokens), atol=2e-5)


@pytest.mark.slow
def test_qlora_learner_step_on_eight_devices_is_the_lora_step_on_the_dequantized_base():
  """The 4-bit values and their block scales shard over the learner mesh; the adapters' gradients and update are the
  ones a float base holding the dequantized weights gives."""
  cfg = LearnerConfig(lr=1e-2, max_tokens_per_mb=64, min_bucket=64, ppo_n_minibatches=1)
  mesh = make_learner_mesh(jax.devices())
  qfns = build_step(LORA.replace(lora_base_quant="nf4"), cfg, mesh)
  params = random_adapters(qfns.init_params(3))
  trajs, tok_adv, layouts = _scored_batch(rows=8)
  got, _ = accumulate_packed(qfns, params, layouts, trajs, tok_adv, 1.0)
  fns = build_step(LORA, cfg, mesh)
  reference = lora.dequantize_base(params)
  want, _ = accumulate_packed(fns, jax.device_put(reference, fns.param_shardings), layouts, trajs, tok_adv, 1.0)
  assert jax.tree.structure(got) == jax.tree.structure(lora.split(params)[0])
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6 * float(jnp.abs(w).max()))
  learner = Learner(model_cfg=LORA.replace(lora_base_quant="nf4"), config=cfg, mesh=mesh, params=params)
  learner.train_step(trajs)
  for old, new in zip(jax.tree.leaves(lora.split(params)[1]), jax.tree.leaves(lora.split(learner.params)[1])):
    np.testing.assert_array_equal(old, new)  # the quantized base is frozen, bit for bit


def test_adapters_match_peft_on_the_hf_model(tmp_path):
  """Our unmerged forward against PEFT's own LoRA layers on the HF model: the adapters written by `save_peft`,
  loaded by `peft.PeftModel.from_pretrained` onto the base written by `save_hf`; the merged export matches too."""
  import peft  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  from areal_jax.models import hf_io  # pylint: disable=g-import-not-at-top

  cfg = LORA.replace(lora_targets=("q", "v", "o", "gate", "down"))
  graphdef, state = nnx.split(create(cfg, 0))
  state = random_adapters(state, scale=0.2)
  model = nnx.merge(graphdef, state)
  plain = nnx.graphdef(nnx.eval_shape(lambda: create(cfg.replace(lora_rank=0), 0)))
  hf_io.save_hf(nnx.merge(plain, lora.split(state)[1]), str(tmp_path / "base"))
  hf_io.save_peft(model, str(tmp_path / "adapters"), base_model=str(tmp_path / "base"))
  hf_io.save_hf(model, str(tmp_path / "merged"))

  tokens = np.random.default_rng(2).integers(0, 64, (2, 16)).astype(np.int32)
  ours = np.asarray(model(jnp.asarray(tokens)))
  base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), attn_implementation="eager")
  adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapters")).eval()
  merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), attn_implementation="eager")
  with torch.no_grad():
    for hf in (adapted, merged.eval()):
      np.testing.assert_allclose(ours, hf(torch.tensor(tokens)).logits.float().numpy(), atol=2e-5, rtol=0)
  assert float(np.abs(ours - np.asarray(nnx.merge(plain, lora.split(state)[1])(jnp.asarray(tokens)))).max()) > 1e-2
