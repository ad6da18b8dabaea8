"""Which role each process of a multi-process job plays, and where the processes meet.

A job of N processes (`--num_processes`, `--process_id`, `--coordinator_address`, as for `jax.distributed`) has
`mesh.sampler_processes` = S sampler processes; the other L = N - S are the learner:

    process id   0 .. L-1        learner (rank 0 is the leader: rollout controller, checkpoints, metrics)
    process id   L .. N-1        sampler (each runs its own engine on its local devices)
    process id   N, N+1, ...     more samplers, joining the running job (samplers come and go; learners do not)

Ports on the coordinator's host (the leader's): `port` takes control connections (requests, trajectories, weight
notices, learner batches; `multiprocessing.connection`, authenticated), `port + 1` is the `jax.distributed` coordinator
of the learner processes only (samplers keep their devices to themselves and never join a collective).

One process (N = 1) is the single-controller mode: `ProcessLayout.single()`, both roles in one process.
"""

from __future__ import annotations

import dataclasses
import os
import re

from areal_jax.errors import ConfigError

ENV_PREFIX = "AREAL_JAX_"
AUTHKEY_ENV = ENV_PREFIX + "AUTHKEY"
DEFAULT_PORT = 8476  # the leader's control port when none is given; + 1: the learners' jax.distributed coordinator


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessLayout:
  num_processes: int = 1
  process_id: int = 0
  coordinator_address: str = ""  # host:port of the leader (process 0)
  sampler_processes: int = 0

  @classmethod
  def single(cls) -> ProcessLayout:
    return cls()

  @classmethod
  def create(cls, *, num_processes: int, process_id: int, coordinator_address: str,
             sampler_processes: int) -> ProcessLayout:
    """Checks the flags and `mesh.sampler_processes` together, naming the value at fault."""
    if num_processes < 1:
      raise ValueError(f"--num_processes={num_processes}: must be >= 1")
    if num_processes == 1:
      return cls.single()
    if process_id < 0:
      raise ValueError(f"--process_id={process_id}: must be >= 0")
    if not 0 < sampler_processes < num_processes:
      raise ValueError(f"config.mesh.sampler_processes={sampler_processes}: must leave at least one of "
                       f"--num_processes={num_processes} processes to each role")
    host, sep, port = coordinator_address.rpartition(":")
    if not sep or not host or not port.isdigit():
      raise ValueError(f"--coordinator_address={coordinator_address!r} (or ${ENV_PREFIX}COORDINATOR_ADDRESS): expected "
                       "host:port of process 0")
    return cls(num_processes=num_processes, process_id=process_id, coordinator_address=coordinator_address,
               sampler_processes=sampler_processes)

  @property
  def multi_process(self) -> bool:
    return self.num_processes > 1

  @property
  def num_learners(self) -> int:
    return self.num_processes - self.sampler_processes

  @property
  def role(self) -> str:
    return "learner" if self.process_id < self.num_learners else "sampler"

  @property
  def is_leader(self) -> bool:
    return self.process_id == 0

  @property
  def sampler_index(self) -> int:
    """0 .. S-1 for sampler processes."""
    return self.process_id - self.num_learners

  @property
  def name(self) -> str:
    if not self.multi_process:
      return "controller"
    return f"learner {self.process_id}" if self.role == "learner" else f"sampler {self.sampler_index}"

  @property
  def host(self) -> str:
    return self.coordinator_address.rpartition(":")[0].strip("[]")

  @property
  def control_address(self) -> tuple[str, int]:
    return self.host, int(self.coordinator_address.rpartition(":")[2])

  @property
  def learner_coordinator(self) -> str:
    host, port = self.control_address
    return f"{host}:{port + 1}"


def authkey() -> bytes:
  """The control connections' shared secret, $AREAL_JAX_AUTHKEY: `launch/local.py` sets a random one; a job started
  by hand or by a scheduler exports the same random value to every process. There is no fallback: a key anyone could
  derive would let anyone who reaches the port feed the leader."""
  key = os.environ.get(AUTHKEY_ENV, "")
  if len(key) < 16:
    raise ConfigError(f"${AUTHKEY_ENV} is {'unset' if not key else 'shorter than 16 characters'}: a multi-process job "
                     "needs a shared random key for its control connections. launch/local.py makes one; otherwise "
                     f"export the same value to every process, e.g. {AUTHKEY_ENV}=$(python -c 'import secrets; "
                     "print(secrets.token_hex(16))')")
  return key.encode()


def from_flags_or_env(*, num_processes: int | None, process_id: int | None, coordinator_address: str | None,
                      sampler_processes: int) -> ProcessLayout:
  """Flags win; unset ones come from $AREAL_JAX_NUM_PROCESSES / _PROCESS_ID / _COORDINATOR_ADDRESS, then from SLURM:
  a task of a SLURM step of several tasks ($SLURM_NTASKS > 1) is process $SLURM_PROCID, and the first host of
  $SLURM_JOB_NODELIST is the coordinator (port $AREAL_JAX_PORT, default 8476). No flags and no environment (or a
  SLURM step of one task) is the single-process mode."""
  env = os.environ

  def pick(flag, name, slurm):
    if flag is not None:
      return flag
    return env.get(f"{ENV_PREFIX}{name}", env.get(slurm))

  n = int(pick(num_processes, "NUM_PROCESSES", "SLURM_NTASKS") or 1)
  coordinator = coordinator_address if coordinator_address is not None else env.get(f"{ENV_PREFIX}COORDINATOR_ADDRESS")
  if not coordinator and n > 1 and env.get("SLURM_JOB_NODELIST"):
    coordinator = f"{first_slurm_host(env['SLURM_JOB_NODELIST'])}:{env.get(f'{ENV_PREFIX}PORT', DEFAULT_PORT)}"
  return ProcessLayout.create(num_processes=n, process_id=int(pick(process_id, "PROCESS_ID", "SLURM_PROCID") or 0),
                              coordinator_address=str(coordinator or ""), sampler_processes=sampler_processes)


def first_slurm_host(nodelist: str) -> str:
  """The first host of a SLURM node list ("gpu[07-09,12],cpu3" -> "gpu07"), as `scontrol show hostnames` would
  print it first."""
  m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", nodelist.strip())
  if not m or not m.group(1):
    raise ValueError(f"$SLURM_JOB_NODELIST={nodelist!r}: expected host names such as node[01-04]")
  prefix, ranges, suffix = m.groups()
  first = ranges.split(",")[0].split("-")[0] if ranges else ""
  return f"{prefix}{first}{suffix}"


def start_jax(layout: ProcessLayout) -> None:
  """Joins the learner processes into one JAX job (`jax.distributed`, gloo collectives on CPU); samplers and the
  single-process mode keep a JAX of their own. Call before any other JAX work."""
  import jax  # pylint: disable=g-import-not-at-top

  if layout.role != "learner" or layout.num_learners == 1:
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(layout.learner_coordinator, num_processes=layout.num_learners,
                             process_id=layout.process_id)
