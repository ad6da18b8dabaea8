"""`generate(model, prompts, ...)`: batch generation for users and evaluation, on the continuous-batching engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.requests import Request, SamplingParams
from areal_jax.sampler.sampler import Sampler


@dataclasses.dataclass(frozen=True, kw_only=True)
class Completion:
  tokens: np.ndarray  # int32 [R] generated ids (EOS / stop tokens included)
  logprobs: np.ndarray  # float32 [R] under the temperature-scaled distribution
  versions: np.ndarray  # int32 [R] policy version of each token
  finish_reason: str  # "eos" | "stop" | "length"


def generate(model: nnx.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = -1, n: int = 1, seed: int = 0, eos_ids: Sequence[int] = (),
             stop: Sequence[Sequence[int]] = (), num_slots: int = 64, page_size: int = 16,
             mesh: Mesh | None = None, version: int = 0, decode_steps: int = 8) -> list[list[Completion]]:
  """For each prompt (token ids), n completions. Answer i of prompt j is drawn with PRNG key (seed, j, i), so
  results do not depend on batching. The cache holds every slot at full length (lower `num_slots` to save memory);
  engines of equal shapes share compiled programs, so repeated calls (evaluation) compile once."""
  prompts = [np.asarray(p, np.int32) for p in prompts]
  if not prompts:
    return []
  need = max(map(len, prompts)) + max_new_tokens
  max_seq_len = max(need, min(1 << (need - 1).bit_length(), model.cfg.max_position_embeddings))  # few shapes
  slots = min(num_slots, 1 << (len(prompts) * n - 1).bit_length())
  data = 1 if mesh is None else mesh.shape["data"]
  slots = -(-slots // data) * data
  pages_per_seq = -(-max_seq_len // page_size)
  cfg = SamplerConfig(num_slots=slots, page_size=page_size, num_pages=data * (slots // data * pages_per_seq + 1),
                      max_seq_len=max_seq_len, max_new_tokens=max_new_tokens, decode_steps=decode_steps)
  engine = Engine(model=model, config=cfg, mesh=mesh)
  sampler = Sampler(engine=engine, params=engine.load_params(model), version=version, eos_ids=eos_ids)
  sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                            stop=tuple(tuple(int(t) for t in s) for s in stop), seed=seed)
  answers = sampler.run([Request(group_id=j, prompt_ids=p, num_answers=n, sampling=sampling)
                        for j, p in enumerate(prompts)])
  return [[Completion(tokens=np.asarray(seq.tokens, np.int32), logprobs=np.asarray(seq.logprobs, np.float32),
                      versions=np.asarray(seq.versions, np.int32), finish_reason=seq.finish_reason) for seq in row]
          for row in answers]
