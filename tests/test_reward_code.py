"""Code rewards: extraction, test formats, output matching, and the sandbox containing hostile programs."""

import json
import os
import signal
import tempfile
import time

import pytest

from areal_jax.reward import code as code_reward
from areal_jax.reward import sandbox

FAST = sandbox.Limits(wall_s=1.5, cpu_s=1.0, memory_mb=512)
STDIN_TESTS = {"inputs": ["3 4\n", "10 -2\n"], "outputs": ["7\n", "8\n"]}


def _answer(body: str) -> str:
  return f"Let me think.\n```python\n{body}\n```\nDone."


def _procs_in(path: str) -> list[int]:
  """Live processes whose working directory is under `path` (finds sandboxed programs whatever their parent)."""
  out = []
  for d in os.listdir("/proc"):
    if d.isdigit():
      try:
        if os.readlink(f"/proc/{d}/cwd").startswith(path):
          out.append(int(d))
      except OSError:
        pass
  return out


@pytest.fixture
def sandbox_tmp(tmp_path, monkeypatch):
  """Sandbox working directories go under tmp_path, so the test can find anything they left running."""
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  yield str(tmp_path)
  assert _procs_in(str(tmp_path)) == [], "sandboxed processes left running"
  assert os.listdir(tmp_path) == [], "sandbox directories left behind"


def test_extract_code_takes_last_python_block():
  text = "```python\nprint(1)\n```\n```js\nconsole.log(2)\n```\n```py\nprint(3)\n```\n```python\nprint(4)"
  assert code_reward.extract_code(text) == "print(3)\n"  # the unterminated last block is not code
  assert code_reward.extract_code("no code") is None


def test_parse_tests_formats():
  taco = code_reward.parse_tests(json.dumps(STDIN_TESTS))
  assert [(t.kind, t.input, t.output) for t in taco] == [("stdin", "3 4\n", "7\n"), ("stdin", "10 -2\n", "8\n")]
  call = code_reward.parse_tests({"inputs": [[1, 2], [3, 4]], "outputs": [3, 7], "fn_name": "add"})
  assert call[1].kind == "call" and call[1].input == [3, 4] and call[1].fn_name == "add"
  lcb = code_reward.parse_tests({"fn_name": "twoSum", "tests": [
      {"input": "[2, 7, 11]\n9", "output": "[0, 1]", "testtype": "functional"},
      {"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]})
  assert lcb[0].input == [[2, 7, 11], 9] and lcb[0].output == [0, 1] and lcb[1].kind == "stdin"


@pytest.mark.parametrize("spec,message", [
    ("{not json", "not valid JSON"),
    ({"inputs": ["1"]}, "needs 'inputs' and 'outputs'"),
    ({"inputs": ["1", "2"], "outputs": ["1"]}, "2 inputs but 1 outputs"),
    ([{"input": "1"}], "test 0 needs 'input' and 'output'"),
    ([{"input": "1", "output": "1", "testtype": "functional"}], "has no fn_name"),
    (7, "must be a dict or a list"),
])
def test_parse_tests_errors_name_the_problem(spec, message):
  with pytest.raises(ValueError, match=message):
    code_reward.parse_tests(spec, where="problems.jsonl:3")


def test_output_matching():
  assert code_reward.stdout_matches("7 \n8\n\n", "7\n8")
  assert code_reward.stdout_matches("0.3333333", "0.33333333")
  assert not code_reward.stdout_matches("7\n9", "7\n8")
  assert not code_reward.stdout_matches("78", "7 8")
  assert code_reward.value_matches((1, 2), [1, 2]) is False  # values arrive as JSON, so tuples are lists
  assert code_reward.value_matches([1, 2], [1, 2])
  assert code_reward.value_matches(5, [5])  # TACO wraps outputs in a list
  assert not code_reward.value_matches(True, 1)


def test_correct_and_wrong_stdin_programs(sandbox_tmp):
  good = _answer("a, b = map(int, input().split())\nprint(a + b)")
  bad = _answer("a, b = map(int, input().split())\nprint(a * b)")
  assert code_reward.check_code(good, STDIN_TESTS, limits=FAST) == (True, "all 2 tests passed")
  ok, why = code_reward.check_code(bad, STDIN_TESTS, limits=FAST)
  assert not ok and why == "test 1/2: wrong output"
  assert code_reward.check_code("no code here", STDIN_TESTS, limits=FAST) == (False, "no ```python block")


def test_function_call_tests(sandbox_tmp):
  tests = {"inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]], "outputs": [[0, 1], [1, 2]], "fn_name": "twoSum"}
  leetcode = _answer("class Solution:\n  def twoSum(self, nums, target):\n    print('debug output is ignored')\n"
                     "    seen = {}\n    for i, x in enumerate(nums):\n      if target - x in seen:\n"
                     "        return [seen[target - x], i]\n      seen[x] = i")
  assert code_reward.check_code(leetcode, tests, limits=FAST)[0]
  plain = _answer("def twoSum(nums, target):\n  return [0, 1]")
  assert code_reward.check_code(plain, tests, limits=FAST) == (False, "test 2/2: wrong return value")
  missing = _answer("def other(): pass")
  assert code_reward.check_code(missing, tests, limits=FAST) == (False, "test 1/2: exit 1")


def test_time_budget_stops_remaining_tests(sandbox_tmp):
  slow = _answer("import time\ntime.sleep(0.4)\nprint(sum(map(int, input().split())))")
  many = {"inputs": ["1 1\n"] * 10, "outputs": ["2\n"] * 10}
  t0 = time.monotonic()
  ok, why = code_reward.check_code(slow, many, limits=FAST, time_budget_s=1.0)
  assert not ok and ("budget" in why or "timeout" in why)
  assert time.monotonic() - t0 < 2.0


# Hostile programs: each must score 0, leave the host (this process) alone and leave nothing running.
HOSTILE = {
    "infinite loop": "while True:\n  pass",
    "sleep forever": "import time\ntime.sleep(3600)",
    "fork bomb": "import os\nwhile True:\n  os.fork()",
    "10 GB allocation": "x = bytearray(10 * 2**30)\nprint(len(x))",
    "write outside": "open({outside!r}, 'w').write('pwned')\nprint(7)",
    "kill parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint(7)",
    "kill parent group": "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)\nprint(7)",
    "segfault": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)",
    "subprocess": "import subprocess\nsubprocess.run(['sleep', '100'])",
    "network": "import socket\nsocket.create_connection(('127.0.0.1', 9))",
    "endless output": "while True:\n  print('x' * 100000)",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_programs_are_contained(name, sandbox_tmp, tmp_path_factory):
  outside = str(tmp_path_factory.mktemp("outside") / "pwned.txt")
  program = HOSTILE[name].format(outside=outside)
  parent_group = os.getpgid(0)
  t0 = time.monotonic()
  ok, why = code_reward.check_code(_answer(program), {"inputs": [""], "outputs": ["7"]}, limits=FAST)
  assert not ok, f"{name}: {why}"
  assert time.monotonic() - t0 < FAST.wall_s + 2.0
  assert not os.path.exists(outside)
  assert os.getpgid(0) == parent_group  # we are alive and in our own group


@pytest.mark.skipif(os.geteuid() != 0, reason="per-run uids need root")
def test_process_cap_holds_when_the_audit_hook_is_bypassed(sandbox_tmp):
  # Re-importing _posixsubprocess restores fork_exec behind the harness's back; RLIMIT_NPROC under the per-run uid
  # must still cap the processes, and everything (even children in new sessions) must die with the run.
  program = r'''
import os, sys, time
del sys.modules["_posixsubprocess"]
import _posixsubprocess
started = 0
for _ in range(100):
  r, w = os.pipe()
  try:
    _posixsubprocess.fork_exec([sys.executable, "-S", "-c", "import time; time.sleep(60)"],
        [sys.executable.encode()], True, (r, w), None, None, -1, -1, -1, -1, -1, -1, r, w, True, True, -1,
        None, None, None, -1, None, False)
    started += 1
  except OSError:
    pass
  os.close(r)
  os.close(w)
print(started, flush=True)
time.sleep(60)
'''
  limits = sandbox.Limits(wall_s=2.0, cpu_s=2.0, max_procs=8)
  r = sandbox.run_python(program, limits=limits)
  assert r.status == "timeout"
  assert 0 < int(r.stdout.split()[0]) < limits.max_procs


def test_sandbox_environment_is_minimal(sandbox_tmp, monkeypatch):
  monkeypatch.setenv("SECRET_TOKEN", "hunter2")
  r = sandbox.run_python("import os\nprint(sorted(os.environ))\nprint(os.getcwd())", limits=FAST)
  assert r.ok
  names = r.stdout.splitlines()[0]
  assert "SECRET_TOKEN" not in names and "PATH" in names
  assert r.stdout.splitlines()[1].startswith(sandbox_tmp)


def test_kill_tree_kills_grandchildren(tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top

  child = subprocess.Popen(["sh", "-c", "sleep 100 & sleep 100 & wait"], start_new_session=True)
  deadline = time.monotonic() + 10
  while len(sandbox.descendants(child.pid)) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
  kids = sandbox.descendants(child.pid)
  assert len(kids) >= 2
  sandbox.kill_tree(child.pid)
  child.wait()
  time.sleep(0.1)
  for k in kids:
    try:
      with open(f"/proc/{k}/stat") as f:
        assert f.read().split(") ")[1][0] == "Z"  # at most a zombie awaiting init
    except FileNotFoundError:
      pass
  assert child.returncode == -signal.SIGKILL
