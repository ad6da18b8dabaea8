"""Lossless deltas between two published versions of the weights (`sync.delta`).

A sampler that holds version v-1 is sent, per leaf, only the elements whose bit pattern changed in version v: their
flat indices (int32) and new values (the sampler's dtype: bf16 by default). A bf16 copy of fp32 weights that Adam moves
by ~lr per step changes in few places (an element's bf16 rounding flips only when the fp32 value crosses a rounding
boundary), so most versions move a small share of the full copy. Each leaf is sent the cheapest exact way:

    code UNCHANGED (-1)  nothing
    code DENSE (0)       the whole leaf (when indices + values would cost as much)
    code k > 0           k (index, value) pairs per shard, padded to a power of two (index = the shard's size: dropped)

Everything runs on the devices, shard by shard (`jax.shard_map` over the pull mesh with the leaf's own partitioning):
each shard's indices are into its own block, so the payload is partitioned as the leaf is and the puller applies it
on its matching shard with no communication. Applying is a scatter of exact bit patterns, so the rebuilt weights are
bit-identical to the full copy (the puller checks the full version's fingerprint).

    codes, changed = plan(new, old)          # per leaf; `changed`: elements whose bits differ
    payload = encode(new, old, codes)        # the arrays to offer
    rebuilt = apply(old, payload, codes)     # on the puller: == new, bit for bit
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

UNCHANGED, DENSE = -1, 0
INDEX_BYTES = 4  # int32 indices: a shard holds fewer than 2**31 elements


def bit_pattern(x: jax.Array) -> jax.Array:
  """`x` as unsigned integers of its width (bools as they are): equal exactly where the bits are (NaN, -0.0)."""
  if x.dtype == jnp.bool_:
    return x
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))


def _axes(spec: P) -> tuple[str, ...]:
  """The mesh axes a leaf is sharded on, in order."""
  return tuple(a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry))


def _flat_spec(spec: P) -> P:
  """The 1-D partitioning of a payload: its blocks laid end to end over every mesh axis the leaf is sharded on."""
  axes = _axes(spec)
  return P(axes) if axes else P()


def _blocks(sharding: NamedSharding) -> int:
  return math.prod(sharding.mesh.shape[a] for a in _axes(sharding.spec))


def _shard_map(fn, sharding: NamedSharding, in_specs, out_specs):
  return jax.shard_map(fn, mesh=sharding.mesh, in_specs=in_specs, out_specs=out_specs)


def _named(x: jax.Array) -> NamedSharding:
  """`x`'s sharding by mesh axes; a leaf on one device (not placed on a mesh) as on a one-device mesh."""
  if isinstance(x.sharding, NamedSharding):
    return x.sharding
  if len(x.sharding.device_set) == 1:
    return NamedSharding(Mesh(np.array(list(x.sharding.device_set)), ("one",)), P())
  raise ValueError(f"a leaf of shape {x.shape} on {len(x.sharding.device_set)} devices without a mesh "
                   f"({type(x.sharding).__name__}): place it with a NamedSharding to count its changes")


@functools.partial(jax.jit, static_argnames="shardings")
def _counts(new, old, *, shardings):
  def local(a, b):
    return jnp.sum(bit_pattern(a) != bit_pattern(b), dtype=jnp.int32)[None]

  return [_shard_map(local, s, (s.spec, s.spec), _flat_spec(s.spec))(a, b) for a, b, s in zip(new, old, shardings)]


def count_changed(new: list[jax.Array], old: list[jax.Array]) -> list[jax.Array]:
  """Per leaf of two lists of equal shapes, dtypes and shardings: the elements whose bits differ, per shard (laid
  end to end over the leaf's sharded axes; int32: a shard holds fewer than 2**31 elements). Counted on the devices in
  one call, dispatched and not waited for: the one counter of `plan` and `weight_transfer.ChangedFraction`."""
  new, old = list(new), list(old)
  return _counts(new, old, shardings=tuple(_named(a) for a in new))


@functools.partial(jax.jit, static_argnames=("sharding", "bucket"))
def _encode(new, old, *, sharding, bucket: int):
  def local(a, b):
    a_flat = a.reshape(-1)
    (index,) = jnp.nonzero(bit_pattern(a_flat) != bit_pattern(b.reshape(-1)), size=bucket, fill_value=a_flat.size)
    return index.astype(jnp.int32), jnp.take(a_flat, index, mode="fill", fill_value=0)

  flat = _flat_spec(sharding.spec)
  return _shard_map(local, sharding, (sharding.spec, sharding.spec), (flat, flat))(new, old)


@functools.partial(jax.jit, static_argnames="sharding")
def _apply(base, index, values, *, sharding):
  def local(b, i, v):
    return b.reshape(-1).at[i].set(v, mode="drop").reshape(b.shape)

  flat = _flat_spec(sharding.spec)
  return _shard_map(local, sharding, (sharding.spec, flat, flat), sharding.spec)(base, index, values)


def _local_size(x) -> int:
  return math.prod(x.shape) // _blocks(x.sharding)


def _code(count: int, x) -> int:
  """The cheapest exact encoding of a leaf whose fullest shard has `count` changed elements."""
  if count == 0:
    return UNCHANGED
  bucket = 1 << (count - 1).bit_length()  # a power of two: few distinct programs over a run
  itemsize = np.dtype(x.dtype).itemsize
  return DENSE if bucket * (INDEX_BYTES + itemsize) >= _local_size(x) * itemsize else bucket


def plan(new: list[jax.Array], old: list[jax.Array]) -> tuple[list[int], int]:
  """(one code per leaf, elements changed in all): `new` and `old` are leaves of equal shapes, dtypes and shardings.
  Counted on the devices; this waits for the counts (a few integers per leaf)."""
  counts = jax.device_get(count_changed(new, old))
  return [_code(int(np.max(c)), a) for c, a in zip(counts, new)], int(sum(int(np.sum(c)) for c in counts))


def encode(new: list[jax.Array], old: list[jax.Array], codes: list[int]) -> list[jax.Array]:
  """The arrays to send for `codes` (`plan`'s): nothing for an unchanged leaf, the leaf for a dense one, its indices
  and values for a sparse one."""
  out = []
  for a, b, code in zip(new, old, codes):
    if code == DENSE:
      out.append(a)
    elif code > 0:
      out.extend(_encode(a, b, sharding=a.sharding, bucket=code))
  return out


def targets(leaves: list[jax.ShapeDtypeStruct], codes: list[int]) -> list[jax.ShapeDtypeStruct]:
  """What a puller receives for `codes`, given the full version's leaves (shapes, dtypes, shardings)."""
  out = []
  for x, code in zip(leaves, codes):
    if code == DENSE:
      out.append(x)
    elif code > 0:
      flat = NamedSharding(x.sharding.mesh, _flat_spec(x.sharding.spec))
      n = _blocks(x.sharding) * code
      out += [jax.ShapeDtypeStruct((n,), jnp.int32, sharding=flat), jax.ShapeDtypeStruct((n,), x.dtype, sharding=flat)]
  return out


def apply(base: list[jax.Array], payload: list[jax.Array], codes: list[int]) -> list[jax.Array]:
  """`base` (the version the delta was taken against) with `payload` applied: new arrays (`base` is left as it is:
  the sampler's replicas may still hold it)."""
  out, rest = [], iter(payload)
  for b, code in zip(base, codes):
    if code == UNCHANGED:
      out.append(b)
    elif code == DENSE:
      out.append(next(rest))
    else:
      index, values = next(rest), next(rest)
      out.append(_apply(b, index, values, sharding=b.sharding))
  return out


def nbytes(payload) -> int:
  """The bytes of arrays (or of their `jax.ShapeDtypeStruct`s)."""
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in payload)
