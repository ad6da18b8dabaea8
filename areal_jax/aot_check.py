"""Will a preset fit on a TPU slice? Ahead-of-time compilation of every device program against a named topology.

No TPU is needed: libtpu describes a topology (`v5e:4x4`, `v5p:2x2x2`, ...) whose devices can be put in a mesh and
compiled for. Parameters, optimizer state, KV pool and batches are abstract shapes; nothing is materialised.

    settings = validate(load_config("configs/math.py:qwen2.5-1.5b"), data=False)  # no dataset needed
    reports = check(settings, sampler_topology="v5e:2x4", learner_topology="v5e:2x4")
    print(format_table(reports)); assert all(r.fits for r in reports)

Programs (per device, from XLA's memory analysis of the partitioned program; FLOPs are the model's, as MFU counts
them, for the packing stated in the note):

* learner `logprobs` (the proximal pass), `accumulate` (forward + backward of one packed micro-batch of
  `max_tokens_per_mb` tokens per row), `apply` (the optimizer update); mesh fsdp × tensor.
* sampler `prefill` (one row of max_seq_len), `decode` (one step of all slots over the KV pool), `insert` (prefill
  results into the pool); mesh data × tensor, weights in `sampler.param_dtype`. With `num_pages = 0` the pool takes
  `memory_fraction` of what the HBM leaves after the parameters, as on a real slice.

`total = arguments + outputs + temporaries - aliased (donated) + resident`. `resident` counts buffers that stay live in
HBM during the program without being its arguments: the optimizer state (and reference parameters with a KL term)
while the learner runs `logprobs` / `accumulate`, the KV pool during `prefill`, the parameters during `insert`. Not
counted: the step's packed batch arrays (about 28 bytes per token of a micro-batch row, all micro-batches of a step on
device at once) and a second parameter copy while the sampler receives new weights.

Waste: for the learner's `logprobs` and `accumulate`, `flop_ratio` is the matmul FLOPs the program executes over the
model's, for rows packed with sequences of `flop_seq_len` tokens (`learner_flops`). A ratio well above 1 means
masked-out or repeated work: attention over pairs no segment holds, or rematerialisation (full remat recomputes the
forward pass in the backward: 4/3 of the matmuls).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import time

import jax
from jax.extend import core as jax_core
import numpy as np

from areal_jax.config import Settings
from areal_jax.distributed.slices import replica_meshes
from areal_jax.learner.critic import build_critic
from areal_jax.learner.step import BATCH_INT_KEYS, build_step
from areal_jax.models.config import ModelConfig
from areal_jax.models.packed_attention import splash_block, splash_blocks_computed
from areal_jax.sampler.aot import abstract_decode_state, abstract_params, lower_sampler
from areal_jax.sharding import LEARNER_RULES, device_bytes, make_mesh

GIB = 1 << 30
# HBM per chip by `device_kind`; a chip described as several devices (v4's two cores) splits it between them.
HBM_GIB = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5e": 16, "TPU v5": 95, "TPU v5p": 95, "TPU v6 lite": 32,
           "TPU v6e": 32}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramReport:
  """One compiled program's per-device footprint. Byte counts are per device; `error` is set when XLA refused."""

  role: str  # learner | sampler
  program: str
  topology: str
  mesh: dict[str, int]
  argument_bytes: int = 0
  output_bytes: int = 0
  temp_bytes: int = 0
  alias_bytes: int = 0
  resident_bytes: int = 0
  hbm_bytes: int
  flops: float = 0.0  # model FLOPs per device (0: not a model pass); see `_model_flops`
  flop_ratio: float = 0.0  # executed FLOPs over `flops` (0: not measured); see `learner_flops`
  compile_s: float = 0.0
  kernels: tuple[str, ...] = ()  # Pallas (Mosaic) kernels in the compiled program, by name
  collectives: tuple[str, ...] = ()  # the compiled program's cross-device collectives, e.g. "all-gather x2"
  note: str = ""
  error: str = ""

  @property
  def total_bytes(self) -> int:
    return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes + self.resident_bytes

  @property
  def fits(self) -> bool:
    return not self.error and self.total_bytes <= self.hbm_bytes

  def verdict(self) -> str:
    """One line naming the program, its bytes and the HBM."""
    where = f"{self.role}/{self.program} on {self.topology} {self.mesh}"
    if self.error:
      return f"{where}: XLA could not compile it: {self.error}"
    return (f"{where}: {self.total_bytes / GIB:.2f} GiB per device of {self.hbm_bytes / GIB:.2f} GiB HBM "
            f"({'fits' if self.fits else 'does NOT fit'})")


def topology_devices(name: str) -> list:
  """The devices of a TPU topology description (`v5e:2x4`, `v5p:2x2x2`, `v6e:4x4`); needs libtpu, not a TPU."""
  # Compiling for a description does not open the chips, so another process holding libtpu's lock is no obstacle.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)


def hbm_bytes(devices, hbm_gib: float = 0.0) -> int:
  """HBM of one of `devices`: `hbm_gib` when given, else its chip's (by `device_kind`) over the devices per chip."""
  if hbm_gib:
    return int(hbm_gib * GIB)
  kind = devices[0].device_kind
  if kind not in HBM_GIB:
    raise ValueError(f"unknown HBM size for device kind {kind!r}; known: {sorted(HBM_GIB)}; pass hbm_gib")
  chip = getattr(devices[0], "coords", None)
  per_chip = sum(getattr(d, "coords", None) == chip for d in devices)
  return HBM_GIB[kind] * GIB // per_chip


def _model_flops(model_cfg: ModelConfig, tokens: int, seq_len: int, devices: int) -> float:
  """Per-device FLOPs of a forward pass over `tokens` tokens (sequences of `seq_len`) split over `devices`
  (`ModelConfig.flops_per_token`, the MFU count; training is 3 passes)."""
  return tokens * model_cfg.flops_per_token(seq_len) / devices


def pallas_kernels(compiled) -> tuple[str, ...]:
  """Names of the Pallas TPU kernels (Mosaic custom calls) in a compiled program, each once, in order."""
  names = re.findall(r"^\s*(?:ROOT )?%([\w.-]+?)(?:\.\d+)? = .*custom_call_target=\"tpu_custom_call\"",
                     compiled.as_text(), re.M)
  return tuple(dict.fromkeys(names))


# Matmuls per (query block, key block) pair in each of JAX's splash kernels: forward q.k and p.v; dq recomputes q.k,
# then do.v and ds.k; dkv recomputes q.k, then do.v, p.do and ds.q.
_SPLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}


_COLLECTIVE = re.compile(r"\s(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def collectives(compiled) -> tuple[str, ...]:
  """The collectives of a compiled program's optimised HLO, by kind with their counts (an async pair counted once)."""
  counts = collections.Counter(_COLLECTIVE.findall(compiled.as_text()))
  return tuple(f"{kind} x{n}" for kind, n in sorted(counts.items()))


def matmul_flops(jaxpr, *, devices: int) -> tuple[float, dict[str, float]]:
  """(Matmul FLOPs of a traced program over all devices, Pallas kernel calls by name) from its jaxpr: every scan's
  body counted `length` times, rematerialised passes as often as they run, `shard_map` bodies once per device, the
  first branch of a `cond`; a `while` body once (none on the learner's path). Grouped matmuls (`ragged_dot`, megablox)
  count each row once; splash kernels' work is not in it (see `learner_flops`). XLA's own count is no substitute: it counts a loop body once, and its TPU compiler turns some
  sharded matmuls into loops of its own (on 8 devices a plain sharded matmul reports half its FLOPs)."""
  total, kernels = 0.0, collections.Counter()

  def walk(jx, mult):
    nonlocal total
    for eqn in jx.eqns:
      name = eqn.primitive.name
      if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        total += mult * 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
        continue
      if name == "ragged_dot_general":  # a grouped matmul: each lhs row meets one group's matrix
        lhs = eqn.invars[0].aval.shape
        total += mult * 2 * lhs[0] * lhs[1] * eqn.outvars[0].aval.shape[-1]
        continue
      if name == "pallas_call":
        cost = eqn.params.get("cost_estimate")
        if eqn.params.get("name") is None and cost is not None:  # megablox's grouped matmuls state their FLOPs
          total += mult * cost.flops
        else:
          kernels[str(eqn.params.get("name"))] += mult
        continue
      inner = mult * (eqn.params["length"] if name == "scan" else
                      eqn.params["mesh"].size if name == "shard_map" else 1)
      subs = ([eqn.params["branches"][0]] if name == "cond" else
              [v for v in eqn.params.values() if isinstance(v, (jax_core.ClosedJaxpr, jax_core.Jaxpr))])
      for sub in subs:
        walk(getattr(sub, "jaxpr", sub), inner)

  walk(jaxpr.jaxpr, 1.0)
  return total, dict(kernels)


def _splash_flops(kernels: dict[str, float], model_cfg: ModelConfig, mesh, length: int, seq_len: int) -> float:
  """FLOPs over all devices of splash kernel calls (`kernels`, by name; each call one row of `length` tokens and the
  heads of one device) for rows packed with sequences of `seq_len`: the block pairs the kernel's own tables visit,
  times the matmuls per pair."""
  tp = -(-length // 128) * 128
  block = splash_block(tp)
  row = np.zeros(tp, np.int32)
  row[:length] = 1 + np.arange(length) // seq_len
  pairs = splash_blocks_computed(row[None], block)
  tensor = mesh.shape["tensor"]
  heads = model_cfg.num_heads // tensor if model_cfg.num_kv_heads % tensor == 0 else model_cfg.num_heads
  per_matmul = 2 * block * block * model_cfg.head_dim * heads * pairs
  total = 0.0
  for name, n in kernels.items():
    kind = next((k for k in ("dkv", "dq", "fwd") if f"_{k}_" in name), None)
    if name.startswith("splash") and kind:
      total += n * _SPLASH_MATMULS[kind] * per_matmul
  return total


def learner_flops(fns, model_cfg: ModelConfig, length: int, seq_len: int) -> dict[str, float]:
  """Per-device matmul FLOPs that the learner's `logprobs` and `accumulate` (`fns`: `build_step`'s) execute on rows
  of `length` tokens packed with sequences of `seq_len` tokens: the traced programs' matmuls (`matmul_flops`) plus
  the splash kernels' block pairs (`_splash_flops`), over the devices."""
  args = fns.abstract_args(length)
  devices = fns.mesh.size
  out = {}
  for name in ("logprobs", "accumulate"):
    flops, kernels = matmul_flops(jax.make_jaxpr(getattr(fns, name))(*args[name]), devices=devices)
    out[name] = (flops + _splash_flops(kernels, model_cfg, fns.mesh, length, seq_len)) / devices
  return out


def _compile(lowered, **fields) -> ProgramReport:
  """Compiles `lowered`; its per-device memory, or the compiler's refusal when it exceeds the HBM."""
  start = time.perf_counter()
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses programs that exceed HBM
    message = str(e)
    if "RESOURCE_EXHAUSTED" not in message:
      raise
    return ProgramReport(error=message.splitlines()[0][:300], compile_s=time.perf_counter() - start, **fields)
  seconds = time.perf_counter() - start
  m = compiled.memory_analysis()
  return ProgramReport(argument_bytes=m.argument_size_in_bytes, output_bytes=m.output_size_in_bytes,
                       temp_bytes=m.temp_size_in_bytes, alias_bytes=m.alias_size_in_bytes, compile_s=seconds,
                       kernels=pallas_kernels(compiled), collectives=collectives(compiled), **fields)


def check_learner(settings: Settings, topology: str, *, hbm_gib: float = 0.0,
                  flop_seq_len: int | None = 4096, held_bytes: int = 0) -> list[ProgramReport]:
  """`logprobs`, `accumulate`, `apply` of the run's learner on `topology` (mesh fsdp × mesh.learner_expert × mesh.learner_tensor).
  Model FLOPs are for rows packed with sequences of `flop_seq_len` tokens (at most the row and `max_seq_len`), and
  the executed FLOPs are measured for them too (`learner_flops`; None: not measured, model FLOPs at the longest).
  `held_bytes`: per device, another role's state resident beside every program (colocated)."""
  devices = topology_devices(topology)
  mesh = make_mesh(devices, settings.mesh.learner_axes())
  cfg, model_cfg, max_seq_len = settings.learner, settings.model, settings.sampler.max_seq_len
  fns = build_step(model_cfg, cfg, mesh, temperature=settings.sampler.temperature)
  params, opt = fns.abstract_state()
  ref = device_bytes(params) if cfg.kl_coef else 0
  critic = None if not cfg.critic else build_critic(model_cfg, cfg, mesh, batch_sharding=fns.batch_sharding,
                                                    replicated=fns.replicated, rules=LEARNER_RULES)
  # With a critic each role's state stays in HBM while the other's programs run.
  ref += device_bytes(critic.abstract_state()) if critic else 0
  resident = {"logprobs": device_bytes(opt) + ref, "accumulate": device_bytes(opt) + ref, "apply": ref}
  seq_len = min(flop_seq_len or max_seq_len, cfg.max_tokens_per_mb, max_seq_len)
  note = f"{fns.rows} rows x {cfg.max_tokens_per_mb} tokens (FLOPs: sequences of {seq_len})"
  hbm = hbm_bytes(devices, hbm_gib)
  forward = _model_flops(model_cfg, fns.rows * cfg.max_tokens_per_mb, seq_len, len(devices))
  flops = {"logprobs": forward, "accumulate": 3 * forward, "apply": 0.0}
  executed = learner_flops(fns, model_cfg, cfg.max_tokens_per_mb, seq_len) if flop_seq_len else {}
  lowered = fns.lower(cfg.max_tokens_per_mb)
  if critic:
    lowered |= critic.lower(fns.abstract_batch(cfg.max_tokens_per_mb, BATCH_INT_KEYS + ("loss_mask",)))
    # The policy's state stays resident, less the base a LoRA-branch critic takes as an argument.
    policy = device_bytes((params, opt)) - device_bytes(critic.abstract_shared())
    critic_opt = device_bytes(critic.abstract_state()[1])
    resident |= {"critic_values": policy + critic_opt, "critic_accumulate": policy + critic_opt,
                 "critic_apply": policy}
    flops |= {"critic_values": forward, "critic_accumulate": 3 * forward, "critic_apply": 0.0}
  return [_compile(lowered[name], role="learner", program=name, topology=topology, mesh=dict(mesh.shape),
                   hbm_bytes=hbm, resident_bytes=resident[name] + held_bytes, flops=flops[name],
                   flop_ratio=executed[name] / flops[name] if name in executed else 0.0,
                   note=note if not name.endswith("apply") else "")
          for name in lowered]


def learner_state_bytes(settings: Settings, topology: str, *, scratch: int = 0) -> tuple[int, int]:
  """Per device, (what the learner keeps in HBM between its programs: parameters, optimizer state, the reference
  policy (with a KL term) and a critic's state; what a step allocates beyond it: the float32 gradient accumulators
  and `scratch`, the most one of its programs needs: `StepFns.working_bytes`, as `Learner.working_bytes`)."""
  mesh = make_mesh(topology_devices(topology), settings.mesh.learner_axes())
  cfg, model_cfg = settings.learner, settings.model
  fns = build_step(model_cfg, cfg, mesh, temperature=settings.sampler.temperature)
  params, opt = fns.abstract_state()
  held = device_bytes((params, opt)) + (device_bytes(params) if cfg.kl_coef else 0)
  if cfg.critic:
    critic = build_critic(model_cfg, cfg, mesh, batch_sharding=fns.batch_sharding, replicated=fns.replicated,
                          rules=LEARNER_RULES)
    held += device_bytes(critic.abstract_state()) - device_bytes(critic.abstract_shared())
  return held, fns.working_bytes(cfg.max_tokens_per_mb, scratch)


def check_sampler(settings: Settings, topology: str, *, hbm_gib: float = 0.0, held_bytes: int = 0,
                  reserved_bytes: int = 0) -> list[ProgramReport]:
  """`prefill`, `decode`, `insert` of the run's sampler on `topology` (mesh data × mesh.sampler_expert × mesh.sampler_tensor),
  `prefill_after` with `sampler.prefix_cache` and `speculate` with `sampler.speculation`. With `mesh.sampler_replicas` the programs of one replica, on its
  share of the topology's devices (every replica's are the same). `held_bytes`: per device, another role's state
  resident beside every program (colocated); the KV pool is sized from what it and `reserved_bytes` (another role's
  working memory) leave, as a run sizes it from the device's free memory."""
  devices = topology_devices(topology)
  mesh = replica_meshes(make_mesh(devices, settings.mesh.sampler_axes()), settings.mesh)[0]
  devices = list(mesh.devices.flat)
  model_cfg, cfg = settings.model, settings.sampler  # a LoRA sampler holds adapters
  hbm = hbm_bytes(devices, hbm_gib)
  _, params = abstract_params(model_cfg, mesh, cfg.weight_dtype)
  free = hbm - held_bytes - reserved_bytes
  state, pages = abstract_decode_state(model_cfg, cfg, mesh, params, free_bytes=free)
  resident = {k: v + held_bytes for k, v in
              {"prefill": device_bytes(state), "prefill_after": 0, "decode": 0, "speculate": 0,
               "insert": device_bytes(params)}.items()}
  note = (f"{cfg.num_slots // mesh.shape['data']} slots, {pages} pages of {cfg.page_size} per data shard"
          f" (max {cfg.pages_per_seq} per sequence)")
  # Prefill: one row on every data shard, split over tensor; decode: one token per slot at the full context.
  tensor, data = mesh.shape["tensor"], mesh.shape["data"]
  flops = {"prefill": _model_flops(model_cfg, cfg.max_seq_len, cfg.max_seq_len, tensor),
           "decode": _model_flops(model_cfg, cfg.num_slots, cfg.max_seq_len, data * tensor), "insert": 0.0}
  flops["prefill_after"] = flops["prefill"]  # the same row, after pages of the prefix cache
  # Speculation: one forward of spec_tokens + 1 positions per slot (weights and each slot's cache read once).
  flops["speculate"] = _model_flops(model_cfg, cfg.num_slots * (cfg.spec_tokens + 1), cfg.max_seq_len, data * tensor)
  lowered = lower_sampler(model_cfg, cfg, mesh, free_bytes=free)
  return [_compile(lowered[name], role="sampler", program=name, topology=topology, mesh=dict(mesh.shape),
                   hbm_bytes=hbm, resident_bytes=resident[name], flops=flops[name],
                   note=note if name in ("decode", "speculate") else "")
          for name in ("prefill", "decode", "insert") + ("prefill_after",) * cfg.prefix_cache
          + ("speculate",) * (cfg.speculation != "off")]


def check_colocated(settings: Settings, topology: str, *, hbm_gib: float = 0.0,
                    flop_seq_len: int | None = 4096) -> list[ProgramReport]:
  """Both roles on every device of `topology` (`mesh.colocated`), as a run places them: the sampler's KV pool sized
  from what the learner's resident state and its step's working memory (gradient accumulators and the largest
  program's scratch: `Learner.working_bytes`) leave; each role's programs counted with the other's state resident
  beside them."""
  learner = check_learner(settings, topology, hbm_gib=hbm_gib, flop_seq_len=flop_seq_len)
  learner_held, working = learner_state_bytes(settings, topology, scratch=max(r.temp_bytes for r in learner))
  sampler = check_sampler(settings, topology, hbm_gib=hbm_gib, held_bytes=learner_held, reserved_bytes=working)
  decode = next(r for r in sampler if r.program == "decode")
  sampler_held = decode.argument_bytes  # its weights and decode state (the pool), what stays while the learner runs
  learner = [dataclasses.replace(r, resident_bytes=r.resident_bytes + sampler_held) for r in learner]
  return learner + sampler


def check(settings: Settings, *, sampler_topology: str | None, learner_topology: str | None,
          hbm_gib: float = 0.0, flop_seq_len: int | None = 4096) -> list[ProgramReport]:
  """Compiles the learner's programs for `learner_topology` and the sampler's for `sampler_topology` (either may be
  None to skip that role); each role gets its own slice, as in a run. `settings`: `validate(config, data=False)`.
  `flop_seq_len`: see `check_learner`."""
  reports = []
  if learner_topology:
    reports += check_learner(settings, learner_topology, hbm_gib=hbm_gib, flop_seq_len=flop_seq_len)
  if sampler_topology:
    reports += check_sampler(settings, sampler_topology, hbm_gib=hbm_gib)
  return reports


def format_table(reports: list[ProgramReport]) -> str:
  """A Markdown table: per-device GiB of each program against the HBM, model TFLOP per device, compile seconds."""
  gib = lambda b: f"{b / GIB:.2f}"
  head = ("role", "program", "topology", "mesh", "args", "out", "temp", "alias", "resident", "total", "HBM", "fits",
          "TFLOP", "FLOP ratio", "compile s", "Pallas kernels", "collectives", "note")
  rows = [head, ("---",) * len(head)]
  for r in reports:
    mesh = "x".join(f"{k}{v}" for k, v in r.mesh.items())
    if r.error:
      rows.append((r.role, r.program, r.topology, mesh, *("-",) * 6, gib(r.hbm_bytes), "no", "-", "-",
                   f"{r.compile_s:.1f}", "-", "-", r.error))
      continue
    rows.append((r.role, r.program, r.topology, mesh, gib(r.argument_bytes), gib(r.output_bytes), gib(r.temp_bytes),
                 gib(r.alias_bytes), gib(r.resident_bytes), gib(r.total_bytes), gib(r.hbm_bytes),
                 "yes" if r.fits else "NO", f"{r.flops / 1e12:.3f}" if r.flops else "-",
                 f"{r.flop_ratio:.2f}" if r.flop_ratio else "-", f"{r.compile_s:.1f}",
                 ", ".join(r.kernels) or "-", ", ".join(r.collectives) or "-", r.note))
  return "\n".join("| " + " | ".join(row) + " |" for row in rows)

