"""Datasheets found by the `device_kind` JAX reports, as MFU and the device check look them up."""

import pytest

from areal_jax import hardware


@pytest.mark.parametrize("kind, name", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                        ("NVIDIA H800", "h800"), ("NVIDIA A100-SXM4-80GB", "a100"),
                                        ("NVIDIA A100 80GB PCIe", "a100"), ("TPU v5 lite", "v5e"), ("TPU v5", "v5p"),
                                        ("TPU v5p", "v5p"), ("TPU v6 lite", "v6e"), ("TPU v4", "v4"), ("cpu", None)])
def test_a_device_kind_finds_its_datasheet(kind, name):
  found = hardware.of_kind(kind)
  assert (found and found.name) == name
