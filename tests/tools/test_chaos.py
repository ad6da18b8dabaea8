"""tools/chaos.py: a run killed mid-checkpoint-write and mid-learner-step resumes with every invariant intact, and
each check catches the violation it names."""

import argparse
import importlib.util
import json
import os
import signal
import struct
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def _scalar_steps(logdir) -> dict[str, list[int]]:
  """tag -> the steps of its scalars, in file order, from the TFRecord event files in `logdir`."""
  from tensorboardX.proto import event_pb2

  out = {}
  for name in sorted(os.listdir(logdir)):
    data, i = open(os.path.join(logdir, name), "rb").read(), 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      for v in event.summary.value:
        out.setdefault(v.tag, []).append(event.step)
  return out


def test_kills_before_the_first_checkpoint_leave_no_rows(tmp_path):
  """Issue 32: two attempts killed before any checkpoint exists (at step 2's weight update; the first checkpoint is
  step 2's), then one to the end. Each restart starts from nothing, so the killed attempts' rows (steps 0 and 1 of
  metrics, rollouts and TensorBoard) must go: every check of tools/chaos.py holds."""
  from areal_jax.faults import ENV

  tool = _tool()
  args = argparse.Namespace(workdir=str(tmp_path / "run"), steps=4, seed=3, processes=0)
  cmd = [sys.executable, os.path.join(ROOT, "launch", "tpu_run.py"), f"--config={tool.CONFIG}",
         f"--workdir={args.workdir}"]
  cmd += [f"--config.{k}={v}" for k, v in tool._overrides(args).items()] + ["--config.metrics.tensorboard=True"]
  attempts = []
  for kill in ("weight_update:2", "weight_update:2", None):
    env = {k: v for k, v in os.environ.items() if k != ENV} | {"JAX_PLATFORMS": "cpu"} | ({ENV: kill} if kill else {})
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT, start_new_session=True,
                         check=False)
    log = out.stdout + out.stderr
    assert out.returncode == (-signal.SIGKILL if kill else 0), log[-3000:]
    assert "resumed" not in log, log[-3000:]
    if kill:
      assert [m["step"] for m in map(json.loads, open(os.path.join(args.workdir, "metrics.jsonl")))] == [0, 1]
    attempts.append(tool.Attempt(kill=kill or "none", outcome="killed" if kill else "completed"))
  checks = dict(tool.check_run(args, attempts))
  assert len(checks) == 5 and not any(checks.values()), checks
  steps = _scalar_steps(os.path.join(args.workdir, "tensorboard"))
  assert steps["learner/loss"] == [1, 2, 3, 4] and steps["eval/accuracy"] == [0, 4], steps


def test_truncate_events_keeps_steps_up_to_the_restored_one(tmp_path):
  from etils import epath

  from areal_jax.rl.metrics import TensorBoard, cut_logs, truncate_events

  logdir = tmp_path / "tensorboard"
  for steps in (range(0, 3), range(1, 5)):  # an attempt killed after step 2, then one killed after step 4
    tb = TensorBoard(logdir)
    for s in steps:
      tb.write(s, {"a": float(s), "b": "text"})
    tb.close()
    time.sleep(1.1)  # event file names hold the second they were made (and the pid): one file per attempt
  assert _scalar_steps(logdir) == {"a": [0, 1, 2, 1, 2, 3, 4]}
  first = sorted(os.listdir(logdir))[0]
  with open(logdir / first, "ab") as f:
    f.write(b"\x10\x00\x00")  # a torn record at the end of the first file
  truncate_events(epath.Path(logdir), 1)
  assert _scalar_steps(logdir) == {"a": [0, 1, 1]}
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(3)))
  cut_logs(str(tmp_path), None)  # no checkpoint: nothing is kept, step 0 included
  assert os.listdir(logdir) == [] and (tmp_path / "metrics.jsonl").read_text() == ""


def test_truncate_jsonl_drops_a_torn_last_line(tmp_path):
  from etils import epath

  from areal_jax.rl.metrics import truncate_jsonl

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
