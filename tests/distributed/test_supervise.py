"""The supervisor's end of a job (`local_job._supervise`, shared by local.py and Ray): once the leader finished, a
sampler that is still running after `SAMPLER_FINISH_S` (one that was starting or rejoining, which the leader could
not tell to stop) is stopped, so the job ends then rather than `FINISH_GRACE_S` later; other learner processes keep
the whole grace. Fake processes: no subprocess is started."""

import signal
import time

from areal_jax.distributed import local_job


class _Fake:
  """A process as `_supervise` sees it: exits with `code` once `exit_at` (monotonic) passes or when signalled."""

  def __init__(self, name, *, sampler=False, exit_at=None, code=0):
    self.name = self.label = name
    self.sampler, self.exit_at, self.code, self.signals = sampler, exit_at, code, []
    self.started, self.pause_s, self.restart_at, self.gone = time.monotonic(), 1.0, None, False

  def poll(self):
    return self.code if self.exit_at is not None and time.monotonic() >= self.exit_at else None

  def wait(self, timeout=None):
    deadline = time.monotonic() + (timeout or 0.0)
    while self.poll() is None and time.monotonic() < deadline:
      time.sleep(0.01)
    return self.poll()

  def signal(self, signum):
    self.signals.append(signum)
    self.exit_at, self.code = time.monotonic(), -signum


def test_a_sampler_the_leader_could_not_tell_is_stopped_soon_after_the_leader_finished(monkeypatch, capsys):
  monkeypatch.setattr(local_job, "SAMPLER_FINISH_S", 0.3)
  monkeypatch.setattr(local_job, "FINISH_GRACE_S", 60.0)
  now = time.monotonic()
  leader = _Fake("learner 0", exit_at=now)
  told = _Fake("sampler 1", sampler=True, exit_at=now + 0.1)  # told by the leader: exits on its own
  starting = _Fake("sampler 2", sampler=True)  # restarted, still starting: never told
  t = time.monotonic()
  assert local_job._supervise([leader, told, starting], [], None, "") == 0  # pylint: disable=protected-access
  assert time.monotonic() - t < 10.0  # not FINISH_GRACE_S
  assert starting.signals == [signal.SIGTERM] and not told.signals and not leader.signals
  assert "sampler 2 still running 0 s after the leader finished; stopping them" in capsys.readouterr().out


def test_a_learner_process_keeps_the_whole_grace(monkeypatch):
  monkeypatch.setattr(local_job, "SAMPLER_FINISH_S", 0.1)
  monkeypatch.setattr(local_job, "FINISH_GRACE_S", 60.0)
  now = time.monotonic()
  leader, learner = _Fake("learner 0", exit_at=now), _Fake("learner 1", exit_at=now + 0.6)
  assert local_job._supervise([leader, learner], [], None, "") == 0  # pylint: disable=protected-access
  assert not learner.signals  # it finished on its own, after the samplers' limit
