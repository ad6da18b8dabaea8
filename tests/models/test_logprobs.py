"""Vocabulary-chunked logprobs and entropy equal the plain formulas on full logits, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from areal_jax.learner.step import make_learner_mesh
from areal_jax.models.logprobs import entropy_of, logprobs_and_entropy, logprobs_of
from areal_jax.sharding import LEARNER_RULES, use_rules

D, V = 16, 100


def inputs(seed, rows=4, length=12, scale=1.0):
  """h [rows, length, D], output weight [D, V] (for tied weights, an embedding [V, D]), targets, cotangents."""
  k = jax.random.split(jax.random.key(seed), 5)
  h = jax.random.normal(k[0], (rows, length, D)) * scale
  w = jax.random.normal(k[1], (D, V)) * 0.5
  targets = jax.random.randint(k[2], (rows, length), 0, V)
  g_lp, g_ent = (jax.random.normal(kk, (rows, length)) for kk in k[3:])
  return h, w, targets, g_lp, g_ent


def head(tied, w):
  """The parameter that is differentiated (lm_head [D, V], or a tied embedding [V, D]) and the projection from it."""
  return (w.T, lambda p: p.T) if tied else (w, lambda p: p)


def value_and_grads(fn, h, param, targets, g_lp, g_ent):
  """(lp, ent) and the gradients w.r.t. (h, param) of Σ g_lp·lp + Σ g_ent·ent."""
  def loss(h, param):
    lp, ent = fn(h, param)
    return jnp.sum(g_lp * lp) + jnp.sum(g_ent * ent), (lp, ent)

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(h, param)
  return out, grads


def plain(project, targets, temperature):
  def fn(h, param):
    logits = jnp.einsum("...d,dv->...v", h, project(param))
    return logprobs_of(logits, targets, temperature), entropy_of(logits, temperature)
  return fn


def chunked(project, targets, temperature, chunk):
  return lambda h, param: logprobs_and_entropy(h, project(param), targets, temperature, chunk=chunk)


def assert_close(got, want, rtol=2e-5):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    assert np.isfinite(g).all()
    np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max())


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [0, 16, 24, 128])  # one chunk; 100 = 6x16 + 4 (padded); 24; chunk > vocab
def test_matches_plain_formula(tied, chunk):
  h, w, targets, g_lp, g_ent = inputs(0)
  param, project = head(tied, w)
  want = value_and_grads(plain(project, targets, 0.7), h, param, targets, g_lp, g_ent)
  got = value_and_grads(chunked(project, targets, 0.7, chunk), h, param, targets, g_lp, g_ent)
  assert_close(got, want)
  assert got[1][1].shape == param.shape


@pytest.mark.parametrize("scale", [0.01, 30.0])  # near-uniform (entropy ~ log V) and near one-hot (entropy ~ 0)
def test_extreme_logits(scale):
  h, w, targets, g_lp, g_ent = inputs(1, scale=scale)
  (lp, ent), _ = got = value_and_grads(chunked(lambda p: p, targets, 1.3, 16), h, w, targets, g_lp, g_ent)
  want = value_and_grads(plain(lambda p: p, targets, 1.3), h, w, targets, g_lp, g_ent)
  assert_close(got, want, rtol=1e-4)
  assert np.all(np.asarray(ent) >= 0) and np.all(np.asarray(ent) <= np.log(V) + 1e-5)
  if scale > 1:
    assert np.asarray(ent).min() < 1e-3  # some rows are near one-hot


def test_forward_only_matches():
  h, w, targets, *_ = inputs(2)
  lp, ent = jax.jit(lambda h, w: logprobs_and_entropy(h, w, targets, 0.5, chunk=32))(h, w)
  logits = jnp.einsum("...d,dv->...v", h, w)
  np.testing.assert_allclose(lp, logprobs_of(logits, targets, 0.5), rtol=2e-5, atol=1e-5)
  np.testing.assert_allclose(ent, entropy_of(logits, 0.5), rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("tensor", [1, 2])
def test_sharded_learner_mesh(tensor):
  """On the 8-device learner mesh (rows over fsdp, hidden over fsdp, vocabulary over tensor), as in the learner."""
  mesh = make_learner_mesh(jax.devices(), tensor=tensor)
  rows = mesh.shape["data"] * mesh.shape["fsdp"]
  h, w, targets, g_lp, g_ent = inputs(3, rows=rows)
  want = value_and_grads(plain(lambda p: p, targets, 0.7), h, w, targets, g_lp, g_ent)
  put = lambda x, *s: jax.device_put(x, NamedSharding(mesh, P(*s)))
  h, targets, g_lp, g_ent = put(h, "fsdp"), put(targets, "fsdp"), put(g_lp, "fsdp"), put(g_ent, "fsdp")
  w = put(w, "fsdp", "tensor" if tensor > 1 else None)

  def fn(h, w):
    with use_rules(mesh, LEARNER_RULES):
      return logprobs_and_entropy(h, w, targets, 0.7, chunk=16)

  got = value_and_grads(fn, h, w, targets, g_lp, g_ent)
  assert_close(got, want)
