"""Per-token log-probabilities under temperature-scaled logits: the one definition sampler and learner share."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def logprobs_of(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
  """log softmax(logits / temperature)[targets], in float32. logits [..., V]; targets [...] int."""
  logits = logits.astype(jnp.float32)
  if temperature != 1.0:
    logits = logits / temperature
  logz = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - logz


def entropy_of(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
  """Entropy of softmax(logits / temperature) over the last axis, in float32."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def next_token_logprobs(model, tokens: jax.Array, *, positions: jax.Array, segment_ids: jax.Array,
                        temperature: float = 1.0) -> jax.Array:
  """[B, T] logprob of tokens[:, t + 1] given the prefix up to t, within packed segments.

  Entry t is meaningless (set to 0) where token t + 1 starts a new segment, is padding, or t is the last column.
  """
  logits = model(tokens, positions=positions, segment_ids=segment_ids)
  nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
  lp = logprobs_of(logits, nxt, temperature)
  same = jnp.concatenate([segment_ids[:, 1:] == segment_ids[:, :-1], jnp.zeros_like(segment_ids[:, :1], bool)], 1)
  return jnp.where(same & (segment_ids != 0), lp, 0.0)
