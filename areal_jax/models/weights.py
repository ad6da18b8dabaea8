"""Checks and casts of weight trees, shared by the learner's publisher and the sampler (which sit above this module).

`check_compatible` names the first leaf whose path, shape or dtype differs from a reference; `with_dtype` and `cast`
give a tree's floating leaves another dtype (the sampler's `sampler.param_dtype`), abstractly or on the devices;
`fingerprint` sums each leaf, to check that two copies of a tree hold the same values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


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


@jax.jit
def _fingerprint(leaves):
  def one(x):
    x = x.astype(jnp.float32).ravel()
    w = 1.0 + (jnp.arange(x.size, dtype=jnp.int32) % 13).astype(jnp.float32)
    return jnp.stack([jnp.sum(x), jnp.sum(x * w)])

  return jnp.stack([one(x) for x in leaves])


def fingerprint(tree) -> np.ndarray:
  """[leaves, 2] float32: each leaf's sum and position-weighted sum (same program on both ends: exact match)."""
  return np.asarray(jax.device_get(_fingerprint(jax.tree.leaves(tree))))


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
