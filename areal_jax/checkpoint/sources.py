"""What to evaluate: a run's checkpoints (local or gs://), an Orbax policy directory, or a HF model directory.

A run's checkpoint directory (an Orbax `CheckpointManager`, see `areal_jax.checkpoint.store`) holds one directory per
saved step, named by the step, with the items `params`, `opt_state` and `meta`. Orbax finalizes a step in one of two
ways: on a local disk it writes `<step>.orbax-checkpoint-tmp-<time>/` and renames it to `<step>/` when done; on GCS
(no atomic rename) it writes `<step>/` in place and adds `commit_success.txt` last. Anything else -- a temporary
directory, a step without its commit file or without its items -- is a save in progress or one cut short, and `scan`
reports it instead of listing it. Nothing here writes to the checkpoint directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from areal_jax.checkpoint.store import CheckpointMeta
from areal_jax.models import create, hf_io, lora, orbax_io, weights
from areal_jax.models.config import ModelConfig

ITEMS = ("params", "meta")  # the items evaluation reads from a step
_TMP_MARK = ".orbax-checkpoint-tmp"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Source:
  """A resolved `--checkpoint_dir`.

  kind: "run" (a checkpoint directory of numbered steps), "policy" (Orbax `model_config.json` + `params/`) or "hf"
  (`config.json` + safetensors). `run_config` is the run's `config.json` as a dict when one is found (in the run
  directory, the checkpoint directory's parent); `default_output` is where results go unless told otherwise.
  """

  kind: str
  path: epath.Path  # the checkpoint directory for "run", else the model directory
  run_config: dict[str, Any] | None
  default_output: epath.Path


def _run_config(directory: epath.Path) -> dict[str, Any] | None:
  """The trainer's `config.json` in `directory` (not a HF model's config.json, which has no `sampler` group)."""
  path = directory / "config.json"
  if not path.exists():
    return None
  try:
    d = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
  return d if isinstance(d, dict) and "model" in d and "sampler" in d else None


def resolve(path: str) -> Source:
  """Classifies `path`: a run directory (with `checkpoints/`), a checkpoint directory, a policy or a HF directory.

  A run directory is recognised by `checkpoints/` or by the trainer's `config.json` (a run that has not saved yet, for
  `--watch`); any other path, existing or not, is taken as a checkpoint directory.
  """
  root = epath.Path(path)
  if (root / "checkpoints").is_dir() or _run_config(root) is not None:
    return Source(kind="run", path=root / "checkpoints", run_config=_run_config(root), default_output=root / "eval")
  if (root / "model_config.json").exists():
    return Source(kind="policy", path=root, run_config=_run_config(root.parent), default_output=root / "eval")
  if (root / "config.json").exists():
    if "://" in os.fspath(root):
      raise ValueError(f"{path}: HF model directories are read from a local disk; copy it locally first")
    return Source(kind="hf", path=root, run_config=None, default_output=root / "eval")
  return Source(kind="run", path=root, run_config=_run_config(root.parent), default_output=root.parent / "eval")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scan:
  complete: list[int]  # finalized steps with every item evaluation reads, ascending
  incomplete: dict[str, str]  # entry name -> why it is not listed


def _forget_cached_listings(root: epath.Path) -> None:
  """gcsfs (etils' gs:// backend) caches directory listings for the life of the process; a watcher must see the
  steps other processes write, so the cache is dropped before every scan."""
  if "://" in os.fspath(root):
    from etils.epath import backend  # pylint: disable=g-import-not-at-top

    backend.fsspec_backend.fs(root).invalidate_cache()


def scan(directory: str | epath.Path) -> Scan:
  """The complete steps of a checkpoint directory, and what was passed over (see the module docstring)."""
  root = epath.Path(directory)
  _forget_cached_listings(root)
  if not root.exists():
    return Scan(complete=[], incomplete={})
  complete, incomplete = [], {}
  for entry in root.iterdir():
    name = entry.name
    if _TMP_MARK in name:
      incomplete[name] = "temporary directory of a save in progress or cut short"
    elif not name.isdigit() or not entry.is_dir():
      continue  # Orbax's own files, or anything else kept beside the steps
    elif not ocp.path.step.is_path_finalized(entry):
      incomplete[name] = "not finalized (no commit_success.txt): a save in progress or cut short"
    elif missing := [item for item in ITEMS if not (entry / item).exists()]:
      incomplete[name] = f"finalized but missing item(s) {', '.join(missing)}"
    else:
      complete.append(int(name))
  return Scan(complete=sorted(complete), incomplete=incomplete)


def read_meta(directory: str | epath.Path, step: int) -> CheckpointMeta:
  """The `meta` item of `step` (learner step, policy version, model config, ...)."""
  path = epath.Path(directory) / str(step) / "meta"
  with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
    return CheckpointMeta.from_json(ckptr.restore(path), where=str(path))


def load_params(directory: str | epath.Path, step: int, model_cfg: ModelConfig, *, shardings) -> nnx.State:
  """The `params` item of `step` (the learner's NNX parameter state, as the trainer saves it), read straight onto
  `shardings` (an NNX state of shardings of the same structure, e.g. the sampling engine's). A LoRA run's step holds
  its adapters alone: they are joined to the base its `meta` names (`load_base`)."""
  _, abstract = orbax_io.abstract_params(model_cfg)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  saved, base = lora.split(target) if model_cfg.lora_rank else (target, None)
  where = epath.Path(directory) / str(step) / "params"
  with ocp.StandardCheckpointer() as ckptr:
    params = orbax_io.restore_any_layout(lambda t: ckptr.restore(where, t), saved, where=str(where))
  if base is None:
    return params
  saved_base = read_meta(directory, step).base
  if saved_base is None:
    raise ValueError(f"step {step} of {directory}: LoRA adapters (model_config.lora_rank={model_cfg.lora_rank}) "
                     "whose meta names no base")
  base = load_base(saved_base["source"], model_cfg, base)
  lora.check_base(saved_base, base, where=f"step {step} of {directory}")
  return nnx.merge_state(base, params)


def load_base(source: dict, model_cfg: ModelConfig, target: nnx.State) -> nnx.State:
  """The base weights a LoRA run's checkpoints name (`run.initial_weights.base_source`), onto `target`'s shardings and
  dtypes: `model.init_from` (a HF or Orbax policy directory), the run's cached warm-start, or the random init of its
  seed; quantized as the learner stored it under QLoRA."""
  shardings = jax.tree.map(lambda t: t.sharding, target)
  if "random_seed" in source:  # the learner's own init: the base part of the adapted model's
    init = lambda: lora.split(nnx.state(create(model_cfg, source["random_seed"]), nnx.Param))[1]
    return jax.jit(init, out_shardings=shardings)()
  path = source.get("init_from") or source["warmstart"]
  if epath.Path(path, "config.json").exists():
    model = hf_io.load_hf(str(path), dtype=model_cfg.dtype)
  else:
    model = orbax_io.load_orbax(str(path), dtype=model_cfg.dtype)
  base = weights.cast(nnx.state(model, nnx.Param), model_cfg.weight_dtype)  # `target`'s dtypes
  return lora.quantized_onto(base, model_cfg, shardings)
