"""Learner → sampler weight transfer: device-to-device `device_put` onto the sampler's shardings, no host round-trip."""

from __future__ import annotations

import jax
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


def transfer(params, shardings):
  """Puts `params` (e.g. fsdp-sharded on the learner slice) onto `shardings` (the sampler slice).

  Shards are copied device-to-device onto the sampler's devices, then resharded there by one compiled program.
  Host↔device copies raise here (explicit or implicit), so a host round-trip cannot slip in.
  """
  with jax.transfer_guard("disallow"), jax.transfer_guard_host_to_device("disallow_explicit"), \
      jax.transfer_guard_device_to_host("disallow_explicit"):
    staged = jax.tree.map(_stage, params, shardings)
    out = jax.jit(_identity, out_shardings=shardings)(staged)
    jax.block_until_ready(out)
  return out
