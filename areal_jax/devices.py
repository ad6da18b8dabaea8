"""Emulated CPU devices for runs without an accelerator. Import this before JAX (it does not import JAX)."""

import os


def emulate_cpu_devices(count: int) -> None:
  """Gives XLA's CPU backend `count` devices (ignored by accelerator backends); must run before JAX is imported."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={count}").strip()
