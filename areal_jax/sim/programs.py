"""The learner's FLOPs per token as the project's own programs execute them, for the planner's cost model.

`tools/aot_check.py` builds the learner's `logprobs` (the proximal pass) and `accumulate` (forward and backward of a
micro-batch) for a named TPU topology; `aot_check.learner_flops` counts the matmul FLOPs of their traced programs
(every layer of the scan, rematerialised forwards, the splash kernels' block pairs for rows packed with sequences of
a given length). Over the model's forward FLOPs (`ModelConfig.flops_per_token`, what MFU counts) these are the passes
the cost model charges per trained token, in place of the analytic 1 + 3 (+ remat). XLA's `cost_analysis()` of the
compiled programs is not used for FLOPs: it counts a loop body (the layer scan) once.
"""

from __future__ import annotations

import dataclasses

import jax

from areal_jax import aot_check
from areal_jax.config import Settings
from areal_jax.learner.step import build_step
from areal_jax.models.config import ModelConfig
from areal_jax.sharding import make_mesh


@dataclasses.dataclass(frozen=True)
class LearnerPasses:
  """Forward passes' worth of FLOPs per trained token: the proximal `logprobs` pass and the whole step (that pass
  plus `accumulate`), for rows packed with sequences of `seq_len` tokens on `topology`."""

  proximal: float
  total: float
  topology: str
  seq_len: int
  scratch_bytes: int = 0  # per device, the most scratch memory one of the step's compiled programs needs


def learner_passes(settings: Settings, topology: str, seq_len: int, model_cfg: ModelConfig | None = None
                   ) -> LearnerPasses:
  """Traces the run's learner programs (of `model_cfg`, default the run's model) for `topology` (mesh fsdp x
  mesh.learner_tensor; libtpu, no TPU) and counts their FLOPs for rows of `learner.max_tokens_per_mb` tokens packed
  with sequences of `seq_len`, and compiles them for their scratch memory per device (each device's rows are the
  same whatever the topology's size, so it holds for the run's learner chips)."""
  cfg, model_cfg = settings.learner, model_cfg or settings.model
  try:
    devices = aot_check.topology_devices(topology)
  except Exception as e:  # pylint: disable=broad-except  # libtpu's own error types
    raise ValueError(f"topology {topology!r}: libtpu cannot describe it ({str(e).splitlines()[0]})") from e
  mesh = make_mesh(devices, settings.mesh.learner_axes())
  fns = build_step(model_cfg, cfg, mesh, temperature=settings.sampler.temperature)
  seq_len = max(1, min(seq_len, cfg.max_tokens_per_mb, settings.sampler.max_seq_len))
  executed = aot_check.learner_flops(fns, model_cfg, cfg.max_tokens_per_mb, seq_len)
  model = fns.rows * cfg.max_tokens_per_mb * model_cfg.flops_per_token(seq_len) / mesh.size
  try:
    scratch = fns.scratch_bytes(fns.lower(cfg.max_tokens_per_mb))
  except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program that exceeds the HBM
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise ValueError(f"--learner_programs={topology}: the learner's step does not fit in a chip's HBM at "
                     f"learner.max_tokens_per_mb={cfg.max_tokens_per_mb}, model.remat={model_cfg.remat!r} "
                     f"({str(e).splitlines()[0][:200]}); the run could not train so") from None
  return LearnerPasses(proximal=executed["logprobs"] / model,
                       total=(executed["logprobs"] + executed["accumulate"]) / model, topology=topology,
                       seq_len=seq_len, scratch_bytes=scratch)
