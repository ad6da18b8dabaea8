"""Weights over jax.experimental.transfer: published by the learner, pulled onto the sampler's devices, leaf by leaf."""

import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.distributed import weight_transfer
from areal_jax.distributed.weight_transfer import (WeightPublisher, WeightPuller, check_fingerprint, fingerprint,
                                                   local_copy)
from areal_jax.models import create, lora, weights
from areal_jax.sharding import LEARNER_RULES, SAMPLER_RULES, make_mesh, state_shardings
from helpers import TINY, tiny_model


@pytest.mark.parametrize("learner_axes,tensor,sampler_axes", [
    ({"fsdp": 4, "tensor": 1}, 1, {"data": 4, "tensor": 1}),
    ({"fsdp": 2, "tensor": 2}, 2, {"data": 2, "tensor": 2}),
    ({"fsdp": 1, "tensor": 4}, 1, {"data": 2, "tensor": 2}),  # the puller's layout follows the publisher's tensor
])
def test_pulled_weights_equal_the_learners_leaf_by_leaf(learner_axes, tensor, sampler_axes):
  devices = jax.devices()
  params = nnx.state(tiny_model(), nnx.Param)
  learner_mesh = make_mesh(devices[:4], learner_axes)
  learner_params = jax.device_put(params, state_shardings(params, learner_mesh, LEARNER_RULES))

  pub = WeightPublisher(abstract_params=params, tensor=tensor, devices=devices[:4], host="127.0.0.1")
  puller = WeightPuller(address=pub.address, abstract_params=params, tensor=tensor, devices=devices[4:],
                        host="127.0.0.1")
  staged = pub.stage(local_copy(learner_params, learner_mesh))
  uuids, published_fp = pub.offer(staged, version=3, pullers=[0])
  pulled, fp = puller.pull(uuids[0], timeout_s=60)
  check_fingerprint(fp, published_fp, paths=puller.paths["all"], what="test")
  sampler_mesh = make_mesh(devices[4:], sampler_axes)
  on_sampler = weight_transfer.transfer(pulled, state_shardings(params, sampler_mesh, SAMPLER_RULES))

  want = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
  for got_tree in (pulled, on_sampler):
    assert {d for x in jax.tree.leaves(got_tree) for d in x.sharding.device_set} <= set(devices[4:])
    for (path, w), g in zip(want, jax.tree.leaves(jax.device_get(got_tree))):
      np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))
  pub.pulled(3, 0)
  assert not pub._live  # pylint: disable=protected-access  # released once every puller has it


def test_a_puller_that_left_releases_its_copies_and_the_server_takes_its_pulls():
  """A lost sampler never pulls: `forget` releases the copies only it was waiting for, and pulls its uuids here so
  the transfer server lets go of them (it has no way to withdraw an offer)."""
  devices = jax.devices()
  params = nnx.state(tiny_model(), nnx.Param)
  pub = WeightPublisher(abstract_params=params, tensor=1, devices=devices[:1], host="127.0.0.1")
  staying = WeightPuller(address=pub.address, abstract_params=params, tensor=1, devices=devices[4:5],
                         host="127.0.0.1")
  first, _ = pub.offer(pub.stage(params), version=1, pullers=[0, 1])
  second, _ = pub.offer(pub.stage(params), version=2, pullers=[1])  # only the one that leaves
  assert len({*first.values(), *second.values()}) == 3  # every offer to every puller its own uuid
  staying.pull(first[0], timeout_s=60)
  pub.pulled(1, 0)
  assert not pub.wait_live_below(2, timeout=0)  # both copies wait for puller 1
  pub.forget(1)
  assert pub.wait_live_below(1, timeout=0)
  [taker] = [t for t in threading.enumerate() if t.name == "weight-forget-1"]
  taker.join(60)
  assert not taker.is_alive()  # both of its pulls were taken


def test_a_bfloat16_sampler_pulls_weights_cast_before_staging():
  """Publisher and puller agree on the sampler's dtype: float32 learner weights are cast on the learner's device
  before staging, so the published copy (and every pull) is half the bytes."""
  devices = jax.devices()
  params = nnx.state(tiny_model(), nnx.Param)
  abstract = weights.with_dtype(params, jnp.bfloat16)
  pub = WeightPublisher(abstract_params=abstract, tensor=1, devices=devices[:1], host="127.0.0.1")
  puller = WeightPuller(address=pub.address, abstract_params=abstract, tensor=1, devices=devices[4:5],
                        host="127.0.0.1")
  assert pub.nbytes() * 2 == WeightPublisher(abstract_params=params, tensor=1, devices=devices[:1],
                                             host="127.0.0.1").nbytes()
  staged = pub.stage(jax.device_put(params, devices[0]))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(staged))
  uuids, published_fp = pub.offer(staged, version=1, pullers=[0])
  pulled, fp = puller.pull(uuids[0], timeout_s=60)
  check_fingerprint(fp, published_fp, paths=puller.paths["all"], what="test")
  for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(pulled)):
    assert g.dtype == jnp.bfloat16, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w.astype(jnp.bfloat16)))
  pub.pulled(1, 0)


def test_a_leaf_that_arrives_permuted_is_named():
  params = nnx.state(tiny_model(), nnx.Param)
  leaves, treedef = jax.tree.flatten(params)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  i = next(k for k, x in enumerate(leaves) if x.ndim == 2)
  swapped = list(leaves)
  swapped[i] = leaves[i][::-1]  # same values, wrong places: what a mismatched shard layout produces
  with pytest.raises(ValueError, match="arrived corrupted") as e:
    check_fingerprint(fingerprint(jax.tree.unflatten(treedef, swapped)), fingerprint(params), paths=paths, what="v7")
  assert paths[i] in str(e.value)


def test_publishing_a_tree_of_the_wrong_shape_is_refused():
  params = nnx.state(tiny_model(), nnx.Param)
  pub = WeightPublisher(abstract_params=params, tensor=1, devices=jax.devices()[:1], host="127.0.0.1")
  bad = jax.tree.map(lambda x: x[..., :1] if x.ndim == 2 else x, params)
  with pytest.raises(ValueError, match="published weights: leaf"):
    pub.stage(bad)


@pytest.mark.slow
def test_a_pull_that_never_arrives_times_out():
  # In a child process: a hung pull thread cannot be cancelled, so it must not outlive the test's interpreter.
  code = textwrap.dedent("""
      import os, sys
      os.environ["JAX_PLATFORMS"] = "cpu"
      sys.path.insert(0, TESTS)
      import jax
      from flax import nnx
      from areal_jax.distributed.weight_transfer import WeightPublisher, WeightPuller
      from helpers import tiny_model
      params = nnx.state(tiny_model(), nnx.Param)
      pub = WeightPublisher(abstract_params=params, tensor=1, devices=jax.devices(), host="127.0.0.1")
      puller = WeightPuller(address=pub.address, abstract_params=params, tensor=1, devices=jax.devices(),
                            host="127.0.0.1")
      try:
        puller.pull(12345, timeout_s=2)  # never offered
      except TimeoutError as e:
        print("TIMEOUT:", e, flush=True)
        os._exit(0)
      os._exit(1)
  """).replace("TESTS", repr(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "TIMEOUT: weight pull 12345" in proc.stdout and "did not finish in 2 s" in proc.stdout


def test_under_lora_a_version_can_be_published_as_its_adapters_alone():
  """A QLoRA model: its nf4 base (4-bit values and their scales) crosses once, then the adapters alone."""
  devices = jax.devices()
  cfg = TINY.replace(lora_rank=2, lora_base_quant="nf4")
  params = nnx.state(create(cfg, 0), nnx.Param)
  pub = WeightPublisher(abstract_params=params, tensor=1, devices=devices[:1], host="127.0.0.1")
  puller = WeightPuller(address=pub.address, abstract_params=params, tensor=1, devices=devices[4:5], host="127.0.0.1")
  assert set(pub.parts) == {"all", "adapters"} and pub.nbytes("adapters") * 3 < pub.nbytes("all")
  for version, part, want in [(1, "all", params), (2, "adapters", lora.split(params)[0])]:
    staged = pub.stage(jax.device_put(params, devices[0]), part)
    uuids, published_fp = pub.offer(staged, version=version, pullers=[0])
    pulled, fp = puller.pull(uuids[0], part=part, timeout_s=60)
    check_fingerprint(fp, published_fp, paths=puller.paths[part], what="test")
    assert jax.tree.structure(pulled) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(pulled), jax.tree.leaves(want)):
      assert g.dtype == w.dtype
      np.testing.assert_array_equal(g, w)


def test_the_changed_fraction_counts_elements_whose_bits_differ():
  old = {"a": jnp.zeros((4, 8), jnp.bfloat16), "b": jnp.array([1.0, jnp.nan, 0.0, 2.0], jnp.float32)}
  new = {"a": old["a"].at[0, :3].set(1e-3), "b": jnp.array([1.0, jnp.nan, -0.0, 2.0], jnp.float32)}
  changed = weight_transfer.ChangedFraction()
  assert changed.latest() is None  # nothing counted yet
  changed.count(new, old)
  # 3 of a's 32 elements, and b's 0.0 -> -0.0 (a different bit pattern; the NaN keeps its bits): 4 of 36.
  wait = jax.block_until_ready
  wait(changed._counts[0])  # pylint: disable=protected-access  # finished on the device
  assert changed.latest() == pytest.approx(4 / 36)
  changed.count(new, new)
  wait(changed._counts[0])  # pylint: disable=protected-access
  assert changed.latest() == 0.0


def test_deltas_rebuild_every_version_bit_for_bit_and_move_only_what_changed():
  """bfloat16 weights on a 2-way tensor mesh: the full copy once, then each version as its delta against the one
  before (a small update, none, a large one), each rebuilt on the puller's devices and checked by the fingerprint."""
  devices = jax.devices()
  params = nnx.state(tiny_model(), nnx.Param)
  abstract = weights.with_dtype(params, jnp.bfloat16)
  pub = WeightPublisher(abstract_params=abstract, tensor=2, devices=devices[:2], host="127.0.0.1")
  puller = WeightPuller(address=pub.address, abstract_params=abstract, tensor=2, devices=devices[4:6],
                        host="127.0.0.1", keep=True)
  master = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  staged = pub.stage(master)
  uuids, fp = pub.offer(staged, version=0, pullers=[0])
  pulled, got = puller.pull(uuids[0], timeout_s=60)
  check_fingerprint(got, fp, paths=puller.paths["all"], what="version 0")
  assert puller.last_nbytes == pub.nbytes()
  pub.pulled(0, 0)
  rng = np.random.default_rng(0)
  for version, lr in [(1, 1e-6), (2, 0.0), (3, 1e-1)]:
    master = jax.tree.map(lambda x: x + lr * jnp.asarray(rng.choice([-1.0, 1.0], size=x.shape), x.dtype), master)
    previous, staged = staged, pub.stage(master)
    delta = pub.delta(staged, previous)
    uuids, fp = pub.offer(staged, version=version, pullers=[0], delta=delta)
    pulled, got = puller.pull(uuids[0], timeout_s=60, codes=delta.codes)
    check_fingerprint(got, fp, paths=puller.paths["all"], what=f"version {version}")
    for g, w in zip(jax.tree.leaves(pulled), jax.tree.leaves(staged)):
      np.testing.assert_array_equal(np.asarray(g).view(np.uint16), np.asarray(w).view(np.uint16))
      assert g.sharding.device_set <= set(devices[4:6])
    assert puller.last_nbytes == delta.nbytes
    changed = sum(int(np.sum(np.asarray(a).view(np.uint16) != np.asarray(b).view(np.uint16)))
                  for a, b in zip(jax.tree.leaves(staged), jax.tree.leaves(previous)))
    assert delta.changed_fraction == pytest.approx(changed / sum(x.size for x in jax.tree.leaves(staged)))
    if lr == 0:
      assert delta.nbytes == 0 and delta.changed_fraction == 0
    elif lr < 1e-3:  # a realistic step: few bf16 roundings flip
      assert 0 < delta.nbytes < pub.nbytes() / 4, (delta.nbytes, pub.nbytes())
    pub.pulled(version, 0)
  assert pub.wait_live_below(1, timeout=0)


def test_a_delta_without_a_base_is_refused():
  params = nnx.state(tiny_model(), nnx.Param)
  devices = jax.devices()
  pub = WeightPublisher(abstract_params=params, tensor=1, devices=devices[:1], host="127.0.0.1")
  puller = WeightPuller(address=pub.address, abstract_params=params, tensor=1, devices=devices[4:5],
                        host="127.0.0.1", keep=True)
  with pytest.raises(RuntimeError, match="holds no earlier version"):
    puller.pull(1, timeout_s=5, codes=[0] * len(jax.tree.leaves(params)))


def test_owned_weights_already_in_place_are_taken_as_they_are():
  """`transfer(owned=True)` (a sampler process's pull onto a replica of the pull's layout): nothing copied where every
  leaf already has its sharding and dtype; a copy otherwise, and always without `owned`."""
  mesh = make_mesh(jax.devices()[:2], {"data": 1, "tensor": 2})
  state = nnx.state(tiny_model(TINY, seed=0))
  shardings = state_shardings(state, mesh, SAMPLER_RULES)
  placed = jax.device_put(state, shardings)
  same = lambda a, b: all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  assert same(weight_transfer.transfer(placed, shardings, dtype=jnp.float32, owned=True), placed)
  assert not same(weight_transfer.transfer(placed, shardings, owned=False), placed)
  cast = weight_transfer.transfer(placed, shardings, dtype=jnp.bfloat16, owned=True)  # another dtype: a copy
  assert {x.dtype for x in jax.tree.leaves(cast)} == {jnp.dtype(jnp.bfloat16)}
  other = state_shardings(state, make_mesh(jax.devices()[2:4], {"data": 1, "tensor": 2}), SAMPLER_RULES)
  moved = weight_transfer.transfer(placed, other, owned=True)  # other devices: a copy
  assert {d.id for x in jax.tree.leaves(moved) for d in x.sharding.device_set} == {d.id for d in jax.devices()[2:4]}
