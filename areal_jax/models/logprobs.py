"""Per-token log-probabilities under temperature-scaled logits: the one definition sampler and learner share."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from areal_jax.sharding import constrain


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


def logprobs_and_entropy(h: jax.Array, w: jax.Array, targets: jax.Array, temperature: float = 1.0, *,
                         chunk: int = 0) -> tuple[jax.Array, jax.Array]:
  """`logprobs_of(h @ w, targets, temperature)` and `entropy_of(h @ w, temperature)` without the [tokens, vocab]
  float32 logits: h [..., D], w [D, V] (the output projection), targets [...] int; both results [...] float32.

  The vocabulary is split into ceil(V / chunk) chunks (`chunk=0`: one), chunk k holding the entries k, k + n, k + 2n,
  ... of n chunks, so a vocabulary sharded in contiguous blocks stays sharded within every chunk. The forward pass
  keeps running logsumexp / picked-logit / entropy sums over the chunks; the backward pass (a `custom_vjp`)
  recomputes each chunk's logits and accumulates the hidden states' gradient and writes the weight's chunk by chunk.
  No program holds more than one [tokens, chunk] float32 tile. The matmuls run in h's dtype, accumulating in float32.
  """
  lead, d = h.shape[:-1], h.shape[-1]
  lp, ent = _chunked_head(float(temperature), int(chunk), h.reshape(-1, d), w.astype(h.dtype),
                          targets.reshape(-1).astype(jnp.int32))
  return lp.reshape(lead), ent.reshape(lead)


def _chunk_weight(w: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
  """[D, V] -> ([n, D, c] chunks with zero padding, [n, c] their vocabulary ids; padding ids are >= V)."""
  d, v = w.shape
  c = min(chunk, v) if chunk else v
  n = -(-v // c)
  w = jnp.pad(w, ((0, 0), (0, n * c - v))).reshape(d, c, n).transpose(2, 0, 1)
  ids = jnp.arange(c, dtype=jnp.int32)[None, :] * n + jnp.arange(n, dtype=jnp.int32)[:, None]
  return constrain(w, (None, "embed", "vocab")), ids


def _chunk_logits(h, wk, ids, temperature, vocab):
  """One chunk's temperature-scaled logits [N, c] in float32, -inf at padding."""
  z = jnp.einsum("nd,dc->nc", h, wk, preferred_element_type=jnp.float32)
  z = constrain(z, ("batch", "act_vocab"))
  if temperature != 1.0:
    z = z / temperature
  return jnp.where(ids < vocab, z, -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_head(temperature, chunk, h, w, targets):
  return _chunked_head_fwd(temperature, chunk, h, w, targets)[0]


def _chunked_head_fwd(temperature, chunk, h, w, targets):
  chunks, ids = _chunk_weight(w, chunk)
  vocab = w.shape[1]

  def body(carry, xs):
    m, s, u, picked = carry  # running max, Σ e^(z - m), Σ e^(z - m)(z - m), the target's logit
    wk, idk = xs
    z = _chunk_logits(h, wk, idk, temperature, vocab)
    m_new = jnp.maximum(m, z.max(-1))
    scale = jnp.exp(m - m_new)
    e = jnp.exp(z - m_new[:, None])
    s_new = scale * s + e.sum(-1)
    u_new = scale * (u + (m - m_new) * s) + jnp.where(e > 0, e * (z - m_new[:, None]), 0.0).sum(-1)
    picked = picked + jnp.where(idk == targets[:, None], z, 0.0).sum(-1)
    return (m_new, s_new, u_new, picked), None

  zeros = jnp.zeros(h.shape[:1], jnp.float32)
  init = (jnp.full(h.shape[:1], jnp.finfo(jnp.float32).min), zeros, zeros, zeros)
  (m, s, u, picked), _ = jax.lax.scan(body, init, (chunks, ids))
  logz = m + jnp.log(s)
  ent = jnp.log(s) - u / s
  return (picked - logz, ent), (h, w, targets, logz, ent)


def _chunked_head_bwd(temperature, chunk, res, cts):
  h, w, targets, logz, ent = res
  g_lp, g_ent = cts
  chunks, ids = _chunk_weight(w, chunk)
  vocab = w.shape[1]

  def body(dh, xs):
    wk, idk = xs
    z = _chunk_logits(h, wk, idk, temperature, vocab)
    logp = z - logz[:, None]
    p = jnp.exp(logp)
    # d lp / dz = onehot - p;  d ent / dz = -p (log p + ent)
    dz = jnp.where(p > 0, -p * (g_lp[:, None] + g_ent[:, None] * (logp + ent[:, None])), 0.0)
    dz = dz + jnp.where(idk == targets[:, None], g_lp[:, None], 0.0)
    dz = (dz / temperature).astype(h.dtype)
    dh = dh + jnp.einsum("nc,dc->nd", dz, wk, preferred_element_type=jnp.float32)
    dwk = jnp.einsum("nd,nc->dc", h, dz, preferred_element_type=jnp.float32).astype(w.dtype)
    return dh, dwk

  dh, dw = jax.lax.scan(body, jnp.zeros(h.shape, jnp.float32), (chunks, ids))
  n, d, c = dw.shape
  dw = dw.transpose(1, 2, 0).reshape(d, c * n)[:, :w.shape[1]]
  return dh.astype(h.dtype), dw, None


_chunked_head.defvjp(_chunked_head_fwd, _chunked_head_bwd)
