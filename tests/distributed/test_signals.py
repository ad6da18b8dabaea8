"""Signals: the first raises `Stopped` in the main thread (every `finally` runs), a second ends the process; a stop
that lands where Python cannot propagate it is kept for the next check. (A sampler process stopped by a signal
leaves the job alone: tests/distributed/test_sampler_hub.py.)"""

import os
import signal
import sys
import time

import pytest

from areal_jax import cli


@pytest.fixture
def signal_handlers():
  saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  yield
  for s, h in saved.items():
    signal.signal(s, h)


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
