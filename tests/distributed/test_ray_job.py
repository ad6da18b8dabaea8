"""launch/ray_run.py on a local Ray cluster of several nodes (`ray.cluster_utils.Cluster`): each node stands for a host
(a custom resource it offers once); a 1-learner + 2-sampler job of the fast preset runs on three of them."""

import os
import secrets
import signal
import subprocess
import sys

import pytest

# Before Ray is imported (it reads this once): a local cluster's nodes keep to 127.0.0.1, not this host's address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")  # the `ray` extra (in `test`)
from ray.cluster_utils import Cluster  # pylint: disable=g-import-not-at-top,wrong-import-position

from areal_jax.config import load_config  # pylint: disable=wrong-import-position
from areal_jax.distributed import ray_job  # pylint: disable=wrong-import-position
from areal_jax.rl.metrics import read_metrics  # pylint: disable=wrong-import-position
from run_checks import FAST, ROOT, Log, assert_every_prompt_once, rollouts  # pylint: disable=wrong-import-position
from waiting import wait_until  # pylint: disable=wrong-import-position

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

HOST = "host"  # the custom resource standing for a host: one process per node
ETA = 2
KEY = secrets.token_hex(16)  # the jobs' authkey: it must appear in no log line
OVERRIDES = {"mesh.cpu_devices": 1, "mesh.sampler_processes": 2, "rollout.max_head_offpolicyness": ETA}


@pytest.fixture(scope="module")
def cluster():
  """A head node that runs no process of the job and three nodes of one host each, all on the loopback interface."""
  c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1",
                                                    "include_dashboard": False})
  for _ in range(3):
    add_host(c)
  ray.init(address=c.address, namespace=ray_job.NAMESPACE)  # this test's own driver: it finds and kills actors
  yield c
  ray.shutdown()
  c.shutdown()


def add_host(c):
  return c.add_node(num_cpus=1, resources={HOST: 1}, node_ip_address="127.0.0.1")


def start(c, workdir, log_path, total_steps, *flags):
  command = [sys.executable, os.path.join(ROOT, "launch", "ray_run.py"), f"--config={FAST}", f"--workdir={workdir}",
             f"--address={c.address}", "--num_processes=3", f"--host_resource={HOST}", *flags,
             *[f"--config.{k}={v}" for k, v in dict(OVERRIDES, total_steps=total_steps).items()]]
  with open(log_path, "a") as out:
    return subprocess.Popen(command, env=dict(os.environ, JAX_PLATFORMS="cpu", AREAL_JAX_AUTHKEY=KEY), stdout=out, stderr=subprocess.STDOUT,
                            cwd=ROOT, start_new_session=True)


def finish(job, log, timeout=600):
  try:
    return job.wait(timeout=timeout)
  finally:
    if job.poll() is None:
      os.killpg(job.pid, signal.SIGKILL)
      print(log.text()[-4000:])


def check_staleness(workdir, total_steps):
  assert [m["step"] for m in read_metrics(workdir)][-1] == total_steps
  for r in rollouts(workdir):
    if not r["filtered"]:
      assert all((r["step"] - 1) - v <= ETA for v in r["version_start"]), r


def test_a_job_runs_on_three_nodes_trains_every_group_once_and_killed_samplers_come_back(cluster, tmp_path):
  workdir, log = str(tmp_path / "run"), Log(str(tmp_path / "job.log"))
  steps = 20
  job = start(cluster, workdir, log.path, steps)
  try:
    wait_until(lambda: len(read_metrics(workdir)) >= 3, timeout_s=400, what="step 2", poll_s=0.2)
    # Ray restarts killed sampler actors and runs them again: they rejoin with the current weights. Both are killed,
    # so the learner waits for them (a run of the fast preset would end before one restart otherwise).
    for i in (0, 1):
      ray.kill(ray.get_actor(ray_job.actor_name(f"sampler {i}")), no_restart=False)
    for i in (0, 1):
      log.wait_for(rf"sampler {i} joined at version", 300, job)
  finally:
    code = finish(job, log)
  assert code == 0, log.text()[-4000:]
  text = log.text()
  assert "ray: the job's control address is 127.0.0.1:" in text
  assert all(f"[sampler {i}] " in text for i in (0, 1)), text[-4000:]
  assert_every_prompt_once(workdir, load_config(FAST, **OVERRIDES, total_steps=steps), last_step=steps)
  check_staleness(workdir, steps)
  assert read_metrics(workdir)[-1]["samplers/live"] == 2
  assert KEY not in text
  wait_until(lambda: not _job_actors(), timeout_s=30, what=lambda: f"the job's actors gone: {_job_actors()}")


def test_a_killed_learner_stops_the_job_and_the_same_command_resumes(cluster, tmp_path):
  workdir, log = str(tmp_path / "run"), Log(str(tmp_path / "job.log"))
  steps = 6
  job = start(cluster, workdir, log.path, steps)

  def saved():
    assert job.poll() is None, log.text()[-4000:]
    return os.path.isdir(os.path.join(workdir, "checkpoints", "2"))

  wait_until(saved, timeout_s=400, what="a checkpoint at step 2", poll_s=0.2)
  ray.kill(ray.get_actor(ray_job.actor_name("learner 0")))
  assert finish(job, log, timeout=120) == 1, log.text()[-4000:]
  assert "ray: learner 0 exited with signal SIGKILL; stopping the other processes" in log.text(), log.text()[-4000:]

  job = start(cluster, workdir, log.path, steps)
  assert finish(job, log) == 0, log.text()[-4000:]
  assert "resumed" in log.text()
  assert_every_prompt_once(workdir, load_config(FAST, **OVERRIDES, total_steps=steps), last_step=steps)


def test_a_lost_node_leaves_the_job_going_and_a_new_node_joins_it(cluster, tmp_path):
  workdir, log = str(tmp_path / "run"), Log(str(tmp_path / "job.log"))
  steps = 30
  # One sampler more than the job's: it waits for a node, as it would for one an autoscaler adds.
  job = start(cluster, workdir, log.path, steps, "--extra_samplers=1")
  try:
    wait_until(lambda: len(read_metrics(workdir)) >= 3, timeout_s=400, what="step 2", poll_s=0.2)
    # A node that goes away takes its sampler with it; with no host left for it, the job goes on without it.
    remove_node_of(cluster, "sampler 1")
    log.wait_for(r"sampler 1 \(process 2\) is gone", 120, job)
    trained = len(read_metrics(workdir))
    wait_until(lambda: len(read_metrics(workdir)) >= trained + 2, timeout_s=120, what="two steps more", poll_s=0.2)
    # The other sampler's node goes too: the learner waits. A node added to the cluster takes one of the three
    # samplers waiting for room (samplers 0 and 1 restarted, or the extra one, process 3): it joins the running job.
    remove_node_of(cluster, "sampler 0")
    log.wait_for(r"sampler 0 \(process 1\) is gone", 120, job)
    add_host(cluster)
    log.wait_for(r"sampler [0-3] joined at version", 300, job)
  finally:
    code = finish(job, log)
  assert code == 0, log.text()[-4000:]  # those still waiting for a node did not hold the end up
  assert_every_prompt_once(workdir, load_config(FAST, **OVERRIDES, total_steps=steps), last_step=steps)
  check_staleness(workdir, steps)
  assert read_metrics(workdir)[-1]["samplers/live"] == 1


def remove_node_of(c, name):
  node_id = ray.get(ray.get_actor(ray_job.actor_name(name)).node_id.remote(), timeout=30)
  [node] = [n for n in c.worker_nodes if n.node_id == node_id]
  c.remove_node(node)


def _job_actors():
  return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == ray_job.NAMESPACE]
