"""A job is signalled as a whole: a sampler process that stops first makes the leader stop the same way (no
traceback, exit 128 + N), and the signal's own late arrival at the leader cannot cut its shutdown."""

import multiprocessing
import os
import signal
import sys
import time

import pytest

from areal_jax import cli
from areal_jax.distributed.control import Peer
from areal_jax.distributed.messages import SAMPLER, Signalled
from areal_jax.distributed.sampler_hub import SamplerHub


@pytest.fixture
def signal_handlers():
  saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  yield
  for s, h in saved.items():
    signal.signal(s, h)
  cli._stopping = False  # pylint: disable=protected-access


def test_a_sampler_stopped_by_a_signal_stops_the_leader_quietly(signal_handlers):
  del signal_handlers
  cli.stop_on_signals()
  ours, theirs = multiprocessing.Pipe()
  hub = SamplerHub(peers={1: Peer(ours, name="sampler 0", process_id=1)}, publisher=None).start()
  sampler = Peer(theirs, name="the leader", process_id=0)
  sampler.send(SAMPLER, Signalled(int(signal.SIGTERM)))
  sampler.close()
  deadline = time.time() + 10
  while hub.error is None and time.time() < deadline:
    time.sleep(0.01)
  with pytest.raises(cli.Stopped, match="received SIGTERM") as stopped:
    hub.check()
  assert stopped.value.signum == signal.SIGTERM
  os.kill(os.getpid(), signal.SIGTERM)  # the job's signal reaching the leader too: absorbed, not a second Stopped
  time.sleep(0.1)
  assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # a further signal ends the process at once


def test_the_first_signal_raises_stopped(signal_handlers):
  del signal_handlers
  cli.stop_on_signals()
  with pytest.raises(cli.Stopped, match="received SIGINT"):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)
  assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL


def test_a_stop_python_could_not_propagate_is_kept_and_raised_by_the_next_check(monkeypatch, capsys):
  """A signal landing in a `__del__` or a garbage-collection callback: Python drops the exception there (and would
  print it as an ignored traceback); the waiting loop's next `check_stopped` raises it."""
  monkeypatch.setattr(cli, "_swallowed", None)
  monkeypatch.setattr(sys, "unraisablehook", cli._keep_swallowed_stop)  # pylint: disable=protected-access

  class Collected:
    def __del__(self):
      raise cli.Stopped(signal.SIGTERM)

  Collected()  # dropped at once: its __del__ raises where nothing can catch it
  assert "Traceback" not in capsys.readouterr().err
  with pytest.raises(cli.Stopped, match="SIGTERM"):
    cli.check_stopped()
