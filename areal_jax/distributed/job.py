"""The job description: every process of a multi-process job, its role, its devices, and where the processes meet.

Built once from the config (`mesh.sampler_processes`) and a launcher's flags, and rendered by every launcher:
`launch/local.py` (processes on this machine), `launch/ray_run.py` (Ray actors), `launch/slurm/` (an sbatch script)
and `tools/render_jobset.py` (a GKE JobSet). None of them derives roles, names, devices or ports on its own: each asks
the `JobSpec` for a process's `layout`, `env` and `argv`.

    spec = JobSpec.create(num_processes=3, sampler_processes=2, accelerator="gpu", learner_devices=8,
                          sampler_devices=8)
    spec.env(process_id=1, coordinator_host="10.0.0.2")
    # {'AREAL_JAX_NUM_PROCESSES': '3', 'AREAL_JAX_PROCESS_ID': '1', 'AREAL_JAX_COORDINATOR_ADDRESS': '10.0.0.2:8476'}

Each process is `launch/tpu_run.py` with that environment (or the same values as flags); its role follows from its id
(`roles.ProcessLayout`). Process 0, the leader, listens on the coordinator's `port` (control connections) and
`port + 1` (the learners' `jax.distributed` coordinator); the others connect to it. The control connections'
authkey is not part of the description: each launcher hands the same secret to every process out of band
($AREAL_JAX_AUTHKEY, a Ray runtime environment, a Kubernetes Secret) and never logs it.
"""

from __future__ import annotations

import dataclasses
import re

from areal_jax import hardware
from areal_jax.distributed.roles import DEFAULT_PORT, ENV_PREFIX, ProcessLayout

ACCELERATORS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Process:
  """One process of the job. `devices`: how many GPUs or TPU chips it owns (0: every device its host shows it; on
  CPU it emulates `mesh.cpu_devices`)."""
  process_id: int
  role: str  # "learner" or "sampler"
  name: str  # "learner 0", "sampler 1": how logs and errors name it
  devices: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobSpec:
  num_processes: int
  sampler_processes: int
  accelerator: str = "cpu"
  learner_devices: int = 0  # per learner process
  sampler_devices: int = 0  # per sampler process
  port: int = DEFAULT_PORT

  @classmethod
  def create(cls, *, num_processes: int, sampler_processes: int, accelerator: str = "cpu", learner_devices: int = 0,
             sampler_devices: int = 0, port: int = DEFAULT_PORT) -> JobSpec:
    """Checks the launcher's flags and `mesh.sampler_processes` together, naming the value at fault."""
    if num_processes < 2:
      raise ValueError(f"--num_processes={num_processes}: a multi-process job has at least 2 (one learner, one "
                       "sampler); one process is launch/tpu_run.py on its own")
    if accelerator not in ACCELERATORS:
      raise ValueError(f"accelerator {accelerator!r}: choose one of {ACCELERATORS}")
    if learner_devices < 0 or sampler_devices < 0:
      raise ValueError(f"--learner_devices={learner_devices} --sampler_devices={sampler_devices}: must be >= 0")
    if accelerator == "cpu" and (learner_devices or sampler_devices):
      raise ValueError(f"--learner_devices={learner_devices} --sampler_devices={sampler_devices}: this machine has no "
                       "GPU or TPU (on CPU each process emulates config.mesh.cpu_devices devices)")
    if not 0 < port < 65535:
      raise ValueError(f"--port={port}: the leader needs it and port + 1 free, in 1..65534")
    ProcessLayout.create(num_processes=num_processes, process_id=0, coordinator_address=f"leader:{port}",
                         sampler_processes=sampler_processes)  # the roles' checks
    return cls(num_processes=num_processes, sampler_processes=sampler_processes, accelerator=accelerator,
               learner_devices=learner_devices, sampler_devices=sampler_devices, port=port)

  @property
  def num_learners(self) -> int:
    return self.num_processes - self.sampler_processes

  def coordinator_address(self, host: str) -> str:
    return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

  def layout(self, process_id: int, coordinator_host: str) -> ProcessLayout:
    """Process `process_id`'s view of the job (ids beyond the job's are more samplers joining it)."""
    return ProcessLayout.create(num_processes=self.num_processes, process_id=process_id,
                                coordinator_address=self.coordinator_address(coordinator_host),
                                sampler_processes=self.sampler_processes)

  def process(self, process_id: int) -> Process:
    layout = self.layout(process_id, "leader")
    devices = self.learner_devices if layout.role == "learner" else self.sampler_devices
    return Process(process_id=process_id, role=layout.role, name=layout.name, devices=devices)

  @property
  def processes(self) -> tuple[Process, ...]:
    return tuple(self.process(i) for i in range(self.num_processes))

  @property
  def learners(self) -> tuple[Process, ...]:
    return self.processes[:self.num_learners]

  @property
  def samplers(self) -> tuple[Process, ...]:
    return self.processes[self.num_learners:]

  def env(self, process_id: int, coordinator_host: str) -> dict[str, str]:
    """What `launch/tpu_run.py` reads when its flags are not given (`roles.from_flags_or_env`)."""
    layout = self.layout(process_id, coordinator_host)
    return {f"{ENV_PREFIX}NUM_PROCESSES": str(layout.num_processes), f"{ENV_PREFIX}PROCESS_ID": str(process_id),
            f"{ENV_PREFIX}COORDINATOR_ADDRESS": layout.coordinator_address}

  def argv(self, process_id: int, coordinator_host: str) -> list[str]:
    """The same as `launch/tpu_run.py` flags."""
    layout = self.layout(process_id, coordinator_host)
    return [f"--num_processes={layout.num_processes}", f"--process_id={process_id}",
            f"--coordinator_address={layout.coordinator_address}"]


@dataclasses.dataclass(frozen=True)
class TpuSlice:
  """A Cloud TPU slice by Google's name ("v5p-32": TensorCores on v4/v5p, chips on v5e/v6e)."""
  name: str
  device: hardware.Device
  chips: int

  @property
  def hosts(self) -> int:
    return max(1, self.chips // self.device.chips_per_host)

  @property
  def chips_per_host(self) -> int:
    return min(self.chips, self.device.chips_per_host)

  @property
  def topology(self) -> str:
    """The chips' arrangement as GKE's `cloud.google.com/gke-tpu-topology` and Ray's `SlicePlacementGroup` name it:
    2-D for v5e/v6e ("2x4"), 3-D for v4/v5p ("2x2x4")."""
    dims = [1, 1, 1] if self.device.cores_per_chip == 2 else [1, 1]
    chips, i = self.chips, 0
    while chips > 1:  # doubles the dimensions in turn, the last first: 4 -> 2x2(x1), 8 -> 2x4, 16 -> 2x2x4, 4x4
      dims[i % len(dims)] *= 2
      chips //= 2
      i += 1
    dims = sorted(d for d in dims if d > 1) + [1] * dims.count(1)  # as GKE lists them: "2x2x1", "2x4x4", "4x8"
    return "x".join(map(str, dims)) if dims.count(1) < len(dims) else "x".join("1" * len(dims))

  @property
  def ray_version(self) -> str:
    """The generation as `ray.util.tpu` names it."""
    return {"v5e": "v5litepod"}.get(self.device.name, self.device.name)

  @property
  def gke_accelerator(self) -> str:
    """The generation as GKE's node label `cloud.google.com/gke-tpu-accelerator` names it."""
    return GKE_TPU_ACCELERATORS[self.device.name]


# GKE's names for the TPU generations (node label `cloud.google.com/gke-tpu-accelerator`).
GKE_TPU_ACCELERATORS = {"v4": "tpu-v4-podslice", "v5e": "tpu-v5-lite-podslice", "v5p": "tpu-v5p-slice",
                        "v6e": "tpu-v6e-slice"}


def tpu_slice(name: str) -> TpuSlice:
  """Parses "v5p-32", "v5e-8", "v6e-16", "v4-8"; a ValueError names the value and the known generations."""
  m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name.strip())
  known = sorted(n for n, d in hardware.DEVICES.items() if d.tpu)
  if not m or m.group(1) not in hardware.DEVICES or not hardware.DEVICES[m.group(1)].tpu:
    raise ValueError(f"TPU slice {name!r}: expected GENERATION-SIZE with a generation of {known}, e.g. v5p-32")
  device = hardware.DEVICES[m.group(1)]
  size = int(m.group(2))
  if size < device.cores_per_chip or size % device.cores_per_chip:
    raise ValueError(f"TPU slice {name!r}: {device.name} slice names count TensorCores, {device.cores_per_chip} "
                     f"per chip")
  chips = size // device.cores_per_chip
  if chips & (chips - 1):
    raise ValueError(f"TPU slice {name!r}: {chips} chips; slices hold a power of two")
  return TpuSlice(name.strip(), device, chips)


def config_args(argv: list[str], default: str = "configs/math.py") -> list[str]:
  """The `--config=FILE[:PRESET]` and `--config.KEY=VALUE` flags of a launcher's `argv`, each as one `--flag=value`
  argument, `--config=<default>` first where `argv` names no file: what a renderer (tools/render_slurm.py,
  tools/render_jobset.py) passes on to every process."""
  out, i = [], 0
  while i < len(argv):
    arg = argv[i]
    if arg == "--config" or arg.startswith("--config."):
      if "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
        arg, i = f"{arg}={argv[i + 1]}", i + 1
      out.append(arg)
    elif arg.startswith("--config="):
      out.append(arg)
    i += 1
  return out if any(a.startswith("--config=") for a in out) else [f"--config={default}", *out]
