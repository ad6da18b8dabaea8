"""A run end to end with QLoRA (an nf4 base) and a critic on a LoRA branch: adapters alone cross to the sampler and into checkpoints, the critic is
trained and checkpointed beside them; resuming needs the same settings."""

import json
import os

import pytest

from areal_jax import config as config_lib
from areal_jax.checkpoint import store as checkpoint
from areal_jax.checkpoint.store import Checkpointer
from areal_jax.config import load_config
from areal_jax.models import ModelConfig
from areal_jax.rl.metrics import read_metrics
from areal_jax.run import trainer

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "math.py")
FAST = CONFIG + ":fast"
VARIANT = {"learner.lora.rank": 4, "learner.lora.alpha": 8.0, "learner.lora.quantize_base": "nf4", "learner.lr": 1e-3,
           "learner.critic": "lora",
           "learner.gae_lambda": 0.95, "learner.adv_norm": "none"}  # unnormalised rewards: returns != 0


def test_lora_and_critic_run_publishes_adapters_checkpoints_and_resumes(tmp_path):
  workdir = str(tmp_path)
  config = load_config(FAST, total_steps=2, **VARIANT)
  full_bytes = 4 * ModelConfig.from_config(config.model).num_params()
  rows = trainer.run(config, workdir)
  assert [r["step"] for r in rows] == [0, 1, 2]
  for m in read_metrics(workdir)[1:]:
    assert 0 < m["sync/bytes"] * 5 < full_bytes, (m["sync/bytes"], full_bytes)
    assert m["critic/value_loss"] > 0 and -10 < m["critic/explained_variance"] <= 1, m
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=2)
  meta = ckpt.read_meta(2)
  ckpt.close()
  assert meta.base["source"] == {"warmstart": os.path.join(workdir, "warmstart")} and meta.base["fingerprint"]
  assert meta.model_cfg.lora_rank == 4 and meta.model_cfg.lora_base_quant == "nf4"
  assert meta.critic == "lora"
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "2", "critic_params"))

  rows = trainer.run(load_config(FAST, total_steps=3, **VARIANT), workdir)
  assert [r["step"] for r in rows] == [3]  # resumed: adapters on the cached warm-started base, and the critic

  for change, message in [
      ({"learner.lora.rank": 0, "learner.lora.quantize_base": "", "learner.critic": "copy"},
       r"config.learner.lora.rank=0: checkpoint 3 in .* holds LoRA adapters of learner.lora.rank=4"),
      ({"learner.lora.targets": "q,v"}, r"config.learner.lora.targets='q,v': checkpoint 3 .* holds adapters on "
                                        r"'q,k,v,o,gate,up,down'"),
      ({"learner.lora.quantize_base": "int8"}, r"config.learner.lora.quantize_base='int8': checkpoint 3 .* holds "
                                               r"adapters trained on a base quantized as 'nf4'"),
      ({"learner.critic": ""}, r"config.learner.critic='': checkpoint 3 in .* was written by a run with "
                               r"learner.critic='lora'")]:
    with pytest.raises(config_lib.ConfigError, match=message):
      trainer.run(load_config(FAST, total_steps=4, **dict(VARIANT, **change)), workdir)
  with open(os.path.join(workdir, "config.json")) as f:  # the refused settings did not replace the run's
    saved = json.load(f)
  assert saved["total_steps"] == 3 and saved["learner"]["critic"] == "lora", saved


def test_full_weight_checkpoint_refuses_a_lora_run():
  meta = checkpoint.CheckpointMeta(step=1, model_config={"lora_rank": 0})
  with pytest.raises(config_lib.ConfigError, match=r"config.learner.lora.rank=8: ckpt holds full weights"):
    checkpoint.check_resumable(meta, ModelConfig.from_config(load_config(CONFIG).model).replace(lora_rank=8), "",
                               where="ckpt")


def test_a_lora_branch_critic_needs_lora():
  with pytest.raises(config_lib.ConfigError, match=r"config.learner.critic='lora': a LoRA branch needs the policy's "
                                                   r"adapters: set learner.lora.rank > 0"):
    config_lib.validate(load_config(CONFIG, **{"learner.critic": "lora"}))
