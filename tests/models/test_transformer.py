"""Decoder layers under `lax.scan` (stacked parameters) against the same layers run one by one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import ModelConfig, create

CFG = ModelConfig(family="qwen3", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True, tie_word_embeddings=False)


def _unrolled_logits(model, tokens, segment_ids):
  """The forward with a Python loop over `model.layer(i)`: today's per-layer model, sharing its parameters."""
  from areal_jax.models.modules import dense_attention
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  attend = dense_attention(segment_ids)
  h, _ = model.run_layers(model.embed_tokens(tokens), positions, lambda i, q, k, v: attend(q, k, v), unroll=True)
  return model.logits(h)


def test_parameters_are_stacked_with_a_layers_axis():
  model = create(CFG, seed=0)
  for path, var in nnx.to_flat_state(nnx.state(model.layers, nnx.Param)):
    assert var.get_value().shape[0] == CFG.num_layers, path
    assert var.get_metadata()["logical_axes"][0] == "layers", path
  q = model.layers.attn.q[...]
  assert not np.allclose(q[0], q[1])  # each layer initialised on its own
  np.testing.assert_array_equal(model.layer(2).attn.q[...], q[2])


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_scan_equals_unrolled_forward_and_gradients(remat):
  model = create(CFG.replace(remat=remat), seed=1)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(2, 20)).astype(np.int32))
  segment_ids = jnp.asarray(np.repeat([[1] * 12 + [2] * 6 + [0] * 2], 2, axis=0).astype(np.int32))
  target = jnp.asarray(rng.normal(size=(2, 20, CFG.vocab_size)).astype(np.float32))

  np.testing.assert_allclose(model(tokens, segment_ids=segment_ids), _unrolled_logits(model, tokens, segment_ids),
                             atol=1e-5, rtol=0)

  graphdef, params = nnx.split(model)

  def loss(params, unroll):
    m = nnx.merge(graphdef, params)
    logits = _unrolled_logits(m, tokens, segment_ids) if unroll else m(tokens, segment_ids=segment_ids)
    return jnp.sum(logits * target)

  g_scan = jax.jit(jax.grad(loss), static_argnums=1)(params, False)
  g_loop = jax.jit(jax.grad(loss), static_argnums=1)(params, True)
  for a, b in zip(jax.tree.leaves(g_scan), jax.tree.leaves(g_loop)):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
  assert all(float(jnp.abs(g).max()) > 0 for g in g_scan["layers"]["mlp"]["up"][...])


def test_checkpoints_with_per_layer_parameters_still_load(tmp_path):
  """Run checkpoints (parameters and Adam's moments) and policy directories written before the layers were stacked
  (`layers/0/...`: `per_layer` writes that layout) restore stacked, equal, onto the learner's shardings."""
  from areal_jax.learner.config import LearnerConfig
  from areal_jax.learner.learner import Learner
  from areal_jax.learner.step import make_learner_mesh
  from areal_jax.models import orbax_io
  from areal_jax.checkpoint.store import CheckpointMeta, Checkpointer

  def learner(seed):
    return Learner(model_cfg=CFG, config=LearnerConfig(lr=1e-3, warmup_steps=0),
                   mesh=make_learner_mesh(jax.devices()[:4], tensor=2),
                   params=nnx.state(create(CFG, seed=seed), nnx.Param))

  old = learner(0)
  old.opt_state = jax.tree.map(lambda x: x + 1, old.opt_state)  # moments that differ from a fresh init
  ckpt = Checkpointer(str(tmp_path / "run"), every_steps=1)
  ckpt.save(3, params=orbax_io.per_layer(old.params), opt_state=orbax_io.per_layer(old.opt_state),
            meta=CheckpointMeta(step=3))
  ckpt.close()
  new = learner(1)
  params, opt_state, meta = Checkpointer(str(tmp_path / "run"), every_steps=1).restore(
      3, params=new.params, opt_state=new.opt_state)
  assert meta == CheckpointMeta(step=3)
  for got, want, like in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves((old.params, old.opt_state)),
                             jax.tree.leaves((new.params, new.opt_state))):
    np.testing.assert_array_equal(got, want)
    assert got.sharding == like.sharding

  model = create(CFG, seed=2)
  orbax_io.save_orbax(model, str(tmp_path / "policy"))  # then rewrite its params in the per-layer layout
  import orbax.checkpoint as ocp
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "policy" / "params", orbax_io.per_layer(nnx.to_pure_dict(nnx.state(model, nnx.Param))),
               force=True)
  loaded = orbax_io.load_orbax(str(tmp_path / "policy"))
  for got, want in zip(jax.tree.leaves(nnx.state(loaded)), jax.tree.leaves(nnx.state(model))):
    np.testing.assert_array_equal(got, want)
