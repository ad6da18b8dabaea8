"""Logical axis names → mesh shardings, for parameters (metadata `logical_axes`) and activations.

Every parameter carries logical axis names (`("embed", "mlp")`); each role maps them to its mesh axes with a rule
table. A mesh axis that does not divide the dimension is dropped (that dimension is replicated), so e.g. 2 KV heads on a
4-way tensor axis still shard the other dimensions.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# Tensor parallelism along heads / mlp / vocab, for parameters and activations alike (both roles).
_TENSOR_RULES: Rules = tuple((name, "tensor") for name in (
    "vocab", "q_heads", "kv_heads", "mlp", "act_heads", "act_kv_heads", "act_mlp", "act_vocab"))
# Learner: FSDP shards parameters along `embed`; a mixture of experts' experts over `expert` (expert parallelism); the
# batch (packed tokens) is split over data, fsdp and expert.
LEARNER_RULES: Rules = (("batch", ("data", "fsdp", "expert")), ("embed", "fsdp"), ("experts", "expert")) + _TENSOR_RULES
# Sampler: no FSDP (weights are read every decode step); slots over data, experts over expert (slots replicated there).
SAMPLER_RULES: Rules = (("batch", "data"), ("experts", "expert")) + _TENSOR_RULES

_CONTEXT: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("areal_sharding", default=None)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules):
  """Activations constrained with `constrain` inside this context (at trace time) follow `rules` on `mesh`."""
  token = _CONTEXT.set((mesh, rules))
  try:
    yield
  finally:
    _CONTEXT.reset(token)


def current() -> tuple[Mesh, Rules] | None:
  """The (mesh, rules) of the innermost `use_rules`, or None outside one."""
  return _CONTEXT.get()


def platform() -> str:
  """The platform programs traced now will run on: the sharding context's mesh's, else JAX's default device's."""
  ctx = _CONTEXT.get()
  return (ctx[0].devices.flat[0] if ctx else jax.devices()[0]).platform


def make_mesh(devices: Sequence[jax.Device], axes: dict[str, int]) -> Mesh:
  """A mesh over `devices` with named axes; one axis size may be -1 (the rest of the devices)."""
  sizes = dict(axes)
  free = [k for k, v in sizes.items() if v == -1]
  known = math.prod(v for v in sizes.values() if v != -1)
  if len(free) > 1:
    raise ValueError(f"mesh axes {axes}: at most one axis may be -1")
  if free:
    if len(devices) % known:
      raise ValueError(f"mesh axes {axes}: {len(devices)} devices are not divisible by {known}")
    sizes[free[0]] = len(devices) // known
  if math.prod(sizes.values()) != len(devices):
    raise ValueError(f"mesh axes {sizes} need {math.prod(sizes.values())} devices, got {len(devices)}")
  return Mesh(np.asarray(devices, dtype=object).reshape(tuple(sizes.values())), tuple(sizes))


def spec(shape: Sequence[int], names: Sequence[str | None], mesh: Mesh, rules: Rules) -> P:
  """PartitionSpec for an array of `shape` whose dimensions have logical `names`."""
  if len(shape) != len(names):
    raise ValueError(f"logical axes {tuple(names)} do not match shape {tuple(shape)}")
  table = dict(rules)
  used: set[str] = set()
  out = []
  for dim, name in zip(shape, names):
    target = table.get(name) if name else None
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
    # Keep the longest prefix of mesh axes whose product divides the dimension.
    while axes and dim % math.prod(mesh.shape[a] for a in axes):
      axes = axes[:-1]
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*out)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint` by logical names; a no-op outside `use_rules`."""
  ctx = _CONTEXT.get()
  if ctx is None:
    return x
  mesh, rules = ctx
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(x.shape, names, mesh, rules)))


def logical_axes(state: nnx.State):
  """The logical axis names of every parameter in an NNX state (same tree structure)."""
  def names(v):
    ax = v.get_metadata().get("logical_axes")
    if ax is None:
      raise ValueError(f"parameter of shape {v.get_value().shape} has no logical_axes metadata")
    return ax

  return jax.tree.map(names, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules):
  """NamedShardings for every array in an NNX state (or an abstract one from `nnx.eval_shape`)."""
  def one(v):
    if isinstance(v, nnx.Variable):
      ax = v.get_metadata().get("logical_axes")
      # A quantized weight (qwix QArray) shards its values and its block scales by the same names.
      return v.replace(jax.tree.map(lambda x: NamedSharding(mesh, spec(x.shape, ax, mesh, rules) if ax else P()),
                                    v.get_value()))
    return NamedSharding(mesh, P())

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def device_bytes(tree) -> int:
  """Bytes of one device's shards of a tree of sharded `ShapeDtypeStruct`s (the largest shard: the worst device)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * jax.dtypes.itemsize_bits(x.dtype) // 8
             for x in jax.tree.leaves(tree))
