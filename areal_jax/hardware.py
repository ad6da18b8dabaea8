"""Accelerators by their datasheets: per-chip peaks for the planner (`tools/plan.py --device=NAME`), the learner's
MFU (`learner.flops`) and the device check's judgements (`tools/device_check.py`). Does not import JAX.

Peaks are the vendors' dense bf16 figures; what a program reaches of them is the cost model's efficiency
(`sim.costs.Efficiency`), fitted on this machine by `sim.calibrate` for the CPU and set from published MFU/bandwidth
figures for the rest. `link` is the bandwidth one chip can send weights at to another slice (ICI for TPUs, NVLink for
GPUs), one direction. `chips_per_host` and `host_network` (bytes/s a host sends over the data-centre network, one
direction; None where no datasheet here gives it) price what crosses between processes on different hosts;
`host_link` (a chip's PCIe to its host, one direction; None where no datasheet gives it) the checkpoint's copy. `kinds`
are the `device_kind` strings JAX reports for the chip (a longer match wins).
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
  kinds: tuple[str, ...] = ()  # JAX's `device_kind` for it, or the start of it (before a space or a hyphen)
  chips_per_host: int = 8
  host_network: float | None = None  # bytes/s per host over the data-centre network, one direction
  cores_per_chip: int = 1  # TensorCores per TPU chip, which Google's slice names count (v4, v5p: 2)
  host_link: float | None = None  # bytes/s one chip copies to its host's memory (PCIe), one direction

  @property
  def tpu(self) -> bool:
    """A Cloud TPU: a slice over several hosts may run under one controller (Pathways)."""
    return any(k.startswith("TPU") for k in self.kinds)

  def describe(self, chips: int) -> str:
    """`chips` of it as people name them: "64 x v5p (v5p-128)" (Google's slice names count TensorCores), "8 x h100"."""
    return f"{chips} x {self.name}" + (f" ({self.name}-{chips * self.cores_per_chip})" if self.tpu else "")


DEVICES = {d.name: d for d in (
    # cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s; all-reduce 1.1 PB/s per 4096-chip pod
    # (268 GB/s per chip); 4 chips per TPU VM host; its DCN bandwidth is not given there.
    # Same page: two TensorCores per chip, which slice names count (v4-8 = 4 chips).
    Device("v4", 275e12, 1200 * GB, 32 * GIB, 268 * GB, ("TPU v4",), chips_per_host=4, cores_per_chip=2),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB at 819 GB/s, ICI 400 GB/s per chip bidirectional.
    # Same page: 8 chips per host, "per-host NIC configuration 2 x 100 Gbps NIC" (25 GB/s).
    Device("v5e", 197e12, 819 * GB, 16 * GB, 200 * GB, ("TPU v5 lite", "TPU v5e"), chips_per_host=8,
           host_network=25 * GB),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GB at 2765 GB/s, ICI 4800 Gbps per chip.
    # Same page: 4-chip VMs, "data center network (DCN) bandwidth per chip 50 Gbps" (200 Gbps = 25 GB/s per host).
    # Same page: two TensorCores per chip, which slice names count (v5p-8 = 4 chips).
    Device("v5p", 459e12, 2765 * GB, 95 * GB, 600 * GB, ("TPU v5", "TPU v5p"), chips_per_host=4,
           host_network=25 * GB, cores_per_chip=2),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GB at 1640 GB/s, ICI 3584 Gbps per chip.
    # Same page: 8 chips per host; its NICs are not given there.
    Device("v6e", 918e12, 1640 * GB, 32 * GB, 448 * GB, ("TPU v6 lite", "TPU v6e"), chips_per_host=8),
    # NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s bf16 dense, 2039 GB/s, NVLink 600 GB/s (both directions).
    # DGX A100 user guide: 8 GPUs and 8 x 200 Gb/s HDR InfiniBand compute ports per system (200 GB/s).
    # Same datasheet: PCIe Gen4 64 GB/s (both directions).
    Device("a100", 312e12, 2039 * GB, 80 * GB, 300 * GB, ("NVIDIA A100",), chips_per_host=8, host_network=200 * GB,
           host_link=32 * GB),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOP/s bf16 dense, 80 GB at 3.35 TB/s, NVLink 900 GB/s (both directions).
    # DGX H100 user guide: 8 GPUs and 8 x 400 Gb/s ConnectX-7 compute ports per system (400 GB/s).
    # Same datasheet: PCIe Gen5 128 GB/s (both directions).
    Device("h100", 989e12, 3350 * GB, 80 * GB, 450 * GB, ("NVIDIA H100",), chips_per_host=8, host_network=400 * GB,
           host_link=64 * GB),
    # H800 SXM5 (H100 for the Chinese market; the AReaL paper's GPU): H100's compute and HBM, NVLink 400 GB/s.
    # 8 per HGX board; the network of a host is the integrator's (no datasheet value).
    Device("h800", 989e12, 3350 * GB, 80 * GB, 200 * GB, ("NVIDIA H800",), chips_per_host=8),
    # NVIDIA H200 datasheet (SXM): 989 TFLOP/s bf16 dense, 141 GB at 4.8 TB/s, NVLink 900 GB/s (both directions).
    # DGX H200 user guide: 8 GPUs and 8 x 400 Gb/s ConnectX-7 compute ports per system (400 GB/s).
    # Same datasheet: PCIe Gen5 128 GB/s (both directions).
    Device("h200", 989e12, 4800 * GB, 141 * GB, 450 * GB, ("NVIDIA H200",), chips_per_host=8, host_network=400 * GB,
           host_link=64 * GB),
    # NVIDIA DGX B200 datasheet: 8 B200 GPUs with 1,440 GB of HBM3e at 64 TB/s in all (180 GB at 8 TB/s each), NVLink
    # 14.4 TB/s in all (1.8 TB/s per GPU, both directions), 8 x 400 Gb/s ConnectX-7 (400 GB/s). HGX B200 datasheet:
    # FP16/BF16 tensor core 36 PFLOPS for 8 GPUs with sparsity, i.e. 2.25 PFLOP/s dense per GPU.
    Device("b200", 2250e12, 8000 * GB, 180 * GB, 900 * GB, ("NVIDIA B200",), chips_per_host=8, host_network=400 * GB),
)}


def device(name: str) -> Device:
  """The named device; a ValueError lists the known names."""
  if name not in DEVICES:
    raise ValueError(f"--device={name!r}: choose one of {sorted(DEVICES)}")
  return DEVICES[name]


def of_kind(kind: str) -> Device | None:
  """The device whose `kinds` match JAX's `device_kind` (exactly, or as its start before a space or a hyphen), or
  None (a CPU, a chip not in the table). The longest match wins ("TPU v5 lite" over "TPU v5")."""
  matches = [(len(k), d) for d in DEVICES.values() for k in d.kinds
             if kind == k or kind.startswith((k + " ", k + "-"))]
  return max(matches, key=lambda m: m[0])[1] if matches else None
