"""tools/convert_hf.py --to=hf takes a run directory: its latest complete checkpoint, logits equal in transformers."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from areal_jax.models import ModelConfig, create, orbax_io
from areal_jax.rl.checkpoint import Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_run_directory_to_hf(tmp_path):
  cfg = ModelConfig(family="qwen3", vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, qk_norm=True)
  run = tmp_path / "run"
  ckpt = Checkpointer(str(run / "checkpoints"), every_steps=2)
  models = {}
  for step, seed in ((2, 0), (4, 1)):
    models[step] = create(cfg, seed=seed)
    params = jax.device_put(nnx.state(models[step], nnx.Param), jax.devices()[0])
    ckpt.save(step, params=params, opt_state={"count": jnp.array(step)},
              meta={"step": step, "model_config": orbax_io.config_to_json(cfg)})
  ckpt.close()
  (run / "config.json").write_text(json.dumps({"model": {}, "sampler": {}}))  # the trainer's config.json

  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_hf.py"), f"--orbax_dir={run}",
                        f"--hf_dir={tmp_path / 'hf'}", "--to=hf"], env=env, capture_output=True, text=True, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"from {run / 'checkpoints'} step 4" in out.stdout
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
  tokens = np.arange(12)[None] % 40
  with torch.no_grad():
    logits = hf(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(logits, np.asarray(models[4](jnp.asarray(tokens, jnp.int32))), atol=1e-5)
  assert not np.allclose(logits, np.asarray(models[2](jnp.asarray(tokens, jnp.int32))), atol=1e-3)
