"""The control plane: a key that must be given, handshakes that cannot block each other, data that cannot be code."""

import dataclasses
import logging
import multiprocessing
import os
import pickle
import socket
import threading
import time
from multiprocessing.connection import Client

import numpy as np
import pytest

from areal_jax.distributed import control, local_job, messages, wire
from areal_jax.distributed.roles import AUTHKEY_ENV, ProcessLayout, authkey
from areal_jax.distributed.sampler_hub import SamplerHub
from areal_jax.errors import ConfigError
from areal_jax.sampler.requests import Request, SamplingParams
from areal_jax.types import Trajectory
from waiting import wait_until

KEY = b"0123456789abcdef0123456789abcdef"


class _Plant:
  """Unpickling this writes a file: proof that someone unpickled it."""

  def __init__(self, path):
    self.path = path

  def __reduce__(self):
    return (open, (self.path, "w"))


def _layouts(n=3):
  address = f"127.0.0.1:{local_job.free_port_pair()}"
  return [ProcessLayout.create(num_processes=n, process_id=i, coordinator_address=address, sampler_processes=1)
          for i in range(n)]


def test_authkey_must_be_set_and_long(monkeypatch):
  monkeypatch.delenv(AUTHKEY_ENV, raising=False)
  with pytest.raises(ConfigError, match=r"\$AREAL_JAX_AUTHKEY is unset.*secrets.token_hex"):
    authkey()
  monkeypatch.setenv(AUTHKEY_ENV, "short")
  with pytest.raises(ConfigError, match="shorter than 16"):
    authkey()
  monkeypatch.setenv(AUTHKEY_ENV, KEY.decode())
  assert authkey() == KEY


def test_wire_round_trips_records_and_refuses_anything_else():
  t = Trajectory(prompt_ids=np.arange(3, dtype=np.int32), response_ids=np.arange(2, dtype=np.int32),
                 logprobs=np.array([-0.5, -1.0], np.float32), versions=np.array([3, 4], np.int32),
                 finish_reason="eos", loss_mask=np.ones(2, np.float32), reward=1.0)
  r = Request(group_id=7, prompt_ids=[1, 2], num_answers=2, sampling=SamplingParams(stop=((1, 2), (3,))))
  kind, (got_t, got_r, n) = wire.decode(wire.encode(("x", (t, r, np.int64(5)))))
  assert kind == "x" and n == 5 and (got_r.group_id, got_r.num_answers, got_r.sampling) == (7, 2, r.sampling)
  assert got_r.sampling.stop == ((1, 2), (3,)) and got_r.prompt_ids.tolist() == [1, 2]
  for name in ("prompt_ids", "response_ids", "logprobs", "versions", "loss_mask"):
    np.testing.assert_array_equal(getattr(got_t, name), getattr(t, name))
    assert getattr(got_t, name).dtype == getattr(t, name).dtype
  with pytest.raises(TypeError, match="_Plant cannot be sent"):
    wire.encode(("x", _Plant("/nonexistent")))
  with pytest.raises(ValueError, match="unreadable"):
    wire.decode(pickle.dumps(("x", 1)))


def test_every_control_record_round_trips_by_type():
  """The sampler processes' and the learners' messages come back as the records sent, field by field."""
  t = Trajectory(prompt_ids=np.arange(3, dtype=np.int32), response_ids=np.arange(2, dtype=np.int32),
                 logprobs=np.array([-0.5, -1.0], np.float32), versions=np.array([3, 4], np.int32),
                 finish_reason="eos", loss_mask=np.ones(2, np.float32), reward=1.0)
  fp = np.arange(6, dtype=np.float32).reshape(3, 2)
  sent = [messages.Weights(version=3, uuid=3 * 4096 + 1, address="10.0.0.1:1234", fingerprint=fp, part="adapters"),
          messages.Generate(Request(group_id=7, prompt_ids=[1, 2], num_answers=2)),
          messages.Stop(), messages.Bye(), messages.Answer(index=1, trajectory=t),
          messages.Pulled(version=3, seconds=0.25), messages.Stats({"tokens": 12, "busy_s": 0.5}),
          messages.Failed("Traceback ..."), messages.Leaving(15), messages.Start(checkpoint=None),
          messages.TrainStep(step=2, trajectories=(t,)), messages.Save(step=2, force=True),
          messages.Dropped("sampler 1 sent nothing for 6 s")]
  assert {type(m) for m in sent} == set(messages.RECORDS)
  for m in sent:
    kind, got = wire.decode(wire.encode((messages.SAMPLER, m)))
    assert kind == messages.SAMPLER and type(got) is type(m), (m, got)
  got = [wire.decode(wire.encode(("k", m)))[1] for m in sent]
  np.testing.assert_array_equal(got[0].fingerprint, fp)
  assert (got[0].version, got[0].uuid, got[0].address, got[0].part) == (3, 3 * 4096 + 1, "10.0.0.1:1234", "adapters")
  assert got[1].request.group_id == 7 and got[1].request.prompt_ids.tolist() == [1, 2]
  assert got[4].index == 1 and got[4].trajectory.finish_reason == "eos"
  np.testing.assert_array_equal(got[4].trajectory.logprobs, t.logprobs)
  assert got[5:9] == sent[5:9] and got[9] == sent[9] and got[11:] == sent[11:]
  assert isinstance(got[10].trajectories, tuple) and got[10].trajectories[0].reward == 1.0


def test_the_hub_drops_a_sampler_that_sends_what_it_does_not_know(caplog):
  ours, theirs = multiprocessing.Pipe()
  hub = SamplerHub(peers={1: control.Peer(ours, name="sampler 0", process_id=1)}, publisher=None).start()
  sampler = control.Peer(theirs, name="the leader", process_id=0)
  sampler.send(messages.SAMPLER, messages.Generate(Request(group_id=1, prompt_ids=[1])))  # leader-to-sampler only
  wait_until(lambda: hub.sampler_metrics()["samplers/lost"] == 1, timeout_s=10, what="the sampler dropped")
  assert hub.sampler_metrics()["samplers/live"] == 0
  assert any("sampler 0 sent an unknown message 'sampler': Generate(request=" in r.message for r in caplog.records)
  hub.check()  # not an error of the job: it goes on with the other samplers (or waits for one)
  sampler.close()
  hub.stop(timeout_s=1)


def test_samplers_connect_again_and_more_join_while_learners_cannot(caplog):
  leader, one, sampler = _layouts()  # learners 0 and 1, sampler process 2
  server = control.ControlServer(leader, KEY)
  joined = []
  try:
    first = control.connect(sampler, KEY, timeout_s=30)
    learner = control.connect(one, KEY, timeout_s=30)
    server.wait([1, 2], timeout_s=30)
    server.on_sampler(joined.append)
    again = control.connect(sampler, KEY, timeout_s=30)  # restarted
    extra = control.connect(dataclasses.replace(sampler, process_id=5), KEY, timeout_s=30)  # one more
    twin = control.connect(one, KEY, timeout_s=30)  # a second learner 1 is refused
    wait_until(lambda: len(joined) >= 2, timeout_s=10, what=lambda: f"two samplers joined, not {joined}")
    assert sorted((p.process_id, p.name) for p in joined) == [(2, "sampler 0"), (5, "sampler 3")]
    with pytest.raises(ConnectionError):
      twin.recv()
    assert any("rejected 'hello' from process 1" in r.message for r in caplog.records)
    for peer in (first, learner, again, extra):
      peer.close()
  finally:
    server.close()


def test_a_silent_stranger_does_not_hold_up_the_job(monkeypatch, caplog):
  monkeypatch.setattr(control, "HANDSHAKE_TIMEOUT_S", 1.0)
  leader, one, two = _layouts()
  server = control.ControlServer(leader, KEY)
  try:
    silent = socket.create_connection(leader.control_address)  # connects first, then says nothing
    t0 = time.monotonic()
    peers = [control.connect(layout, KEY, timeout_s=30) for layout in (one, two)]
    got = server.wait([1, 2], timeout_s=30)
    assert time.monotonic() - t0 < 1.0  # not after the stranger's timeout
    peers[0].send("trajectory", (3, None))
    assert got[1].recv() == ("trajectory", [3, None])
    silent.settimeout(30)  # dropped after HANDSHAKE_TIMEOUT_S: the challenge, then EOF
    received = b""
    while chunk := silent.recv(1 << 16):
      received += chunk
    assert received
    wait_until(lambda: any("rejected a connection" in r.message for r in caplog.records), what="the rejection logged")
  finally:
    server.close()


def test_wrong_key_and_pickles_are_refused(tmp_path):
  leader, one, _ = _layouts()
  server = control.ControlServer(leader, KEY)
  planted = str(tmp_path / "planted")
  try:
    with pytest.raises(ConnectionError, match="AREAL_JAX_AUTHKEY"):
      control.connect(one, b"not-the-key-not-the-key", timeout_s=30)
    raw = Client(leader.control_address, authkey=KEY)  # right key, then a pickle as its hello
    raw.send(("hello", _Plant(planted)))
    with pytest.raises(EOFError):
      raw.recv_bytes()  # the leader hung up
    peer = control.connect(one, KEY, timeout_s=30)
    got = server.wait([1], timeout_s=30)[1]
    peer.conn.send(("trajectory", _Plant(planted)))  # a pickle after the handshake
    with pytest.raises(ConnectionError, match="malformed message"):
      got.recv()
    assert not os.path.exists(planted)
  finally:
    server.close()


def test_close_is_clean(caplog):
  caplog.set_level(logging.INFO)
  for _ in range(8):  # close() used to race the accept loop into logging without end
    leader, *_ = _layouts()
    server = control.ControlServer(leader, KEY)
    time.sleep(0.01)
    server.close()
  wait_until(lambda: not [t for t in threading.enumerate() if t.name == "control-accept"],
             what="the accept threads ended")  # after which nothing logs
  assert len(caplog.records) <= 8, [r.message for r in caplog.records][:10]
