"""Orbax checkpoints of a run: named items, asynchronous saves, local or gs://.

Items per step: `params` and `opt_state` (array trees, restored straight onto the learner's shardings), with a critic
`critic_params` and `critic_opt_state` too, and `meta` (JSON, a `CheckpointMeta`: learner step, policy version,
update count, the rollout controller's state, elapsed time, model config, critic, a LoRA run's base).

A save that fails in the background (a full disk, a lost bucket permission) surfaces as `CheckpointError` at the next
`check`, `save` or `close`, naming the step, the directory and the cause; the failed step's temporary directory is not
a checkpoint, so the previous one stays the latest and a restart resumes from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from areal_jax.errors import ConfigError
from areal_jax.models import orbax_io
from areal_jax.models.config import ModelConfig


class CheckpointError(OSError):
  """An asynchronous checkpoint write failed; the previous checkpoint is intact."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointMeta:
  """The `meta` item of a checkpoint step: what resuming, evaluation and serving read besides the arrays.

  Only the primary process writes it (the leader's); a follower passes `CheckpointMeta(step=step)`. Written as JSON by
  `to_json`, with the keys checkpoints had before this record; `from_json` reads both.
  """

  step: int  # the learner step
  version: int = 0  # the policy version of the saved parameters
  updates: int = 0  # optimizer updates so far
  controller: dict[str, Any] | None = None  # rollout controller: dataset position, undone prompt uids, next group id
  elapsed_s: float = 0.0  # the run's time so far (time/elapsed_s goes on from it)
  model_config: dict[str, Any] = dataclasses.field(default_factory=dict)  # `orbax_io.config_to_json` form
  critic: str = ""  # the run's learner.critic
  base: dict[str, Any] | None = None  # LoRA: the base the adapters adapt (`lora.base_meta`)

  @property
  def model_cfg(self) -> ModelConfig:
    if not self.model_config:
      raise ValueError(f"the meta of step {self.step} holds no model_config (not written by a run's leader)")
    return orbax_io.config_from_json(self.model_config)

  def to_json(self) -> dict[str, Any]:
    """What is written: every field but the None ones (old readers index the keys they know)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

  @classmethod
  def from_json(cls, d: dict[str, Any], where: str) -> CheckpointMeta:
    """The record of a JSON `meta` read from `where` (also one written before this record: the same keys; unknown
    keys are ignored). A ValueError naming `where` if `step` is missing or a field has the wrong type."""
    if not isinstance(d, dict):
      raise ValueError(f"{where}: the checkpoint meta is a {type(d).__name__}, not a JSON object")
    if "step" not in d:
      raise ValueError(f"{where}: the checkpoint meta has no `step` (keys: {sorted(d)})")
    kwargs = {}
    for name, kinds in _META_TYPES.items():
      if name not in d:
        continue
      value = d[name]
      if isinstance(value, bool) or not isinstance(value, kinds):
        want = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise ValueError(f"{where}: the checkpoint meta's `{name}` is {value!r} ({type(value).__name__}), not {want}")
      kwargs[name] = float(value) if name == "elapsed_s" else value
    return cls(**kwargs)


_META_TYPES = {"step": (int,), "version": (int,), "updates": (int,), "controller": (dict, type(None)),
               "elapsed_s": (float, int), "model_config": (dict,), "critic": (str,), "base": (dict, type(None))}


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:

  def __init__(self, directory: str, *, every_steps: int, max_to_keep: int = 3):
    self.directory = epath.Path(directory)
    self.every_steps = every_steps
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=True,
                                           create=True)
    self._mngr = ocp.CheckpointManager(self.directory, options=options)
    self._writing: int | None = None  # the step whose asynchronous write may still be in flight
    self._reported = False  # a failure was raised already (close() does not raise it twice)

  def _failed(self, e: Exception) -> CheckpointError:
    step, self._writing, self._reported = self._writing, None, True
    cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if len(cause) > 400:
      cause = cause[:200] + " ... " + cause[-200:]
    if "os_error_code='28'" in cause or "No space left" in cause:
      cause = f"no space left on device ({cause})"
    previous = [s for s in self._mngr.all_steps() if s != step]
    intact = f"step {max(previous)}'s checkpoint is intact" if previous else "no earlier checkpoint exists"
    return CheckpointError(f"checkpoint of step {step} to {self.directory} failed: {cause}. Stopping: {intact}; "
                           "fix the cause and restart to resume from it")

  def check(self) -> None:
    """Raises `CheckpointError` if a background write has failed since the last call; never waits."""
    try:
      self._mngr.check_for_errors()
    except Exception as e:  # pylint: disable=broad-except  (Orbax and TensorStore raise several types)
      raise self._failed(e) from e

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def save(self, step: int, *, params, opt_state, meta: CheckpointMeta, force: bool = False,
           extra: dict[str, Any] | None = None) -> bool:
    """Saves at multiples of `every_steps` (or always with `force`); returns whether a save started. `extra`: more
    array trees by item name (the critic's). Raises `CheckpointError` if an earlier write failed."""
    if not isinstance(meta, CheckpointMeta):
      raise TypeError(f"checkpoint of step {step}: meta is a {type(meta).__name__}, not a CheckpointMeta")
    self.check()
    if not force and step % self.every_steps:
      return False
    if step in self._mngr.all_steps():
      return False
    self.wait()  # the previous write (Orbax would wait for it too): a failure there is named as that step's
    self._writing = step
    try:
      started = self._mngr.save(step, args=ocp.args.Composite(
          params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
          meta=ocp.args.JsonSave(meta.to_json()), **{k: ocp.args.StandardSave(v) for k, v in (extra or {}).items()}),
          force=True)
    except Exception as e:  # pylint: disable=broad-except
      raise self._failed(e) from e
    if not started:
      self._writing = None
    return started

  def restore(self, step: int, *, params, opt_state) -> tuple[Any, Any, CheckpointMeta]:
    """Restores onto the shardings of the given (live or abstract) `params` / `opt_state` trees (also a checkpoint
    written before the decoder layers were stacked: `orbax_io.restore_any_layout`)."""
    def restore(target):
      out = self._mngr.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(target[0]), opt_state=ocp.args.StandardRestore(target[1])))
      return out.params, out.opt_state

    params, opt_state = orbax_io.restore_any_layout(restore, (_abstract(params), _abstract(opt_state)),
                                                    where=f"{self.directory} step {step}")
    return params, opt_state, self.read_meta(step)

  def restore_extra(self, step: int, targets: dict[str, Any]) -> dict[str, Any]:
    """The `extra` items of `step` (see `save`), onto the shardings of the given trees."""
    out = self._mngr.restore(step, args=ocp.args.Composite(
        **{k: ocp.args.StandardRestore(_abstract(v)) for k, v in targets.items()}))
    return {k: out[k] for k in targets}

  def read_meta(self, step: int) -> CheckpointMeta:
    """The `meta` item of `step` alone (no arrays read)."""
    d = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    return CheckpointMeta.from_json(d, where=f"{self.directory} step {step}")

  def wait(self) -> None:
    try:
      self._mngr.wait_until_finished()
      self._mngr.check_for_errors()
    except Exception as e:  # pylint: disable=broad-except
      raise self._failed(e) from e
    self._writing = None

  def close(self) -> None:
    """Waits for the write in flight; raises `CheckpointError` if it failed and was not reported yet (the manager
    is closed either way)."""
    reported = self._reported
    try:
      self.wait()
    except CheckpointError:
      if not reported:
        raise
    finally:
      self._mngr.close()


def check_resumable(meta: CheckpointMeta, model_cfg: ModelConfig, critic: str, *, where: str) -> None:
  """A checkpoint resumes only into a run with the same adapters (or none) and the same critic setting (its leader's
  `meta` says which): else a `ConfigError` naming both."""
  saved = meta.model_config
  rank, targets = saved.get("lora_rank", 0), ",".join(saved.get("lora_targets", ()))
  if rank != model_cfg.lora_rank:
    what = f"LoRA adapters of learner.lora.rank={rank}" if rank else "full weights (no adapters)"
    raise ConfigError(f"config.learner.lora.rank={model_cfg.lora_rank}: {where} holds {what}; set it to match, or "
                      "use another workdir")
  if rank and targets != ",".join(model_cfg.lora_targets):
    raise ConfigError(f"config.learner.lora.targets={','.join(model_cfg.lora_targets)!r}: {where} holds adapters "
                      f"on {targets!r}; set it to match, or use another workdir")
  quant = saved.get("lora_base_quant", "")
  if rank and quant != model_cfg.lora_base_quant:
    raise ConfigError(f"config.learner.lora.quantize_base={model_cfg.lora_base_quant!r}: {where} holds adapters "
                      f"trained on a base quantized as {quant!r}; set it to match, or use another workdir")
  if meta.critic != critic:
    raise ConfigError(f"config.learner.critic={critic!r}: {where} was written by a run with "
                      f"learner.critic={meta.critic!r}; set it to match, or use another workdir")
