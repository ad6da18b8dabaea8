"""Log-probabilities of given tokens and their most likely alternatives, by one dense forward pass over the weights
the sampler serves: what `echo` (the prompt's logprobs) and top alternatives (`logprobs` > 0, `top_logprobs`) need.

    scorer = Scorer(engine)
    scores = scorer(params, prompt_ids + answer_ids, temperature=0.7, vocab_limit=tok.vocab_size)
    scores.logprobs[p - 1]  # log p(token p | tokens before it), p >= 1
    scores.top_ids[p - 1], scores.top_logprobs[p - 1]  # the `TOP` likeliest ids at position p, best first

The sampler draws answers from its paged cache and keeps only the drawn token's logprob; the alternatives come from
this second pass over prompt + answer, under the same temperature-scaled distribution (`sampling.sample`'s). The two
passes agree to float rounding, and exactly in what they rank, while the weights stay the same: a weight update
between drawing an answer and scoring it (training, not serving) scores it under the newer weights. Sequences are
padded to power-of-two lengths, one compiled program per length.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.sampler.engine import Engine
from areal_jax.sharding import SAMPLER_RULES, use_rules

TOP = 20  # the most alternatives OpenAI serves per token


@dataclasses.dataclass(frozen=True)
class Scores:
  """Row p - 1 is about token p of the scored sequence (the first token has no row)."""

  logprobs: np.ndarray  # [n - 1] float32
  top_ids: np.ndarray  # [n - 1, TOP] int32
  top_logprobs: np.ndarray  # [n - 1, TOP] float32


class Scorer:

  def __init__(self, engine: Engine):
    self.engine = engine
    self._min_len = 16

  @functools.cached_property
  def _score(self):
    graphdef, mesh = self.engine.graphdef, self.engine.mesh

    def score(params, tokens, temperature, vocab_limit):
      model = nnx.merge(graphdef, params)
      with use_rules(mesh, SAMPLER_RULES):
        logits = model(tokens[None])[0]  # [T, V] float32
      lp = jax.nn.log_softmax(logits / temperature, axis=-1)
      chosen = jnp.take_along_axis(lp[:-1], tokens[1:, None], axis=-1)[:, 0]
      drawable = jnp.arange(lp.shape[-1]) < vocab_limit
      top_lp, top_ids = jax.lax.top_k(jnp.where(drawable, lp, -jnp.inf)[:-1], min(TOP, lp.shape[-1]))
      return chosen, top_ids.astype(jnp.int32), top_lp

    return jax.jit(score)

  def __call__(self, params, token_ids, *, temperature: float, vocab_limit: int = 0) -> Scores:
    """Scores `token_ids` (at least 2) under `params` (on the engine's shardings); greedy (temperature 0) scores
    under temperature 1, as the sampler reports. Ids at or above `vocab_limit` (> 0) are never alternatives."""
    n = len(token_ids)
    if n < 2:
      raise ValueError(f"{n} token(s): scoring needs at least 2")
    padded = max(self._min_len, 1 << (n - 1).bit_length())
    tokens = np.zeros(padded, np.int32)
    tokens[:n] = token_ids
    vocab = self.engine.model_cfg.vocab_size
    t = temperature if temperature > 0 else 1.0
    chosen, top_ids, top_lp = jax.device_get(self._score(params, tokens, np.float32(t),
                                                         np.int32(vocab_limit or vocab)))
    return Scores(logprobs=chosen[:n - 1], top_ids=top_ids[:n - 1], top_logprobs=top_lp[:n - 1])
