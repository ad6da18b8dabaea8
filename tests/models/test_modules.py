"""The training attention in query blocks equals one dense pass over the packed mask, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models.modules import dense_attention, gqa_attention, packed_mask


def test_blockwise_training_attention_equals_dense():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.float32) for _ in range(3))
  k, v = k[:, :, :2], v[:, :, :2]  # 2 KV heads for 4 query heads
  seg = jnp.asarray([[1] * 5 + [2] * 7 + [0] * 4, [1] * 16], jnp.int32)
  loss = lambda attend: lambda q, k, v: (attend(q, k, v)[0] ** 2).sum()
  want = gqa_attention(q, k, v, packed_mask(seg))
  want_grads = jax.grad(loss(lambda q, k, v: (gqa_attention(q, k, v, packed_mask(seg)), None)), (0, 1, 2))(q, k, v)
  for chunk in (4, 16):
    attend = dense_attention(seg, query_chunk=chunk)
    np.testing.assert_allclose(attend(q, k, v)[0], want, atol=1e-6)
    for got, ref in zip(jax.grad(loss(attend), (0, 1, 2))(q, k, v), want_grads):
      np.testing.assert_allclose(got, ref, atol=1e-5)
