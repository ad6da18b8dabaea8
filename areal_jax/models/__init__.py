"""One decoder-only transformer (Qwen2/Qwen2.5, Qwen3, Llama 3) with exact HF import/export."""

from areal_jax.models.config import ModelConfig
from areal_jax.models.hf_io import load_hf, read_config, save_hf
from areal_jax.models.transformer import Transformer, create

__all__ = ["ModelConfig", "Transformer", "create", "load_hf", "read_config", "save_hf"]
