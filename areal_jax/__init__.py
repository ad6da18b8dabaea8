"""AReaL in JAX. Importing the package before JAX picks the CPU backend on a machine without an accelerator
(`devices.cpu_without_accelerator`)."""

from areal_jax import devices as _devices

_devices.cpu_without_accelerator()
