"""Shared by the tests of whole runs: the repo's paths, a run's rollouts, and the check that a run (killed and resumed,
or run as processes) trained every prompt exactly once."""

import json
import os
import re
import subprocess
import sys

from areal_jax.checkpoint.store import Checkpointer
from areal_jax.data import DataConfig, build_dataset
from areal_jax.rl.metrics import read_metrics
from areal_jax.tokenizer import load_tokenizer
from waiting import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "math.py")
FAST = CONFIG + ":fast"  # a small, quick run with every mechanism on


def local_job_command(workdir, num_processes, overrides):
  """`launch/local.py` running FAST in `workdir` as `num_processes` processes, with `--config.K=V` overrides."""
  args = [sys.executable, os.path.join(ROOT, "launch", "local.py"), f"--config={FAST}", f"--workdir={workdir}",
          f"--num_processes={num_processes}"]
  return args + [f"--config.{k}={v}" for k, v in overrides.items()]


def run_local_job(workdir, num_processes, overrides, timeout=400):
  """`local_job_command` run to its end on CPU, tests/ importable (agent_examples); its CompletedProcess."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH")])))
  return subprocess.run(local_job_command(workdir, num_processes, overrides), env=env, capture_output=True, text=True,
                        timeout=timeout)


def rollouts(workdir):
  with open(os.path.join(workdir, "rollouts.jsonl")) as f:
    return [json.loads(line) for line in f]


def _epoch_order(config, n):
  ds = build_dataset(DataConfig.from_config(config.data), load_tokenizer(config.model.tokenizer), split="train")
  return [next(ds).uid for _ in range(n)]


def assert_every_prompt_once(workdir, config, *, last_step):
  """Steps 0..last_step logged once each; no prompt trained on twice; every prompt drawn is done or pending, and
  together they are exactly a prefix of the epoch's order (none skipped)."""
  assert [m["step"] for m in read_metrics(workdir)] == list(range(0, last_step + 1))
  logged = [r["uid"] for r in rollouts(workdir)]
  assert len(logged) == len(set(logged)), "a prompt was trained on (or filtered) twice"
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=2)
  undone = ckpt.read_meta(last_step).controller["undone"]
  ckpt.close()
  assert not set(undone) & set(logged)
  assert sorted(logged + undone) == sorted(_epoch_order(config, len(logged) + len(undone)))


class Log:
  """The launcher's output, read as it grows."""

  def __init__(self, path):
    self.path = path

  def text(self) -> str:
    with open(self.path) as f:
      return f.read()

  def wait_for(self, pattern: str, timeout: float, proc=None, count: int = 1) -> list:
    """The matches (`re.findall`) of `pattern` once it has appeared `count` times."""
    def found():
      assert proc is None or proc.poll() is None, f"the job ended waiting for {pattern!r}:\n{self.text()[-4000:]}"
      return len(matches := re.findall(pattern, self.text())) >= count and matches

    return wait_until(found, timeout_s=timeout, what=lambda: f"{pattern!r}:\n{self.text()[-4000:]}", poll_s=0.1)
