"""Code rewards: extraction, test formats, output matching, and the sandbox containing hostile programs."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import types

import hostile_code
import pytest

from areal_jax.reward import code as code_reward
from areal_jax.reward import sandbox
from areal_jax.reward.service import RewardService
from waiting import wait_until

FAST = sandbox.Limits(wall_s=1.5, cpu_s=1.0, memory_mb=512)
STDIN_TESTS = {"inputs": ["3 4\n", "10 -2\n"], "outputs": ["7\n", "8\n"]}


def _answer(body: str) -> str:
  return f"Let me think.\n```python\n{body}\n```\nDone."


@pytest.fixture
def sandbox_tmp(tmp_path, monkeypatch):
  """Checks that a test's runs leave nothing: no jailed process, no working directory ("rlimits" makes them here)."""
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  yield str(tmp_path)
  assert hostile_code.jailed_processes() == [], "sandboxed processes left running"
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


@pytest.fixture(scope="module")
def hostile():
  setup = hostile_code.Setup.make()
  yield setup
  setup.close()


def test_hostile_answers_score_zero_through_the_reward_service(hostile, sandbox_tmp, monkeypatch):
  monkeypatch.setenv("AREAL_JAX_AUTHKEY", hostile_code.SECRET)  # the workers inherit it, as in a training run
  limits = sandbox.Limits(wall_s=2.0, cpu_s=2.0, memory_mb=1024)
  tests = {"inputs": [""], "outputs": ["7"]}
  with RewardService(num_workers=2, timeout_s=20.0, code_limits=limits) as service:
    futures = {name: service.submit(name, "code", _answer(program), tests)
               for name, program in hostile.programs().items()}
    results = {name: f.result(timeout=120) for name, f in futures.items()}
    scored = {name: r.reason for name, r in results.items() if r.reward != 0.0}
    assert not scored, scored
    assert service.healthy and service.stats()["crashes"] == 0, service.stats()
    assert service.submit("honest", "code", _answer("print(3 + 4)"), tests).result(30).reward == 1.0
  assert hostile.breaches() == []
  assert hostile_code.jailed_processes() == []


@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("setpriv") and os.path.exists("/usr/bin/python3")),
                    reason="runs the attacks as uid 65534: needs root, setpriv and a system /usr/bin/python3")
def test_hostile_answers_score_zero_as_an_unprivileged_user(hostile, tmp_path):
  # The same jail started by an unprivileged service: a copy of the sandbox (and pyseccomp) that uid 65534 can read,
  # run by the system interpreter (ours may sit where that uid cannot reach).
  import pyseccomp  # pylint: disable=g-import-not-at-top
  here = tempfile.mkdtemp(prefix="unprivileged_")
  try:
    os.chmod(here, 0o755)
    for src in (sandbox.__file__, pyseccomp.__file__, hostile_code.__file__):
      shutil.copy(src, here)
    spec = json.dumps({"programs": hostile.programs()})
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-s", "-E",
                        os.path.join(here, "hostile_code.py"), spec], capture_output=True, text=True, timeout=300,
                       cwd=here, env={"PATH": os.environ["PATH"], "AREAL_JAX_AUTHKEY": hostile_code.SECRET})
  finally:
    shutil.rmtree(here, ignore_errors=True)
  assert r.returncode == 0, r.stderr[-3000:]
  results = json.loads(r.stdout.splitlines()[-1])
  assert set(results) == set(hostile_code.ATTACKS)
  assert not [s for s in results.values() if s[0].startswith("error")], results  # each one really ran
  scored = {name: s for name, s in results.items() if s[1]}
  assert not scored, scored
  assert hostile.breaches() == []
  assert hostile_code.jailed_processes() == []


def test_missing_isolation_refuses_to_score_unless_the_weaker_mode_is_named(sandbox_tmp, monkeypatch):
  monkeypatch.setattr(shutil, "which", lambda name: None)
  with pytest.raises(sandbox.SandboxUnavailable, match="bubblewrap"):
    sandbox.run_python("print(1)", limits=FAST)
  with pytest.raises(sandbox.SandboxUnavailable, match="isolation='rlimits'"):
    code_reward.check_code(_answer("print(7)"), {"inputs": [""], "outputs": ["7"]}, limits=FAST)
  weak = dataclasses.replace(FAST, isolation="rlimits")
  assert code_reward.check_code(_answer("print(7)"), {"inputs": [""], "outputs": ["7"]}, limits=weak) == (
      True, "all 1 tests passed")
  with pytest.raises(ValueError, match="choose one of"):
    sandbox.Limits(isolation="none")


def test_rlimits_mode_still_caps_time_memory_and_output(sandbox_tmp):
  weak = dataclasses.replace(FAST, isolation="rlimits")
  assert sandbox.run_python("while True: pass", limits=weak).status in ("timeout", "signal SIGXCPU", "signal SIGKILL")
  assert sandbox.run_python("x = bytearray(10 << 30)", limits=weak).status == "exit 1"
  assert sandbox.run_python("while True: print('x' * 10000)", limits=weak).status == "output limit"


def test_nothing_of_a_run_outlives_its_return(sandbox_tmp):
  # bwrap can exit a moment before its jail's init: run_python must wait for the jail itself (this caught ~5%).
  for _ in range(60):
    assert sandbox.run_python("print(1)", limits=FAST).ok
    assert hostile_code.jailed_processes() == []


def test_sandbox_environment_is_minimal(sandbox_tmp, monkeypatch):
  monkeypatch.setenv("SECRET_TOKEN", "hunter2")
  program = (f"import os\nprint(sorted(os.environ))\n"
             f"print(os.getcwd(), os.getuid(), os.path.exists({__file__!r}), os.path.exists('/etc'))")
  r = sandbox.run_python(program, limits=FAST)
  assert r.ok, r
  names, where = r.stdout.splitlines()
  assert "SECRET_TOKEN" not in names and "PATH" in names
  assert where.split() == ["/tmp", "65534", "False", "False"]  # no project tree, no /etc


def test_kill_tree_kills_grandchildren(tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top

  child = subprocess.Popen(["sh", "-c", "sleep 100 & sleep 100 & wait"], start_new_session=True)
  kids = wait_until(lambda: len(found := sandbox.descendants(child.pid)) >= 2 and found, timeout_s=10,
                    what="both grandchildren started")
  sandbox.kill_tree(child.pid)
  child.wait()

  def gone(pid) -> bool:  # at most a zombie awaiting init
    try:
      with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] == "Z"
    except FileNotFoundError:
      return True

  wait_until(lambda: all(gone(k) for k in kids), timeout_s=10, what=f"grandchildren {kids} killed")
  assert child.returncode == -signal.SIGKILL


def test_a_run_with_code_problems_refuses_to_start_without_the_jail(monkeypatch):
  from areal_jax.config import load_config
  from areal_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from areal_jax.data.records import PromptRecord  # pylint: disable=g-import-not-at-top
  from areal_jax.run import trainer  # pylint: disable=g-import-not-at-top

  def missing():
    raise sandbox.SandboxUnavailable("code sandbox: `bwrap` is not on PATH")

  monkeypatch.setattr(sandbox, "check_isolation", missing)
  reward = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "math.py")).reward
  code = PromptRecord(uid="a", prompt="", prompt_ids=None, reference="", kind="code")
  code_set = types.SimpleNamespace(records=[code])
  math_set = types.SimpleNamespace(records=[PromptRecord(uid="b", prompt="", prompt_ids=None, reference="")])
  trainer._check_code_sandbox(reward, [math_set])  # pylint: disable=protected-access  # math needs no jail
  with pytest.raises(ConfigError, match="config.reward.code_isolation='bwrap': code sandbox: `bwrap` is not on PATH"):
    trainer._check_code_sandbox(reward, [math_set, code_set])  # pylint: disable=protected-access
  reward.code_isolation = "rlimits"
  trainer._check_code_sandbox(reward, [code_set])  # pylint: disable=protected-access  # the weaker mode, by name
