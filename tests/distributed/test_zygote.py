"""The zygote forks a script's children with their own session, output, cores and environment, and reports exits."""

import os
import signal
import subprocess
import sys

import pytest

from areal_jax.distributed import zygote

SCRIPT = """
import json, os, sys, time
print(json.dumps({"argv": sys.argv, "name": __name__, "cores": sorted(os.sched_getaffinity(0)),
                  "env": os.environ.get("ZYGOTE_TEST"), "session": os.getsid(0) == os.getpid(),
                  "preloaded": "email.mime.text" in sys.modules}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "sleep":
  time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


def _spawn(forker, script, arg):
  read, write = os.pipe()
  try:
    child = forker.spawn([str(script), arg], [0], {"ZYGOTE_TEST": arg}, write)
  finally:
    os.close(write)
  return child, os.fdopen(read)


@pytest.fixture(name="forker")
def _forker():
  forker = zygote.Zygote(["email.mime.text"], dict(os.environ), sys.executable)
  yield forker
  forker.close()


def test_a_child_runs_the_script_with_its_own_output_cores_and_environment(tmp_path, forker):
  script = tmp_path / "child.py"
  script.write_text(SCRIPT)
  child, out = _spawn(forker, script, "3")
  assert child.wait(30) == 3 and child.poll() == 3
  lines = out.read().splitlines()
  assert lines[1] == "to stderr"
  assert lines[0] == ('{"argv": ["%s", "3"], "name": "__main__", "cores": [0], "env": "3", "session": true, '
                      '"preloaded": true}' % script)


def test_a_killed_child_reports_its_signal_and_others_go_on(tmp_path, forker):
  script = tmp_path / "child.py"
  script.write_text(SCRIPT)
  sleeper, out = _spawn(forker, script, "sleep")
  assert '"env": "sleep"' in out.readline()  # it started
  other, _ = _spawn(forker, script, "0")
  assert other.wait(30) == 0 and sleeper.poll() is None
  with pytest.raises(subprocess.TimeoutExpired):
    sleeper.wait(0.1)
  os.killpg(sleeper.pid, signal.SIGKILL)  # its own process group, as the launcher and tools/chaos.py signal it
  assert sleeper.wait(30) == -signal.SIGKILL


def test_a_gone_zygote_is_an_error_not_a_hang(tmp_path, forker):
  forker.proc.kill()
  forker.proc.wait()
  with pytest.raises(OSError, match="the zygote"):
    _spawn(forker, tmp_path / "child.py", "0")


def test_a_child_outliving_its_zygote_is_still_seen_to_exit(tmp_path, forker):
  script = tmp_path / "child.py"
  script.write_text(SCRIPT)
  sleeper, out = _spawn(forker, script, "sleep")
  assert '"env": "sleep"' in out.readline()
  forker.proc.kill()  # its exit status goes with the zygote
  forker.proc.wait()
  with pytest.raises(subprocess.TimeoutExpired):
    sleeper.wait(0.5)
  os.killpg(sleeper.pid, signal.SIGKILL)
  assert sleeper.wait(30) == 1
