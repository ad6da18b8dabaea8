r"""What running the job on Ray costs against launch/local.py on this machine: start-up and a sampler's restart.

  python tools/bench_launchers.py [--steps=6] [--workdir=/tmp/bench_launchers]

Runs the same 2-process job of the fast preset (one learner, one sampler, one CPU device each) twice, side by side in
one run: with `launch/local.py --restart_samplers`, and with `launch/ray_run.py` on a Ray instance started here. It
prints, for each, the seconds from the launcher's start to the leader's control address (the processes placed), to
the first trained step, and from a SIGKILL of the sampler (its process; on Ray, its actor) to the sampler rejoining
the running job, then Ray's figures over local's.
"""

import os
import re
import signal
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported: the loopback interface

_STEPS = flags.DEFINE_integer("steps", 6, "Learner steps of each job.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/bench_launchers", "Where the two jobs write (emptied first).")
TIMEOUT_S = 600.0


def _wait(path: str, pattern: str, proc: subprocess.Popen, count: int = 1) -> re.Match:
  deadline = time.monotonic() + TIMEOUT_S
  while time.monotonic() < deadline:
    with open(path) as f:
      matches = list(re.finditer(pattern, f.read()))
    if len(matches) >= count:
      return matches[-1]
    if proc.poll() is not None:
      raise RuntimeError(f"the job ended (status {proc.returncode}) before {pattern!r}; see {path}")
    time.sleep(0.05)
  raise TimeoutError(f"no {pattern!r} within {TIMEOUT_S:.0f} s; see {path}")


def _job(name: str, command: list[str], kill_sampler) -> dict[str, float]:
  workdir = os.path.join(_WORKDIR.value, name)
  log = os.path.join(_WORKDIR.value, f"{name}.log")
  command = command + [f"--config={ROOT}/configs/math.py:fast", f"--workdir={workdir}", "--num_processes=2",
                       "--config.mesh.cpu_devices=1", f"--config.total_steps={_STEPS.value}"]
  start = time.monotonic()
  with open(log, "w") as out:
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
  try:
    _wait(log, r"control address is", proc)
    placed = time.monotonic() - start
    _wait(log, r"step 1/\d+ \[", proc)
    first_step = time.monotonic() - start
    text = open(log).read()
    killed = time.monotonic()
    kill_sampler(text)
    _wait(log, r"sampler 0 joined at version", proc)
    rejoined = time.monotonic() - killed
    if proc.wait(TIMEOUT_S) != 0:
      raise RuntimeError(f"{name}: the job failed; see {log}")
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  return {"placed_s": placed, "first_step_s": first_step, "sampler_rejoined_s": rejoined}


def main(argv):
  del argv
  import ray  # pylint: disable=g-import-not-at-top
  from ray.cluster_utils import Cluster  # pylint: disable=g-import-not-at-top

  from areal_jax.distributed import ray_job  # pylint: disable=g-import-not-at-top
  subprocess.run(["rm", "-rf", _WORKDIR.value], check=True)
  os.makedirs(_WORKDIR.value)

  def kill_local(text):
    os.kill(int(re.search(r"sampler 0 is process 1 \(pid (\d+)\)", text).group(1)), signal.SIGKILL)

  local = _job("local", [sys.executable, "launch/local.py", "--restart_samplers"], kill_local)

  start = time.monotonic()
  cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "node_ip_address": "127.0.0.1",
                                                          "include_dashboard": False})
  ray_up = time.monotonic() - start
  ray.init(address=cluster.address, namespace=ray_job.NAMESPACE)
  try:
    def kill_ray(_text):
      ray.kill(ray.get_actor(ray_job.actor_name("sampler 0")), no_restart=False)

    on_ray = _job("ray", [sys.executable, "launch/ray_run.py", f"--address={cluster.address}"], kill_ray)
  finally:
    ray.shutdown()
    cluster.shutdown()
  print(f"a Ray instance started in {ray_up:.1f} s (before the ray job's clock)")
  for key in local:
    print(f"{key}: local {local[key]:.1f} s, ray {on_ray[key]:.1f} s, ray / local {on_ray[key] / local[key]:.2f}")


if __name__ == "__main__":
  app.run(main)
