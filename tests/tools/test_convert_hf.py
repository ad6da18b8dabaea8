"""HF -> Orbax -> HF through tools/convert_hf.py gives back the same logits in transformers."""

import pytest
import os
import subprocess
import sys

import numpy as np
import torch
import transformers

from areal_jax.models import orbax_io

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_convert_roundtrip(family, tmp_path):
  torch.manual_seed(0)
  kw = dict(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
  if family == "qwen3":
    cfg = transformers.Qwen3Config(**kw)
  else:
    cfg = transformers.Qwen3MoeConfig(**kw, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                      norm_topk_prob=True, mlp_only_layers=[0])
  hf = transformers.AutoModelForCausalLM.from_config(cfg)
  with torch.no_grad():
    for p in hf.parameters():
      p.add_(0.1 * torch.randn_like(p))
  hf.save_pretrained(tmp_path / "hf")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = lambda *a: subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_hf.py"), *a], env=env,
                                  check=True, capture_output=True, text=True)
  run(f"--hf_dir={tmp_path / 'hf'}", f"--orbax_dir={tmp_path / 'orbax'}")
  assert (tmp_path / "orbax" / "model_config.json").exists()
  model = orbax_io.load_orbax(str(tmp_path / "orbax"))
  assert model.cfg.family == family and model.cfg.head_dim == 16
  run(f"--hf_dir={tmp_path / 'back'}", f"--orbax_dir={tmp_path / 'orbax'}", "--to=hf")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
  tokens = torch.tensor(np.arange(20)[None] % 80)
  with torch.no_grad():
    np.testing.assert_allclose(back(tokens).logits.numpy(), hf(tokens).logits.numpy(), atol=1e-6)


def test_load_orbax_reads_a_run_checkpoint(tmp_path):
  """A step written by the trainer's Checkpointer (NNX state on a 4-device mesh) loads as a model."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from areal_jax import sharding as shd
  from areal_jax.models import ModelConfig, create
  from areal_jax.checkpoint.store import CheckpointMeta, Checkpointer

  cfg = ModelConfig(family="qwen3", vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8)
  model = create(cfg, seed=2)
  mesh = shd.make_mesh(jax.devices()[:4], {"fsdp": 4, "tensor": 1})
  params = jax.device_put(nnx.state(model, nnx.Param),
                          shd.state_shardings(nnx.state(model, nnx.Param), mesh, shd.LEARNER_RULES))
  ckpt = Checkpointer(str(tmp_path), every_steps=1)
  ckpt.save(3, params=params, opt_state={"count": jnp.array(1)},
            meta=CheckpointMeta(step=3, model_config=orbax_io.config_to_json(cfg)))
  ckpt.close()
  loaded = orbax_io.load_orbax(str(tmp_path))
  tokens = jnp.arange(12, dtype=jnp.int32)[None] % 40
  np.testing.assert_allclose(np.asarray(loaded(tokens)), np.asarray(model(tokens)), atol=1e-6)


def test_load_orbax_reads_a_policy_saved_on_other_devices(tmp_path):
  """A policy directory written from a 4-device mesh (the warm-start cache) loads in a 1-device process."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from areal_jax import sharding as shd
  from areal_jax.models import ModelConfig, create

  cfg = ModelConfig(family="qwen2", vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8)
  model = create(cfg, seed=3)
  mesh = shd.make_mesh(jax.devices()[:4], {"fsdp": 4, "tensor": 1})
  state = nnx.state(model, nnx.Param)
  nnx.update(model, jax.device_put(state, shd.state_shardings(state, mesh, shd.LEARNER_RULES)))
  orbax_io.save_orbax(model, str(tmp_path / "policy"))
  tokens = np.arange(12, dtype=np.int32)[None] % 40
  np.save(tmp_path / "want.npy", np.asarray(model(jnp.asarray(tokens))))
  check = ("import sys, numpy as np, jax; from areal_jax.models import orbax_io; assert jax.device_count() == 1; "
           "m = orbax_io.load_orbax(sys.argv[1]); want = np.load(sys.argv[2]); "
           "np.testing.assert_allclose(np.asarray(m(np.arange(12, dtype=np.int32)[None] % 40)), want, atol=1e-6)")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
  subprocess.run([sys.executable, "-c", check, str(tmp_path / "policy"), str(tmp_path / "want.npy")], env=env,
                 check=True, capture_output=True, text=True)
