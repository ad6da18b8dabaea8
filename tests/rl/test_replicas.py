"""`mesh.sampler_replicas`: independent engines on parts of the sampler slice behind one `LocalRollout`. A group
goes whole to one replica and its answers do not depend on which; one replica's weight swap does not stop another's
decoding; a replica that fails has its groups generated again on the others."""

import threading

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.distributed.slices import MeshConfig, build_slices
from areal_jax.errors import SamplerLost
from areal_jax.distributed.replicas import LocalRollout
from areal_jax.sampler import Request, SamplerConfig, SamplingParams
from helpers import TINY, tiny_model
from waiting import wait_until

CFG = SamplerConfig(num_slots=4, page_size=4, num_pages=4 * 16 + 4, max_seq_len=64, max_new_tokens=48,
                    decode_steps=4)


@pytest.fixture(scope="module")
def model():
  return tiny_model(TINY, seed=2)


def _rollout(model, replicas: int, devices: int = 4, cfg: SamplerConfig = CFG) -> LocalRollout:
  mesh = MeshConfig(sampler_devices=devices, sampler_replicas=replicas)
  meshes = build_slices(mesh).replicas
  assert len(meshes) == replicas and {len(m.devices.flat) for m in meshes} == {devices // replicas}
  return LocalRollout(abstract_model=nnx.eval_shape(lambda: model), config=cfg, meshes=meshes,
                      params=nnx.state(model, nnx.Param), version=0, eos_ids=[1], detokenize=None)


def _requests(n: int, max_new_tokens: int = 24, first: int = 0) -> list[Request]:
  rng = np.random.default_rng(first)
  sp = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=3)
  return [Request(group_id=first + g, prompt_ids=rng.integers(2, 64, size=int(rng.integers(3, 12))), num_answers=2,
                  sampling=sp) for g in range(n)]


def _generate(rollout: LocalRollout, requests) -> dict:
  futures = {(r.group_id, i): f for r in requests for i, f in enumerate(rollout.submit(r))}
  return {k: f.result(timeout=120) for k, f in futures.items()}


@pytest.mark.parametrize("replicas", [2, 4])
def test_groups_spread_over_replicas_and_answers_do_not_depend_on_which(model, replicas):
  requests = _requests(8)
  one = _rollout(model, 1, devices=4 // replicas)  # one replica's shape, alone
  try:
    alone = _generate(one, requests)
  finally:
    one.stop()
  rollout = _rollout(model, replicas)
  try:
    spread = _generate(rollout, requests)
    per = [r.sampler.stats() for r in rollout.replicas]
    metrics = rollout.sampler_metrics()
    total = rollout.stats()
  finally:
    rollout.stop()
  assert sum(p["requests"] for p in per) == len(requests) and all(p["requests"] > 0 for p in per)  # whole groups
  assert total["tokens"] == sum(p["tokens"] for p in per) == sum(len(t.response_ids) for t in spread.values())
  assert all(metrics[f"sampler/replica{i}/tokens"] == per[i]["tokens"] for i in range(replicas))
  assert sum(metrics[f"sampler/replica{i}/answers"] for i in range(replicas)) == 2 * len(requests)
  for key, a in alone.items():  # the same PRNG keys and weights on an engine of the same shape
    b = spread[key]
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_the_replica_with_more_work_in_tokens_is_passed_over(model):
  """Skewed groups, held on their replicas (they wait for a version never published): one long group on replica 0,
  two short ones on replica 1. The next group goes to replica 1, which holds more answers but fewer tokens of work;
  the accounting is empty again once the held answers are cancelled."""
  rollout = _rollout(model, 2)
  held = dict(min_version=99)
  prompt = np.arange(3, 9, dtype=np.int32)
  long, short = SamplingParams(max_new_tokens=48), SamplingParams(max_new_tokens=4)
  try:
    rollout.submit(Request(group_id=0, prompt_ids=prompt, num_answers=2, sampling=long, **held))  # a tie: replica 0
    rollout.submit(Request(group_id=1, prompt_ids=prompt, num_answers=2, sampling=short, **held))
    rollout.submit(Request(group_id=2, prompt_ids=prompt, num_answers=2, sampling=short, **held))
    r0, r1 = (r.outstanding for r in rollout.replicas)
    assert list(r0) == [0] and list(r1) == [1, 2]
    assert (r0.answers, r1.answers) == (2, 4) and (r0.tokens, r1.tokens) == (6 + 96, 2 * (6 + 8))
  finally:
    rollout.stop()
  assert [(r.outstanding.answers, r.outstanding.tokens) for r in rollout.replicas] == [(0, 0), (0, 0)]


def test_an_episode_s_next_turn_goes_to_its_replica_and_finds_its_pages(model):
  """With the prefix cache: an episode's second turn goes to the replica that served its first, though the other is
  less loaded, and finds the first turn's pages there; the same context without the episode goes to the other
  replica and prefills it all."""
  rollout = _rollout(model, 2, cfg=CFG.replace(prefix_cache=True))
  sp = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=3)
  prompt = np.arange(3, 12, dtype=np.int32)
  try:
    [first] = rollout.submit(Request(group_id=0, prompt_ids=prompt, sampling=sp, episode="e"))  # a tie: replica 0
    context = np.concatenate([prompt, first.result(timeout=120).response_ids, [7, 8, 9]]).astype(np.int32)
    rollout.submit(Request(group_id=1, prompt_ids=prompt, sampling=sp, min_version=99))  # held on replica 0
    [kept] = rollout.submit(Request(group_id=2, prompt_ids=context, sampling=sp, episode="e"))
    [moved] = rollout.submit(Request(group_id=3, prompt_ids=context, sampling=sp))
    kept.result(timeout=120), moved.result(timeout=120)
    stats = [r.sampler.stats() for r in rollout.replicas]
    metrics = rollout.sampler_metrics()
  finally:
    rollout.stop()
  assert [r.dispatched for r in rollout.replicas] == [3, 1]
  page = CFG.page_size
  assert stats[0]["cached_tokens"] == (len(context) - 1) // page * page > 0 and stats[1]["cached_tokens"] == 0
  assert metrics["sampler/replica0/prefix_hits"] > 0 == metrics["sampler/replica1/prefix_hits"]


def test_one_replica_s_swap_does_not_stop_another_s_decoding(model):
  rollout = _rollout(model, 2)
  stuck, release = threading.Event(), threading.Event()
  sched0 = rollout.replicas[0].sampler.scheduler
  swap = sched0._swap_weights  # pylint: disable=protected-access

  def slow_swap(params, version):
    stuck.set()
    release.wait(60)
    swap(params, version)

  sched0._swap_weights = slow_swap  # pylint: disable=protected-access
  try:
    rollout.publish(nnx.state(model, nnx.Param), 1)
    assert stuck.wait(60)  # replica 0 is inside its swap
    futures = rollout.submit(_requests(1, max_new_tokens=48)[0])  # to replica 0 (a tie goes to the first): held
    held = rollout.replicas[0].sampler.stats()["tokens"]
    # A new group goes to replica 1 (fewer answers outstanding), which swaps and finishes it meanwhile.
    later = rollout.submit(_requests(1, max_new_tokens=16, first=100)[0])
    out = [f.result(timeout=120) for f in later]
    assert all(set(t.versions.tolist()) == {1} for t in out)
    assert rollout.replicas[0].sampler.stats()["tokens"] == held and not release.is_set()
    release.set()
    out = [f.result(timeout=120) for f in futures]
    assert all(set(t.versions.tolist()) == {1} for t in out)
    assert rollout.stats()["weight_updates"] == 2
    # The same weights published again: nothing changed, counted without the learner waiting for it.
    wait_until(lambda: rollout.sync_metrics().get("sync/changed_fraction") is not None, what=rollout.sync_metrics)
    assert rollout.sync_metrics()["sync/changed_fraction"] == 0.0
  finally:
    release.set()
    rollout.stop()


def test_each_replica_gets_its_copy_as_soon_as_it_is_dispatched(model, monkeypatch):
  """A publish hands replica i its weights right after dispatching replica i's copy, before replica i + 1's is made,
  and waits for no copy to finish (`block=False`): no replica waits for the others' copies, nor the learner for any.
  The swapped-in weights are the published ones, and `sync/learner_seconds` says how long the publish took."""
  rollout = _rollout(model, 4)
  events = []
  move = rollout._move  # pylint: disable=protected-access

  def watched_move(params, shardings, dtype, **kw):
    events.append(("copy", kw.get("block", True)))
    return move(params, shardings, dtype, **kw)

  monkeypatch.setattr(rollout, "_move", watched_move)
  for r in rollout.replicas:
    monkeypatch.setattr(r.sampler, "update_params", lambda p, v, r=r, f=r.sampler.update_params: (
        events.append(("swap", r.index)), f(p, v)))
  try:
    new = jax.tree.map(lambda x: x + 1, nnx.state(model, nnx.Param))
    rollout.publish(new, 1)
    assert events == [e for i in range(4) for e in (("copy", False), ("swap", i))]
    wait_until(lambda: rollout.stats()["weight_updates"] == 4, what=rollout.stats)
    for r in rollout.replicas:
      for got, want in zip(jax.tree.leaves(r.sampler.scheduler.params), jax.tree.leaves(new)):
        np.testing.assert_array_equal(got, want)
    assert rollout.sync_metrics()["sync/learner_seconds"] > 0
  finally:
    rollout.stop()


def test_a_failed_replica_s_groups_are_generated_again_on_the_others(model):
  rollout = _rollout(model, 2)
  broken = rollout.replicas[0].sampler.scheduler

  def fail():
    raise RuntimeError("replica 0 broke")

  broken.step = fail
  try:
    requests = _requests(4)
    futures = {r.group_id: rollout.submit(r) for r in requests}
    lost, done = [], {}
    for r in requests:
      try:
        done[r.group_id] = [f.result(timeout=120) for f in futures[r.group_id]]
      except SamplerLost:
        lost.append(r)
    assert lost and done  # the first group went to replica 0, the second to replica 1
    rollout.check()  # one replica is left: the run goes on
    again = _generate(rollout, lost)  # as the controller does: the lost groups again
    assert len(again) == 2 * len(lost)
    assert rollout.sampler_metrics()["sampler/replica0/failed"] == 1.0
  finally:
    rollout.stop()


def test_a_replica_that_fails_while_idle_is_dropped_and_takes_no_groups(model):
  rollout = _rollout(model, 2)
  one = rollout.replicas[1].sampler

  def fail():
    raise RuntimeError("replica 1 broke in its weight swap")

  one.scheduler.step = fail
  try:
    one.update_params(one.scheduler.params, 1)  # an idle replica steps to swap: the step fails, no answer open
    wait_until(lambda: one.error is not None, what="replica 1's sampler stopping on its error")
    rollout.check()  # replica 0 is left
    out = _generate(rollout, _requests(3))
    assert len(out) == 6 and rollout.replicas[0].sampler.stats()["requests"] == 3
    assert rollout.sampler_metrics()["sampler/replica1/failed"] == 1.0
  finally:
    rollout.stop()


def test_a_lone_replica_s_failure_fails_the_run(model):
  rollout = _rollout(model, 1)
  broken = rollout.replicas[0].sampler.scheduler
  broken.step = lambda: (_ for _ in ()).throw(RuntimeError("the only replica broke"))
  [f, _] = rollout.submit(_requests(1)[0])
  with pytest.raises(RuntimeError, match="the only replica broke"):
    f.result(timeout=120)
  with pytest.raises(RuntimeError):
    rollout.check()
  with pytest.raises(RuntimeError):
    rollout.stop()


def test_replicas_must_divide_the_sampler_slice():
  with pytest.raises(ValueError, match="mesh.sampler_replicas=3"):
    build_slices(MeshConfig(sampler_devices=4, sampler_replicas=3))
  with pytest.raises(ValueError, match="mesh.sampler_replicas=2"):
    build_slices(MeshConfig(sampler_devices=4, sampler_replicas=2), devices=jax.devices()[:1])
