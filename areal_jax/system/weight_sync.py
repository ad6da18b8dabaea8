"""Learner → sampler weight transfer: device-to-device `device_put` onto the sampler's shardings, no host round-trip.

The sampler may hold its weights in a narrower dtype than the learner's float32 master copy (`sampler.param_dtype`):
`transfer(..., dtype=jnp.bfloat16)` casts on the learner's devices first, so only half the bytes cross over.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from areal_jax.models.weights import cast


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
