"""Splitting the visible devices into a sampler slice and a learner slice, one mesh each, as the `mesh` group
(`MeshConfig`) says."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from areal_jax.config_records import from_group
from areal_jax.sharding import make_mesh


def split_devices(num_devices: int, sampler_devices: int | float) -> tuple[int, int]:
  """(sampler, learner) device counts; with one device both roles share it (returns (1, 1))."""
  if num_devices == 1:
    return 1, 1
  if isinstance(sampler_devices, float) and not sampler_devices.is_integer():
    if not 0 < sampler_devices < 1:
      raise ValueError(f"mesh.sampler_devices={sampler_devices!r}: a fraction must lie in (0, 1)")
    n = max(1, min(num_devices - 1, round(num_devices * sampler_devices)))
  else:
    n = int(sampler_devices)
    if not 0 < n < num_devices:
      raise ValueError(f"mesh.sampler_devices={sampler_devices!r}: must leave at least one of {num_devices} devices "
                       "to the learner")
  return n, num_devices - n


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """The `mesh` group as a frozen, validated record; field meanings as in configs/math.py. The tensor axes are
  checked against the model's heads and the device split against the devices by `config.validate`."""

  cpu_devices: int = 4  # emulated devices per process on CPU
  sampler_processes: int = 1  # of a multi-process job
  sampler_heartbeat_s: float = 30.0  # a sampler process silent this long is dropped (its groups generated again)
  sampler_devices: int | float = 0.5  # int = count, float in (0, 1) = fraction
  # Both roles on every device, generate-then-train (η = 0): the synchronous baseline; `sampler_devices` is unused.
  colocated: bool = False
  sampler_tensor: int = 1
  # Independent sampler engines the slice is split into, each on its own devices with its own scheduler, KV pool
  # and weight swap (`distributed.replicas.LocalRollout`); `sampler.num_slots` and `num_pages` count per replica.
  sampler_replicas: int = 1
  learner_tensor: int = 1
  sampler_expert: int = 1  # expert parallelism (a mixture of experts' experts over this many devices)
  learner_expert: int = 1

  def __post_init__(self):
    if not self.cpu_devices > 0:
      raise ValueError(f"mesh.cpu_devices={self.cpu_devices!r}: must be positive")
    if self.sampler_replicas < 1:
      raise ValueError(f"mesh.sampler_replicas={self.sampler_replicas!r}: must be >= 1")
    if self.sampler_processes < 0:
      raise ValueError(f"mesh.sampler_processes={self.sampler_processes!r}: must be >= 0")
    if not self.sampler_heartbeat_s >= 2:
      raise ValueError(f"mesh.sampler_heartbeat_s={self.sampler_heartbeat_s!r}: must be >= 2 (samplers report every "
                       "second)")

  def sampler_axes(self) -> dict[str, int]:
    """The sampler mesh's axes: data (the rest of the devices) x expert x tensor."""
    return {"data": -1, "expert": self.sampler_expert, "tensor": self.sampler_tensor}

  def learner_axes(self) -> dict[str, int]:
    """The learner mesh's axes: fsdp (the rest of the devices) x expert x tensor."""
    return {"fsdp": -1, "expert": self.learner_expert, "tensor": self.learner_tensor}

  def split(self, num_devices: int) -> tuple[int, int]:
    """(sampler, learner) device counts of `num_devices` (`split_devices`)."""
    return split_devices(num_devices, self.sampler_devices)

  @classmethod
  def from_config(cls, c) -> MeshConfig:
    """From the `mesh` group of an ml_collections config; unknown keys raise."""
    return from_group(cls, c, "mesh")


@dataclasses.dataclass(frozen=True)
class Slices:
  sampler: Mesh  # axes (data, expert, tensor): the whole sampler slice
  learner: Mesh  # axes (fsdp, expert, tensor)
  shared: bool  # every device time-shared by both roles (`mesh.colocated`, or one device)
  replicas: tuple[Mesh, ...] = ()  # `mesh.sampler_replicas` meshes over disjoint parts of the sampler slice


def replica_meshes(sampler: Mesh, mesh_config: MeshConfig) -> tuple[Mesh, ...]:
  """The sampler slice split into `mesh.sampler_replicas` meshes of consecutive devices, each (data, expert,
  tensor); a ValueError names the field when they do not divide it."""
  n, devices = mesh_config.sampler_replicas, list(sampler.devices.flat)
  per = len(devices) // n
  group = mesh_config.sampler_tensor * mesh_config.sampler_expert
  if len(devices) % n or per % group:
    raise ValueError(f"mesh.sampler_replicas={n}: must split the {len(devices)} sampler devices into equal replicas "
                     f"of a multiple of mesh.sampler_tensor x mesh.sampler_expert = {group} devices")
  if n == 1:
    return (sampler,)
  return tuple(make_mesh(devices[i * per:(i + 1) * per], mesh_config.sampler_axes()) for i in range(n))


def _by_slice(devices: Sequence[jax.Device], n_sampler: int) -> tuple[list, list] | None:
  """On a multislice TPU, whole slices go to each role (sampler first); None when devices carry one slice."""
  index = [getattr(d, "slice_index", None) for d in devices]
  if None in index or len(set(index)) < 2:
    return None
  slices = sorted(set(index))
  per = len(devices) // len(slices)
  k = max(1, min(len(slices) - 1, round(n_sampler / per)))
  sampler_ids = set(slices[:k])
  return ([d for d in devices if d.slice_index in sampler_ids],
          [d for d in devices if d.slice_index not in sampler_ids])


def build_slices(mesh_config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Slices:
  """The sampler and learner meshes over `devices` (default: every visible device): disjoint slices, or, colocated
  (`mesh.colocated`, or one device), both over every device."""
  devices = list(devices if devices is not None else jax.devices())
  if len(devices) == 1 or mesh_config.colocated:
    if len(devices) == 1 and mesh_config.sampler_replicas != 1:
      raise ValueError(f"mesh.sampler_replicas={mesh_config.sampler_replicas}: one device holds one sampler")
    one = len(devices) == 1  # then the tensor and expert axes have one device too, whatever the config says
    sampler = make_mesh(devices, {"data": 1, "expert": 1, "tensor": 1} if one else mesh_config.sampler_axes())
    learner = make_mesh(devices, {"fsdp": 1, "expert": 1, "tensor": 1} if one else mesh_config.learner_axes())
    logging.info("colocated: sampler %s and learner %s time-share the %d devices", dict(sampler.shape),
                 dict(learner.shape), len(devices))
    return Slices(sampler, learner, shared=True, replicas=(sampler,) if one else replica_meshes(sampler, mesh_config))
  n_sampler, _ = mesh_config.split(len(devices))
  split = _by_slice(devices, n_sampler) or (devices[:n_sampler], devices[n_sampler:])
  sampler = make_mesh(split[0], mesh_config.sampler_axes())
  learner = make_mesh(split[1], mesh_config.learner_axes())
  logging.info("sampler slice: %d devices %s; learner slice: %d devices %s", len(split[0]), dict(sampler.shape),
               len(split[1]), dict(learner.shape))
  return Slices(sampler, learner, shared=False, replicas=replica_meshes(sampler, mesh_config))
