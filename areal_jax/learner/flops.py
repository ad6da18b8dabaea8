"""Peak FLOP/s of devices, for model FLOP utilisation: a datasheet table for accelerators, else a measured matmul."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from areal_jax import hardware

def datasheet_peak(device: jax.Device) -> float | None:
  """Dense bf16 FLOP/s of one device from its datasheet (`hardware`), or None when unknown (e.g. CPU)."""
  known = hardware.of_kind(device.device_kind)
  return None if known is None else known.flops


def measure_matmul_peak(devices: Sequence[jax.Device], *, dtype=jnp.float32, size: int = 1024,
                        repeats: int = 5) -> float:
  """Achieved FLOP/s of all `devices` together on a square matmul per device (best of `repeats`)."""
  mesh = Mesh(np.asarray(devices, dtype=object), ("d",))
  sharding = NamedSharding(mesh, P("d"))
  a = jax.device_put(np.ones((len(devices), size, size), np.float32), sharding).astype(dtype)
  f = jax.jit(lambda x: jnp.einsum("nij,njk->nik", x, x), out_shardings=sharding)
  f(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    f(a).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2.0 * size**3 * len(devices) / best


@functools.cache
def _measured(device_ids: tuple[int, ...], dtype_name: str) -> float:
  devices = [d for d in jax.devices() if d.id in device_ids]
  return measure_matmul_peak(devices, dtype=jnp.dtype(dtype_name))


def peak_flops(devices: Sequence[jax.Device], dtype=jnp.bfloat16) -> float:
  """Total peak FLOP/s of `devices`: the datasheet when every device is known, else measured once and cached."""
  table = [datasheet_peak(d) for d in devices]
  if all(p is not None for p in table):
    return float(sum(table))
  return _measured(tuple(sorted(d.id for d in devices)), jnp.dtype(dtype).name)


def measure_bandwidth(device: jax.Device) -> float:
  """Bytes/s of reading a 256 MiB float32 array once (a jitted sum), best of 5."""
  x = jax.device_put(jnp.ones((64 << 20,), jnp.float32), device)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  best = float("inf")
  for _ in range(5):
    t = time.perf_counter()
    total(x).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return x.nbytes / best
