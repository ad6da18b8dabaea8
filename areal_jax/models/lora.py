"""LoRA adapters (Hu et al., 2021) on the transformer's projections, as Flax NNX `nnx.LoRAParam`s.

With `ModelConfig.lora_rank = r > 0`, every projection W named in `lora_targets` gets two adapters beside it: A
(W's input dims x r, uniform in ±1/sqrt(fan-in)) and B (r x W's output dims, zeros, so a new adapter changes nothing),
and computes x·W + (alpha / r)·(x·A)·B. The adapters are applied unmerged, in the learner and the sampler alike: the
learner's gradient never forms a full-size weight gradient, and a sampler keeps one copy of the base weights and
takes new adapters each version (a few MB) instead of the whole model.

The adapters are `nnx.LoRAParam`s (a subclass of `nnx.Param`), so NNX's filters separate them: `split(state)` gives
(adapters, base), `nnx.merge_state` joins them again, and `trainable(cfg)` is the filter of what the learner
differentiates. `merged(state, cfg)` folds the adapters into the base weights (export to HF, a merged sampler).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models import weights
from areal_jax.models.config import ModelConfig

ADAPTERS = nnx.LoRAParam


def trainable(cfg: ModelConfig):
  """The NNX filter of what the learner trains: the adapters under LoRA, else every parameter."""
  return ADAPTERS if cfg.lora_rank else nnx.Param


def split(state: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(adapters, everything else) of a parameter state; the adapters are empty without LoRA."""
  return nnx.split_state(state, ADAPTERS, ...)


def has_adapters(state) -> bool:
  return bool(jax.tree.leaves(split(state)[0]))


def nbytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def scale(cfg: ModelConfig) -> float:
  return cfg.lora_alpha / cfg.lora_rank


def create(rngs: nnx.Rngs, in_shape: tuple[int, ...], out_shape: tuple[int, ...], in_names, out_names,
           rank: int) -> tuple[nnx.LoRAParam, nnx.LoRAParam]:
  """A (in_shape + (rank,)) and B ((rank,) + out_shape), float32 whatever the base weights' dtype (the adapters
  are the learner's master weights)."""
  bound = 1.0 / np.sqrt(np.prod(in_shape))
  a = jax.random.uniform(rngs.params(), (*in_shape, rank), jnp.float32, -bound, bound)
  return (nnx.LoRAParam(a, logical_axes=(*in_names, None)),
          nnx.LoRAParam(jnp.zeros((rank, *out_shape), jnp.float32), logical_axes=(None, *out_names)))


def delta(x: jax.Array, a: jax.Array, b: jax.Array, scale_: float) -> jax.Array:
  """(x·A)·B·scale, contracting x's trailing dims with A's input dims, in x's dtype."""
  n_in = a.ndim - 1
  h = jnp.tensordot(x, a.astype(x.dtype), axes=n_in)
  return jnp.tensordot(h, b.astype(x.dtype) * jnp.asarray(scale_, x.dtype), axes=1)


def base_meta(source: dict, base: nnx.State) -> dict:
  """What a LoRA checkpoint records of its base: where it comes from (`source`, e.g. {"init_from": path}) and, when
  this process can read it whole, its fingerprint."""
  out = {"source": source}
  if all(x.is_fully_addressable for x in jax.tree.leaves(base)):
    out["fingerprint"] = weights.fingerprint(base).tolist()
  return out


def check_base(meta: dict, base: nnx.State, *, where: str) -> None:
  """Adapters trained on one base mean nothing on another: `base` must match the fingerprint `base_meta` recorded."""
  want = meta.get("fingerprint")
  if want is None or not all(x.is_fully_addressable for x in jax.tree.leaves(base)):
    return
  if not np.array_equal(weights.fingerprint(base), np.asarray(want, np.float32)):
    raise ValueError(f"{where}: its adapters were trained on other base weights than the ones loaded from "
                     f"{meta.get('source')}; restore the base they were trained on")


def merged(state: nnx.State, cfg: ModelConfig) -> nnx.State:
  """`state` without adapters, each adapted weight W replaced by W + scale·A·B (in W's dtype): the weights of a model
  with `lora_rank=0` that computes the same function."""
  adapters, base = split(state)
  if not jax.tree.leaves(adapters):
    return base
  flat = dict(nnx.to_flat_state(base))
  s = scale(cfg)
  for path, a in nnx.to_flat_state(adapters):
    if path[-1].endswith("_lora_a"):
      name = path[-1][:-len("_lora_a")]
      b = adapters
      for key in (*path[:-1], f"{name}_lora_b"):
        b = b[key]
      w = flat[(*path[:-1], name)]
      # A [layers, in..., r], B [layers, r, out...]: the stacked decoder layers' leading axis is batched over.
      ab = jax.vmap(lambda a_, b_: jnp.tensordot(a_, b_, axes=1))(a[...], b[...])
      flat[(*path[:-1], name)] = w.replace((w[...].astype(jnp.float32) + s * ab).astype(w[...].dtype))
  return nnx.from_flat_state(flat)
