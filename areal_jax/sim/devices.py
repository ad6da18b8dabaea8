"""Accelerators the planner knows: published per-chip peaks (`tools/plan.py --device=NAME`).

Peaks are the vendors' dense bf16 figures; what a program reaches of them is the cost model's efficiency
(`costs.Efficiency`), fitted on this machine by `calibrate` for the CPU and set from published MFU/bandwidth figures for
the rest. `link` is the bandwidth one chip can send weights at to another slice (ICI for TPUs, NVLink for GPUs), one
direction.
"""

from __future__ import annotations

import dataclasses

GB = 1e9
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Device:
  name: str
  flops: float  # peak dense bf16 FLOP/s per chip
  hbm_bw: float  # HBM bytes/s per chip
  hbm: float  # HBM bytes per chip
  link: float  # bytes/s one chip sends to another, one direction


DEVICES = {d.name: d for d in (
    # cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s; all-reduce 1.1 PB/s per 4096-chip pod
    # (268 GB/s per chip).
    Device("v4", 275e12, 1200 * GB, 32 * GIB, 268 * GB),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB at 819 GB/s, ICI 400 GB/s per chip bidirectional.
    Device("v5e", 197e12, 819 * GB, 16 * GB, 200 * GB),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GB at 2765 GB/s, ICI 4800 Gbps per chip.
    Device("v5p", 459e12, 2765 * GB, 95 * GB, 600 * GB),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GB at 1640 GB/s, ICI 3584 Gbps per chip.
    Device("v6e", 918e12, 1640 * GB, 32 * GB, 448 * GB),
    # NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s bf16 dense, 2039 GB/s, NVLink 600 GB/s (both directions).
    Device("a100", 312e12, 2039 * GB, 80 * GB, 300 * GB),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOP/s bf16 dense, 80 GB at 3.35 TB/s, NVLink 900 GB/s (both directions).
    Device("h100", 989e12, 3350 * GB, 80 * GB, 450 * GB),
    # H800 SXM5 (H100 for the Chinese market; the AReaL paper's GPU): H100's compute and HBM, NVLink 400 GB/s.
    Device("h800", 989e12, 3350 * GB, 80 * GB, 200 * GB),
    # NVIDIA H200 datasheet (SXM): 989 TFLOP/s bf16 dense, 141 GB at 4.8 TB/s, NVLink 900 GB/s (both directions).
    Device("h200", 989e12, 4800 * GB, 141 * GB, 450 * GB),
)}


def device(name: str) -> Device:
  """The named device; a ValueError lists the known names."""
  if name not in DEVICES:
    raise ValueError(f"--device={name!r}: choose one of {sorted(DEVICES)}")
  return DEVICES[name]
