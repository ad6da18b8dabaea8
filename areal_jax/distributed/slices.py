"""Splitting the visible devices into a sampler slice and a learner slice, one mesh each."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from areal_jax.config import split_devices
from areal_jax.sharding import make_mesh


@dataclasses.dataclass(frozen=True)
class Slices:
  sampler: Mesh  # axes (data, tensor)
  learner: Mesh  # axes (fsdp, tensor)
  shared: bool  # one device time-shared by both roles


def _by_slice(devices: Sequence[jax.Device], n_sampler: int) -> tuple[list, list] | None:
  """On a multislice TPU, whole slices go to each role (sampler first); None when devices carry one slice."""
  index = [getattr(d, "slice_index", None) for d in devices]
  if None in index or len(set(index)) < 2:
    return None
  slices = sorted(set(index))
  per = len(devices) // len(slices)
  k = max(1, min(len(slices) - 1, round(n_sampler / per)))
  sampler_ids = set(slices[:k])
  return ([d for d in devices if d.slice_index in sampler_ids], [d for d in devices if d.slice_index not in sampler_ids])


def build_slices(mesh_config, devices: Sequence[jax.Device] | None = None) -> Slices:
  devices = list(devices if devices is not None else jax.devices())
  if len(devices) == 1:
    logging.info("one device: sampler and learner time-share %s", devices[0])
    d = devices
    return Slices(make_mesh(d, {"data": 1, "tensor": 1}), make_mesh(d, {"fsdp": 1, "tensor": 1}), shared=True)
  n_sampler, _ = split_devices(len(devices), mesh_config.sampler_devices)
  split = _by_slice(devices, n_sampler) or (devices[:n_sampler], devices[n_sampler:])
  sampler = make_mesh(split[0], {"data": -1, "tensor": mesh_config.sampler_tensor})
  learner = make_mesh(split[1], {"fsdp": -1, "tensor": mesh_config.learner_tensor})
  logging.info("sampler slice: %d devices %s; learner slice: %d devices %s", len(split[0]), dict(sampler.shape),
               len(split[1]), dict(learner.shape))
  return Slices(sampler, learner, shared=False)
