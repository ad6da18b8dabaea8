"""tools/chaos.py: a run killed mid-checkpoint-write and mid-learner-step resumes with every invariant intact, and
each check catches the violation it names."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "chaos.py")


def _tool():
  spec = importlib.util.spec_from_file_location("chaos", TOOL)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclass looks itself up there
  spec.loader.exec_module(module)
  return module


def test_chaos_kills_then_checks_catch_tampering(tmp_path):
  workdir = str(tmp_path / "run")
  out = subprocess.run([sys.executable, TOOL, f"--workdir={workdir}", "--kills=2", "--steps=12", "--seed=1",
                        "--phases=checkpoint_write,learner_step"], capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "2 kills" in out.stdout and out.stdout.count(" ok\n") == 5, out.stdout
  assert "killed" in out.stdout and "completed" in out.stdout

  tool = _tool()
  args = argparse.Namespace(workdir=workdir, steps=12, seed=1)
  ok = dict(tool.check_run(args, []))
  assert not any(ok.values()), ok
  rollouts = os.path.join(workdir, "rollouts.jsonl")
  metrics = os.path.join(workdir, "metrics.jsonl")
  original = {p: open(p).read() for p in (rollouts, metrics)}

  def violated(edit_path, text):
    with open(edit_path, "w") as f:
      f.write(text)
    try:
      return {name for name, problems in tool.check_run(args, []) if problems}
    finally:
      for p, t in original.items():
        with open(p, "w") as f:
          f.write(t)

  lines = original[rollouts].splitlines(keepends=True)
  assert violated(rollouts, original[rollouts] + lines[-1]) == {"prompts: each trained once, none lost"}
  assert violated(rollouts, "".join(lines[:-1])) == {"prompts: each trained once, none lost"}  # one lost
  stale = json.loads(lines[-1]) | {"version_start": [-10] * 4}
  assert violated(rollouts, "".join(lines[:-1]) + json.dumps(stale) + "\n") == {
      "staleness: <= eta = 4 in every trained batch"}
  assert "logs: no torn or duplicated lines" in violated(metrics, original[metrics] + '{"step": 7, "ver')


def test_truncate_jsonl_drops_a_torn_last_line(tmp_path):
  from etils import epath

  from areal_jax.system.metrics import truncate_jsonl

  path = epath.Path(tmp_path / "metrics.jsonl")
  rows = "".join(json.dumps({"step": s}) + "\n" for s in range(4))
  path.write_text(rows + '{"step": 4, "lo')  # killed while appending step 4
  truncate_jsonl(path, 2)
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
  path.write_text('{"step": 0}\n{"st\n{"step": 1}\n')  # a broken line in the middle is not a torn tail
  with pytest.raises(ValueError, match="line 2 is not JSON"):
    truncate_jsonl(path, 1)


def test_kill_spec_errors_name_the_variable():
  from areal_jax import faults

  assert faults.parse("learner_step:3") == ("learner_step", 3)
  for bad in ("learner:1", "learner_step", "learner_step:0"):
    with pytest.raises(ValueError, match=f"AREAL_KILL_AT='{bad}'"):
      faults.parse(bad)
