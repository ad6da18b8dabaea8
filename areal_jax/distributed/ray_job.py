"""Runs a multi-process job on a Ray cluster: each process of the job description (`job.JobSpec`) is a Ray actor on
its own host, slice or device block, running `launch/tpu_run.py` as `launch/local.py` runs it on one machine.

Placement (`Placement`):
- learner processes: one actor per host. TPU: a slice placement group over the learner slice (`ray.util.tpu`, one
  bundle per host, the whole slice reserved together). GPU: one bundle of `learner_devices` GPUs per process, packed
  onto as few nodes as possible. CPU: `host_resource` (a custom resource each node offers once) puts one process on
  each node, which is how the tests stand a local multi-node cluster in for hosts.
- sampler processes: one actor each, over `sampler_devices` GPUs, a single-host TPU slice's chips, or a node's
  `host_resource`. `extra_samplers` more are asked for beyond the job's: they wait for room, so nodes an autoscaler
  adds for them become samplers that join the running job (process ids N, N+1, ...).

Ray does the supervision: a sampler actor that dies (its process failed, was preempted, or its node went away) is
restarted by Ray (`max_restarts`) and its `run` called again (`max_task_retries`); it rejoins through the leader's
join path with the current weights, its groups in flight generated again by the others. Learner actors are never
restarted: one that dies stops the job naming it, and the same command resumes from the last checkpoint. Ending,
signals and the exit status are `local_job.supervise`'s, the same code `launch/local.py` runs.

Each actor starts its process in a session of its own, which dies with the actor (PR_SET_PDEATHSIG), so a killed
actor or a removed node leaves no process behind. The control connections' authkey reaches the actors through their
runtime environment, never an argument or a log line. The leader's control port (and port + 1) and every transfer
server bind the address of the node the actor runs on.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from areal_jax.distributed.job import JobSpec, tpu_slice
from areal_jax.distributed.local_job import free_port_pair, supervise
from areal_jax.distributed.roles import AUTHKEY_ENV

STARTUP_TIMEOUT_S = 600.0  # for the learner actors to be placed (a slice to be reserved)
NAMESPACE = "areal_jax"  # the job's actors are named in it: "learner-0", "sampler-1" (`ray.get_actor`)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
  """Where the job's processes go on the cluster."""
  learner_slice: str = ""  # TPU: the learner's slice ("v5p-32"); its hosts are the learner processes
  sampler_slice: str = ""  # TPU: each sampler's slice ("v5e-8"); single-host
  host_resource: str = ""  # a custom resource each node offers once: one process per node
  cpus_per_process: float = 1.0
  max_sampler_restarts: int = -1  # -1: Ray restarts a sampler actor as often as it dies
  extra_samplers: int = 0  # joiners beyond the job's samplers, placed when room appears (an autoscaler's nodes)

  def check(self, spec: JobSpec) -> None:
    """A ValueError names the flag whose value does not fit the job."""
    if spec.accelerator == "tpu":
      if not self.learner_slice or not self.sampler_slice:
        raise ValueError("a TPU job names --learner_slice and --sampler_slice (e.g. v5p-32 and v5e-8)")
      learner, sampler = tpu_slice(self.learner_slice), tpu_slice(self.sampler_slice)
      if learner.hosts != spec.num_learners:
        raise ValueError(f"--learner_slice={self.learner_slice} has {learner.hosts} hosts, one learner process each; "
                         f"the job has {spec.num_learners} (--num_processes - config.mesh.sampler_processes)")
      if sampler.hosts != 1:
        raise ValueError(f"--sampler_slice={self.sampler_slice} spans {sampler.hosts} hosts: a sampler process owns "
                         "its devices and never joins a collective, so its slice is one host")
    if self.extra_samplers < 0:
      raise ValueError(f"--extra_samplers={self.extra_samplers}: must be >= 0")

  def learner_options(self, spec: JobSpec) -> tuple[dict, object]:
    """Ray options for every learner actor, and the placement group they share (None on CPU)."""
    from ray.util import placement_group  # pylint: disable=g-import-not-at-top
    from ray.util.scheduling_strategies import \
        PlacementGroupSchedulingStrategy  # pylint: disable=g-import-not-at-top
    options = {"num_cpus": self.cpus_per_process}
    if spec.accelerator == "tpu":
      from ray.util.tpu import SlicePlacementGroup  # pylint: disable=g-import-not-at-top
      learner = tpu_slice(self.learner_slice)
      group = SlicePlacementGroup(topology=learner.topology, accelerator_version=learner.ray_version,
                                  resources_per_bundle={"TPU": learner.chips_per_host, "CPU": self.cpus_per_process},
                                  name="areal_jax-learner").placement_group
      options.update(resources={"TPU": learner.chips_per_host})
    elif spec.accelerator == "gpu":
      bundle = {"GPU": spec.learner_devices, "CPU": self.cpus_per_process}
      group = placement_group([bundle] * spec.num_learners, strategy="PACK", name="areal_jax-learner")
      options.update(num_gpus=spec.learner_devices)
    else:
      group = None
      if self.host_resource:
        options.update(resources={self.host_resource: 1})
    if group is not None:
      options.update(scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group))
    return options, group

  def sampler_options(self, spec: JobSpec) -> dict:
    options: dict = {"num_cpus": self.cpus_per_process}
    if spec.accelerator == "tpu":
      options.update(resources={"TPU": tpu_slice(self.sampler_slice).chips})
    elif spec.accelerator == "gpu":
      options.update(num_gpus=spec.sampler_devices)
    elif self.host_resource:
      options.update(resources={self.host_resource: 1})
    return options


class ProcessActor:
  """One process of the job on its node: `run` starts `launch/tpu_run.py` there and returns its exit status. A
  sampler whose process fails takes the actor down with it, so that Ray restarts the actor and calls `run` again."""

  def __init__(self):
    self._proc: subprocess.Popen | None = None
    self._lock = threading.Lock()

  def node_ip(self) -> str:
    import ray  # pylint: disable=g-import-not-at-top
    return ray.util.get_node_ip_address()

  def node_id(self) -> str:
    import ray  # pylint: disable=g-import-not-at-top
    return ray.get_runtime_context().get_node_id()

  def free_port(self) -> int:
    """A port p with p and p + 1 free on this node (the leader's control port and its learners' coordinator)."""
    return free_port_pair(self.node_ip())

  def run(self, argv: Sequence[str], env: dict[str, str], name: str, sampler: bool, cwd: str) -> int:
    with self._lock:
      self._proc = subprocess.Popen([sys.executable, "-c", _ORPHAN_GUARD, "-u", *argv], env=dict(os.environ, **env),
                                    cwd=cwd if os.path.isdir(cwd) else None, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
    for line in self._proc.stdout:  # Ray forwards an actor's output to the driver
      sys.stdout.write(f"[{name}] {line}")
      sys.stdout.flush()
    code = self._proc.wait()
    if sampler and code != 0:
      print(f"[{name}] exited with status {code}; Ray restarts it", flush=True)
      os._exit(1)  # pylint: disable=protected-access  # the actor dies: Ray restarts it and calls `run` again
    return code

  def signal(self, signum: int) -> None:
    with self._lock:
      if self._proc is not None and self._proc.poll() is None:
        try:
          os.killpg(self._proc.pid, signum)  # the process and what it started (reward workers)
        except ProcessLookupError:
          pass


# argv: the python arguments to exec once this process is set to die with its parent (the actor).
_ORPHAN_GUARD = ("import ctypes, os, signal, sys; ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL); "
                 "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")


class _ActorProcess:
  """An actor's `run` as `local_job.supervise` sees a process: polled, waited for, signalled."""

  def __init__(self, name: str, sampler: bool, actor, run_ref, leader: _ActorProcess | None = None):
    self.name, self.sampler, self.actor, self.ref, self.leader = name, sampler, actor, run_ref, leader
    self.code: int | None = None
    self.started, self.pause_s, self.restart_at, self.gone = time.monotonic(), 1.0, None, False
    self.label = name

  def poll(self) -> int | None:
    import ray  # pylint: disable=g-import-not-at-top
    if self.code is None and ray.wait([self.ref], timeout=0)[0]:
      try:
        self.code = int(ray.get(self.ref))
      except ray.exceptions.RayError as e:  # the actor died and is not (or no longer) restarted
        print(f"ray: {self.name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
        self.code = -signal.SIGKILL
    if self.code is None and self.sampler and self.leader is not None and self.leader.poll() == 0:
      if not ray.wait([self.actor.node_ip.remote()], timeout=1.0)[0]:
        self.code = 0  # the run is over and this one was never placed (or is being restarted): nothing to wait for
    return self.code

  def wait(self, timeout: float | None) -> int:
    import ray  # pylint: disable=g-import-not-at-top
    deadline = None if timeout is None else time.monotonic() + timeout
    while self.poll() is None:
      if deadline is not None and time.monotonic() >= deadline:
        raise subprocess.TimeoutExpired(self.name, timeout)
      ray.wait([self.ref], timeout=0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic())))
    return self.code

  def signal(self, signum: int) -> None:
    import ray  # pylint: disable=g-import-not-at-top
    if signum == signal.SIGKILL:
      ray.kill(self.actor, no_restart=True)
    else:
      self.actor.signal.remote(signum)


def actor_name(process_name: str) -> str:
  """The Ray actor of a process ("sampler 1" -> "sampler-1", in namespace `NAMESPACE`)."""
  return process_name.replace(" ", "-")


def run_ray(*, script: str, args: Sequence[str], spec: JobSpec, placement: Placement, address: str | None = None,
            port: int | None = None, env: dict[str, str] | None = None, local_cpus: int | None = None) -> int:
  """Runs the job on the Ray cluster at `address` (None: a local one started here), returns its exit status as
  `launch/local.py` would (0: every learner process finished cleanly)."""
  import ray  # pylint: disable=g-import-not-at-top
  placement.check(spec)
  key = os.environ.get(AUTHKEY_ENV) or secrets.token_hex(16)
  os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every process's lines as it wrote them
  local = {}
  if address is None:  # a private instance on this machine: its traffic stays on the loopback interface
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    local = dict(num_cpus=local_cpus, _node_ip_address="127.0.0.1")
  ray.init(address=address, namespace=NAMESPACE, include_dashboard=False, log_to_driver=True,
           runtime_env={"env_vars": {AUTHKEY_ENV: key}}, **local)
  actor_class = ray.remote(max_concurrency=4)(ProcessActor)
  env = dict(env or {})
  group = None
  processes: list[_ActorProcess] = []
  try:
    options, group = placement.learner_options(spec)
    if group is not None:
      ray.get(group.ready(), timeout=STARTUP_TIMEOUT_S)
    learners = [actor_class.options(max_restarts=0, name=actor_name(p.name), **options).remote()
                for p in spec.learners]
    host = ray.get(learners[0].node_ip.remote(), timeout=STARTUP_TIMEOUT_S)
    spec = dataclasses.replace(spec, port=port or ray.get(learners[0].free_port.remote()))
    print(f"ray: the job's control address is {spec.coordinator_address(host)}", flush=True)
    samplers = [actor_class.options(max_restarts=placement.max_sampler_restarts, max_task_retries=-1,
                                    name=actor_name(spec.layout(i, host).name), **placement.sampler_options(spec)
                                    ).remote()
                for i in range(spec.num_learners, spec.num_processes + placement.extra_samplers)]
    for i, actor in enumerate(learners + samplers):
      name = spec.layout(i, host).name
      sampler = i >= spec.num_learners
      ref = actor.run.remote([script, *args, *spec.argv(i, host)], env, name, sampler, os.getcwd())
      processes.append(_ActorProcess(name, sampler, actor, ref, leader=processes[0] if processes else None))
      print(f"ray: {name} is process {i}", flush=True)
    return supervise(processes, no_restart_hint="Ray's restarts are used up or its node is gone", tag="ray")
  finally:
    for p in processes:
      ray.kill(p.actor, no_restart=True)
    if group is not None:
      ray.util.remove_placement_group(group)
    ray.shutdown()
