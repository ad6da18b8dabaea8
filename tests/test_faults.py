"""Faults beyond a kill, each on a real run (`launch/tpu_run.py`, the fast 2-layer config): bad data rows, a prompt
longer than the cache, reward workers that crash or hang, NaN gradients, an evaluation file that disappears and a
disk that fills up during a checkpoint write. Each must say what went wrong, keep what was written, and go on where it
can; a restart must resume from the last checkpoint."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from areal_jax import faults
from areal_jax.data import synthetic
from areal_jax.data.prompts import INSTRUCTIONS
from helpers import write_bpe_tokenizer

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _job(workdir, *flags, env=None, wrap=(), timeout=600):
  cmd = [sys.executable, os.path.join(ROOT, "launch", "tpu_run.py"), f"--config={ROOT}/configs/math.py:fast",
         f"--workdir={workdir}"]
  cmd += list(flags)
  out = subprocess.run(list(wrap) + cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, check=False)
  return out.returncode, out.stdout + out.stderr


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]  # raises on a torn line


def _restorable(workdir):
  """Steps of the run's checkpoints, read by Orbax itself; the latest is restored and must be finite."""
  with ocp.CheckpointManager(os.path.join(workdir, "checkpoints")) as mngr:
    steps = sorted(mngr.all_steps())
    restored = mngr.restore(steps[-1])
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(restored["params"]))
  assert restored["meta"]["step"] == steps[-1]
  return steps


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  """A JSONL train file with two bad rows and one over-long prompt in the middle, an eval file, a BPE tokenizer."""
  d = tmp_path_factory.mktemp("data")
  train = synthetic.generate(300, difficulty=1, seed=0)
  held = synthetic.generate(8, difficulty=1, seed=0, split="eval")
  rows = [json.dumps({"id": p.uid, "problem": p.question, "answer": p.reference, "solution": p.solution})
          for p in train]
  rows[100] = '{"problem": "what is 2+2", "answer": '  # a torn row
  rows[150] = json.dumps({"question": "what is 3+3?"})  # no answer
  rows[200] = json.dumps({"id": "too-long", "problem": "1+" * 200 + "1", "answer": "201"})
  (d / "train.jsonl").write_text("\n".join(rows) + "\n")
  (d / "eval.jsonl").write_text("".join(json.dumps({"id": p.uid, "problem": p.question, "answer": p.reference}) + "\n"
                                        for p in held))
  texts = [INSTRUCTIONS["math"]] * 20 + [f"{p.question}\n{p.solution}" for p in train]
  tokenizer = write_bpe_tokenizer(str(d / "tokenizer"), texts)
  flags = ["--config.data.source=jsonl", f"--config.data.path={d}/train.jsonl",
           f"--config.data.eval_path={d}/eval.jsonl", f"--config.model.tokenizer={tokenizer}",
           "--config.model.vocab_size=304", "--config.data.max_prompt_len=64", "--config.sampler.max_seq_len=112",
           "--config.eval.every_steps=4"]
  return d, flags


def test_bad_rows_reward_storm_nan_and_a_lost_eval_file(tmp_path, data):
  d, flags = data
  workdir = str(tmp_path / "run")

  # Bad rows stop the run before it writes anything, naming file, line and the way out.
  rc, log = _job(workdir, *flags, "--config.total_steps=4")
  assert rc != 0 and f"{d}/train.jsonl:101: malformed JSON (Expecting value at column 38)" in log, log[-3000:]
  assert "set data.skip_bad_rows=True" in log
  assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))

  # Skipped and counted; the over-long prompt is dropped by name; every 10th reward crashes its worker and every
  # 25th hangs until the timeout: those answers score 0, are named in the log and counted, and the run goes on.
  flags += ["--config.data.skip_bad_rows=True", "--config.reward.timeout_s=1", "--config.reward.num_workers=2"]
  rc, log = _job(workdir, *flags, "--config.total_steps=4", env={faults.FAULT_ENV: "reward_crash:10,reward_hang:25"})
  assert rc == 0, log[-5000:]
  assert "train.jsonl:101: malformed JSON" in log and "train.jsonl:151: missing field 'answer'" in log
  assert "skipped 2 of 300 rows as bad" in log
  assert "dropped 1 of 298 prompts longer than data.max_prompt_len=64 tokens" in log and "e.g. too-long" in log
  assert "worker crashed (exit code 3); scored 0" in log and "timed out after 1.0 s" in log
  assert "evaluation: " in log and "could not be scored and count as wrong" in log
  metrics = _lines(os.path.join(workdir, "metrics.jsonl"))
  assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
  assert metrics[-1]["rollout/reward_failures"] >= 4
  assert _restorable(workdir) == [2, 4]

  # NaN gradients in the second step after the restart: the run stops naming the step; nothing past step 4's
  # checkpoint is saved and the logs are whole.
  rc, log = _job(workdir, *flags, "--config.total_steps=8", env={faults.FAULT_ENV: "nan_grads:2"})
  assert rc != 0 and "resumed" in log and "at step 4" in log
  assert "FloatingPointError: learner step 6: " in log and "is nan" in log and "last checkpoint is intact" in log
  assert _restorable(workdir) == [2, 4]
  assert [m["step"] for m in _lines(os.path.join(workdir, "metrics.jsonl"))] == [0, 1, 2, 3, 4, 5]
  logs = {name: open(os.path.join(workdir, name)).read() for name in ("metrics.jsonl", "rollouts.jsonl")}

  # The eval file is gone: the restart stops at once, naming the setting and the file, and changes nothing.
  os.rename(d / "eval.jsonl", d / "eval.moved")
  try:
    rc, log = _job(workdir, *flags, "--config.total_steps=6")
  finally:
    os.rename(d / "eval.moved", d / "eval.jsonl")
  assert rc != 0 and f"data.eval_path: data file '{d}/eval.jsonl' does not exist" in log, log[-3000:]
  assert {name: open(os.path.join(workdir, name)).read() for name in logs} == logs
  assert _restorable(workdir) == [2, 4]  # what a restart resumes from (resuming: tests/tools/test_chaos.py)


def _can_mount_tmpfs(tmp_path):
  target = tmp_path / "probe"
  target.mkdir()
  probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                          f"mount -t tmpfs -o size=64k tmpfs {target}"], capture_output=True, check=False)
  return probe.returncode == 0


def test_disk_full_during_a_checkpoint_write(tmp_path):
  """The checkpoint directory is a 1.1 MB tmpfs (in a user and mount namespace; no root needed): two checkpoints of
  the fast model fit, the third does not. One takes 0.42-0.46 MB there (measured: three fill 1.25-1.30 MB, two
  fit in 0.95 MB), so the size sits in the middle of the window, not at its edge."""
  if shutil.which("unshare") is None or not _can_mount_tmpfs(tmp_path):
    pytest.skip("needs `unshare` with user namespaces to mount a small tmpfs")
  workdir = tmp_path / "run"
  checkpoints = workdir / "checkpoints"
  checkpoints.mkdir(parents=True)
  # The tmpfs lives as long as the namespace: copy what the run left there before leaving it.
  script = f'mount -t tmpfs -o size=1100k tmpfs {checkpoints} && "$@"; rc=$?; cp -a {checkpoints} {tmp_path}/kept; ' \
           'exit $rc'
  rc, log = _job(str(workdir), "--config.total_steps=6",
                 wrap=["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh"])
  assert rc != 0, log[-3000:]
  assert f"CheckpointError: checkpoint of step 6 to {checkpoints} failed: no space left on device" in log, log[-5000:]
  assert "step 4's checkpoint is intact" in log
  assert [m["step"] for m in _lines(workdir / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5, 6]

  # What was on the full disk is intact: steps 2 and 4 (step 6 only as Orbax's temporary directory). Restarted on
  # them with free space, the run resumes from step 4.
  os.rmdir(checkpoints)
  shutil.move(tmp_path / "kept", checkpoints)
  assert _restorable(str(workdir)) == [2, 4]
  rc, log = _job(str(workdir), "--config.total_steps=6")
  assert rc == 0 and "at step 4" in log, log[-3000:]
  assert [m["step"] for m in _lines(workdir / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5, 6]
  assert _restorable(str(workdir)) == [2, 4, 6]


def test_fault_specs_name_the_variable(monkeypatch):
  assert faults.parse_faults("nan_grads:3,reward_hang:10") == {"nan_grads": 3, "reward_hang": 10}
  for bad in ("nan_grad:3", "reward_crash:0", "reward_crash", "nan_grads:x"):
    with pytest.raises(ValueError, match=faults.FAULT_ENV):
      faults.parse_faults(bad)
  monkeypatch.setenv(faults.FAULT_ENV, "reward_crash:3,nan_grads:2")
  assert [faults.hit("reward_crash", n) for n in range(1, 7)] == [False, False, True, False, False, True]
  assert [faults.hit("nan_grads") for _ in range(4)] == [False, True, False, False]
  assert not faults.hit("reward_hang", 5)
