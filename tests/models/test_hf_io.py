"""The NNX transformer against HF transformers (PyTorch, fp32) on tiny random configs of each family."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from areal_jax.models import ModelConfig, create, load_hf, save_hf

TOL = 1e-4


def _hf_config(kind: str):
  common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
  if kind == "qwen2_tied":
    return transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
  if kind == "qwen2_untied":
    return transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e4)
  if kind == "qwen3":
    return transformers.Qwen3Config(**common, head_dim=24, tie_word_embeddings=True, rope_theta=1e6)
  if kind == "llama3":
    return transformers.LlamaConfig(
        **common, tie_word_embeddings=False, rope_theta=5e5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32})
  raise ValueError(kind)


def _random_hf_model(kind: str, path: str):
  """Saves a HF model with every parameter random (biases and norm scales too, so none is trivially checked)."""
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind), attn_implementation="eager")
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.1 * torch.randn_like(p))
  model.eval()
  model.save_pretrained(path)
  return model


def _hf_logits(model, tokens: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
  with torch.no_grad():
    kw = {} if positions is None else {"position_ids": torch.tensor(positions)}
    return model(torch.tensor(tokens), **kw).logits.float().numpy()


FAMILIES = ["qwen2_tied", "qwen2_untied", "qwen3", "llama3"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_logits_match_transformers(kind, tmp_path):
  hf = _random_hf_model(kind, str(tmp_path))
  model = load_hf(str(tmp_path))
  tokens = np.random.default_rng(1).integers(0, 97, size=(2, 40)).astype(np.int32)
  ours = np.asarray(model(jnp.asarray(tokens)))
  np.testing.assert_allclose(ours, _hf_logits(hf, tokens), atol=TOL, rtol=0)
  # Positions well past original_max_position_embeddings exercise the long-context rope scaling.
  pos = np.broadcast_to(np.arange(100, 140), tokens.shape).astype(np.int32)
  ours = np.asarray(model(jnp.asarray(tokens), positions=jnp.asarray(pos)))
  np.testing.assert_allclose(ours, _hf_logits(hf, tokens, pos), atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["qwen3", "llama3"])
def test_packed_segments_match_transformers_per_segment(kind, tmp_path):
  """Three sequences packed in one row (plus padding) equal HF run on each sequence alone."""
  hf = _random_hf_model(kind, str(tmp_path))
  model = load_hf(str(tmp_path))
  rng = np.random.default_rng(2)
  lengths = [11, 17, 6]
  seqs = [rng.integers(0, 97, size=n).astype(np.int32) for n in lengths]
  pad = 4
  tokens = np.concatenate(seqs + [np.zeros(pad, np.int32)])[None]
  positions = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(pad, int)])[None].astype(np.int32)
  segment_ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(pad, int)])
  segment_ids = segment_ids[None].astype(np.int32)
  ours = np.asarray(model(jnp.asarray(tokens), positions=jnp.asarray(positions),
                          segment_ids=jnp.asarray(segment_ids)))[0]
  assert np.isfinite(ours).all()
  start = 0
  for s in seqs:
    ref = _hf_logits(hf, s[None])[0]
    np.testing.assert_allclose(ours[start:start + len(s)], ref, atol=TOL, rtol=0)
    start += len(s)


def test_packed_forward_equals_separate_forward():
  """Packing is exact without any reference implementation: each segment equals its own unpacked forward."""
  cfg = ModelConfig(family="qwen2", vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=1, head_dim=8, attention_bias=True, tie_word_embeddings=False)
  model = create(cfg, seed=3)
  rng = np.random.default_rng(0)
  lengths = [5, 9, 3, 7]
  seqs = [rng.integers(0, 50, size=n).astype(np.int32) for n in lengths]
  tokens = jnp.asarray(np.concatenate(seqs)[None])
  positions = jnp.asarray(np.concatenate([np.arange(n) for n in lengths])[None].astype(np.int32))
  segment_ids = jnp.asarray(np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None].astype(np.int32))
  packed = np.asarray(model(tokens, positions=positions, segment_ids=segment_ids))[0]
  start = 0
  for s in seqs:
    alone = np.asarray(model(jnp.asarray(s[None])))[0]
    np.testing.assert_allclose(packed[start:start + len(s)], alone, atol=1e-5, rtol=0)
    start += len(s)


@pytest.mark.parametrize("kind", ["qwen2_tied", "qwen3", "llama3"])
def test_load_save_roundtrip_through_transformers(kind, tmp_path):
  hf = _random_hf_model(kind, str(tmp_path / "orig"))
  model = load_hf(str(tmp_path / "orig"))
  save_hf(model, str(tmp_path / "export"))
  hf2 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), attn_implementation="eager")
  assert type(hf2) is type(hf)
  tokens = np.random.default_rng(3).integers(0, 97, size=(1, 24)).astype(np.int32)
  np.testing.assert_allclose(_hf_logits(hf2, tokens), _hf_logits(hf, tokens), atol=1e-6, rtol=0)


def test_random_init_exports_to_transformers(tmp_path):
  cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, tie_word_embeddings=True,
                    rope_scaling=(("factor", 4.0), ("rope_type", "linear")))
  model = create(cfg, seed=0)
  save_hf(model, str(tmp_path))
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
  tokens = np.arange(30, dtype=np.int32)[None] % 64
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), _hf_logits(hf, tokens), atol=TOL, rtol=0)


def test_bfloat16_compute_close_to_float32(tmp_path):
  _random_hf_model("qwen2_tied", str(tmp_path))
  f32 = load_hf(str(tmp_path))
  bf16 = load_hf(str(tmp_path), dtype=jnp.bfloat16)
  assert jax.tree.leaves(bf16)[0].dtype == jnp.float32  # parameters stay fp32
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 97, size=(1, 16)).astype(np.int32))
  a, b = np.asarray(f32(tokens)), np.asarray(bf16(tokens))
  assert b.dtype == np.float32
  assert np.abs(a - b).max() < 0.1 * np.abs(a).max()


def test_errors_name_the_tensor(tmp_path):
  _random_hf_model("qwen2_untied", str(tmp_path))
  from safetensors.numpy import load_file, save_file
  tensors = load_file(str(tmp_path / "model.safetensors"))
  broken = dict(tensors)
  del broken["model.layers.1.mlp.up_proj.weight"]
  save_file(broken, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
    load_hf(str(tmp_path))
  broken = dict(tensors)
  broken["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
  save_file(broken, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"k_proj\.weight.*shape \(8, 64\)"):
    load_hf(str(tmp_path))
  with open(tmp_path / "config.json") as f:
    cfg = json.load(f)
  cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
  with open(tmp_path / "config.json", "w") as f:
    json.dump(cfg, f)
  with pytest.raises(ValueError, match="MistralForCausalLM"):
    load_hf(str(tmp_path))


def test_sharded_index_and_mesh_placement(tmp_path):
  """A checkpoint split over several safetensors files with an index loads onto a fsdp x tensor mesh."""
  hf = _random_hf_model("qwen3", str(tmp_path))
  hf.save_pretrained(str(tmp_path), max_shard_size="20KB")
  assert os.path.exists(tmp_path / "model.safetensors.index.json")
  from areal_jax import sharding as shd
  mesh = shd.make_mesh(jax.devices(), {"fsdp": 4, "tensor": 2})
  model = load_hf(str(tmp_path), mesh=mesh)
  q = model.layers.attn.q[...]  # [layers, embed, heads, head_dim]
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  tokens = np.random.default_rng(5).integers(0, 97, size=(1, 12)).astype(np.int32)
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), _hf_logits(hf, tokens), atol=TOL, rtol=0)
