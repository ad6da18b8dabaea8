"""Runs end to end with LoRA (adapters alone cross to the sampler and into checkpoints) and with a critic; resuming
needs the same settings."""

import os

import pytest

from areal_jax import config as config_lib
from areal_jax.config import load_config
from areal_jax.models import ModelConfig
from areal_jax.rl import trainer
from areal_jax.rl.checkpoint import Checkpointer
from areal_jax.rl.metrics import read_metrics
from helpers import FAST

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "math.py")
LORA = {"learner.lora.rank": 4, "learner.lora.alpha": 8.0, "learner.lr": 1e-3}


def test_lora_run_publishes_adapters_and_resumes_from_them(tmp_path):
  workdir = str(tmp_path)
  config = load_config(CONFIG, total_steps=2, **FAST, **LORA)
  model = ModelConfig.from_config(config.model)
  full_bytes = 4 * model.num_params()
  rows = trainer.run(config, workdir)
  assert [r["step"] for r in rows] == [0, 1, 2]
  for m in read_metrics(workdir)[1:]:
    assert 0 < m["sync/bytes"] * 5 < full_bytes, (m["sync/bytes"], full_bytes)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=2)
  meta = ckpt.read_meta(2)
  ckpt.close()
  assert meta["base"]["source"] == {"warmstart": os.path.join(workdir, "warmstart")}
  assert meta["model_config"]["lora_rank"] == 4

  rows = trainer.run(load_config(CONFIG, total_steps=3, **FAST, **LORA), workdir)
  assert [r["step"] for r in rows] == [3]  # resumed: the adapters on the cached warm-started base

  with pytest.raises(config_lib.ConfigError, match=r"config.learner.lora.rank=0: checkpoint 3 in .* holds LoRA "
                     r"adapters of learner.lora.rank=4"):
    trainer.run(load_config(CONFIG, total_steps=4, **FAST, **dict(LORA, **{"learner.lora.rank": 0})), workdir)
  with pytest.raises(config_lib.ConfigError, match=r"config.learner.lora.targets='q,v': checkpoint 3 .* holds "
                     r"adapters on 'q,k,v,o,gate,up,down'"):
    trainer.run(load_config(CONFIG, total_steps=4, **FAST, **dict(LORA, **{"learner.lora.targets": "q,v"})), workdir)


def test_full_weight_checkpoint_refuses_a_lora_run():
  meta = {"model_config": {"lora_rank": 0}}
  with pytest.raises(config_lib.ConfigError, match=r"config.learner.lora.rank=8: ckpt holds full weights"):
    trainer._check_adapters(meta, ModelConfig.from_config(load_config(CONFIG).model).replace(lora_rank=8),
                            where="ckpt")  # pylint: disable=protected-access


def test_critic_run_trains_checkpoints_and_resumes_its_critic(tmp_path):
  workdir = str(tmp_path)
  critic = {"learner.critic": "copy", "learner.gae_lambda": 0.95, "learner.adv_norm": "none"}  # returns != 0
  rows = trainer.run(load_config(CONFIG, total_steps=2, **FAST, **critic), workdir)
  assert [r["step"] for r in rows] == [0, 1, 2]
  for m in read_metrics(workdir)[1:]:
    assert m["critic/value_loss"] > 0 and -10 < m["critic/explained_variance"] <= 1, m
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "2", "critic_params"))
  rows = trainer.run(load_config(CONFIG, total_steps=3, **FAST, **critic), workdir)
  assert [r["step"] for r in rows] == [3]
  with pytest.raises(config_lib.ConfigError, match=r"config.learner.critic='': checkpoint 3 in .* was written by a "
                     r"run with learner.critic='copy'"):
    trainer.run(load_config(CONFIG, total_steps=4, **FAST), workdir)
