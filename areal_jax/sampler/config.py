"""The sampler's settings as one frozen, validated record (from the config's `sampler` group)."""

from __future__ import annotations

import dataclasses

from areal_jax.models.config import DTYPES
from areal_jax.sampler.requests import SamplingParams

ATTENTION_IMPLS = ("auto", "jax", "pallas_tpu", "pallas_gpu")
SPECULATION = ("off", "suffix")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerConfig:
  """Field meanings as in configs/math.py.

  `num_pages` counts pages over the whole mesh (split evenly between the data shards; one page per shard is reserved
  as the scratch page that idle slots write to); 0 sizes the pool from `memory_fraction` of free device memory.

  `param_dtype` is the dtype the sampler holds its weights in (the learner keeps its own, float32 master weights):
  bfloat16 halves the weights' memory (more room for the KV pool) and the bytes of every weight update, at the price
  of behaviour logprobs that differ slightly from the learner's (measured each step as `sampler/logprob_gap`).
  """

  num_slots: int = 64
  page_size: int = 16
  num_pages: int = 0
  memory_fraction: float = 0.8
  max_seq_len: int = 2048
  max_new_tokens: int = 1024
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  attention: str = "auto"
  min_prefill_len: int = 16  # smallest prefill bucket; buckets double up to max_seq_len
  max_prefill_tokens: int = 0  # rows x bucket length of one batched prefill per data shard; 0 = max(8192, max_seq_len)
  # Tokens per block of the pure-JAX paged attention loop (rounded to whole pages); 0 = 32 on CPU (measured fastest
  # there, 2-4x faster than 256 at 40-400 token contexts), 256 elsewhere (fewer loop iterations on GPU).
  attention_block: int = 0
  decode_steps: int = 8  # decode steps per device call (the host reads tokens and admits new answers between calls)
  # Keep the full pages of released sequences (`prefix_cache.py`) and prefill a prompt after the ones that hold its
  # first tokens. Cached keys/values come from decode steps, not one prefill: logprobs may differ by float rounding.
  prefix_cache: bool = False
  param_dtype: str = "float32"  # float32 | bfloat16
  # Ids at or above this are never drawn: a model vocabulary padded beyond its tokenizer's (Qwen2.5: 151936 rows,
  # 151665 tokens) would otherwise sample ids that decode to nothing. 0 = every id of the model.
  vocab_limit: int = 0
  # A weight swap recomputes the keys/values of the answers running (AReaL's interruptible generation); False keeps
  # the ones the old weights computed (as PipelineRL does): no stall at a swap, tokens drawn over a stale cache.
  recompute_on_swap: bool = True
  # Compile every program the scheduler can call (each prefill bucket and row count, decode) before generating: no
  # compile stalls mid-run, a longer start (`Engine.warmup`).
  warmup: bool = False
  # Dispatch each decode call before reading the previous one's tokens, so that the host's bookkeeping runs while
  # the device decodes (`scheduler.py`); False reads each call before the next (one call sooner, nothing hidden).
  overlap: bool = True
  # Speculative decoding (`drafts.py`, `sampling.verify`): "suffix" drafts up to `spec_tokens` tokens per answer and
  # step from the rollouts already drawn (the answer's own context, the finished answers to the same prompt, recent
  # answers) and verifies them exactly in one forward over spec_tokens + 1 positions; "off": one token per step.
  speculation: str = "off"
  spec_tokens: int = 4
  # Record a mixture of experts' routing of every position (`Trajectory.routes`), for the learner's routing replay;
  # not a config key: set by `learner.routing_replay`.
  record_routes: bool = False

  def __post_init__(self):
    def bad(field, why):
      raise ValueError(f"sampler.{field}={getattr(self, field)!r}: {why}")

    for f in ("num_slots", "page_size", "max_seq_len", "max_new_tokens", "min_prefill_len", "decode_steps"):
      if getattr(self, f) <= 0:
        bad(f, "must be positive")
    if self.vocab_limit < 0:
      bad("vocab_limit", "must be >= 0 (0 = every id of the model)")
    if self.attention_block < 0:
      bad("attention_block", "must be >= 0 (0 = by platform)")
    if self.num_pages < 0:
      bad("num_pages", "must be >= 0 (0 = fill memory_fraction of free device memory)")
    if not 0 < self.memory_fraction <= 1:
      bad("memory_fraction", "must lie in (0, 1]")
    if self.temperature < 0:
      bad("temperature", "must be >= 0 (0 = greedy)")
    if not 0 < self.top_p <= 1:
      bad("top_p", "must lie in (0, 1]")
    if self.top_k == 0 or self.top_k < -1:
      bad("top_k", "must be positive or -1 (off)")
    if self.attention not in ATTENTION_IMPLS:
      bad("attention", f"choose one of {ATTENTION_IMPLS}")
    if self.param_dtype not in DTYPES:
      bad("param_dtype", f"choose one of {tuple(DTYPES)}")
    if self.speculation not in SPECULATION:
      bad("speculation", f"choose one of {SPECULATION}")
    if self.spec_tokens <= 0:
      bad("spec_tokens", "must be positive")
    if self.speculation != "off" and self.record_routes:
      bad("speculation", "cannot record a mixture of experts' routes (learner.routing_replay) yet")
    if self.max_prefill_tokens and self.max_prefill_tokens < self.pages_per_seq * self.page_size:
      bad("max_prefill_tokens", f"must hold one sequence of max_seq_len={self.max_seq_len} (rounded up to pages)")

  @property
  def prefill_budget(self) -> int:
    """Tokens (rows x padded length) one batched prefill may hold on each data shard."""
    return self.max_prefill_tokens or max(8192, self.pages_per_seq * self.page_size)

  @property
  def draft_width(self) -> int:
    """Draft tokens the scheduler gives each slot per call: what one call can verify (decode_steps tokens), after the
    decode_steps a call still in flight may draw, plus spec_tokens."""
    return 2 * self.decode_steps + self.spec_tokens

  @property
  def weight_dtype(self):
    """`param_dtype` as a JAX dtype."""
    return DTYPES[self.param_dtype]

  @property
  def pages_per_seq(self) -> int:
    return -(-self.max_seq_len // self.page_size)

  def sampling(self, *, seed: int = 0) -> SamplingParams:
    """The run's sampling parameters: temperature, top-p, top-k and answer length from this config."""
    return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                          max_new_tokens=self.max_new_tokens, seed=seed)

  def for_tokenizer(self, vocab_size: int) -> SamplerConfig:
    """This config drawing only ids below a tokenizer's `vocab_size`, unless `vocab_limit` is set already."""
    return self if self.vocab_limit else self.replace(vocab_limit=vocab_size)

  def replace(self, **kw) -> SamplerConfig:
    return dataclasses.replace(self, **kw)

  @classmethod
  def from_config(cls, c, *, record_routes: bool = False) -> SamplerConfig:
    """From the `sampler` group of an ml_collections config; unknown keys raise."""
    names = {f.name for f in dataclasses.fields(cls)} - {"record_routes"}
    unknown = set(c.keys()) - names
    if unknown:
      raise ValueError(f"unknown sampler config keys {sorted(unknown)}; known: {sorted(names)}")
    return cls(**dict(c), record_routes=record_routes)
