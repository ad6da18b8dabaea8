"""Loading and validating run configs (`configs/*.py` files with `get_config(preset)`).

Unknown keys are caught by the locked ConfigDict itself. `validate` builds a run's typed `Settings` once: the model,
learner, sampler and agent records each check their own fields and own their choice lists; `validate` adds what
depends on several groups, and every error names the field at fault as `config.FIELD=VALUE: why`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import ml_collections
from etils import epath

from areal_jax.agents.agent import AgentConfig
from areal_jax.data import prompts, synthetic
from areal_jax.data.dataset import SOURCES
from areal_jax.learner.config import LearnerConfig
from areal_jax.models import hf_io
from areal_jax.models.config import ModelConfig
from areal_jax.reward.sandbox import ISOLATIONS
from areal_jax.sampler.config import SamplerConfig
from areal_jax.tokenizer import CharTokenizer

# Choices of the groups without a typed record of their own (the records check theirs).
_CHOICES = {
    "data.source": SOURCES,
    "data.prompt_template": prompts.TEMPLATES,
    "data.synthetic_task": synthetic.TASKS,
    "reward.code_isolation": ISOLATIONS,
}


@dataclasses.dataclass(frozen=True)
class Settings:
  """A run's typed settings, built and checked once (`validate`)."""

  model: ModelConfig  # the architecture (a HF `model.init_from`'s own), with `learner.lora`'s adapters
  learner: LearnerConfig
  sampler: SamplerConfig
  agent: AgentConfig


def load_config(spec: str, **overrides) -> ml_collections.ConfigDict:
  """`load_config("configs/math.py:tiny", **{"learner.lr": 1e-5})`: the programmatic twin of `--config=...`."""
  path, _, preset = spec.partition(":")
  if not os.path.exists(path):
    raise FileNotFoundError(f"config file {path!r} does not exist")
  module_spec = importlib.util.spec_from_file_location("_areal_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config(preset or None)
  config.lock()
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      node = getattr(node, p)
    setattr(node, leaf, value)  # a locked ConfigDict raises on unknown keys, naming them
  return config


class ConfigError(ValueError):
  """A config value that cannot work, named as `config.FIELD=VALUE: why`."""


def _fail(field: str, value, why: str):
  raise ConfigError(f"config.{field}={value!r}: {why}")


def _positive(c, *fields):
  for f in fields:
    group, name = f.split(".")
    v = c[group][name]
    if not v > 0:
      _fail(f, v, "must be positive")


def split_devices(num_devices: int, sampler_devices: int | float) -> tuple[int, int]:
  """(sampler, learner) device counts; with one device both roles share it (returns (1, 1))."""
  if num_devices == 1:
    return 1, 1
  if isinstance(sampler_devices, float) and not sampler_devices.is_integer():
    if not 0 < sampler_devices < 1:
      _fail("mesh.sampler_devices", sampler_devices, "a fraction must lie in (0, 1)")
    n = max(1, min(num_devices - 1, round(num_devices * sampler_devices)))
  else:
    n = int(sampler_devices)
    if not 0 < n < num_devices:
      _fail("mesh.sampler_devices", sampler_devices, f"must leave at least one of {num_devices} devices to the learner")
  return n, num_devices - n


def model_config(c: ml_collections.ConfigDict) -> ModelConfig:
  """The run's model: `model.init_from`'s architecture when it is a HF directory, else the `model` group's; with
  `learner.lora`'s adapters."""
  init = c.model.init_from
  if init and epath.Path(init, "config.json").exists():
    model = hf_io.read_config(init, dtype=c.model.dtype, param_dtype=c.model.param_dtype, remat=c.model.remat)
  else:
    model = ModelConfig.from_config(c.model)
  return model.with_lora(c.learner.lora)


def validate(c: ml_collections.ConfigDict, *, num_devices: int | None = None, data: bool = True) -> Settings:
  """The run's `Settings`; raises ConfigError (a ValueError) naming the first inconsistent field. With
  `num_devices`, also checks the device split; `data=False` skips the dataset's fields (a compile check reads none)."""
  for field, choices in _CHOICES.items():
    group, name = field.split(".")
    if c[group][name] not in choices:
      _fail(field, c[group][name], f"choose one of {choices}")
  try:
    settings = Settings(model=model_config(c),
                        learner=LearnerConfig.from_config(c.learner, max_new_tokens=c.sampler.max_new_tokens),
                        sampler=SamplerConfig.from_config(c.sampler), agent=AgentConfig.from_config(c.agent))
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  model = settings.model
  if settings.learner.critic == "lora" and not model.lora_rank:
    _fail("learner.critic", "lora", "a LoRA branch needs the policy's adapters: set learner.lora.rank > 0, or use "
          "critic='copy'")
  if c.model.tokenizer == "char" and model.vocab_size < CharTokenizer().vocab_size:
    _fail("model.vocab_size", model.vocab_size, f"smaller than the char tokenizer's {CharTokenizer().vocab_size} ids")

  if data and c.data.source == "jsonl" and not c.data.path:
    _fail("data.path", c.data.path, "data.source='jsonl' needs a path to a .jsonl file")
  if data and c.data.source == "tfds" and not c.data.tfds_name:
    _fail("data.tfds_name", c.data.tfds_name, "data.source='tfds' needs a dataset name")
  _positive(c, "data.max_prompt_len", "rollout.batch_size", "rollout.group_size", "rollout.max_concurrent_rollouts",
            "rollout.stall_timeout_s", "reward.num_workers", "reward.timeout_s", "checkpoint.every_steps",
            "eval.every_steps", "eval.num_samples")

  s, lr = settings.sampler, settings.learner
  if c.data.max_prompt_len + s.max_new_tokens > s.max_seq_len:
    _fail("sampler.max_seq_len", s.max_seq_len,
          f"must hold data.max_prompt_len={c.data.max_prompt_len} + sampler.max_new_tokens={s.max_new_tokens}")
  if s.max_seq_len > model.max_position_embeddings:
    _fail("sampler.max_seq_len", s.max_seq_len,
          f"exceeds model.max_position_embeddings={model.max_position_embeddings}")
  if s.num_pages and s.num_pages < math.ceil(s.max_seq_len / s.page_size):
    _fail("sampler.num_pages", s.num_pages, f"cannot hold one sequence of sampler.max_seq_len={s.max_seq_len}")
  if lr.max_tokens_per_mb < s.max_seq_len:
    _fail("learner.max_tokens_per_mb", lr.max_tokens_per_mb,
          f"must hold one whole sequence (sampler.max_seq_len={s.max_seq_len})")
  groups = c.rollout.batch_size
  if groups % lr.ppo_n_minibatches:
    _fail("learner.ppo_n_minibatches", lr.ppo_n_minibatches,
          f"must divide rollout.batch_size={groups} (minibatches hold whole prompt groups)")
  r = c.rollout
  if r.max_head_offpolicyness < 0:
    _fail("rollout.max_head_offpolicyness", r.max_head_offpolicyness, "must be >= 0 (0 = synchronous RL)")
  if r.target_staleness is not None and not 0 <= r.target_staleness <= r.max_head_offpolicyness:
    _fail("rollout.target_staleness", r.target_staleness,
          f"must lie in [0, rollout.max_head_offpolicyness={r.max_head_offpolicyness}] (None = the bound)")
  if r.group_size > s.num_slots:
    _fail("rollout.group_size", r.group_size, f"must fit in sampler.num_slots={s.num_slots}")
  _check_mesh(c, model, num_devices)
  return settings


def _check_mesh(c: ml_collections.ConfigDict, model: ModelConfig, num_devices: int | None) -> None:
  """Tensor parallelism that divides the heads; with `num_devices`, a device split that the meshes divide."""
  m, s = c.mesh, c.sampler
  for role in ("sampler", "learner"):
    t = m[f"{role}_tensor"]
    if t < 1 or model.num_heads % t:
      _fail(f"mesh.{role}_tensor", t, f"must divide model.num_heads={model.num_heads}")
  if num_devices is not None:
    n_sampler, n_learner = split_devices(num_devices, m.sampler_devices)
    if n_sampler % m.sampler_tensor:
      _fail("mesh.sampler_tensor", m.sampler_tensor, f"must divide the {n_sampler} sampler devices")
    if n_learner % m.learner_tensor:
      _fail("mesh.learner_tensor", m.learner_tensor, f"must divide the {n_learner} learner devices")
    data = n_sampler // m.sampler_tensor
    if s.num_slots % data:
      _fail("sampler.num_slots", s.num_slots, f"not divisible by the sampler's data axis ({data} devices)")
