"""Learner → sampler weight transfer: device-to-device `device_put` onto the sampler's shardings, no host round-trip.

The sampler may hold its weights in a narrower dtype than the learner's float32 master copy (`sampler.param_dtype`):
`transfer(..., dtype=jnp.bfloat16)` casts on the learner's devices first, so only half the bytes cross over.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def check_compatible(new, reference, *, what: str = "params") -> None:
  """Raises ValueError naming the first leaf whose path, shape or dtype differs."""
  new_leaves = jax.tree_util.tree_flatten_with_path(new)[0]
  ref_leaves = jax.tree_util.tree_flatten_with_path(reference)[0]
  new_paths = {jax.tree_util.keystr(p): v for p, v in new_leaves}
  ref_paths = {jax.tree_util.keystr(p): v for p, v in ref_leaves}
  for path in ref_paths.keys() - new_paths.keys():
    raise ValueError(f"{what}: leaf {path} is missing from the new weights")
  for path in new_paths.keys() - ref_paths.keys():
    raise ValueError(f"{what}: unexpected leaf {path} in the new weights")
  for path, ref in ref_paths.items():
    v = new_paths[path]
    if tuple(v.shape) != tuple(ref.shape) or v.dtype != ref.dtype:
      raise ValueError(f"{what}: leaf {path} is {v.dtype}{list(v.shape)}, expected {ref.dtype}{list(ref.shape)}")


def _floating(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def with_dtype(tree, dtype):
  """`tree`'s leaves as `jax.ShapeDtypeStruct`s, floating ones of `dtype` (the abstract weights a sampler holding
  `dtype` expects); NNX variables and their metadata (logical axes) are kept."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype if _floating(x.dtype) else x.dtype), tree)


@functools.partial(jax.jit, static_argnums=1)
def _cast(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype) if _floating(x.dtype) else x, tree)


def cast(tree, dtype):
  """`tree` with its floating leaves cast to `dtype`, on the devices (and shardings) that hold them; the tree itself
  when nothing needs casting."""
  dtype = np.dtype(dtype)
  if all(x.dtype == dtype or not _floating(x.dtype) for x in jax.tree.leaves(tree)):
    return tree
  return _cast(tree, dtype)


def _identity(tree):
  return tree


def _stage(x: jax.Array, dst: NamedSharding) -> jax.Array:
  """Copies x shard-by-shard onto dst's devices (device-to-device), keeping x's partitioning."""
  if not isinstance(x, jax.Array):
    return x  # a host value: the transfer guard rejects it below
  src = x.sharding
  if src.device_set == dst.device_set:
    return x
  dst_devices = list(dst.mesh.devices.flat)
  if isinstance(src, NamedSharding) and src.mesh.devices.size == len(dst_devices):
    staged = Mesh(np.asarray(dst_devices, dtype=object).reshape(src.mesh.devices.shape), src.mesh.axis_names)
    return jax.device_put(x, NamedSharding(staged, src.spec))
  # Different device counts: replicate on the source (one leaf at a time), then copy the replica across.
  replicated = jax.jit(_identity, out_shardings=NamedSharding(src.mesh, P()))(x)
  return jax.device_put(replicated, NamedSharding(dst.mesh, P()))


def transfer(params, shardings, *, dtype=None):
  """Puts `params` (e.g. fsdp-sharded on the learner slice) onto `shardings` (the sampler slice), with floating leaves
  cast to `dtype` first (None = as they are) where they live, so a narrower copy is what crosses over.

  Shards are copied device-to-device onto the sampler's devices, then resharded there by one compiled program.
  Host↔device copies raise here (explicit or implicit), so a host round-trip cannot slip in.
  """
  with jax.transfer_guard("disallow"), jax.transfer_guard_host_to_device("disallow_explicit"), \
      jax.transfer_guard_device_to_host("disallow_explicit"):
    if dtype is not None:
      params = cast(params, dtype)
    staged = jax.tree.map(_stage, params, shardings)
    out = jax.jit(_identity, out_shardings=shardings)(staged)
    jax.block_until_ready(out)
  return out
