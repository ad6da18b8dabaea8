"""Every preset builds and validates; command-line overrides work and typos fail naming the key."""

import json
import os
import re
import shlex
import subprocess
import sys

import jax.numpy as jnp
import pytest
from absl import flags
from ml_collections import config_flags

from areal_jax.config import load_config, split_devices, validate
from areal_jax.data import DataConfig
from areal_jax.models import ModelConfig
from areal_jax.rl.rollout_buffer import RolloutConfig
from areal_jax.rl.run_config import EvalConfig
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.requests import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "math.py")


def _parse(*args):
  argv = ["prog", *args]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", default=CONFIG, lock_config=True, flag_values=fv, sys_argv=argv)
  fv(argv)
  return fv.config


@pytest.mark.parametrize("preset", ["tiny", "qwen2.5-1.5b", "r1-distill-qwen-7b"])
def test_every_preset_validates(preset):
  # Real presets read the user's data, weights and tokenizer (not opened by validate).
  data = {} if preset == "tiny" else {"data.path": "math.jsonl", "model.init_from": "/ckpt/q",
                                      "model.tokenizer": "/ckpt/q"}
  c = load_config(f"{CONFIG}:{preset}", **data)
  validate(c, num_devices=8)
  m = ModelConfig.from_config(c.model)
  if preset == "tiny":
    assert 1e6 < m.num_params() < 1e7
  else:  # Table 3 of the paper
    assert (c.learner.lr, c.learner.weight_decay, c.learner.b1, c.learner.b2) == (2e-5, 0.05, 0.9, 0.95)
    assert (c.learner.adam_eps, c.learner.grad_clip, c.learner.eps_clip) == (1e-5, 1.0, 0.2)
    assert (c.rollout.batch_size, c.rollout.group_size, c.learner.ppo_n_minibatches) == (512, 16, 4)
    assert c.rollout.max_head_offpolicyness == 8 and c.sampler.temperature == 1.0
  # The tiny CPU default keeps the float32 sampler (logprobs equal the learner's); real sizes serve bfloat16 weights.
  assert c.sampler.param_dtype == ("float32" if preset == "tiny" else "bfloat16")
  assert c.model.param_dtype == "float32"  # the learner's master weights
  expected = {"tiny": 3e6, "qwen2.5-1.5b": 1.78e9, "r1-distill-qwen-7b": 7.6e9}[preset]
  assert abs(m.num_params() / expected - 1) < 0.1, m.num_params()


def _scale_command(marker: str) -> list[str]:
  """The arguments of the command in docs/scale.md whose text holds `marker` (continuation lines joined)."""
  with open(os.path.join(ROOT, "docs", "scale.md")) as f:
    text = f.read().replace("\\\n", " ")
  [line] = [line for line in text.splitlines() if line.startswith("python launch/") and marker in line]
  return shlex.split(line)[2:]


def test_the_docs_8_gpu_command_without_weights_is_refused_naming_both_fields():
  """docs/scale.md's one-host 8-GPU command validates; without `model.init_from` and `model.tokenizer` it would train
  a random 1.5B model on 64 characters, and is refused at load time naming both fields and the way out."""
  args = [a for a in _scale_command("--learner_devices=4") if a.startswith("--config")]
  assert any("qwen2.5-1.5b" in a for a in args), args
  validate(_parse(*args), num_devices=8)
  bare = [a for a in args if not a.startswith(("--config.model.init_from=", "--config.model.tokenizer="))]
  assert len(bare) == len(args) - 2, args
  with pytest.raises(ValueError, match=r"^config\.model\.init_from='': a 1,7\d\dM-parameter model \(preset "
                     r"qwen2\.5-1\.5b\) with random weights .* and the 64-character vocabulary learns nothing; pass "
                     r"model\.init_from=HF_DIR and model\.tokenizer=HF_DIR .*model\.allow_random_init=True"):
    validate(_parse(*bare), num_devices=8)
  validate(_parse(*bare, "--config.model.allow_random_init=True"), num_devices=8)  # meant: a benchmark


@pytest.mark.parametrize("override, field", [
    ({"model.init_from": "/ckpt/q"}, "model.tokenizer"),  # released weights, the char vocabulary
    ({"model.tokenizer": "/ckpt/q"}, "model.init_from"),  # a real tokenizer, random weights
])
def test_a_real_size_model_needs_weights_and_a_tokenizer(override, field):
  c = load_config(f"{CONFIG}:qwen2.5-1.5b", **{"data.path": "math.jsonl"} | override)
  with pytest.raises(ValueError, match=rf"^config\.{re.escape(field)}="):
    validate(c)
  validate(c, data=False)  # a compile check or a plan loads no weights
  # A warm-start trains the random weights first; with a real tokenizer that is the user's choice.
  if field == "model.init_from":
    validate(load_config(f"{CONFIG}:qwen2.5-1.5b", **{"data.path": "math.jsonl", "warmstart.steps": 10} | override))


def test_any_model_over_50m_parameters_is_real_size():
  """The tiny model is random and speaks characters by design; made larger than 50M parameters it is refused too."""
  assert validate(load_config(CONFIG)).model.num_params() < 50e6
  with pytest.raises(ValueError, match=r"^config\.model\.tokenizer='char': a \d+M-parameter model \(preset tiny\) "
                     r"with the 64"):
    validate(load_config(CONFIG, **{"model.num_layers": 80}))


def test_flag_overrides_and_presets():
  c = _parse(f"--config={CONFIG}:qwen2.5-1.5b", "--config.learner.lr=1e-5", "--config.rollout.max_head_offpolicyness=4")
  assert c.preset == "qwen2.5-1.5b" and c.learner.lr == 1e-5 and c.rollout.max_head_offpolicyness == 4
  assert _parse().preset == "tiny"


def test_unknown_key_names_it():
  with pytest.raises(AttributeError, match="lrr"):
    _parse(f"--config={CONFIG}", "--config.learner.lrr=1")
  with pytest.raises(AttributeError, match="lrr"):
    load_config(CONFIG, **{"learner.lrr": 1})


@pytest.mark.parametrize("flag, message", [
    ("--config.learner.lrr=1", """FATAL Flags parsing error: --config.learner.lrr: the config has no field 'lrr'; """
                               """did you mean "lr" instead of "lrr"?"""),
    ("--config.rollout.group_size=0", "FATAL config error: config.rollout.group_size=0: must be positive"),
])
def test_launcher_reports_a_bad_flag_in_one_line_and_writes_nothing(tmp_path, flag, message):
  workdir = tmp_path / "run"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "tpu_run.py"), f"--workdir={workdir}", flag],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == message, out.stderr[-3000:]
  assert "Traceback" not in out.stderr and not workdir.exists()


def test_unknown_preset():
  with pytest.raises(ValueError, match="qwen9"):
    load_config(f"{CONFIG}:qwen9")


@pytest.mark.parametrize("override, field", [
    ({"model.num_kv_heads": 3}, "model.num_heads"),
    ({"model.family": "mistral"}, "model.family"),
    ({"model.rope_scaling.rope_type": "yarn"}, "model.rope_scaling"),
    ({"sampler.max_new_tokens": 4096}, "sampler.max_seq_len"),
    ({"learner.ppo_n_minibatches": 3}, "learner.ppo_n_minibatches"),
    ({"learner.eps_clip": 1.5}, "learner.eps_clip"),
    ({"learner.vocab_chunk": -1}, "learner.vocab_chunk"),
    ({"data.source": "parquet"}, "data.source"),
    ({"data.source": "jsonl"}, "data.path"),
    ({"rollout.max_head_offpolicyness": -1}, "rollout.max_head_offpolicyness"),
    ({"rollout.target_staleness": 4.5}, "rollout.target_staleness"),
    ({"mesh.learner_tensor": 3}, "mesh.learner_tensor"),
    ({"sampler.num_slots": 66}, "sampler.num_slots"),
    ({"mesh.sampler_devices": 8}, "mesh.sampler_devices"),
    ({"mesh.sampler_replicas": 3}, "mesh.sampler_replicas"),  # 4 sampler devices
    ({"mesh.sampler_replicas": 2, "sampler.num_slots": 3}, "sampler.num_slots"),
    ({"model.vocab_size": 32}, "model.vocab_size"),
    ({"sampler.param_dtype": "float16"}, "sampler.param_dtype"),
    ({"sampler.param_dtype": "bf16"}, "sampler.param_dtype"),
    ({"reward.code_isolation": "none"}, "reward.code_isolation"),
    ({"learner.routing_replay": True}, "learner.routing_replay"),  # a dense model
    ({"eval.num_samples": 1, "eval.temperature": 0.6}, "eval.temperature"),  # greedy: the temperature does nothing
    ({"warmstart.on_init_from": True}, "warmstart.on_init_from"),  # no model.init_from to warm-start
])
def test_validation_names_the_field(override, field):
  c = load_config(CONFIG, **override)
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    validate(c, num_devices=8)


def test_split_devices():
  assert split_devices(8, 0.5) == (4, 4)
  assert split_devices(8, 6) == (6, 2)
  assert split_devices(8, 0.25) == (2, 6)
  assert split_devices(1, 0.5) == (1, 1)
  with pytest.raises(ValueError, match="sampler_devices"):
    split_devices(4, 1.5)


def test_sampler_config_rejects_a_bad_param_dtype():
  """The sampler's own record names the key too (it is built from the `sampler` group without `validate`)."""
  c = load_config(CONFIG, **{"sampler.param_dtype": "int8"})
  with pytest.raises(ValueError, match=r"sampler\.param_dtype='int8'.*float32.*bfloat16"):
    SamplerConfig.from_config(c.sampler)
  assert SamplerConfig.from_config(load_config(CONFIG, **{"sampler.param_dtype": "bfloat16"}).sampler).weight_dtype \
      == jnp.bfloat16


def test_settings_hold_a_typed_record_per_group():
  """Every group a run reads has its frozen record in `Settings`; each record checks its own fields without
  `validate` too, and takes its defaults for keys a group lacks."""
  c = load_config(CONFIG)
  s = validate(c)
  assert (s.data.source, s.rollout.batch_size, s.reward.num_workers, s.mesh.sampler_tensor) == (
      c.data.source, c.rollout.batch_size, c.reward.num_workers, c.mesh.sampler_tensor)
  assert (s.eval.every_steps, s.checkpoint.max_to_keep, s.metrics.tensorboard, s.warmstart.steps) == (
      c.eval.every_steps, c.checkpoint.max_to_keep, c.metrics.tensorboard, c.warmstart.steps)
  assert (s.seed, s.total_steps, s.preset, s.model_source.tokenizer) == (0, 90, "tiny", "char")
  assert not s.sampler.record_routes
  assert validate(load_config(CONFIG + ":tiny-moe", **{"learner.routing_replay": True})).sampler.record_routes
  assert s.sampler.sampling(seed=3) == SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=64, seed=3)
  with pytest.raises(ValueError, match=r"rollout\.target_staleness=5\.0: must lie in \[0, rollout\.max_head_"):
    RolloutConfig(target_staleness=5.0)
  with pytest.raises(ValueError, match=r"unknown eval config keys \['every'\]"):
    EvalConfig.from_config({"every": 1})
  assert DataConfig.from_config({"source": "synthetic"}) == DataConfig()
  with pytest.raises(ValueError, match=r"data\.path='': data\.source='files' needs a path to a \.jsonl or \.parquet"):
    DataConfig.from_config({"source": "jsonl"})  # the former name of `files`
  assert DataConfig.from_config({"source": "jsonl"}, source=False).source == "files"  # one name below the config
  assert DataConfig.from_config({"source": "files"}, source=False).path == ""  # a compile check reads no data


def test_a_saved_config_loads_with_fields_added_since(tmp_path):
  c = load_config(CONFIG, **{"rollout.batch_size": 8})
  saved = json.loads(c.to_json_best_effort())
  del saved["reward"]["code_isolation"]  # saved before the field existed
  path = tmp_path / "config.json"
  path.write_text(json.dumps(saved))
  again = load_config(f"{os.path.join(os.path.dirname(CONFIG), 'from_json.py')}:{path}")
  validate(again)
  assert again.rollout.batch_size == 8 and again.reward.code_isolation == "bwrap"


def test_loading_a_config_loads_no_http_or_agent_stack():
  """Sampler processes and `tools/aot_check.py` load configs: the serving and agent stack stays out of them."""
  code = ("import sys; from areal_jax import config as c\n"
          "for name in ('math', 'agent'):\n"
          "  c.validate(c.load_config(f'configs/{name}.py'), num_devices=8)\n"
          "print(sorted(m for m in ('fastapi', 'uvicorn', 'openai', 'starlette', 'httpx2') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout
