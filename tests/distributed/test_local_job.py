"""Multi-process jobs on CPU, started with launch/local.py: roles in separate processes, each pinned to its cores."""

import pytest
import os
import re
import signal
import subprocess
import threading
import time

import jax
import numpy as np

from areal_jax.checkpoint.store import Checkpointer
from areal_jax.config import load_config
from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.learner import Learner
from areal_jax.models.config import ModelConfig
from areal_jax.rl.batches import load_batch
from areal_jax.rl.metrics import read_metrics
from areal_jax.sharding import make_mesh
from run_checks import FAST, assert_every_prompt_once, local_job_command as _command, rollouts, \
    run_local_job as _run
from waiting import wait_until

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

PROCESS_OVERRIDES = {"mesh.cpu_devices": 1}


def test_two_process_job_respects_staleness_and_checks_every_weight_pull(tmp_path):
  """With LoRA: the sampler process pulls the whole model once, then each version's adapters alone, and hands them to
  its two engine replicas (one device each)."""
  eta = 1
  overrides = dict(PROCESS_OVERRIDES, total_steps=4, **{"rollout.max_head_offpolicyness": eta,
                                                        "learner.lora.rank": 4, "mesh.cpu_devices": 2,
                                                        "mesh.sampler_replicas": 2})
  adapter_bytes = 4 * 4 * 2 * sum(i + o for i, o in ModelConfig.from_config(
      load_config(FAST, **overrides).model).lora_shapes().values())  # float32, rank 4, 2 layers
  proc = _run(tmp_path, 2, overrides)
  assert proc.returncode == 0, proc.stdout[-4000:]
  assert re.search(r"learner 0 is process 0 .* on cores \[\d+\]", proc.stdout)
  assert re.search(r"sampler 0 is process 1 .* on cores \[\d+\]", proc.stdout)
  assert re.search(r"sampler 0: 2 engine replica\(s\) of \{'data': 1, 'expert': 1, 'tensor': 1\} on 2 local devices",
                   proc.stdout + proc.stderr), proc.stdout[-4000:]
  metrics = read_metrics(str(tmp_path))
  assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
  # Under sync.overlap a row's publish figures are the version before's: step 1's are version 0's whole model.
  assert metrics[1]["sync/bytes"] > adapter_bytes
  for m in metrics[1:]:
    assert m["version"] == m["step"] and m["staleness/max"] <= eta
    # Every pull the sampler made was checked against the published fingerprint (a mismatch stops the run).
    assert m["sync/sampler0/seconds"] > 0 and m["sync/mb_per_s"] > 0 and m["sync/version_lag"] >= 0
    assert m["step"] == 1 or m["sync/bytes"] == adapter_bytes
    assert m["sampler/busy_s"] > 0 and m["learner/busy_s"] > 0
  trained = [r for r in rollouts(tmp_path) if not r["filtered"]]
  assert len(trained) == 4 * load_config(FAST).rollout.batch_size
  versions = [v for r in trained for v in r["version_start"] + r["version_end"]]
  assert max(versions) >= 1, "the sampler never generated with pulled (non-initial) weights"
  for r in trained:
    assert all((r["step"] - 1) - v <= eta for v in r["version_start"]), r
    assert all(a <= b for a, b in zip(r["version_start"], r["version_end"]))


def test_an_agent_trains_through_the_sampler_hub(tmp_path):
  """An agent's episodes on the leader reach a sampler process through the hub, and are recorded and trained."""
  overrides = dict(PROCESS_OVERRIDES, total_steps=2, **{"agent.path": "agent_examples:two_turn",
                                                         "sampler.max_seq_len": 128})
  proc = _run(tmp_path, 2, overrides)
  assert proc.returncode == 0, proc.stdout[-4000:]
  metrics = read_metrics(str(tmp_path))
  assert [m["step"] for m in metrics] == [0, 1, 2]
  for m in metrics[1:]:
    assert m["agent/turns_mean"] == 2.0 and m["agent/episode_failures"] == 0 and m["sampler/busy_s"] > 0, m
  trained = [r for r in rollouts(tmp_path) if not r["filtered"]]
  assert all(r["turns"] == [2] * load_config(FAST).rollout.group_size for r in trained)


def test_a_killed_learner_process_stops_the_job_and_a_restart_resumes(tmp_path):
  """Learners are not elastic (samplers are: test_elastic_samplers.py)."""
  workdir = str(tmp_path / "run")
  overrides = dict(PROCESS_OVERRIDES, total_steps=6)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(_command(workdir, 2, overrides), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
  lines = []
  try:
    def saved():
      assert proc.poll() is None, proc.stdout.read()[-3000:]
      return os.path.isdir(os.path.join(workdir, "checkpoints", "2"))

    wait_until(saved, timeout_s=300, what="a checkpoint at step 2", poll_s=0.2)
    out = proc.stdout
    learner_pid = None
    while learner_pid is None:  # the launcher printed every process's pid first
      lines.append(out.readline())
      if m := re.search(r"learner 0 is process 0 \(pid (\d+)\)", lines[-1]):
        learner_pid = int(m.group(1))
    os.kill(learner_pid, signal.SIGKILL)
    killed_at = time.time()
    lines += out.readlines()
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  assert proc.returncode != 0
  assert time.time() - killed_at < 30, "the job took too long to stop after its learner died"
  log = "".join(lines)
  assert "local: learner 0" in log and "exited with signal SIGKILL" in log, log[-3000:]

  done = _run(workdir, 2, overrides)
  assert done.returncode == 0, done.stdout[-4000:]
  assert "resumed" in done.stdout
  assert_every_prompt_once(workdir, load_config(FAST, **overrides), last_step=6)


def test_sigterm_stops_the_job_cleanly(tmp_path):
  """`kill -TERM` of launch/local.py: every process shuts down (no crash in a signal handler), the job exits 143."""
  workdir = str(tmp_path / "run")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(_command(workdir, 2, dict(PROCESS_OVERRIDES, total_steps=50)), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
  lines = []
  reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
  reader.start()
  try:
    def trained():  # step 1 trained: every thread and process is at work
      assert proc.poll() is None, "".join(lines)[-3000:]
      return len(read_metrics(workdir)) >= 2

    wait_until(trained, timeout_s=300, what="step 1", poll_s=0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  reader.join(10)
  log = "".join(lines)
  assert proc.returncode == 128 + signal.SIGTERM, log[-3000:]
  assert "local: stopped by SIGTERM; run the same command again" in log, log[-3000:]
  assert "received SIGTERM: stopped" in log and "Traceback" not in log and "exited with" not in log, log[-3000:]
  steps = [m["step"] for m in read_metrics(workdir)]
  assert steps == list(range(len(steps))) and len(steps) < 51


def test_two_learner_processes_take_the_single_process_step(tmp_path):
  """learner 0 + learner 1 (fsdp across the two processes, gloo) + one sampler; the step they take equals one
  process's step on the same batch, from the same random init."""
  overrides = dict(PROCESS_OVERRIDES, total_steps=1, **{
      "warmstart.steps": 0, "checkpoint.every_steps": 1, "eval.every_steps": 100, "metrics.save_batches": True,
      # Untrained, every answer scores 0: raw (unnormalised) advantages and no warmup make the step move anyway.
      "learner.ppo_n_minibatches": 2, "learner.adv_norm": "none", "learner.warmup_steps": 0})
  proc = _run(tmp_path, 3, dict(overrides, **{"mesh.sampler_processes": 1}))
  assert proc.returncode == 0, proc.stdout[-4000:]
  assert "learner 1 is process 1" in proc.stdout and "sampler 0 is process 2" in proc.stdout

  config = load_config(FAST, **overrides)
  mesh = make_mesh(jax.devices()[:2], {"fsdp": 2, "tensor": 1})
  learner_cfg = LearnerConfig.from_config(config.learner, max_new_tokens=config.sampler.max_new_tokens)
  learner = Learner(model_cfg=ModelConfig.from_config(config.model), config=learner_cfg, mesh=mesh,
                    temperature=config.sampler.temperature, seed=config.seed)
  ckpt = Checkpointer(os.path.join(tmp_path, "checkpoints"), every_steps=1)
  want, _, meta = ckpt.restore(1, params=learner.params, opt_state=learner.opt_state)
  ckpt.close()
  assert meta.version == 1
  learner.train_step(load_batch(str(tmp_path), 1))
  got = jax.tree_util.tree_flatten_with_path(jax.device_get(learner.params))[0]
  for (path, a), b in zip(got, jax.tree.leaves(jax.device_get(want))):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=jax.tree_util.keystr(path))
  moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
              for (_, a), b in zip(got, jax.tree.leaves(jax.device_get(learner.fns.init_params(config.seed)))))
  assert moved > 1e-4, "the step did not move the parameters: the comparison would prove nothing"


def test_local_launcher_rejects_a_bad_layout(tmp_path):
  proc = _run(tmp_path, 2, dict(PROCESS_OVERRIDES, **{"mesh.sampler_processes": 2}), timeout=60)
  assert proc.returncode != 0
  assert "config.mesh.sampler_processes=2" in proc.stdout + proc.stderr


def test_batches_round_trip(tmp_path):
  n = 3
  from areal_jax.rl.batches import save_batch  # pylint: disable=g-import-not-at-top
  from areal_jax.types import Trajectory  # pylint: disable=g-import-not-at-top

  trajs = [Trajectory(prompt_ids=np.arange(3, dtype=np.int32), response_ids=np.arange(i + 1, dtype=np.int32),
                      logprobs=-np.ones(i + 1, np.float32), versions=np.full(i + 1, i, np.int32),
                      finish_reason="eos", group_id=i // 2, reward=float(i % 2)) for i in range(4)]
  trajs[1] = trajs[1].replace(routes=np.arange(4 * 3 * 2, dtype=np.int16).reshape(4, 3, 2))  # a MoE's, recorded
  save_batch(str(tmp_path), n, trajs)
  back = load_batch(str(tmp_path), n)
  assert len(back) == 4
  for a, b in zip(trajs, back):
    for k in ("prompt_ids", "response_ids", "logprobs", "versions", "routes"):
      np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
      assert getattr(a, k) is None or getattr(a, k).dtype == getattr(b, k).dtype
    assert (a.finish_reason, a.group_id, a.reward) == (b.finish_reason, b.group_id, b.reward)
