"""Policy weights in Orbax: a standalone policy directory, or one step of a run's `CheckpointManager`.

A policy directory holds `model_config.json` and `params/` (an Orbax StandardCheckpointer tree of the model's
parameters). A run directory (written by the trainer's CheckpointManager) holds numbered steps, each with a `params`
item and a `meta` JSON item carrying `model_config`; `load_orbax` reads either.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import Transformer


def config_to_json(cfg: ModelConfig) -> dict:
  d = dataclasses.asdict(cfg)
  d["rope_scaling"] = dict(cfg.rope_scaling)
  return d


def config_from_json(d: dict, **overrides) -> ModelConfig:
  d = dict(d, rope_scaling=tuple(sorted(d.get("rope_scaling", {}).items())))
  d.update(overrides)
  return ModelConfig(**d)


def abstract_params(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """Graph definition and abstract (shape-only) parameter state, without allocating anything."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))


def save_orbax(model: Transformer, path: str) -> None:
  """Writes a standalone policy directory (local or gs://)."""
  path = epath.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  (path / "model_config.json").write_text(json.dumps(config_to_json(model.cfg), indent=2))
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path / "params", nnx.to_pure_dict(nnx.state(model, nnx.Param)), force=True)


def load_orbax(path: str, *, step: int | None = None, dtype=None, shardings=None) -> Transformer:
  """A model from a policy directory, or from `step` (default: latest) of a run's checkpoint directory.

  `shardings` (an `nnx.State` of shardings for the parameters) places the arrays; by default they are read onto this
  process's first device, whatever devices wrote them.
  """
  root = epath.Path(path)
  overrides = {} if dtype is None else {"dtype": jnp.dtype(dtype).name}

  def target_for(meta):
    """(graphdef, abstract state, the state as ShapeDtypeStructs with the shardings to read onto)."""
    graphdef, state = abstract_params(config_from_json(meta, **overrides))
    where = shardings or jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), state)
    return graphdef, state, jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, where)

  if (root / "model_config.json").exists():
    graphdef, state, target = target_for(json.loads((root / "model_config.json").read_text()))
    with ocp.StandardCheckpointer() as ckptr:
      restored = ckptr.restore(root / "params", nnx.to_pure_dict(target))
  else:
    with ocp.CheckpointManager(root) as mngr:
      step = mngr.latest_step() if step is None else step
      if step is None:
        raise FileNotFoundError(f"{path}: neither a policy directory (model_config.json) nor a run with checkpoints")
      meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
      graphdef, _, target = target_for(meta["model_config"])
      # The trainer saves the NNX parameter state itself (not a pure dict): restore into its abstract twin.
      restored = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target))).params
      return nnx.merge(graphdef, restored)
  nnx.replace_by_pure_dict(state, restored)
  return nnx.merge(graphdef, state)
