"""The sampler hub over samplers that come and go, with scripted sampler processes on the other end of real control
connections: a lost sampler's answers fail with `SamplerLost` (and release its pulls), work goes to the others or
waits for one to join, a joiner gets the current weights first, a silent one is dropped at the heartbeat limit."""

import multiprocessing
import signal
import threading
import time

import numpy as np
import pytest

from areal_jax.distributed.control import Peer
from areal_jax.distributed.messages import (SAMPLER, Answer, Dropped, Generate, Leaving, Pulled, Stats, Weights)
from areal_jax.distributed.sampler_hub import SamplerHub
from areal_jax.distributed.weight_transfer import Delta
from areal_jax.errors import SamplerLost
from areal_jax.sampler.requests import Request, SamplingParams
from areal_jax.types import Trajectory
from waiting import wait_until


class FakePublisher:
  """What the hub asks of a `WeightPublisher`, recorded."""

  parts = {"all": None}
  address = "127.0.0.1:1"

  def __init__(self):
    self.offers, self.forgotten, self.pulls = [], [], []
    self.room = threading.Event()  # cleared: as if MAX_LIVE_VERSIONS versions were still being pulled
    self.room.set()

  def stage(self, params, part="all", block=True):
    return ("staged", params, part)

  def offer(self, staged, version, pullers, delta=None):
    self.offers.append((staged, version, list(pullers)) + ((delta,) if delta is not None else ()))
    return {p: 100 + p for p in pullers}, np.zeros((1, 2), np.float32)

  def delta(self, staged, base):
    return Delta(codes=(1,), payload=[("from", base[1], "to", staged[1])], changed_fraction=0.25, nbytes=2)

  def wait_live_below(self, n, timeout=None):
    return self.room.wait(timeout)

  def pulled(self, version, puller):
    self.pulls.append((version, puller))

  def forget(self, puller):
    self.forgotten.append(puller)

  def nbytes(self, part="all"):
    return 8


class Sampler:
  """The sampler process's end of a control connection, driven by the test."""

  def __init__(self, pid: int):
    ours, theirs = multiprocessing.Pipe()
    self.hub_end = Peer(ours, name=f"sampler {pid - 1}", process_id=pid)
    self.peer = Peer(theirs, name="the leader", process_id=0)

  def next(self, timeout=5.0):
    assert self.peer.poll(timeout), "the hub sent nothing"
    return self.peer.recv()[1]

  def answer(self, request: Request, index: int):
    traj = Trajectory(prompt_ids=np.asarray(request.prompt_ids, np.int32), response_ids=np.array([5, 6], np.int32),
                      logprobs=np.zeros(2, np.float32), versions=np.zeros(2, np.int32), finish_reason="eos",
                      group_id=request.group_id)
    self.peer.send(SAMPLER, Answer(index=index, trajectory=traj))


def _request(gid, n=2):
  return Request(group_id=gid, prompt_ids=np.array([1, 2, 3], np.int32), num_answers=n,
                 sampling=SamplingParams(max_new_tokens=4), min_version=0)


@pytest.fixture
def hub_of_two():
  a, b = Sampler(1), Sampler(2)
  pub = FakePublisher()
  hub = SamplerHub(peers={1: a.hub_end, 2: b.hub_end}, publisher=pub, heartbeat_s=30).start()
  hub.publish({"w": 0}, 0)
  for s in (a, b):
    assert isinstance(s.next(), Weights)
  yield hub, pub, a, b
  hub.stop(timeout_s=1)


def test_a_lost_sampler_fails_only_its_own_answers_and_the_next_group_goes_elsewhere(hub_of_two):
  hub, pub, a, b = hub_of_two
  first, second = hub.submit(_request(0)), hub.submit(_request(1))  # one each: the fewest outstanding
  [to_a], [to_b] = [a.next()], [b.next()]
  assert isinstance(to_a, Generate) and isinstance(to_b, Generate)
  assert {to_a.request.group_id, to_b.request.group_id} == {0, 1}
  mine = first if to_a.request.group_id == 0 else second
  theirs = second if mine is first else first
  a.answer(to_a.request, 0)  # one answer arrives before it dies
  a.peer.send(SAMPLER, Stats({"tokens": 5.0, "running": 2.0}))
  wait_until(lambda: mine[0].done() and hub.stats().get("running") == 2.0)
  a.peer.close()  # killed
  with pytest.raises(SamplerLost, match=r"sampler 0 \(process 1\) is gone"):
    mine[1].result(timeout=10)
  assert mine[0].result().group_id == to_a.request.group_id  # what arrived stays arrived
  assert not any(f.done() for f in theirs)
  assert pub.forgotten == [1]
  assert hub.stats() == {"tokens": 5.0}  # its work still counts; its answers running do not
  assert hub.sampler_metrics() == {"samplers/live": 1.0, "samplers/joined": 0.0, "samplers/lost": 1.0,
                                   "samplers/wait_s": 0.0}
  hub.submit(_request(2))
  assert b.next().request.group_id == 2


def test_a_preempted_sampler_leaves_at_once_and_work_waits_for_one_that_joins(hub_of_two):
  hub, pub, a, b = hub_of_two
  for s in (a, b):
    s.peer.send(SAMPLER, Leaving(int(signal.SIGTERM)))
  wait_until(lambda: hub.sampler_metrics()["samplers/live"] == 0)
  waiting = hub.submit(_request(7))  # nobody to take it: held
  wait_until(lambda: hub.sampler_metrics()["samplers/wait_s"] > 0, what="the held group counted as waiting")
  c = Sampler(3)
  hub.join(c.hub_end)
  weights, work = c.next(), c.next()  # the current weights (the whole model) first, then the group that waited
  assert isinstance(weights, Weights) and weights.version == 0 and weights.part == "all"
  assert pub.offers[-1] == (("staged", {"w": 0}, "all"), 0, [3])
  assert isinstance(work, Generate) and work.request.group_id == 7
  for i in range(2):
    c.answer(work.request, i)
  assert [f.result(timeout=10).group_id for f in waiting] == [7, 7]
  hub.publish({"w": 1}, 1)  # its loop is not running yet: the learner does not wait for it
  assert pub.offers[-1][2] == [] and not c.peer.poll(0.2)
  c.peer.send(SAMPLER, Stats({"version": 0.0}))  # now it runs: it is sent the newest version, then every publish
  assert c.next().version == 1 and pub.offers[-1] == (("staged", {"w": 1}, "all"), 1, [3])
  c.peer.send(SAMPLER, Stats({"version": 1.0}))
  hub.publish({"w": 2}, 2)
  assert c.next().version == 2 and pub.offers[-1][2] == [3]
  m = hub.sampler_metrics()
  assert (m["samplers/live"], m["samplers/joined"], m["samplers/lost"]) == (1.0, 1.0, 2.0)


def test_a_restarted_sampler_replaces_its_previous_connection(hub_of_two):
  hub, _, a, _ = hub_of_two
  group = hub.submit(_request(0))
  gid = a.next().request.group_id if a.peer.poll(0.5) else None
  again = Sampler(1)  # the same process id connects again: the old process is gone
  hub.join(again.hub_end)
  assert isinstance(again.next(), Weights)
  if gid == 0:
    with pytest.raises(SamplerLost, match="reconnected"):
      group[0].result(timeout=10)
  assert hub.sampler_metrics()["samplers/live"] == 2.0
  again.peer.send(SAMPLER, Stats({"version": 0.0}))  # running, and nothing published since its join: no second offer
  wait_until(lambda: hub._live[1].catching_up is None)  # pylint: disable=protected-access
  hub.publish({"w": 1}, 1)
  assert again.next().version == 1 and not again.peer.poll(0.2)


def test_a_silent_sampler_is_dropped_at_the_heartbeat_limit():
  a, b = Sampler(1), Sampler(2)
  start = time.time()
  hub = SamplerHub(peers={1: a.hub_end, 2: b.hub_end}, publisher=FakePublisher(), heartbeat_s=2.0).start()
  stop = threading.Event()

  def beat():  # b reports every 0.3 s; a says nothing (SIGSTOPped)
    while not stop.wait(0.3):
      b.peer.send(SAMPLER, Stats({"tokens": 1.0}))

  threading.Thread(target=beat, daemon=True).start()
  try:
    wait_until(lambda: hub.sampler_metrics()["samplers/lost"] == 1, timeout_s=10)
    assert 2.0 <= time.time() - start <= 4.0
    assert hub.sampler_metrics()["samplers/live"] == 1
    assert hub.stats() == {"tokens": 1.0}
    assert isinstance(a.next(), Dropped)  # its last word: a stopped process that resumes connects again
    with pytest.raises(ConnectionError):  # then the hub closed its connection
      a.peer.recv()
  finally:
    stop.set()
    hub.stop(timeout_s=1)


def test_pulls_are_reported_to_the_publisher(hub_of_two):
  hub, pub, a, _ = hub_of_two
  a.peer.send(SAMPLER, Pulled(version=0, seconds=0.5))
  wait_until(lambda: pub.pulls == [(0, 1)])
  wait_until(lambda: "sync/sampler0/seconds" in hub.sync_metrics())
  assert hub.sync_metrics()["sync/sampler0/seconds"] == 0.5


def test_deltas_go_to_samplers_that_hold_their_base_and_whole_copies_to_the_rest():
  a, b = Sampler(1), Sampler(2)
  pub = FakePublisher()
  hub = SamplerHub(peers={1: a.hub_end, 2: b.hub_end}, publisher=pub, heartbeat_s=30, delta=True).start()
  try:
    hub.publish({"w": 0}, 0)
    assert [(w.version, w.base) for w in (a.next(), b.next())] == [(0, -1), (0, -1)]  # nothing to diff against
    hub.publish({"w": 1}, 1)
    for s in (a, b):
      w = s.next()
      assert (w.version, w.base, w.codes) == (1, 0, (1,))
    assert pub.offers[-1][2] == [1, 2] and pub.offers[-1][3].payload == [("from", {"w": 0}, "to", {"w": 1})]
    c = Sampler(3)  # joins: the whole copy of the latest version
    hub.join(c.hub_end)
    assert (c.next().base, pub.offers[-1][2]) == (-1, [3])
    restarted = Sampler(1)  # sampler 0's process again: it holds nothing
    hub.join(restarted.hub_end)
    assert restarted.next().base == -1
    for s in (c, restarted):
      s.peer.send(SAMPLER, Stats({"version": 1.0}))
    wait_until(lambda: all(s.catching_up is None for s in hub._live.values()))  # pylint: disable=protected-access
    hub.publish({"w": 2}, 2)
    assert [s.next().base for s in (b, c, restarted)] == [1, 1, 1]
    assert hub.sync_metrics()["sync/changed_fraction"] == 0.25
  finally:
    hub.stop(timeout_s=1)


def test_with_overlap_the_learner_goes_on_while_the_version_waits_for_room():
  """The learner's publish returns once the copy is dispatched; the version is offered when fewer than
  MAX_LIVE_VERSIONS are live; the next publish waits for that (one version in flight)."""
  a = Sampler(1)
  pub = FakePublisher()
  hub = SamplerHub(peers={1: a.hub_end}, publisher=pub, heartbeat_s=30, overlap=True).start()
  try:
    hub.publish({"w": 0}, 0)
    assert a.next().version == 0
    pub.room.clear()
    hub.publish({"w": 1}, 1)  # returns: the offer waits on the hub-publish thread
    assert not a.peer.poll(0.3)
    second = threading.Thread(target=hub.publish, args=({"w": 2}, 2))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # waits for version 1 to be offered
    pub.room.set()
    assert [a.next().version, a.next().version] == [1, 2]
    second.join(5)
    assert not second.is_alive()
    assert hub.sync_metrics()["sync/learner_seconds"] < hub.sync_metrics()["sync/publish_seconds"] + 1
  finally:
    hub.stop(timeout_s=1)


def test_a_publish_that_fails_in_the_background_fails_the_learners_next_call():
  a = Sampler(1)
  pub = FakePublisher()
  hub = SamplerHub(peers={1: a.hub_end}, publisher=pub, heartbeat_s=30, overlap=True, delta=True).start()
  try:
    hub.publish({"w": 0}, 0)
    a.next()

    def broken(staged, base):
      raise RuntimeError("device lost while diffing")

    pub.delta = broken
    hub.publish({"w": 1}, 1)
    wait_until(lambda: hub.error is not None)
    with pytest.raises(RuntimeError, match="device lost while diffing"):
      hub.publish({"w": 2}, 2)
  finally:
    hub.stop(timeout_s=1)
