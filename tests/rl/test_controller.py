"""The rollout controller with a scripted sampler and reward pool: admission, filtering, resumable bookkeeping."""

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

from areal_jax.data.dataset import PromptDataset
from areal_jax.data.records import PromptRecord
from areal_jax.errors import SamplerLost
from areal_jax.reward.service import RewardResult
from areal_jax.rl.controller import RolloutController
from areal_jax.rl.rollout_buffer import RolloutBuffer
from areal_jax.sampler.requests import SamplingParams
from areal_jax.types import Trajectory
from waiting import settle, wait_until

G = 4


class FakeLoop:
  """Answers every request at once (its futures are done when returned); the answer text says whether it is
  correct."""

  def __init__(self):
    self.version = 0
    self.submitted = []

  def submit(self, request):
    self.submitted.append(request.group_id)
    assert request.min_version <= self.version + 1
    uid_number = int(request.prompt_ids[0])
    futures = []
    for i in range(request.num_answers):
      # Prompts whose number is divisible by 3 get all-wrong answers (a uniform group); others one right answer.
      correct = uid_number % 3 != 0 and i == 0
      futures.append(_done(Trajectory(
          prompt_ids=request.prompt_ids, response_ids=np.array([5, 6], np.int32),
          logprobs=np.zeros(2, np.float32), versions=np.full(2, self.version, np.int32), finish_reason="eos",
          group_id=request.group_id, response_text="right" if correct else "wrong")))
    return futures


def _done(value):
  f = Future()
  f.set_result(value)
  return f


class FakeRewards:
  """Scores in a thread of its own, as the reward service's dispatcher does."""

  def __init__(self):
    self._pool = ThreadPoolExecutor(1)

  def submit(self, key, kind, completion, reference):
    return self._pool.submit(lambda: RewardResult(item_id=key, reward=float(completion == "right"), reason="ok",
                                                  latency_s=0.0, run_s=0.0))


def _dataset(n=60):
  records = [PromptRecord(uid=f"p{i}", prompt=str(i), prompt_ids=np.array([i + 1], np.int32), reference="")
             for i in range(n)]
  return PromptDataset(records, seed=0)


def test_filtering_admission_and_bookkeeping():
  ds = _dataset()
  loop, rewards = FakeLoop(), FakeRewards()
  b, eta = 4, 1
  out = RolloutBuffer(batch_size=b, max_offpolicyness=eta, max_concurrent=100)
  ctl = RolloutController(dataset=ds, rollout=loop, rewards=rewards, buffer=out, version=0,
                          group_size=G, sampling=SamplingParams(), filter_uniform=True).start()
  try:
    trained, filtered = [], []
    for version in range(1, 4):
      batch = out.take_batch(b, version - 1, timeout=10)
      assert batch is not None
      for g in batch:
        assert len(g.trajectories) == G and len(set(g.rewards.tolist())) > 1  # uniform groups never reach training
      trained += [g.record.uid for g in batch]
      ctl.mark_trained(batch)
      loop.version = version
      ctl.admit(version)
      state, newly_filtered = ctl.snapshot()
      filtered += [g.record.uid for g in newly_filtered]
      assert all(np.all(g.rewards == 0) for g in newly_filtered)
    bound = (eta + 3 + 1) * b
    wait_until(lambda: out.accepted + out.running == bound, what=lambda: f"admission at the bound for version 3: "
               f"{out.accepted} accepted + {out.running} running, not {bound}")
  finally:
    ctl.stop()
  ctl.check()
  state, newly_filtered = ctl.snapshot()
  filtered += [g.record.uid for g in newly_filtered]
  # Admission: kept groups (trained + queued) never exceed (eta + v + 1) * B.
  assert out.accepted + out.running == bound
  assert out.accepted == len(trained) + len(out)
  # Every drawn prompt is exactly one of: trained, filtered, or still undone (queued / in flight) - in draw order.
  undone = state["undone"]
  drawn = trained + filtered + undone
  assert len(drawn) == len(set(drawn)) == state["dataset"]["index"] == len(loop.submitted)
  fresh = _dataset()
  assert sorted(drawn) == sorted(next(fresh).uid for _ in range(len(drawn)))
  assert filtered and all(int(u[1:]) % 3 == 2 for u in filtered)  # prompt_ids = i + 1 divisible by 3


def test_replay_comes_first_and_group_ids_continue():
  ds = _dataset()
  loop, rewards = FakeLoop(), FakeRewards()
  buffer = RolloutBuffer(batch_size=2, max_offpolicyness=0, max_concurrent=100)
  replay = [ds.records[10], ds.records[20]]
  ctl = RolloutController(dataset=ds, rollout=loop, rewards=rewards, buffer=buffer, version=0,
                          group_size=G, sampling=SamplingParams(), filter_uniform=False, next_group_id=7,
                          replay=replay)
  ctl.start()
  wait_until(lambda: len(loop.submitted) >= 2, timeout_s=5, what="two groups submitted")
  settle(ctl.thread.loop)  # had admission gone past the bound, the extra group would be submitted by now
  ctl.stop()
  assert loop.submitted == [7, 8]  # eta = 0: exactly B groups, numbered on from the checkpoint
  state, _ = ctl.snapshot()
  assert state["undone"][:2] == ["p10", "p20"] and state["dataset"]["index"] == 0 and state["next_group_id"] == 9


class ThreadedLoop(FakeLoop):
  """Completes each answer later, from a pool of threads (as the sampler's detokeniser and hub readers do)."""

  def __init__(self, seed=0):
    super().__init__()
    self._pool = ThreadPoolExecutor(4)
    self._rng = np.random.default_rng(seed)

  def submit(self, request):
    delays = self._rng.uniform(0, 0.003, request.num_answers)
    return [self._pool.submit(lambda f=f, d=d: (time.sleep(d), f.result())[1])
            for f, d in zip(super().submit(request), delays)]


def test_admissions_from_many_threads_are_never_lost():
  """Groups finish on several threads at once, each asking the controller to admit: with eta = 0 every version
  needs exactly B new groups, so one lost admission would stall the learner."""
  ds, loop, rewards = _dataset(), ThreadedLoop(), FakeRewards()
  b = 4
  buffer = RolloutBuffer(batch_size=b, max_offpolicyness=0, max_concurrent=3)
  ctl = RolloutController(dataset=ds, rollout=loop, rewards=rewards, buffer=buffer, version=0,
                          group_size=G, sampling=SamplingParams(), filter_uniform=False).start()
  try:
    for version in range(30):
      batch = buffer.take_batch(b, version, timeout=10)
      assert batch is not None, f"no batch for version {version}: {buffer.running} running, {len(buffer)} finished"
      ctl.mark_trained(batch)
      loop.version = version + 1
      ctl.admit(version + 1)
  finally:
    ctl.stop()
  ctl.check()
  assert 30 * b <= buffer.accepted and buffer.accepted + buffer.running <= 31 * b  # trained; Eq. 3 at version 30


class FailingRewards(FakeRewards):
  """Its third answer's scoring fails (a broken verifier, say)."""

  def __init__(self):
    super().__init__()
    self.calls = 0

  def submit(self, key, kind, completion, reference):
    self.calls += 1
    if self.calls == 3:
      f = Future()
      f.set_exception(ValueError("verifier broke"))
      return f
    return super().submit(key, kind, completion, reference)


def test_a_groups_error_stops_admission_and_reaches_the_learner():
  ds, loop = _dataset(), ThreadedLoop()
  buffer = RolloutBuffer(batch_size=2, max_offpolicyness=1, max_concurrent=100)
  ctl = RolloutController(dataset=ds, rollout=loop, rewards=FailingRewards(), buffer=buffer, version=0,
                          group_size=G, sampling=SamplingParams(), filter_uniform=False).start()
  try:
    wait_until(lambda: ctl.error is not None, timeout_s=10, what="the group's error")
    submitted = len(loop.submitted)
    ctl.admit()
    settle(ctl.thread.loop)  # the admission task has woken and looked
    assert len(loop.submitted) == submitted  # nothing admitted after the failure
  finally:
    ctl.stop()
  with pytest.raises(RuntimeError, match="rollout controller failed") as info:
    ctl.check()
  assert "verifier broke" in str(info.value.__cause__)


class LosingLoop(FakeLoop):
  """Loses every third group's sampler after its first answer: the rest of its answers fail with `SamplerLost`."""

  def submit(self, request):
    futures = super().submit(request)
    if len(self.submitted) % 3 == 1:
      futures = futures[:1] + [Future() for _ in futures[1:]]
      for f in futures[1:]:
        f.set_exception(SamplerLost("sampler 0 is gone"))
    return futures


def test_a_group_whose_sampler_is_lost_is_admitted_again_and_trained_once():
  ds = _dataset()
  loop = LosingLoop()
  b, eta = 4, 1
  buffer = RolloutBuffer(batch_size=b, max_offpolicyness=eta, max_concurrent=100)
  ctl = RolloutController(dataset=ds, rollout=loop, rewards=FakeRewards(), buffer=buffer, version=0,
                          group_size=G, sampling=SamplingParams(), filter_uniform=False).start()
  trained = []
  try:
    for version in range(1, 5):
      batch = buffer.take_batch(b, version - 1, timeout=10)
      assert batch is not None
      trained += [g.record.uid for g in batch]
      assert all(len(g.trajectories) == G for g in batch)
      ctl.mark_trained(batch)
      loop.version = version
      ctl.admit(version)
  finally:
    ctl.stop()
  ctl.check()
  state, _ = ctl.snapshot()
  regenerated = ctl.counters["regenerated_groups"]
  assert regenerated >= 4 and len(loop.submitted) == len(set(loop.submitted))  # a new group id each time
  assert len(trained) == len(set(trained))  # none twice
  drawn = trained + state["undone"]  # none lost: a regenerated prompt is trained or still pending
  assert len(drawn) == len(set(drawn)) == state["dataset"]["index"]
  assert buffer.accepted == len(trained) + len(buffer)  # withdrawn groups never counted as accepted
  assert buffer.accepted + buffer.running <= (eta + 4 + 1) * b
