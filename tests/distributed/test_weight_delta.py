"""Lossless deltas: the version rebuilt from its predecessor and its delta is the version, bit for bit, on every
partitioning a sampler's weights take; each leaf goes the cheapest exact way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from areal_jax.distributed import weight_delta
from areal_jax.sharding import make_mesh


def _bits(x):
  x = np.asarray(jax.device_get(x))
  return x.view(f"u{x.dtype.itemsize}") if x.dtype != bool else x


@pytest.mark.parametrize("spec", [P(), P(None, "tensor"), P("tensor"), P("expert", "tensor"), P(("expert", "tensor"))])
def test_a_version_rebuilt_from_its_delta_is_bit_identical(spec):
  mesh = make_mesh(jax.devices()[:4], {"data": 1, "expert": 2, "tensor": 2})
  sharding = NamedSharding(mesh, spec)
  rng = np.random.default_rng(0)
  old = rng.normal(size=(16, 32)).astype(np.float32)
  new = old.copy()
  new[3, 5] += 1.0
  new[15, 31] = np.nan
  new[0, :] = np.where(old[0, :] == 0, -0.0, old[0, :])  # unchanged values: still unchanged bits
  new[7, 1] = -0.0 if old[7, 1] != 0 else 1.0
  old_b, new_b = (jax.device_put(jnp.asarray(x, jnp.bfloat16), sharding) for x in (old, new))
  codes, changed = weight_delta.plan([new_b], [old_b])
  assert changed == int(np.sum(_bits(new_b) != _bits(old_b))) == 3
  assert codes[0] > 0  # 3 of 512: indices and values
  payload = weight_delta.encode([new_b], [old_b], codes)
  want = weight_delta.targets([jax.ShapeDtypeStruct(old_b.shape, old_b.dtype, sharding=sharding)], codes)
  assert [(x.shape, x.dtype, x.sharding) for x in payload] == [(x.shape, x.dtype, x.sharding) for x in want]
  assert weight_delta.nbytes(payload) == weight_delta.nbytes(want) < old_b.nbytes
  [rebuilt] = weight_delta.apply([old_b], payload, codes)
  np.testing.assert_array_equal(_bits(rebuilt), _bits(new_b))
  assert rebuilt.sharding == sharding
  np.testing.assert_array_equal(_bits(old_b), _bits(jnp.asarray(old, jnp.bfloat16)))  # the base is left as it was


def test_each_leaf_goes_the_cheapest_exact_way():
  mesh = make_mesh(jax.devices()[:2], {"data": 1, "expert": 1, "tensor": 2})
  rows = NamedSharding(mesh, P("tensor"))
  old = [jax.device_put(jnp.zeros((64,), jnp.bfloat16), rows), jax.device_put(jnp.zeros((64,), jnp.bfloat16), rows),
         jax.device_put(jnp.zeros((1,), jnp.int32), NamedSharding(mesh, P())),
         jax.device_put(jnp.zeros((8,), jnp.bool_), NamedSharding(mesh, P()))]
  new = [old[0], old[1].at[:20].set(1.0).at[40].set(2.0), old[2].at[0].set(7), old[3].at[2].set(True)]
  codes, changed = weight_delta.plan(new, old)
  # Unchanged; 20 of one shard's 32 (a 32-pair bucket costs more than the shard): whole; a lone int32 (its index and
  # value cost 8 bytes, the leaf 4): whole; one bool of 8: 1 pair (5 bytes) < 8 bytes.
  assert codes == [weight_delta.UNCHANGED, weight_delta.DENSE, weight_delta.DENSE, 1]
  assert changed == 21 + 1 + 1
  payload = weight_delta.encode(new, old, codes)
  assert len(payload) == 1 + 1 + 2
  for got, want in zip(weight_delta.apply(old, payload, codes), new):
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_shards_with_different_change_counts_share_one_padded_bucket():
  mesh = make_mesh(jax.devices()[:4], {"data": 1, "expert": 1, "tensor": 4})
  sharding = NamedSharding(mesh, P(None, "tensor"))
  old = jax.device_put(jnp.zeros((32, 64), jnp.bfloat16), sharding)
  new = old.at[:5, 0].set(1.0).at[9, 63].set(3.0)  # shard 0: 5 changed, shard 3: 1, the others none
  codes, changed = weight_delta.plan([new], [old])
  assert (codes, changed) == ([8], 6)  # the fullest shard's 5, padded to a power of two
  payload = weight_delta.encode([new], [old], codes)
  assert payload[0].shape == (4 * 8,)
  [rebuilt] = weight_delta.apply([old], payload, codes)
  np.testing.assert_array_equal(_bits(rebuilt), _bits(new))
