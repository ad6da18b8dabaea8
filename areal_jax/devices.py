"""CPU runs without an accelerator: emulated devices, and no TPU backend attempt. Import this before JAX (it does not
import JAX)."""

import glob
import os


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
