"""LoRA adapters (Hu et al., 2021) on the transformer's projections, as Flax NNX `nnx.LoRAParam`s.

With `ModelConfig.lora_rank = r > 0`, every projection W named in `lora_targets` gets two adapters beside it: A
(W's input dims x r, uniform in ±1/sqrt(fan-in)) and B (r x W's output dims, zeros, so a new adapter changes nothing),
and computes x·W + (alpha / r)·(x·A)·B. The adapters are applied unmerged, in the learner and the sampler alike: the
learner's gradient never forms a full-size weight gradient, and a sampler keeps one copy of the base weights and
takes new adapters each version (a few MB) instead of the whole model.

The adapters are `nnx.LoRAParam`s (a subclass of `nnx.Param`), so NNX's filters separate them: `split(state)` gives
(adapters, base), `nnx.merge_state` joins them again, and `trainable(cfg)` is the filter of what the learner
differentiates. `merged(state, cfg)` folds the adapters into the base weights (export to HF, a merged sampler).

QLoRA (`cfg.lora_base_quant` "int8" or "nf4", Dettmers et al., 2023): the base projections are stored as `qwix`
QArrays, quantized with one absmax scale per block of `QUANT_BLOCK` inputs (per output channel and layer), and
dequantized where they are used (`dequantized`), one layer at a time inside the layer scan. The model is then the
quantized base plus the adapters, in the learner and the sampler alike: both compute with the same dequantized
values, so the behaviour and the learner's logprobs agree as without quantization, and the adapters learn to
correct the quantization's error. `quantize_base` turns a float base (a warm-start, HF weights) into that form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

from areal_jax.models import weights
from areal_jax.models.config import ModelConfig

ADAPTERS = nnx.LoRAParam
QUANT_BLOCK = 64  # inputs per quantization scale (QLoRA's block size)
# The input axis each projection's blocks run along (its last contracted axis), by logical name.
_BLOCK_AXIS = {"q": "embed", "k": "embed", "v": "embed", "o": "head_dim", "gate": "embed", "up": "embed",
               "down": "mlp"}


def trainable(cfg: ModelConfig):
  """The NNX filter of what the learner trains: the adapters under LoRA, else every parameter."""
  return ADAPTERS if cfg.lora_rank else nnx.Param


def split(state: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(adapters, everything else) of a parameter state; the adapters are empty without LoRA."""
  return nnx.split_state(state, ADAPTERS, ...)


def has_adapters(state) -> bool:
  return bool(jax.tree.leaves(split(state)[0]))


def nbytes(tree) -> int:
  """Bytes of a tree's arrays, 4-bit ones at half a byte per value."""
  return sum(int(np.prod(x.shape)) * jax.dtypes.itemsize_bits(x.dtype) // 8 for x in jax.tree.leaves(tree))


def dequantized(w) -> jax.Array:
  """A weight as a plain array: a QLoRA base's QArray dequantized (in its scale's dtype), anything else as it is."""
  return qwix.dequantize(w) if isinstance(w, qwix.QArray) else w


def _quantize(w: jax.Array, axis: int, qtype: str, stacked: bool) -> qwix.QArray:
  """`w` quantized to `qtype` in blocks of QUANT_BLOCK along `axis` (one scale for the whole axis when it is shorter
  or does not divide), a scale per index of every other axis; layer by layer when `stacked` (memory)."""
  tiles = {axis - stacked: QUANT_BLOCK} if w.shape[axis] % QUANT_BLOCK == 0 else {}
  channels = [i for i in range(w.ndim - stacked) if i != axis - stacked]
  one = lambda x: qwix.quantize(x, qtype, channelwise_axes=channels, tiled_axes=tiles)
  return jax.lax.map(one, w) if stacked else one(w)


def quantize_base(state: nnx.State, cfg: ModelConfig) -> nnx.State:
  """`state` with its float base projections quantized as `cfg.lora_base_quant` says (the state itself when it says
  nothing); adapters, embeddings, norms and biases stay as they are."""
  if not cfg.lora_base_quant:
    return state
  flat = []
  for path, v in nnx.to_flat_state(state):
    if path[-1] in _BLOCK_AXIS and type(v) is nnx.Param and not isinstance(v.get_value(), qwix.QArray):
      names = v.get_metadata()["logical_axes"]
      v = v.replace(_quantize(v.get_value(), names.index(_BLOCK_AXIS[path[-1]]), cfg.lora_base_quant,
                              stacked=names[0] == "layers"))
    flat.append((path, v))
  return nnx.from_flat_state(flat)


def scale(cfg: ModelConfig) -> float:
  return cfg.lora_alpha / cfg.lora_rank


def create(rngs: nnx.Rngs, in_shape: tuple[int, ...], out_shape: tuple[int, ...], in_names, out_names,
           rank: int) -> tuple[nnx.LoRAParam, nnx.LoRAParam]:
  """A (in_shape + (rank,)) and B ((rank,) + out_shape), float32 whatever the base weights' dtype (the adapters
  are the learner's master weights). A is drawn from the "lora" stream of `rngs` (its default stream where it has
  none), so adding adapters leaves the base weights' random init as it was."""
  bound = 1.0 / np.sqrt(np.prod(in_shape))
  a = jax.random.uniform(rngs.lora(), (*in_shape, rank), jnp.float32, -bound, bound)
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


def quantized_onto(state: nnx.State, cfg: ModelConfig, shardings) -> nnx.State:
  """`quantize_base` as one program whose result lands on `shardings`: sharded, layer by layer, never a whole
  model's quantization temporaries on one device."""
  return jax.jit(functools.partial(quantize_base, cfg=cfg), out_shardings=shardings)(state)


def dequantize_base(state: nnx.State) -> nnx.State:
  """`state` with every quantized weight dequantized (the inverse of `quantize_base`, up to its rounding)."""
  return jax.tree.map(dequantized, state, is_leaf=lambda x: isinstance(x, qwix.QArray))


def merged(state: nnx.State, cfg: ModelConfig) -> nnx.State:
  """`state` without adapters, each adapted weight W replaced by W + scale·A·B (in W's dtype) and a quantized base
  dequantized: the weights of a model with `lora_rank=0` (`cfg.without_lora()`) that computes the same function."""
  adapters, base = split(state)
  base = dequantize_base(base)
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
