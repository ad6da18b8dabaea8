"""Policy weights in Orbax: a standalone policy directory, or one step of a run's `CheckpointManager`.

A policy directory holds `model_config.json` and `params/` (an Orbax StandardCheckpointer tree of the model's
parameters). A run directory (written by the trainer's CheckpointManager) holds numbered steps, each with a `params`
item and a `meta` JSON item carrying `model_config`; `load_orbax` reads either.

Checkpoints written before the decoder layers were stacked (parameters `layers/0/...`, `layers/1/...`) still load:
`restore_any_layout` restores them in their own layout and stacks the layers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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
  for key in ("lora_targets", "mlp_only_layers"):
    if key in d:
      d[key] = tuple(d[key])
  d.update(overrides)
  return ModelConfig(**d)


def _holds_layers(x) -> bool:
  return isinstance(x, Mapping) and "layers" in x


def _with_layers(node, layers):
  new = dict(node, layers=layers)
  return nnx.State(new) if isinstance(node, nnx.State) else new


def _layer_slice(x, i: int):
  """Layer `i` of a stacked leaf: an array's slice, or a `jax.ShapeDtypeStruct`'s with the sharding of the rest."""
  if not isinstance(x, jax.ShapeDtypeStruct):
    return x[i]
  sharding = x.sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (len(x.shape) - len(sharding.spec))
    sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]))
  return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)


def per_layer(tree):
  """`tree` (parameters, or any tree holding them, such as Adam's moments) in the layout of checkpoints written before
  the decoder layers were stacked: each `layers` group becomes {0: layer 0, 1: layer 1, ...}."""
  def split(node):
    if not _holds_layers(node):
      return node
    layers = node["layers"]
    n = jax.tree.leaves(layers)[0].shape[0]
    groups = {i: jax.tree.map(lambda x, i=i: _layer_slice(x, i), layers) for i in range(n)}
    return _with_layers(node, nnx.State(groups) if isinstance(layers, nnx.State) else groups)

  return jax.tree.map(split, tree, is_leaf=_holds_layers)


def stack_layers(restored, target):
  """Inverse of `per_layer`: `restored` (per-layer groups) with each group stacked onto `target`'s leaf (a
  `jax.ShapeDtypeStruct` whose sharding places the stacked array)."""
  def stack(node, like):
    if not _holds_layers(node):
      return node
    groups = node["layers"]
    parts = [groups[i] for i in range(len(groups))]
    place = lambda t, *xs: jax.device_put(np.stack([np.asarray(x) for x in xs]).astype(t.dtype), t.sharding)
    return _with_layers(node, jax.tree.map(place, like["layers"], *parts))

  return jax.tree.map(stack, restored, target, is_leaf=_holds_layers)


def restore_any_layout(restore: Callable[[Any], Any], target, *, where: str):
  """`restore(target)` (an Orbax restore onto the abstract `target`). A checkpoint written before the decoder layers
  were stacked (Orbax finds other tree structures) is restored in its own layout and its layers stacked."""
  try:
    return restore(target)
  except ValueError as e:
    if "tree structures do not match" not in str(e):
      raise
    try:
      restored = restore(per_layer(target))
    except ValueError:
      raise e from None  # not the per-layer layout either: Orbax's message names the mismatch
  logging.warning("%s: per-layer decoder parameters (written before the layers were stacked); stacking them", where)
  return stack_layers(restored, target)


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
      restored = restore_any_layout(lambda t: ckptr.restore(root / "params", t), nnx.to_pure_dict(target),
                                    where=str(root))
  else:
    with ocp.CheckpointManager(root) as mngr:
      step = mngr.latest_step() if step is None else step
      if step is None:
        raise FileNotFoundError(f"{path}: neither a policy directory (model_config.json) nor a run with checkpoints")
      meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
      graphdef, _, target = target_for(meta["model_config"])
      # The trainer saves the NNX parameter state itself (not a pure dict): restore into its abstract twin.
      restored = restore_any_layout(
          lambda t: mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(t))).params, target,
          where=f"{path} step {step}")
      return nnx.merge(graphdef, restored)
  nnx.replace_by_pure_dict(state, restored)
  return nnx.merge(graphdef, state)
