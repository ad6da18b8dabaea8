"""LoRA: adapters on the model (against PEFT on the HF model), the learner training only them, bad settings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.learner import Learner
from areal_jax.learner.microbatch import plan_packed
from areal_jax.learner.step import build_step, make_learner_mesh
from areal_jax.models import create, lora
from helpers import TINY
from test_learner_step import accumulate_packed, make_trajectories

LORA = TINY.replace(lora_rank=4, lora_alpha=8.0)


def random_adapters(state, seed=1, scale=0.1):
  """`state` with every adapter (B too) random, so the adapters change the function."""
  adapters, base = lora.split(state)
  leaves, treedef = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  return nnx.merge_state(base, jax.tree.unflatten(treedef, leaves))


def test_adapters_start_as_identity_and_merge_exactly():
  model = create(LORA, 0)
  graphdef, state = nnx.split(model)
  adapters, base = lora.split(state)
  names = {path[-1] for path, _ in nnx.to_flat_state(adapters)}
  assert names == {f"{t}_lora_{ab}" for t in ("q", "k", "v", "o", "gate", "up", "down") for ab in "ab"}
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(adapters))
  plain = nnx.graphdef(nnx.eval_shape(lambda: create(TINY, 0)))
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
])
def test_bad_lora_settings_name_the_field(field, value, message):
  with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
    LORA.replace(**{field: value})


def test_learner_trains_only_the_adapters_with_the_merged_models_gradient():
  cfg = LearnerConfig(lr=1e-2, max_tokens_per_mb=64, min_bucket=64, ppo_n_minibatches=1)
  fns = build_step(LORA, cfg, make_learner_mesh(jax.devices()[:1]))
  params = random_adapters(fns.init_params(3))
  trajs = make_trajectories(0, n=8)
  adv = np.random.default_rng(1).normal(size=len(trajs)).astype(np.float32)
  tok_adv = [np.full(len(t.response_ids), a, np.float32) for t, a in zip(trajs, adv)]
  layouts = plan_packed([t.num_tokens for t in trajs], max_tokens=64, rows=1, min_bucket=64)
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
