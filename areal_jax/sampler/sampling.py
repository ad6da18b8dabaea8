"""Token sampling with per-row settings in one compiled program: greedy, temperature, top-k, top-p.

Every row carries its own PRNG key (raw threefry key data) and token index, and draws with
`fold_in(key, index)`: a request's tokens do not depend on its slot, its batch neighbours, or on being preempted and
resumed, so runs are reproducible under a seed.

The returned logprob is the sampled token's log-probability under the temperature-scaled, unfiltered distribution
(`logprobs_of`, the definition the learner uses); top-k/top-p and `vocab_limit` only restrict which tokens may be
drawn. Greedy rows (temperature 0) report the logprob under temperature 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models.logprobs import logprobs_of

KEY_IMPL = "threefry2x32"


def request_key(seed: int, *ids: int) -> np.ndarray:
  """Raw key data (uint32 [2]) for one answer, from the run's seed and integers naming the answer (group, index)."""
  h = np.uint64(0x9E3779B97F4A7C15)
  with np.errstate(over="ignore"):
    for i in ids:  # splitmix64 over the ids
      h = np.uint64(h + np.uint64(i & 0xFFFFFFFFFFFFFFFF) + np.uint64(0x9E3779B97F4A7C15))
      h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
      h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
      h = h ^ (h >> np.uint64(31))
  return np.array([seed & 0xFFFFFFFF, int(h) & 0xFFFFFFFF], np.uint32)


def filter_logits(scaled: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
  """Sets logits outside each row's top-k / top-p nucleus to -inf. scaled [B, V]; top_p [B]; top_k [B] (-1 = off)."""
  v = scaled.shape[-1]
  desc = -jnp.sort(-scaled, axis=-1)
  probs = jax.nn.softmax(desc, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each rank
  rank = jnp.arange(v)[None, :]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)[:, None]
  keep = (rank < k) & ((before < top_p[:, None]) | (rank == 0))
  kept = jnp.maximum(jnp.sum(keep, axis=-1), 1)
  threshold = jnp.take_along_axis(desc, (kept - 1)[:, None], axis=-1)
  return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(logits: jax.Array, keys: jax.Array, index: jax.Array, temperature: jax.Array, top_p: jax.Array,
           top_k: jax.Array, *, vocab_limit: int = 0) -> tuple[jax.Array, jax.Array]:
  """(tokens [B] int32, logprobs [B] float32) from logits [B, V]; keys [B, 2] uint32, index [B] int32.

  `vocab_limit` > 0: ids at or above it are never drawn (a model's vocabulary padded beyond its tokenizer's).
  """
  logits = logits.astype(jnp.float32)
  greedy = temperature <= 0
  t = jnp.where(greedy, 1.0, temperature)
  scaled = logits / t[:, None]
  if 0 < vocab_limit < logits.shape[-1]:
    drawable = jnp.arange(logits.shape[-1]) < vocab_limit
    logits = jnp.where(drawable, logits, -jnp.inf)
    scaled, unmasked = jnp.where(drawable, scaled, -jnp.inf), scaled
  else:
    unmasked = scaled
  needs_filter = jnp.any(((top_k > 0) | (top_p < 1)) & ~greedy)
  filtered = jax.lax.cond(needs_filter, filter_logits, lambda s, p, k: s, scaled, top_p, top_k)

  def draw(key_data, i, row):
    key = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl=KEY_IMPL), i)
    return jax.random.categorical(key, row)

  drawn = jax.vmap(draw)(keys, index, filtered)
  tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
  return tokens, logprobs_of(unmasked, tokens)
