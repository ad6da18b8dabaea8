"""What a process's JAX will see, set before JAX starts: emulated CPU devices, no TPU backend attempt without a TPU,
and a subset of this host's accelerators (so that one host's GPUs or TPU chips can be several processes). Import this
before JAX (it does not import JAX)."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence


def emulate_cpu_devices(count: int) -> None:
  """Gives XLA's CPU backend `count` devices (ignored by accelerator backends); must run before JAX is imported."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={count}").strip()


# Device files of the accelerators JAX drives: TPU (/dev/accel*, /dev/vfio/N on newer TPU VMs), NVIDIA and AMD GPUs.
_ACCELERATOR_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")


def cpu_without_accelerator() -> None:
  """Sets JAX_PLATFORMS=cpu when it is unset and the machine has no accelerator device: otherwise, with libtpu
  installed, every process tries the TPU backend first and logs its failure. Has effect only before JAX is imported;
  TPU topology descriptions (`areal_jax.aot_check`) load libtpu themselves and still work."""
  if "JAX_PLATFORMS" not in os.environ and not any(glob.glob(p) for p in _ACCELERATOR_FILES):
    os.environ["JAX_PLATFORMS"] = "cpu"


# Chips per process -> their bounds as one process of a one-process slice (`TPU_CHIPS_PER_PROCESS_BOUNDS`), chips
# taken in index order: the shapes Ray and tpu-inference give a TPU host's sub-slices.
TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}


def local_accelerators() -> tuple[str, int]:
  """This host's accelerators from their device files, without starting JAX: ("gpu", n) for NVIDIA GPUs, ("tpu", n)
  for TPU chips, ("cpu", 0) for none."""
  gpus = [p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)]
  if gpus:
    return "gpu", len(gpus)
  chips = glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*")
  if chips:
    return "tpu", len(chips)
  return "cpu", 0


def device_subset_env(kind: str, devices: Sequence[int], *, port: int) -> dict[str, str]:
  """The environment that gives a process only `devices` (indices) of this host's accelerators. GPU: they are
  `CUDA_VISIBLE_DEVICES`. TPU: the chips libtpu may open (`TPU_VISIBLE_CHIPS`), their bounds as the one process of a
  one-process slice, and a mesh controller on `port` of its own (independent processes on one host must not share
  one)."""
  devices = [int(d) for d in devices]
  if not devices:
    raise ValueError("device_subset_env: no devices")
  ids = ",".join(map(str, devices))
  if kind == "gpu":
    return {"CUDA_VISIBLE_DEVICES": ids}
  if kind == "tpu":
    if len(devices) not in TPU_CHIP_BOUNDS:
      raise ValueError(f"{len(devices)} TPU chips per process: a process of a TPU host holds "
                       f"{' or '.join(map(str, TPU_CHIP_BOUNDS))} chips")
    return {"TPU_VISIBLE_CHIPS": ids, "TPU_CHIPS_PER_PROCESS_BOUNDS": TPU_CHIP_BOUNDS[len(devices)],
            "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{port}",
            "TPU_MESH_CONTROLLER_PORT": str(port)}
  raise ValueError(f"device subsets are for GPUs and TPU chips, not {kind!r} (on CPU each process emulates "
                   "config.mesh.cpu_devices devices)")
