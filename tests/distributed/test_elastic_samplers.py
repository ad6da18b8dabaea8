"""Samplers come and go while the learner runs on: a job of a learner and two sampler processes
(`launch/local.py --restart_samplers`) through a sampler killed with groups in flight, one stopped (SIGSTOP) past the
heartbeat limit, and a third started by hand that joins."""

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time

import pytest

from areal_jax.config import load_config
from areal_jax.rl.metrics import read_metrics
from run_checks import FAST, ROOT, Log, assert_every_prompt_once, rollouts
from waiting import wait_until

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

HEARTBEAT_S = 5
STEPS = 60
# Delta weight sync on, with bfloat16 sampler weights (a float32 copy changes nearly everywhere every step): every
# pull after a sampler's first is rebuilt from its delta and checked against the version's fingerprint.
OVERRIDES = {"mesh.cpu_devices": 1, "mesh.sampler_processes": 2, "mesh.sampler_heartbeat_s": HEARTBEAT_S,
             "total_steps": STEPS, "sync.delta": True, "sampler.param_dtype": "bfloat16"}


def _steps(workdir) -> int:
  return len(read_metrics(workdir)) - 1 if os.path.exists(os.path.join(workdir, "metrics.jsonl")) else -1


def _wait_steps(workdir, n, job, timeout=300):
  def done():
    assert job.poll() is None, f"the job ended before step {n}"
    return _steps(workdir) >= n

  wait_until(done, timeout_s=timeout, what=f"step {n}", poll_s=0.1)


def test_samplers_leave_and_join_a_running_job(tmp_path):
  workdir = str(tmp_path / "run")
  flags = [f"--config={FAST}", f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  env = dict(os.environ, JAX_PLATFORMS="cpu", AREAL_JAX_AUTHKEY=secrets.token_hex(16))
  log = Log(str(tmp_path / "job.log"))
  with open(log.path, "w") as out:
    job = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "local.py"), *flags, "--num_processes=3",
                            "--restart_samplers"], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                           start_new_session=True)
  extra = None
  try:
    [address] = log.wait_for(r"control address is (\S+)", 60, job)
    log.wait_for(r"sampler 1 is process 2", 60, job)
    pids = {name: int(pid) for name, pid in re.findall(r"(sampler \d) is process \d \(pid (\d+)\)", log.text())}
    _wait_steps(workdir, 2, job)

    # One more sampler, started by hand against the running job: it gets the current weights and work. (Early, so that
    # the run has most of its steps left to give it work on a slow machine.)
    with open(tmp_path / "extra.log", "w") as out:
      extra = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "tpu_run.py"), *flags,
                                "--num_processes=3", "--process_id=3", f"--coordinator_address={address}"],
                               env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    step_before = _steps(workdir)
    joined_at = int(log.wait_for(r"sampler 2 joined at version (\d+)", 120, job)[0])

    # Killed with groups in flight: they are generated again; it is restarted and rejoins. (A kill that finds it
    # between groups, the buffer full while the learner evaluates, shows nothing: then again, once it is back.)
    lost = 0
    for attempt in range(1, 6):
      _wait_steps(workdir, _steps(workdir) + 2, job)  # at work: groups go to both samplers
      os.kill(pids["sampler 0"], signal.SIGKILL)
      lost = int(log.wait_for(r"sampler 0 \(process 1\) is gone.*: dropped; its (\d+) groups", 30, job, attempt)[-1])
      pids["sampler 0"] = int(log.wait_for(r"local: sampler 0 is restarted \(pid (\d+)\)", 30, job, attempt)[-1])
      log.wait_for(r"sampler 0 joined at version", 120, job, attempt)
      if lost:
        break

    # Hung (SIGSTOP): dropped at the heartbeat limit and told so; once it runs again, the same process (its engine
    # as it was) connects again and rejoins.
    joins = len(re.findall(r"sampler 1 joined at version", log.text()))
    os.kill(pids["sampler 1"], signal.SIGSTOP)
    stopped_at = time.time()
    log.wait_for(r"sampler 1 sent nothing for \d+ s \(mesh.sampler_heartbeat_s=5\)", HEARTBEAT_S + 10, job)
    dropped_after = time.time() - stopped_at
    os.kill(pids["sampler 1"], signal.SIGCONT)
    log.wait_for(r"sampler 1: the leader dropped it \(.*hung or cut off\); connecting again", 60, job)
    log.wait_for(r"sampler 1 joined at version", 60, job, joins + 1)

    assert job.wait(timeout=600) == 0, log.text()[-4000:]
    assert extra.wait(timeout=60) == 0
  finally:
    for p in (job, extra):
      if p is not None and p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)

  text = log.text()
  assert dropped_after <= HEARTBEAT_S + 3, f"a SIGSTOPped sampler was dropped after {dropped_after:.1f} s"
  # The version current when it joined: at least the one before the latest row's (sync.overlap offers a version
  # while the learner trains on, so its row may be written before it is offered).
  assert joined_at >= step_before - 1
  answers = int(re.search(r"sampler 2: stopping after (\d+) answers", open(tmp_path / "extra.log").read()).group(1))
  assert answers > 0
  assert text.count("learner 0 is process 0") == 1 and "resumed" not in text  # the learner never restarted
  assert "local: sampler 1 (pid" not in text  # the stopped one rejoined without exiting
  config = load_config(FAST, **OVERRIDES)
  assert_every_prompt_once(workdir, config, last_step=STEPS)
  metrics = read_metrics(workdir)
  last = metrics[-1]
  # Deltas moved: fewer bytes than the whole copy on some version, and every pull checked (a mismatch fails the job).
  assert all(0 <= m["sync/changed_fraction"] <= 1 for m in metrics[2:]), metrics[2]
  assert min(m["sync/bytes"] for m in metrics[2:]) < metrics[1]["sync/bytes"]
  assert last["samplers/lost"] >= 2 and last["samplers/joined"] >= 3 and last["samplers/live"] == 3
  assert lost >= 1 and last["rollout/regenerated_groups"] >= lost, (lost, last["rollout/regenerated_groups"])
  eta = config.rollout.max_head_offpolicyness
  for r in rollouts(workdir):
    assert r["filtered"] or all((r["step"] - 1) - v <= eta for v in r["version_start"]), json.dumps(r)
