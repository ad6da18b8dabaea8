"""Model hyperparameters: one frozen record for Qwen2/Qwen2.5, Qwen3, Qwen3-MoE and Llama 3, with HF config.json
conversion."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# HF `architectures[0]` / `model_type` for each family we implement.
FAMILIES = {
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "llama": ("LlamaForCausalLM", "llama"),
}
_ARCH_TO_FAMILY = {arch: fam for fam, (arch, _) in FAMILIES.items()}
ROPE_TYPES = ("default", "linear", "llama3")
ATTENTION_IMPLS = ("auto", "flash", "splash", "pallas_gpu", "dense")  # see models/packed_attention.py
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# The projections LoRA adapters can sit on (models/lora.py); configured as `learner.lora.targets`.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# learner.lora.quantize_base: "" = model.param_dtype; "int8" and "nf4" quantize the base projections (QLoRA).
LORA_QUANT_TYPES = ("int8", "nf4")
LORA_BASE_DTYPES = ("", "bfloat16", *LORA_QUANT_TYPES)
EXPERTS_IMPLS = ("auto", "ragged_dot", "tiled", "megablox")  # see models/moe.py


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  family: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, Any], ...] = ()  # sorted (key, value) pairs of HF rope_scaling; () = none
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int = 32768
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # q/k/v projection biases (Qwen2)
  qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
  # Mixture of experts (Qwen3-MoE, models/moe.py): 0 experts = every layer dense. Layer i is sparse when it is not in
  # mlp_only_layers and (i + 1) % decoder_sparse_step == 0, as in HF.
  num_experts: int = 0
  num_experts_per_tok: int = 0  # top-k
  moe_intermediate_size: int = 0  # each expert's MLP width
  norm_topk_prob: bool = True  # renormalise the k routing weights to sum to 1
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  experts_impl: str = "auto"  # auto (TPU megablox, GPU ragged_dot, CPU tiled) | ragged_dot | tiled | megablox
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  remat: str = "none"  # none | full | dots
  scan_layers: bool = True  # run the decoder layers under lax.scan (False: unrolled; the parameters are stacked alike)
  attention: str = "auto"  # packed training attention: auto | flash | splash | dense (models/packed_attention.py)
  attention_block: int = 0  # tokens per attention block; 0 = flash: 128 on CPU, 512 elsewhere; splash: <= 512 by row
  # LoRA adapters (models/lora.py), set from `learner.lora`: rank 0 = none (every weight trains).
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = LORA_TARGETS
  lora_base_quant: str = ""  # "" | "int8" | "nf4": the frozen base projections stored quantized (models/lora.py)

  def __post_init__(self):
    def bad(field, why):
      raise ValueError(f"model.{field}={getattr(self, field)!r}: {why}")

    if self.family not in FAMILIES:
      bad("family", f"unknown model family; supported: {sorted(FAMILIES)}")
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim"):
      if getattr(self, f) <= 0:
        bad(f, "must be positive")
    if self.num_heads % self.num_kv_heads:
      bad("num_heads", f"must be a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      bad("head_dim", "must be even for rotary embeddings")
    if self.dtype not in DTYPES:
      bad("dtype", f"choose one of {sorted(DTYPES)}")
    if self.param_dtype not in DTYPES:
      bad("param_dtype", f"choose one of {sorted(DTYPES)}")
    if self.remat not in ("none", "full", "dots"):
      bad("remat", "choose one of none, full, dots")
    if self.attention not in ATTENTION_IMPLS:
      bad("attention", f"choose one of {', '.join(ATTENTION_IMPLS)}")
    if self.attention_block < 0:
      bad("attention_block", "must be positive (or 0: chosen by platform)")
    if self.attention == "splash" and self.attention_block % 128:
      bad("attention_block", "the splash kernel's blocks are multiples of 128 tokens (or 0: chosen by row length)")
    if self.rope_type not in ROPE_TYPES:
      bad("rope_scaling", f"rope_type {self.rope_type!r} not supported; supported: {ROPE_TYPES}")
    if self.num_experts:
      self._check_moe(bad)
    if self.lora_rank:
      self._check_lora()

  def _check_moe(self, bad):
    if self.num_experts < 0:
      bad("num_experts", "must be >= 0 (0 = a dense model)")
    if self.family != "qwen3_moe":
      bad("num_experts", f"experts need family 'qwen3_moe', not {self.family!r}")
    if not 0 < self.num_experts_per_tok <= self.num_experts:
      bad("num_experts_per_tok", f"must be between 1 and num_experts={self.num_experts}")
    if self.moe_intermediate_size <= 0:
      bad("moe_intermediate_size", "must be positive")
    if self.decoder_sparse_step <= 0:
      bad("decoder_sparse_step", "must be positive")
    if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
      bad("mlp_only_layers", f"layer indices must lie in [0, num_layers={self.num_layers})")
    if self.experts_impl not in EXPERTS_IMPLS:
      bad("experts_impl", f"choose one of {', '.join(EXPERTS_IMPLS)}")

  def sparse_layers(self) -> tuple[bool, ...]:
    """Whether each decoder layer's feed-forward is a mixture of experts (HF's rule)."""
    return tuple(bool(self.num_experts) and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                 for i in range(self.num_layers))

  def layer_groups(self) -> dict[str, tuple[int, ...]]:
    """Stacked parameter group -> the decoder layers it holds, in order: `layers` holds every layer of a uniform model
    (all dense or all sparse); a mixed one keeps its sparse layers in `layers` and its dense ones in `dense_layers`."""
    sparse = self.sparse_layers()
    if all(sparse) or not any(sparse):
      return {"layers": tuple(range(self.num_layers))}
    return {"layers": tuple(i for i, s in enumerate(sparse) if s),
            "dense_layers": tuple(i for i, s in enumerate(sparse) if not s)}

  def lora_shapes(self) -> dict[str, tuple[int, int]]:
    """(input, output) width of each projection LoRA can adapt."""
    d, f = self.hidden_size, self.intermediate_size
    q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, f), "up": (d, f), "down": (f, d)}

  def _check_lora(self):
    def bad(field, value, why):
      raise ValueError(f"learner.lora.{field}={value!r}: {why}")

    if self.lora_rank < 0:
      bad("rank", self.lora_rank, "must be >= 0 (0 = no adapters)")
    if not self.lora_targets:
      bad("targets", list(self.lora_targets), f"names no projection; choose from {list(LORA_TARGETS)}")
    unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
    if unknown:
      bad("targets", list(self.lora_targets), f"{unknown} name no projection; choose from {list(LORA_TARGETS)}")
    if self.lora_alpha <= 0:
      bad("alpha", self.lora_alpha, "must be positive")
    if self.num_experts and {"gate", "up", "down"} & set(self.lora_targets):
      bad("targets", list(self.lora_targets), "a mixture-of-experts model's MLPs take no adapters; choose from "
          "q, k, v, o")
    if self.lora_base_quant not in ("", *LORA_QUANT_TYPES):
      bad("quantize_base", self.lora_base_quant, f"choose one of {['', *LORA_QUANT_TYPES]}")
    shapes = self.lora_shapes()
    for t in self.lora_targets:
      if self.lora_rank > min(shapes[t]):
        bad("rank", self.lora_rank, f"exceeds the {t} projection's {min(shapes[t])} (its shape {shapes[t]}): "
            "an adapter of that rank is no low-rank update")

  @property
  def rope(self) -> dict[str, Any]:
    return dict(self.rope_scaling)

  @property
  def rope_type(self) -> str:
    return self.rope.get("rope_type", self.rope.get("type", "default")) or "default"

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def weight_dtype(self):
    return DTYPES[self.param_dtype]

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)

  def without_lora(self) -> ModelConfig:
    """The config of the plain model this one's weights merge into (`lora.merged`): no adapters, a float base."""
    return self.replace(lora_rank=0, lora_base_quant="")

  def with_lora(self, c) -> ModelConfig:
    """This config with the adapters of a `learner.lora` config group (rank 0: none)."""
    if c.dropout:
      raise ValueError(f"learner.lora.dropout={c.dropout!r}: must be 0; a random mask in the learner's forward would "
                       "make its logprobs noisy against the proximal and behaviour logprobs the ratios compare")
    if c.quantize_base not in LORA_BASE_DTYPES:
      raise ValueError(f"learner.lora.quantize_base={c.quantize_base!r}: choose one of {LORA_BASE_DTYPES}")
    if c.quantize_base and not c.rank:
      raise ValueError(f"learner.lora.quantize_base={c.quantize_base!r}: needs learner.lora.rank > 0 (only a LoRA "
                       "run's base is frozen)")
    if not c.rank:
      return self.without_lora()
    targets = tuple(t.strip() for t in c.targets.split(",") if t.strip())
    out = self.replace(lora_rank=c.rank, lora_alpha=float(c.alpha), lora_targets=targets,
                       lora_base_quant=c.quantize_base if c.quantize_base in LORA_QUANT_TYPES else "")
    return out.replace(param_dtype="bfloat16") if c.quantize_base == "bfloat16" else out

  @classmethod
  def from_config(cls, c) -> ModelConfig:
    """From the `model` group of an ml_collections config."""
    rope = {}
    if c.rope_scaling.rope_type:
      rope = dict(c.rope_scaling)
    names = {f.name for f in dataclasses.fields(cls)} - {"lora_rank", "lora_alpha", "lora_targets", "lora_base_quant"}
    kw = {k: v for k, v in c.items() if k in names and k not in ("rope_scaling", "mlp_only_layers")}
    return cls(rope_scaling=tuple(sorted(rope.items())), mlp_only_layers=tuple(c.get("mlp_only_layers", ())), **kw)

  @classmethod
  def from_hf(cls, hf: dict[str, Any], *, source: str = "config.json", **overrides) -> ModelConfig:
    """From a HF `config.json` dict. `source` names the file in error messages."""
    archs = hf.get("architectures") or []
    family = next((_ARCH_TO_FAMILY[a] for a in archs if a in _ARCH_TO_FAMILY), None)
    if family is None:
      family = hf.get("model_type") if hf.get("model_type") in FAMILIES else None
    if family is None:
      raise ValueError(
          f"{source}: unsupported architecture {archs or hf.get('model_type')!r}; supported: "
          f"{sorted(_ARCH_TO_FAMILY)}")
    try:
      num_heads = hf["num_attention_heads"]
      rope = hf.get("rope_scaling") or {}
      if rope and "rope_theta" in rope:  # transformers 5 keeps rope_theta inside rope_parameters
        rope = {k: v for k, v in rope.items() if k != "rope_theta"}
      rope_params = hf.get("rope_parameters") or {}
      theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
      if not rope and rope_params.get("rope_type", "default") != "default":
        rope = {k: v for k, v in rope_params.items() if k != "rope_theta"}
      if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = {}
      kw = dict(
          family=family,
          vocab_size=hf["vocab_size"],
          hidden_size=hf["hidden_size"],
          intermediate_size=hf["intermediate_size"],
          num_layers=hf["num_hidden_layers"],
          num_heads=num_heads,
          num_kv_heads=hf.get("num_key_value_heads") or num_heads,
          head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
          rope_theta=float(theta),
          rope_scaling=tuple(sorted(rope.items())),
          rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
          max_position_embeddings=hf.get("max_position_embeddings", 32768),
          tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
          attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
          qk_norm=family in ("qwen3", "qwen3_moe"),
      )
      if family == "qwen3_moe":
        kw.update(num_experts=hf.get("num_experts", hf.get("num_local_experts")),
                  num_experts_per_tok=hf["num_experts_per_tok"], moe_intermediate_size=hf["moe_intermediate_size"],
                  norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                  decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                  mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))
    except KeyError as e:
      raise ValueError(f"{source}: missing field {e.args[0]!r}") from None
    if hf.get("mlp_bias"):
      raise ValueError(f"{source}: mlp_bias=true is not supported")
    kw.update(overrides)
    return cls(**kw)

  def to_hf(self) -> dict[str, Any]:
    """A HF `config.json` dict that `transformers` loads into the matching *ForCausalLM."""
    arch, model_type = FAMILIES[self.family]
    hf = dict(
        architectures=[arch],
        model_type=model_type,
        vocab_size=self.vocab_size,
        hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size,
        num_hidden_layers=self.num_layers,
        num_attention_heads=self.num_heads,
        num_key_value_heads=self.num_kv_heads,
        head_dim=self.head_dim,
        hidden_act="silu",
        rope_theta=self.rope_theta,
        rope_scaling=dict(self.rope_scaling) or None,
        rms_norm_eps=self.rms_norm_eps,
        max_position_embeddings=self.max_position_embeddings,
        tie_word_embeddings=self.tie_word_embeddings,
        torch_dtype=self.param_dtype,
        use_cache=True,
    )
    if self.family == "llama":
      hf.update(attention_bias=self.attention_bias, mlp_bias=False)
    if self.family in ("qwen3", "qwen3_moe"):
      hf.update(attention_bias=False)
    if self.family == "qwen3_moe":
      hf.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=0.001, output_router_logits=False)
    if self.family in ("qwen2", "qwen3", "qwen3_moe"):
      hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers)
    return hf

  def num_params(self, *, active: bool = False) -> int:
    """Parameters in all; `active`: those one token uses (its k experts of each sparse layer's E)."""
    d, f, h, k, hd = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
    attn = d * hd * (h + 2 * k) + h * hd * d + (hd * (h + 2 * k) if self.attention_bias else 0)
    attn += 2 * hd if self.qk_norm else 0
    experts = self.num_experts_per_tok if active else self.num_experts
    sparse = sum(self.sparse_layers())
    ffn = (self.num_layers - sparse) * 3 * d * f + sparse * (d * self.num_experts + experts * 3 * d *
                                                              self.moe_intermediate_size)
    emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
    return self.num_layers * (attn + 2 * d) + ffn + emb + d

  def flops_per_token(self, seq_len: int) -> float:
    """Forward FLOPs per token (matmuls + attention scores; a sparse layer's k experts), for MFU. Training is 3x."""
    d, h, hd = self.hidden_size, self.num_heads, self.head_dim
    # 2 FLOPs per weight; the embedding lookup is a gather, the (possibly tied) output head a matmul.
    dense = 2 * self.num_params(active=True) - (0 if self.tie_word_embeddings else 2 * self.vocab_size * d)
    attn = 2 * 2 * self.num_layers * h * hd * seq_len / 2  # causal: half of q.k and p.v on average
    return float(dense + attn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSource:
  """Where a run's model comes from: the `model` group's fields beside the architecture (`ModelConfig`)."""

  init_from: str = ""  # HF or Orbax directory; "" = the random init (warm-started when `warmstart.steps` > 0)
  tokenizer: str = "char"  # "char" or a path
  param_dtype: str = "float32"  # the base weights' dtype as loaded (before `learner.lora.quantize_base`)
  # A real-size model may train from random weights or with the char tokenizer (`config.validate` refuses them
  # otherwise). Out of the repr, which keys shared warm-starts (`run/initial_weights.py`): it decides no weights.
  allow_random_init: bool = dataclasses.field(default=False, repr=False)

  @classmethod
  def from_config(cls, c) -> ModelSource:
    """From the `model` group of an ml_collections config (one saved before `allow_random_init` existed too)."""
    return cls(init_from=str(c.init_from), tokenizer=str(c.tokenizer), param_dtype=c.param_dtype,
               allow_random_init=bool(c.get("allow_random_init", False)))
