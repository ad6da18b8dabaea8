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


def _processed(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array, vocab_limit: int):
  """(logits with undrawable ids at -inf, temperature-scaled logits unmasked (for the logprob), the distribution drawn
  from (scaled, filtered: -inf outside), greedy rows) of logits [B, V]."""
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
  return logits, unmasked, filtered, greedy


def _key(key_data, i):
  return jax.random.fold_in(jax.random.wrap_key_data(key_data, impl=KEY_IMPL), i)


def sample(logits: jax.Array, keys: jax.Array, index: jax.Array, temperature: jax.Array, top_p: jax.Array,
           top_k: jax.Array, *, vocab_limit: int = 0) -> tuple[jax.Array, jax.Array]:
  """(tokens [B] int32, logprobs [B] float32) from logits [B, V]; keys [B, 2] uint32, index [B] int32.

  `vocab_limit` > 0: ids at or above it are never drawn (a model's vocabulary padded beyond its tokenizer's).
  """
  logits, unmasked, filtered, greedy = _processed(logits, temperature, top_p, top_k, vocab_limit)
  drawn = jax.vmap(lambda key_data, i, row: jax.random.categorical(_key(key_data, i), row))(keys, index, filtered)
  tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
  return tokens, logprobs_of(unmasked, tokens)


def verify(logits: jax.Array, drafts: jax.Array, num_drafted: jax.Array, keys: jax.Array, index: jax.Array,
           temperature: jax.Array, top_p: jax.Array, top_k: jax.Array, *,
           vocab_limit: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Speculative sampling of drafted tokens, exact: what is emitted is distributed as `sample` one token at a time.

  logits [B, Q, V]: the target's logits at Q consecutive positions of each row, position j predicting the row's token
  `index + j`; drafts [B, Q - 1]: the tokens guessed for positions 0 .. Q - 2 (position j + 1's input is draft j), of
  which the first `num_drafted[b]` count. A draft is a deterministic guess (a point mass), so draft j is accepted with
  probability p_j(draft j) under the processed target distribution (temperature, top-k, top-p, `vocab_limit`: the
  one `sample` draws from); at the first rejection the token is drawn from the residual, p_j with the draft's mass
  removed and renormalised; after every draft is accepted one more token is drawn from the next position's p, with
  the key `sample` would use (`fold_in(key, index + j)`), so a row with no drafts draws what `sample` draws. Greedy
  rows accept a draft that is the argmax and emit the argmax after it. The acceptance test and residual draw use
  their own keys derived from the token's (`fold_in(., 1)`, `fold_in(., 2)`).

  Returns (tokens [B, Q], logprobs [B, Q], emitted [B]): the first `emitted[b]` = accepted drafts + 1 tokens of row b
  are its next tokens, each with its logprob as `sample` reports it.
  """
  b, q, v = logits.shape
  rep = lambda x: jnp.repeat(x, q, axis=0)
  flat = logits.reshape(b * q, v)
  masked, unmasked, filtered, greedy = _processed(flat, rep(temperature), rep(top_p), rep(top_k), vocab_limit)
  ids = (index[:, None] + jnp.arange(q)[None, :]).reshape(-1)
  guess = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1).reshape(-1).astype(jnp.int32)
  argmax = jnp.argmax(masked, axis=-1)
  p_guess = jnp.exp(jnp.take_along_axis(jax.nn.log_softmax(filtered, axis=-1), guess[:, None], axis=-1)[:, 0])
  residual = filtered.at[jnp.arange(b * q), guess].set(-jnp.inf)

  def draws(key_data, i, row, rest):
    key = _key(key_data, i)
    return (jax.random.uniform(jax.random.fold_in(key, 1)), jax.random.categorical(key, row),
            jax.random.categorical(jax.random.fold_in(key, 2), rest))

  u, fresh, corrected = jax.vmap(draws)(rep(keys), ids, filtered, residual)
  accept = jnp.where(greedy, guess == argmax, u < p_guess).reshape(b, q)
  accept &= jnp.arange(q)[None, :] < num_drafted[:, None]
  accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1)  # leading accepted drafts, < q
  drafted = (jnp.arange(q)[None, :] < num_drafted[:, None]).reshape(-1)  # a position with a draft: rejected there
  last = jnp.where(greedy, argmax, jnp.where(drafted, corrected, fresh)).reshape(b, q)
  pos = jnp.arange(q)[None, :]
  tokens = jnp.where(pos < accepted[:, None], guess.reshape(b, q), last).astype(jnp.int32)
  return tokens, logprobs_of(unmasked, tokens.reshape(-1)).reshape(b, q), accepted + 1
