"""Exact import/export of HF checkpoints (config.json + safetensors, single file or sharded with an index)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors import numpy as safetensors_numpy
from safetensors.flax import save_file

from areal_jax import sharding as shd
from areal_jax.models import lora
from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import Transformer

# HF tensors we ignore on import (buffers, not parameters).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _param_map(cfg: ModelConfig) -> Iterator[tuple[tuple, list, Callable, Callable]]:
  """(our state path, HF names, hf→ours, ours→hf) for every parameter. A decoder-layer parameter is stacked along
  a leading layers axis: its HF names are those of each layer of its group (`cfg.layer_groups`), and the converters act
  on one layer. An expert weight's name per layer is a tuple, one per expert (stacked along a leading experts axis)."""
  h, k, hd, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
  ident = lambda x: x
  t = lambda x: x.T
  experts_t = lambda x: jnp.swapaxes(x, -1, -2)  # HF [E, out, in] <-> ours [E, in, out]

  def heads_in(n):  # HF [n*hd, d] <-> ours [d, n, hd]
    return (lambda x: x.T.reshape(d, n, hd)), (lambda x: x.reshape(d, n * hd).T)

  def bias(n):  # HF [n*hd] <-> ours [n, hd]
    return (lambda x: x.reshape(n, hd)), (lambda x: x.reshape(n * hd))

  yield ("embed",), ["model.embed_tokens.weight"], ident, ident
  for group, indices in cfg.layer_groups().items():
    layers = lambda name: [f"model.layers.{i}.{name}" for i in indices]  # pylint: disable=cell-var-from-loop
    yield (group, "attn_norm", "scale"), layers("input_layernorm.weight"), ident, ident
    yield (group, "mlp_norm", "scale"), layers("post_attention_layernorm.weight"), ident, ident
    for name, n in (("q", h), ("k", k), ("v", k)):
      yield (group, "attn", name), layers(f"self_attn.{name}_proj.weight"), *heads_in(n)
      if cfg.attention_bias:
        yield (group, "attn", f"{name}_bias"), layers(f"self_attn.{name}_proj.bias"), *bias(n)
    yield ((group, "attn", "o"), layers("self_attn.o_proj.weight"),
           lambda x: x.T.reshape(h, hd, d), lambda x: x.reshape(h * hd, d).T)
    if cfg.qk_norm:
      yield (group, "attn", "q_norm", "scale"), layers("self_attn.q_norm.weight"), ident, ident
      yield (group, "attn", "k_norm", "scale"), layers("self_attn.k_norm.weight"), ident, ident
    sparse = cfg.sparse_layers()[indices[0]]
    if sparse:
      yield (group, "mlp", "router"), layers("mlp.gate.weight"), t, t
    for name in ("gate", "up", "down"):
      if sparse:
        names = [tuple(f"{n}.experts.{e}.{name}_proj.weight" for e in range(cfg.num_experts))
                 for n in layers("mlp")]
        yield (group, "mlp", name), names, experts_t, experts_t
      else:
        yield (group, "mlp", name), layers(f"mlp.{name}_proj.weight"), t, t
  yield ("final_norm", "scale"), ["model.norm.weight"], ident, ident
  if not cfg.tie_word_embeddings:
    yield ("lm_head",), ["lm_head.weight"], t, t


_STACKED = ("layers", "dense_layers")


def _tensor_files(path: str) -> dict[str, str]:
  """HF tensor name → safetensors file, from the index or the single file."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(path, fname) for name, fname in weight_map.items()}
  single = os.path.join(path, "model.safetensors")
  if not os.path.exists(single):
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
  with safe_open(single, framework="flax") as f:
    return {name: single for name in f.keys()}


def _abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))


def read_config(path: str, **overrides) -> ModelConfig:
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f"{path}: no config.json (not a HF model directory)")
  with open(cfg_path) as f:
    return ModelConfig.from_hf(json.load(f), source=cfg_path, **overrides)


def load_hf(path: str, dtype=jnp.float32, *, param_dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None,
            rules: shd.Rules = shd.LEARNER_RULES) -> Transformer:
  """Reads a local HF model directory into an NNX `Transformer` with compute `dtype` and `param_dtype` parameters.

  With `mesh`, each parameter is placed straight onto its sharding (logical `rules`) as it is read.
  """
  cfg = read_config(path, dtype=jnp.dtype(dtype).name, param_dtype=jnp.dtype(param_dtype).name)
  graphdef, state = _abstract_model(cfg)
  files = _tensor_files(path)
  flat = dict(nnx.to_flat_state(state))
  used = set()
  with contextlib.ExitStack() as stack:
    handles = {}

    def tensor(hf_name: str):
      if hf_name not in files:
        raise ValueError(f"{path}: tensor {hf_name!r} is missing (architecture {cfg.family})")
      fname = files[hf_name]
      if fname not in handles:
        handles[fname] = stack.enter_context(safe_open(fname, framework="flax"))
      used.add(hf_name)
      return handles[fname].get_tensor(hf_name)

    def read(hf_name: str | tuple[str, ...], shape: tuple[int, ...], to_ours: Callable, our_name: str) -> np.ndarray:
      raw = jnp.stack([tensor(n) for n in hf_name]) if isinstance(hf_name, tuple) else tensor(hf_name)
      fname = files[hf_name[0] if isinstance(hf_name, tuple) else hf_name]
      try:
        value = to_ours(raw)
      except (ValueError, TypeError):
        value = None
      if value is None or value.shape != shape:
        raise ValueError(f"{path}: tensor {hf_name!r} in {os.path.basename(fname)} has shape {tuple(raw.shape)}, "
                         f"which does not fit parameter {our_name} of shape {shape} ({cfg.family}, hidden_size "
                         f"{cfg.hidden_size})")
      return np.asarray(jax.device_get(value.astype(param_dtype)))

    for our_path, hf_names, to_ours, _ in _param_map(cfg):
      var = flat[our_path]
      shape, name = var.get_value().shape, ".".join(map(str, our_path))
      if our_path[0] in _STACKED:
        value = np.stack([read(n, shape[1:], to_ours, f"{name}[{i}]") for i, n in enumerate(hf_names)])
      else:
        value = read(hf_names[0], shape, to_ours, name)
      if mesh is not None:
        names = var.get_metadata()["logical_axes"]
        value = jax.device_put(value, jax.sharding.NamedSharding(mesh, shd.spec(value.shape, names, mesh, rules)))
      var.set_value(jnp.asarray(value))
  extra = [n for n in files if n not in used and not n.endswith(_IGNORED_SUFFIXES)
           and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
  if extra:
    logging.warning("%s: ignoring %d unexpected tensors, e.g. %s", path, len(extra), extra[:5])
  return nnx.merge(graphdef, state)


# Our LoRA targets as HF module names (PEFT's `target_modules`).
_HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def save_hf(model: Transformer, path: str, *, dtype=None) -> None:
  """Writes `config.json` and `model.safetensors` that `transformers.AutoModelForCausalLM` loads; LoRA adapters are
  merged into the weights they adapt (`lora.merged`; `save_peft` writes them apart)."""
  cfg = model.cfg
  os.makedirs(path, exist_ok=True)
  flat = dict(nnx.to_flat_state(lora.merged(nnx.state(model, nnx.Param), cfg)))
  tensors = {}
  for our_path, hf_names, _, to_hf in _param_map(cfg):
    value = jnp.asarray(jax.device_get(flat[our_path].get_value()))
    if dtype is not None:
      value = value.astype(dtype)
    for names, x in zip(hf_names, value if our_path[0] in _STACKED else [value]):
      x = to_hf(x)
      tensors.update(zip(names, x) if isinstance(names, tuple) else [(names, x)])
  hf_cfg = cfg.to_hf()
  if dtype is not None:
    hf_cfg["torch_dtype"] = jnp.dtype(dtype).name
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=2)


def save_peft(model: Transformer, path: str, *, base_model: str = "") -> None:
  """Writes a LoRA model's adapters as a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`)
  that `peft.PeftModel.from_pretrained(hf_base_model, path)` loads onto the base (`base_model` names it)."""
  cfg = model.cfg
  if not cfg.lora_rank:
    raise ValueError("save_peft: the model has no LoRA adapters (learner.lora.rank=0)")
  if cfg.lora_base_quant:
    logging.warning("save_peft: these adapters were trained on a %s-quantized base; on the float base %r they compute "
                    "a slightly different function (save_hf merges them into the base they were trained on)",
                    cfg.lora_base_quant, base_model)
  os.makedirs(path, exist_ok=True)
  adapters, _ = lora.split(nnx.state(model, nnx.Param))
  flat = {(path_[0], path_[-1]): np.asarray(jax.device_get(v.get_value()), np.float32)
          for path_, v in nnx.to_flat_state(adapters)}
  tensors = {}
  for group, indices in cfg.layer_groups().items():
    for target in cfg.lora_targets:
      a, b = flat[group, f"{target}_lora_a"], flat[group, f"{target}_lora_b"]  # [layers, in..., r], [layers, r, out...]
      for j, i in enumerate(indices):
        name = f"base_model.model.model.layers.{i}.{_HF_MODULES[target]}"
        tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[j].reshape(-1, cfg.lora_rank).T)  # [r, in]
        tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[j].reshape(cfg.lora_rank, -1).T)  # [out, r]
  safetensors_numpy.save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "target_modules": sorted(_HF_MODULES[t].split(".")[1] for t in cfg.lora_targets),
            "base_model_name_or_path": base_model}
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=2)
