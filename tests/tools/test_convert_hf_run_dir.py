"""tools/convert_hf.py --to=hf takes a run directory: its latest complete checkpoint, logits equal in transformers."""

import pytest
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

from areal_jax.checkpoint.store import CheckpointMeta, Checkpointer
from areal_jax.models import ModelConfig, create, orbax_io

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
              meta=CheckpointMeta(step=step, model_config=orbax_io.config_to_json(cfg)))
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


def test_lora_run_directory_to_merged_hf_and_peft(tmp_path):
  """A LoRA run's checkpoint holds its adapters alone and names its base (here a policy directory, as the cached
  warm-start is): --to=hf writes the merged model, --to=peft the adapters that PEFT puts back on the base."""
  import peft  # pylint: disable=g-import-not-at-top

  from areal_jax.models import lora  # pylint: disable=g-import-not-at-top

  base_cfg = ModelConfig(family="qwen2", vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)
  cfg = base_cfg.replace(lora_rank=4, lora_alpha=4.0, lora_targets=("q", "k", "up"))
  base = create(base_cfg, seed=3)
  orbax_io.save_orbax(base, str(tmp_path / "warmstart"))
  graphdef, state = nnx.split(create(cfg, seed=0))
  adapters, _ = lora.split(state)
  adapters = jax.tree.map(lambda x: 0.3 * jax.random.normal(jax.random.key(7), x.shape), adapters)
  base_state = nnx.state(base, nnx.Param)
  model = nnx.merge(graphdef, nnx.merge_state(base_state, adapters))
  run = tmp_path / "run"
  ckpt = Checkpointer(str(run / "checkpoints"), every_steps=2)
  ckpt.save(2, params=jax.device_put(adapters, jax.devices()[0]), opt_state={"count": jnp.array(2)},
            meta=CheckpointMeta(step=2, model_config=orbax_io.config_to_json(cfg),
                                base=lora.base_meta({"warmstart": str(tmp_path / "warmstart")}, base_state)))
  ckpt.close()

  env = dict(os.environ, JAX_PLATFORMS="cpu")
  convert = lambda *a: subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_hf.py"), *a], env=env,
                                      capture_output=True, text=True, check=False)
  for args in ([f"--orbax_dir={run}", f"--hf_dir={tmp_path / 'merged'}", "--to=hf"],
               [f"--orbax_dir={run}", f"--hf_dir={tmp_path / 'adapters'}", "--to=peft"],
               [f"--orbax_dir={tmp_path / 'warmstart'}", f"--hf_dir={tmp_path / 'base'}", "--to=hf"]):
    out = convert(*args)
    assert out.returncode == 0, out.stderr[-3000:]
  tokens = np.arange(12)[None] % 40
  want = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
  hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
  adapted = peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "adapters"))
  with torch.no_grad():
    for hf in (merged, adapted):
      np.testing.assert_allclose(hf.eval()(torch.tensor(tokens)).logits.numpy(), want, atol=2e-5)
  assert not np.allclose(want, np.asarray(base(jnp.asarray(tokens, jnp.int32))), atol=1e-3)

  # QLoRA: adapters trained on the int8-quantized base merge into that base's dequantized weights.
  qcfg = cfg.replace(lora_base_quant="int8")
  qgraph, _ = nnx.split(create(qcfg, seed=0))
  qbase = lora.quantize_base(base_state, qcfg)
  ckpt = Checkpointer(str(tmp_path / "qrun" / "checkpoints"), every_steps=2)
  ckpt.save(2, params=jax.device_put(adapters, jax.devices()[0]), opt_state={"count": jnp.array(2)},
            meta=CheckpointMeta(step=2, model_config=orbax_io.config_to_json(qcfg),
                                base=lora.base_meta({"warmstart": str(tmp_path / "warmstart")}, qbase)))
  ckpt.close()
  out = convert(f"--orbax_dir={tmp_path / 'qrun'}", f"--hf_dir={tmp_path / 'qmerged'}", "--to=hf")
  assert out.returncode == 0, out.stderr[-3000:]
  want = np.asarray(nnx.merge(qgraph, nnx.merge_state(qbase, adapters))(jnp.asarray(tokens, jnp.int32)))
  with torch.no_grad():
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qmerged").eval()(torch.tensor(tokens)).logits
  np.testing.assert_allclose(got.numpy(), want, atol=2e-5)

  # Another base than the one the adapters were trained on is refused, naming it.
  orbax_io.save_orbax(create(base_cfg, seed=4), str(tmp_path / "warmstart"))
  out = convert(f"--orbax_dir={run}", f"--hf_dir={tmp_path / 'other'}", "--to=hf")
  assert out.returncode != 0 and "adapters were trained on other base weights" in out.stderr
