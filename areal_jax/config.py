"""Loading and validating run configs (`configs/*.py` files with `get_config(preset)`).

Unknown keys are caught by the locked ConfigDict itself. `validate` builds a run's typed `Settings` once: one frozen
record per config group, each next to the code that reads it, checks its own fields and owns its choice lists;
`validate` adds what depends on several groups, and every error names the field at fault as `config.FIELD=VALUE: why`.
Below `rl/`, code takes these records, not the ConfigDict.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import ml_collections
from etils import epath

from areal_jax.agents.agent import AgentConfig
from areal_jax.data.config import DataConfig
from areal_jax.distributed.slices import MeshConfig, split_devices
from areal_jax.errors import ConfigError
from areal_jax.learner.config import LearnerConfig
from areal_jax.models import hf_io
from areal_jax.models.config import ModelConfig, ModelSource
from areal_jax.reward.config import RewardConfig
from areal_jax.rl.rollout_buffer import RolloutConfig
from areal_jax.rl import workflows
from areal_jax.rl.run_config import CheckpointConfig, EvalConfig, MetricsConfig, SyncConfig, WarmstartConfig
from areal_jax.sampler.config import SamplerConfig
from areal_jax.tokenizer import CharTokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  """A run's typed settings, built and checked once (`validate`): one record per config group, and the top-level
  fields."""

  model: ModelConfig  # the architecture (a HF `model.init_from`'s own), with `learner.lora`'s adapters
  model_source: ModelSource  # init_from, tokenizer: the `model` group's other fields
  learner: LearnerConfig
  sampler: SamplerConfig
  agent: AgentConfig
  data: DataConfig
  rollout: RolloutConfig
  reward: RewardConfig
  mesh: MeshConfig
  eval: EvalConfig
  checkpoint: CheckpointConfig
  metrics: MetricsConfig
  warmstart: WarmstartConfig
  sync: SyncConfig
  seed: int = 0  # model init, sampling and data order
  total_steps: int = 0  # learner steps (policy versions) to train
  preset: str = ""  # the preset the config was built from

  @property
  def workflow(self) -> str:
    """The episode workflow (`rollout.workflow`; by default `agent` with `agent.path`, else `rlvr`)."""
    return self.rollout.workflow or ("agent" if self.agent.path else "rlvr")


def _config_module(path: str):
  if not os.path.exists(path):
    raise FileNotFoundError(f"config file {path!r} does not exist")
  module_spec = importlib.util.spec_from_file_location("_areal_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def presets(path: str) -> tuple[str, ...]:
  """The presets a config file names (its `PRESETS`), for `load_config(f"{path}:{preset}")`."""
  return tuple(getattr(_config_module(path), "PRESETS", ()))


def load_config(spec: str, **overrides) -> ml_collections.ConfigDict:
  """`load_config("configs/math.py:tiny", **{"learner.lr": 1e-5})`: the programmatic twin of `--config=...`."""
  path, _, preset = spec.partition(":")
  config = _config_module(path).get_config(preset or None)
  config.lock()
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      node = getattr(node, p)
    setattr(node, leaf, value)  # a locked ConfigDict raises on unknown keys, naming them
  return config


def _fail(field: str, value, why: str):
  raise ConfigError(f"config.{field}={value!r}: {why}")


def model_config(c: ml_collections.ConfigDict) -> ModelConfig:
  """The run's model: `model.init_from`'s architecture when it is a HF directory, else the `model` group's; with
  `learner.lora`'s adapters."""
  init = c.model.init_from
  if init and epath.Path(init, "config.json").exists():
    model = hf_io.read_config(init, dtype=c.model.dtype, param_dtype=c.model.param_dtype, remat=c.model.remat)
  else:
    model = ModelConfig.from_config(c.model)
  return model.with_lora(c.learner.lora)


def _records(c: ml_collections.ConfigDict, data: bool) -> Settings:
  """Every group's record, each checking its own fields (`data=False`: not the data source's path or name)."""
  return Settings(
      model=model_config(c), model_source=ModelSource.from_config(c.model),
      learner=LearnerConfig.from_config(c.learner, max_new_tokens=c.sampler.max_new_tokens),
      sampler=SamplerConfig.from_config(c.sampler, record_routes=bool(c.learner.get("routing_replay", False))),
      agent=AgentConfig.from_config(c.agent),
      data=DataConfig.from_config(c.data, source=data), rollout=RolloutConfig.from_config(c.rollout),
      reward=RewardConfig.from_config(c.reward), mesh=MeshConfig.from_config(c.mesh),
      eval=EvalConfig.from_config(c.eval), checkpoint=CheckpointConfig.from_config(c.checkpoint),
      metrics=MetricsConfig.from_config(c.metrics), warmstart=WarmstartConfig.from_config(c.warmstart),
      sync=SyncConfig.from_config(c.sync),
      seed=int(c.seed), total_steps=int(c.total_steps), preset=str(c.get("preset", "")))


def validate(c: ml_collections.ConfigDict, *, num_devices: int | None = None, data: bool = True) -> Settings:
  """The run's `Settings`; raises ConfigError (a ValueError) naming the first inconsistent field. With
  `num_devices`, also checks the device split; `data=False` skips the dataset's path and name and where a real-size
  model's weights and tokenizer come from (a compile check or a plan reads neither)."""
  try:
    settings = _records(c, data)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  model = settings.model
  if settings.total_steps < 0:
    _fail("total_steps", settings.total_steps, "must be >= 0")
  if settings.learner.critic == "lora" and not model.lora_rank:
    _fail("learner.critic", "lora", "a LoRA branch needs the policy's adapters: set learner.lora.rank > 0, or use "
          "critic='copy'")
  if settings.learner.routing_replay and not model.num_experts:
    _fail("learner.routing_replay", True, "replays a mixture of experts' routing; the model has no experts")
  if settings.model_source.tokenizer == "char" and model.vocab_size < CharTokenizer().vocab_size:
    _fail("model.vocab_size", model.vocab_size, f"smaller than the char tokenizer's {CharTokenizer().vocab_size} ids")

  s, lr, prompt_len = settings.sampler, settings.learner, settings.data.max_prompt_len
  if prompt_len + s.max_new_tokens > s.max_seq_len:
    _fail("sampler.max_seq_len", s.max_seq_len,
          f"must hold data.max_prompt_len={prompt_len} + sampler.max_new_tokens={s.max_new_tokens}")
  if s.max_seq_len > model.max_position_embeddings:
    _fail("sampler.max_seq_len", s.max_seq_len,
          f"exceeds model.max_position_embeddings={model.max_position_embeddings}")
  if s.num_pages and s.num_pages < math.ceil(s.max_seq_len / s.page_size):
    _fail("sampler.num_pages", s.num_pages, f"cannot hold one sequence of sampler.max_seq_len={s.max_seq_len}")
  if lr.max_tokens_per_mb < s.max_seq_len:
    _fail("learner.max_tokens_per_mb", lr.max_tokens_per_mb,
          f"must hold one whole sequence (sampler.max_seq_len={s.max_seq_len})")
  r = settings.rollout
  if r.batch_size % lr.ppo_n_minibatches:
    _fail("learner.ppo_n_minibatches", lr.ppo_n_minibatches,
          f"must divide rollout.batch_size={r.batch_size} (minibatches hold whole prompt groups)")
  if r.group_size > s.num_slots:
    _fail("rollout.group_size", r.group_size, f"must fit in sampler.num_slots={s.num_slots}")
  try:
    workflows.resolve(settings.workflow)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  if settings.workflow == "agent" and not settings.agent.path:
    _fail("rollout.workflow", "agent", "runs the agent at agent.path: set it")
  m = settings.mesh
  if m.colocated and r.max_head_offpolicyness != 0:
    _fail("mesh.colocated", True, f"generates then trains (synchronous RL): needs rollout.max_head_offpolicyness=0, "
          f"not {r.max_head_offpolicyness}")
  if settings.warmstart.on_init_from and not settings.model_source.init_from:
    _fail("warmstart.on_init_from", True, "warm-starts model.init_from's weights: set model.init_from (without it the "
          "random init is warm-started anyway)")
  if data:
    _check_weights(settings)
  _check_mesh(settings, num_devices)
  return settings


REAL_SIZE_PARAMS = 50_000_000  # above this a model trains from released weights and their tokenizer


def _check_weights(settings: Settings) -> None:
  """A real-size model (over REAL_SIZE_PARAMS parameters) from random weights (no `model.init_from`, no warm-start) or
  with the 64-character vocabulary learns nothing: every reward stays 0 until `rollout.stall_timeout_s`. Refused
  unless `model.allow_random_init` says it is meant (a benchmark); compile checks and plans (`data=False`) load no
  weights and are not asked."""
  source, n = settings.model_source, settings.model.num_params()
  if n <= REAL_SIZE_PARAMS or source.allow_random_init:
    return
  faults = []  # (field, value, what it gives)
  if not source.init_from and not settings.warmstart.steps:
    faults.append(("model.init_from", source.init_from, "random weights (and warmstart.steps=0)"))
  if source.tokenizer == "char":
    faults.append(("model.tokenizer", source.tokenizer, "the 64-character vocabulary"))
  if faults:
    field, value, _ = faults[0]
    _fail(field, value, f"a {n / 1e6:,.0f}M-parameter model{f' (preset {settings.preset})' if settings.preset else ''}"
          f" with {' and '.join(what for *_, what in faults)} learns nothing; pass "
          f"{' and '.join(f'{f}=HF_DIR' for f, *_ in faults)} (a HF checkpoint directory, its config.json and "
          f"tokenizer.json), or model.allow_random_init=True to train it so anyway")


def _check_mesh(settings: Settings, num_devices: int | None) -> None:
  """Tensor parallelism that divides the heads; with `num_devices`, a device split that the meshes divide."""
  m, s, model = settings.mesh, settings.sampler, settings.model
  for role in ("sampler", "learner"):
    e = getattr(m, f"{role}_expert")
    if e < 1 or (e > 1 and (not model.num_experts or model.num_experts % e)):
      _fail(f"mesh.{role}_expert", e, f"must divide model.num_experts={model.num_experts} (1 without experts)")
    t = getattr(m, f"{role}_tensor")
    if t < 1 or model.num_heads % t:
      _fail(f"mesh.{role}_tensor", t, f"must divide model.num_heads={model.num_heads}")
  if num_devices is not None:
    try:
      n_sampler, n_learner = ((num_devices, num_devices) if m.colocated
                              else split_devices(num_devices, m.sampler_devices))
    except ValueError as e:
      raise ConfigError(f"config.{e}") from None
    if n_sampler % (m.sampler_tensor * m.sampler_expert):
      _fail("mesh.sampler_tensor", m.sampler_tensor, f"times mesh.sampler_expert={m.sampler_expert} must divide the "
            f"{n_sampler} sampler devices")
    if n_learner % (m.learner_tensor * m.learner_expert):
      _fail("mesh.learner_tensor", m.learner_tensor, f"times mesh.learner_expert={m.learner_expert} must divide the "
            f"{n_learner} learner devices")
    r = m.sampler_replicas
    if n_sampler % (r * m.sampler_tensor * m.sampler_expert):
      _fail("mesh.sampler_replicas", r, f"times mesh.sampler_tensor={m.sampler_tensor} times mesh.sampler_expert="
            f"{m.sampler_expert} must divide the {n_sampler} sampler devices")
    data = n_sampler // (r * m.sampler_tensor * m.sampler_expert)
    if s.num_slots % data:
      _fail("sampler.num_slots", s.num_slots, f"not divisible by the sampler's data axis ({data} devices"
            + (f" per replica of {r})" if r > 1 else ")"))
