import types

import jax
import pytest

from areal_jax.learner.flops import datasheet_peak, measure_matmul_peak, peak_flops


@pytest.mark.parametrize("kind, peak", [("TPU v5 lite", 197e12), ("TPU v5", 459e12), ("TPU v6 lite", 918e12),
                                        ("NVIDIA H100 80GB HBM3", 989e12), ("cpu", None)])
def test_datasheet_lookup_by_device_kind(kind, peak):
  assert datasheet_peak(types.SimpleNamespace(device_kind=kind)) == peak


def test_cpu_peak_is_measured_on_the_given_devices():
  one = measure_matmul_peak(jax.devices()[:1], size=128, repeats=2)
  assert one > 1e6
  assert peak_flops(jax.devices()[:2]) > 0
