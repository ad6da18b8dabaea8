"""What each device call of a run costs: max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)) plus a
fixed overhead per call, for the sampler's decode steps and prefills, the learner's step and the weight transfer.

FLOPs and bytes are counted from the model's shapes (`ModelConfig.num_params`, `flops_per_token`): a decode step
reads every weight once and the keys/values of every live answer's context; a prefill and a training pass are
compute-bound matmuls. `Efficiency` holds what the programs reach of the peaks; `calibrate.py` fits it for this
machine's CPU from the project's own programs.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from areal_jax.distributed.weight_delta import INDEX_BYTES
from areal_jax.models.config import ModelConfig
from areal_jax.hardware import Device


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Shares of the peaks the programs reach, and fixed costs per call. Defaults: what well-tuned JAX programs reach
  on TPUs/GPUs (MaxText-style training at 40-50% MFU, bandwidth-bound decode at 60-80% of HBM bandwidth)."""

  decode_flops: float = 0.5
  decode_bw: float = 0.7
  decode_call_s: float = 2e-3  # per decode call: dispatch, the host's read of the tokens, admission
  decode_step_s: float = 1e-4  # per decode step within a call (the device loop's own cost beyond the model)
  # The scheduler's host work per decode call (recording tokens, growing pages, admission's bookkeeping): a fixed part
  # and a part per slot of the engine. Source: `tools/bench_sampler.py --host_slots` (docs/results.md, "Host work per
  # decode call", commit f5d7381): 0.6 / 4.3 / 12.4 ms at 256 / 2048 / 8192 slots; the line of least relative error
  # through them, within 17% of each.
  # On the critical path unless `sampler.overlap` hides it behind the device call (then the longer of the two).
  host_call_s: float = 1.9e-4
  host_slot_s: float = 1.66e-6
  # With `sampler.speculation`, the drafter's host work per decode call and slot that draws in it (`SuffixDrafter`:
  # the proposal, indexing the tokens drawn, finished answers' histories), priced as the scheduler's above. Source:
  # `tools/bench_sampler.py --speculation` (docs/results.md, "Speculative rollout (suffix drafts)", commit 4f7138c,
  # the quiet 2-core CPU): `Scheduler.seconds["drafts"]` 0.17 s over 69 calls of 32 slots (revisited prompts), 0.10 s
  # over 42 (long tail): 7.7e-5 and 7.4e-5 s per slot a call, counting every slot (not every one drew: a lower bound).
  draft_slot_s: float = 7.7e-5
  prefill_flops: float = 0.5
  prefill_call_s: float = 2e-3
  learner_mfu: float = 0.4
  learner_bw: float = 0.7  # the optimizer's pass over parameters and moments
  # The learner's host work per step (`Learner.prepare`: advantages, the minibatch split, packing), before its device
  # work: a fixed part and a part per micro-batch of `max_tokens_per_mb` tokens. Source: `tools/bench_learner.py
  # --host_answers=1024,4096,8192` (docs/results.md, "Learner host work per step", commit ded294a): 0.042 / 0.248 /
  # 0.389 s at 92 / 364 / 728 micro-batches of 32,768 tokens; the least-squares line through them.
  micro_batch_s: float = 5.4e-4
  step_s: float = 0.0144
  link: float = 0.7  # of the chip-to-chip bandwidth a weight transfer reaches
  transfer_s: float = 0.05  # per weight transfer: gathering shards, the sampler's swap

  def replace(self, **kw) -> Efficiency:
    return dataclasses.replace(self, **kw)


# What training and inference engines published on each device family, as shares of `hardware.py`'s datasheet peaks;
# the fields a family does not list keep `Efficiency`'s defaults, and `published` says which. The MFUs are training
# engines' on larger models than the presets (5-20x), so upper bounds for them; `tools/device_check.py` measures ours.
PUBLISHED: dict[str, dict[str, tuple[float, str]]] = {
    # MaxText MaxText/configs/2xv4-128.sh: "158TFLOP/s, 22B params" per chip on 2 x v4-128 (of 275).
    # PyTorch/XLA's blog "The Path to Achieve Ultra-Low Inference Latency With LLaMA 65B on PyTorch/XLA": LLaMA 7B,
    # bf16, "4.7ms/token" on v4-8 (4 chips), reading 14.128 GB a step (its Table 2: weights and a one-answer cache of
    # 256 tokens; the batch is not stated, the cache is sized for one): 3.01 of 4 x 1.2 TB/s.
    "v4": {"learner_mfu": (0.57, "MaxText, 22B on 2 x v4-128: 158 of 275 TFLOP/s"),
           "decode_bw": (0.626, "PyTorch/XLA, LLaMA 7B bf16 decode on v4-8: 14.128 GB in 4.7 ms, of 4 x 1200 GB/s")},
    # MaxText MaxText/configs/v5e/README.md: 16B on 1 x v5e-256, 120 TFLOP/s per chip, 61.10% MFU.
    "v5e": {"learner_mfu": (0.611, "MaxText, 16B on v5e-256: 61.10% MFU")},
    # MaxText's runtime performance results (MaxText/configs/README.md): 32B on v5p-128, 328 TFLOP/s, 71.47% MFU.
    "v5p": {"learner_mfu": (0.715, "MaxText, 32B on v5p-128: 71.47% MFU")},
    # MaxText docs/reference/models/tiering.md (Trillium, Gold): Llama 3.1 8B on 256 chips, BF16, SL 8192, 45.46% MFU.
    "v6e": {"learner_mfu": (0.455, "MaxText, Llama 3.1 8B on 256 v6e chips: 45.46% MFU")},
    # Megatron-LM's README (weak scaling on H100, sequences of 4096, end to end): "MFU increases from 41% for the
    # smallest model considered" (2B) "to 47-48% for the largest"; the presets are nearest the smallest.
    # PyTorch's gpt-fast README on its gqa_support branch (commit 7f2c922, "Benchmarks run on 1 NVIDIA H100"):
    # Llama-2-7B bf16 decode at 146.66 tokens/s reads 1938.12 GB/s, of the datasheet's 3350 (one answer at a time).
    "h100": {"learner_mfu": (0.41, "Megatron-LM weak scaling on H100: 41% MFU at 2B"),
             "decode_bw": (0.579, "gpt-fast, Llama-2-7B bf16 decode on one H100: 1938 of 3350 GB/s")},
    # PyTorch's gpt-fast README (benchmarks on an A100-80GB power-limited to 330 W): Llama-2-7B bf16 decode at
    # 104.9 tokens/s reads 1397.31 GB/s, of the datasheet's 2039 (one answer at a time: the weights' read alone).
    # Megatron-LM's README of April 2021 (commit 50a4b5f, images/cases_april2021.png: GPT models on Selene's A100s,
    # end to end, sequences of 2048): 1.7B on 32 GPUs at 137 TFLOP/s per GPU, "44%" of peak, its smallest model
    # (43-52% up to 1T).
    "a100": {"decode_bw": (0.685, "gpt-fast, Llama-2-7B bf16 decode on A100-80GB: 1397 of 2039 GB/s"),
             "learner_mfu": (0.44, "Megatron-LM weak scaling on A100 (2021): 44% MFU at 1.7B")},
}


# `Efficiency`'s defaults with a source on every family: host work of the run's own code, measured on this project's
# 2-core CPU machine (docs/results.md), the same whatever accelerator the host drives.
HOST_MEASURED: dict[str, str] = {
    "host_call_s": "the scheduler's host work, measured: tools/bench_sampler.py --host_slots",
    "host_slot_s": "the scheduler's host work, measured: tools/bench_sampler.py --host_slots",
    "draft_slot_s": "the drafter's host work, measured: tools/bench_sampler.py --speculation",
    "step_s": "the learner's host work, measured: tools/bench_learner.py --host_answers",
    "micro_batch_s": "the learner's host work, measured: tools/bench_learner.py --host_answers",
}
UNSOURCED = "default: no published figure for this device"


def published(device: Device, eff: Efficiency = Efficiency()) -> tuple[Efficiency, dict[str, str]]:
  """`eff` with `device`'s published figures (`PUBLISHED`), and the source of every field that has one: those
  figures and the host measurements (`HOST_MEASURED`); the fields not named keep `Efficiency`'s defaults, for which
  no published figure was found for that family (`UNSOURCED`)."""
  figures = PUBLISHED.get(device.name, {})
  return (eff.replace(**{k: v for k, (v, _) in figures.items()}),
          HOST_MEASURED | {k: src for k, (_, src) in figures.items()})


def from_device_check(report: dict, device: Device, eff: Efficiency = Efficiency(), *,
                      where: str = "device_check.json") -> Efficiency:
  """`eff` with what `tools/device_check.py` measured on `device` (`report`: its device_check.json): decode's share
  of the datasheet's HBM roofline at the most slots it ran becomes `decode_bw`, and the per-call and per-step decode
  overheads 0 (the measured share already carries them at that batch); the learner's MFU against the datasheet peak
  becomes `learner_mfu`. A dry run (tiny shapes) or a report of another device is refused, naming it."""
  if report.get("dry_run"):
    raise ValueError(f"{where}: a dry run (tiny shapes, interpreted kernels) measures no device's efficiencies")
  if report.get("device") != device.name:
    raise ValueError(f"{where}: measured on {report.get('device')!r}, not on {device.name!r} (--device)")
  cal = report.get("calibration") or {}
  decode = {int(k.rsplit("_", 1)[1]): v for k, v in cal.items() if k.startswith("decode_of_spec_roofline_")}
  updates = {}
  if decode:
    updates |= {"decode_bw": float(decode[max(decode)]), "decode_call_s": 0.0, "decode_step_s": 0.0}
  if "learner_mfu" in cal:
    updates["learner_mfu"] = float(cal["learner_mfu"])
  if not updates:
    raise ValueError(f"{where}: no decode or learner figures in its calibration ({sorted(cal)})")
  return eff.replace(**updates)


@dataclasses.dataclass(frozen=True)
class Acceptance:
  """What speculative rollout (`sampler.speculation`) accepts, measured, for pricing it: `accepted[j]` is the share
  of drafted slot-forwards whose drafts at positions 0..j (of `sampler.spec_tokens`) were all accepted; `drafted` the
  share of slot-forwards that carry a draft at all (each taken as spec_tokens long). A slot-forward then emits 1 + L
  tokens, L its accepted leading drafts: P(L >= j) = drafted x accepted[j - 1] (made non-increasing), at most the
  tokens its call has left for it. Measured drafts are often shorter (`tools/bench_sampler.py --speculation`: 0.340
  of slot-forwards drafted, fewer at later positions), so the scheduler's by-position shares (`spec_accepted_at /
  spec_drafted_at`, of the forwards whose draft reached j) times `drafted` overstate P(L >= j); exact: the bench's
  accepted per slot-forward by position (`spec_accepted_at / spec_forwards`) with drafted 1."""

  accepted: tuple[float, ...]
  drafted: float = 1.0

  def __post_init__(self):
    if not self.accepted or not all(0.0 <= a <= 1.0 for a in (*self.accepted, self.drafted)):
      raise ValueError(f"acceptance {self.accepted}, drafted {self.drafted}: shares in [0, 1], at least one position")

  @classmethod
  def parse(cls, text: str, spec_tokens: int, drafted: float = 1.0) -> Acceptance:
    """`a` (each draft token accepted with probability a, independently: a^j at position j) or `a1,...,ak`, the
    shares by position as the scheduler counts them (k = `sampler.spec_tokens`)."""
    try:
      values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
      raise ValueError(f"acceptance {text!r}: expected a share or comma-separated shares by draft position") from None
    if len(values) == 1:
      values = [values[0] ** (j + 1) for j in range(spec_tokens)]
    elif len(values) != spec_tokens:
      raise ValueError(f"acceptance {text!r}: {len(values)} draft positions, sampler.spec_tokens={spec_tokens}")
    return cls(tuple(values), drafted)

  @property
  def spec_tokens(self) -> int:
    return len(self.accepted)

  def leading(self) -> np.ndarray:
    """P(L >= j) for j = 0..spec_tokens."""
    return np.minimum.accumulate(np.concatenate([[1.0], self.drafted * np.asarray(self.accepted, np.float64)]))

  def tokens_per_forward(self) -> float:
    """Tokens a slot-forward emits on average when its call leaves it room for all of them."""
    return float(self.leading().sum())

  def forwards_cdf(self, tokens: int) -> np.ndarray:
    """cdf[t, f] = P(a slot emits t tokens in at most f forwards), t, f = 0..`tokens`: each forward emits 1 + its
    accepted leading drafts, at most the t it has left (the device drafts no further than the slot's budget)."""
    at_least = self.leading()
    pmf = at_least - np.append(at_least[1:], 0.0)  # P(L = j)
    p = np.zeros((tokens + 1, tokens + 1))
    p[0, 0] = 1.0
    for t in range(1, tokens + 1):
      for j, q in enumerate(pmf):
        p[t, 1:] += q * p[t - 1 - min(j, t - 1), :-1]
    cdf = np.cumsum(p, axis=1)
    cdf[np.triu_indices(tokens + 1)] = 1.0  # t tokens take at most t forwards (exactly, not to rounding)
    return cdf

  def describe(self) -> str:
    return (f"{self.spec_tokens} drafts, accepted by position " + ", ".join(f"{a:.3g}" for a in self.accepted)
            + f", drafted {self.drafted:g}: {self.tokens_per_forward():.2f} tokens per slot-forward")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
  """Seconds per device call for one job layout: `sampler_chips` split in `sampler_shards` data shards (on TPUs and
  GPUs, of `mesh.sampler_tensor` chips each; emulated CPU devices may share a core) over `engines` independent
  engines, `learner_chips` training; `colocated` when both roles share the same chips (weights are then resharded in
  HBM); `sampler_processes` > 0 when the samplers are processes on other hosts, each pulling every version from the
  learner's leader over the network (`host_network`, bytes/s of the leader's host): the whole copy, or with
  `sync_delta` > 0 (`sync.delta`: that share of the elements changed a version) the indices and values of what
  changed; with `sync_overlap` (`sync.overlap`) that pull runs beside the learner's next step."""

  model: ModelConfig
  device: Device
  sampler_chips: float
  learner_chips: float
  sampler_shards: int = 1
  engines: int = 1
  colocated: bool = False
  sampler_processes: int = 0
  host_network: float = 0.0
  sync_delta: float = 0.0
  sync_overlap: bool = False
  weight_bytes: int = 2  # bytes per sampler weight (bfloat16)
  kv_bytes: int = 2  # bytes per cached key/value element
  passes: float = 4.0  # learner FLOP passes per token: forward + backward (3), the proximal forward (1)
  remat: float = 1.0  # extra forwards for rematerialisation: "full" = 1, "dots" ~ 0.3, "none" = 0
  max_tokens_per_mb: int = 32768
  minibatches: int = 4  # optimizer updates per learner step
  # Held-out evaluation (`rl.evaluation.Evaluator`, between learner steps, on the leader host's learner chips):
  # `eval_answers` = data.eval_size x eval.num_samples answers of `eval_len` tokens after `eval_prompt` ones, with
  # `eval_slots` decode slots drawing `eval_decode_steps` tokens a call, every `eval_every` steps (0 = none).
  eval_answers: int = 0
  eval_every: int = 0
  eval_len: float = 0.0
  eval_prompt: int = 0
  eval_slots: int = 64
  eval_decode_steps: int = 8
  eval_overlap: bool = True  # sampler.overlap, which the evaluation's engine runs with too
  checkpoint_every: int = 0  # checkpoint.every_steps (0 = none)
  learner_scratch: float = 0.0  # bytes per chip the learner step's programs need beyond its state (colocated)
  acceptance: Acceptance | None = None  # with sampler.speculation: what its drafts are accepted at (`Acceptance`)
  eff: Efficiency = Efficiency()

  @property
  def params(self) -> int:
    return self.model.num_params()

  @property
  def shard_chips(self) -> float:
    return self.sampler_chips / self.sampler_shards

  @property
  def engine_shards(self) -> int:
    """Data shards of one engine (its prefill's rows spread over them)."""
    return max(1, self.sampler_shards // self.engines)

  @property
  def kv_per_token(self) -> int:
    """Bytes of keys and values one context token holds in the cache, over all layers."""
    m = self.model
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * self.kv_bytes

  def decode_weight_bytes(self, batch: np.ndarray) -> np.ndarray:
    """Weight bytes one decode step of `batch` tokens reads: every weight of a dense model; of a mixture of experts,
    the shared ones and the experts its tokens route to (k of E each, independently: a share 1 - (1 - k/E)^batch
    of each sparse layer's experts)."""
    m, batch = self.model, np.asarray(batch, np.float64)
    if not m.num_experts:
      return np.full(batch.shape, float(self.params * self.weight_bytes))
    experts = sum(m.sparse_layers()) * m.num_experts * 3 * m.hidden_size * m.moe_intermediate_size
    touched = 1.0 - (1.0 - m.num_experts_per_tok / m.num_experts) ** batch
    return (self.params - experts + experts * touched) * self.weight_bytes

  def forward_s(self, batch: np.ndarray, context: np.ndarray, positions: int = 1) -> np.ndarray:
    """Seconds of one decode forward on each data shard (any leading axes broadcast), `batch` live answers holding
    `context` cached tokens in all, each computing `positions` positions (speculation: its pending token and
    `sampler.spec_tokens` drafts) against its cache: FLOPs count the weights a token uses (a mixture of experts: its
    k experts) and attention over the context, for every position; bytes the weights the forward reads
    (`decode_weight_bytes` of all its positions' tokens) and each answer's cache once."""
    m, d, t, e = self.model, self.device, self.shard_chips, self.eff
    batch, context = np.asarray(batch, np.float64), np.asarray(context, np.float64)
    dense = 2 * m.num_params(active=True) - (0 if m.tie_word_embeddings else 2 * m.vocab_size * m.hidden_size)
    flops = positions * (batch * dense + 4 * m.num_layers * m.num_heads * m.head_dim * context)
    bytes_ = np.where(batch > 0, self.decode_weight_bytes(batch * positions) + context * self.kv_per_token, 0)
    return np.maximum(flops / (t * d.flops * e.decode_flops), bytes_ / (t * d.hbm_bw * e.decode_bw))

  def decode_step(self, batch: np.ndarray, context: np.ndarray) -> float:
    """One decode step; per data shard `batch[i]` live answers holding `context[i]` cached tokens in all
    (`forward_s`, one position each). The shards run in lockstep: the slowest decides."""
    return float(self.forward_s(batch, context).max(initial=0.0)) + self.eff.decode_step_s

  def decode_call(self, device_s: float, slots: int, *, overlap: bool, drafting: float = 0.0) -> float:
    """One decode call of an engine of `slots` slots whose device part takes `device_s`: the scheduler's host work
    (`host_call_s` + `host_slot_s` per slot, + `draft_slot_s` for each of `drafting` slots the drafter works for with
    `sampler.speculation`) beside it with `sampler.overlap` (the longer decides), after it without; plus the fixed
    dispatch cost."""
    host = self.eff.host_call_s + self.eff.host_slot_s * slots + self.eff.draft_slot_s * drafting
    return (max(device_s, host) if overlap else device_s + host) + self.eff.decode_call_s

  def prefill(self, rows: int, length: int, *, sharded: bool = True) -> float:
    """One batched prefill of `rows` rows padded to `length` tokens, as the sampler compiles it
    (`Engine.prefill_batch`): sharded, each of the engine's data shards computes and keeps its own rows (the code
    pads them to the same count on every shard: `rows` is a multiple of the shards, else rounded up); replicated
    (JetStream's prefill, no shard given), every shard computes all of them. The shards run at once."""
    d, e, t = self.device, self.eff, self.shard_chips
    per_shard = -(-rows // self.engine_shards) if sharded else rows
    flops = per_shard * length * self.model.flops_per_token(length)
    bytes_ = self.params * self.weight_bytes + per_shard * length * self.kv_per_token
    seconds = max(flops / (t * d.flops * e.prefill_flops), bytes_ / (t * d.hbm_bw * e.decode_bw))
    return seconds + e.prefill_call_s

  def train_step(self, lengths: np.ndarray) -> float:
    """One learner step on sequences of `lengths` tokens (prompt + answer): the passes over every token, the
    optimizer's `minibatches` updates over fp32 parameters and Adam moments, and a fixed cost per micro-batch."""
    d, e, n = self.device, self.eff, self.learner_chips
    flops = sum((self.passes + self.remat) * length * self.model.flops_per_token(length) for length in lengths)
    micro_batches = max(self.minibatches, math.ceil(float(np.sum(lengths)) / self.max_tokens_per_mb))
    optimizer_bytes = self.minibatches * self.params * 4 * 7  # read params, grads, m, v; write params, m, v
    return (flops / (n * d.flops * e.learner_mfu) + optimizer_bytes / (n * d.hbm_bw * e.learner_bw)
            + micro_batches * e.micro_batch_s + e.step_s)

  def transfer(self) -> float:
    """New weights from the learner to the samplers: resharded in HBM when both roles share the chips; to sampler
    processes on other hosts, one copy each through the leader's host network (`weight_transfer`: each pulls the
    leader's published copy); else over the chip-to-chip links of the smaller side."""
    d, e, size = self.device, self.eff, self.params * self.weight_bytes
    if self.sampler_processes:
      if not self.host_network:
        raise ValueError(f"{d.name}: no host network bandwidth to price sampler processes' weight pulls over "
                         "(tools/plan.py --host_network_gbps)")
      diff = 0.0
      if self.sync_delta:  # on the published copy's chips (one sampler's tensor group): read both copies, write once
        diff = 3 * size / (self.sampler_chips / self.sampler_shards * d.hbm_bw * e.learner_bw)
        size *= self.delta_share
      return self.sampler_processes * size / (self.host_network * e.link) + diff + e.transfer_s
    if self.colocated:
      return 2 * size / (self.sampler_chips * d.hbm_bw * e.decode_bw) + e.transfer_s
    return size / (min(self.sampler_chips, self.learner_chips) * d.link * e.link) + e.transfer_s

  @property
  def delta_share(self) -> float:
    """A version's pull as a share of the whole copy under `sync_delta`: each changed element's index and value, or
    the whole leaf where that costs less (`weight_delta`)."""
    return min(1.0, self.sync_delta * (INDEX_BYTES + self.weight_bytes) / self.weight_bytes)

  @property
  def transfer_overlaps(self) -> bool:
    """Whether the learner trains on while the samplers pull (`sync.overlap` applies to sampler processes)."""
    return self.sync_overlap and self.sampler_processes > 0

  def after_step(self) -> float:
    """The learner host's work between a step's publication and awaiting the next batch: the held-out evaluation
    and the checkpoint, each spread over the steps between two (`evaluation() / eval_every`, `checkpoint() /
    checkpoint_every`); metrics are in `train_step`'s `step_s`."""
    evaluation = self.evaluation() / self.eval_every if self.eval_every and self.eval_answers else 0.0
    return evaluation + (self.checkpoint() / self.checkpoint_every if self.checkpoint_every else 0.0)

  def checkpoint(self) -> float:
    """The part of a checkpoint the learner waits for: Orbax's asynchronous save blocks while each chip copies its
    shards of the float32 parameters and Adam moments (12 bytes a parameter) to its host, at the datasheet's PCIe
    rate (`host_link`: a lower bound); the write to storage runs behind the next steps. 0 where the device table
    has no host link (the TPUs: Google's pages give none), so unpriced there."""
    if not self.device.host_link:
      return 0.0
    return self.params * 12 / self.learner_chips / self.device.host_link

  def evaluation(self) -> float:
    """One evaluation as `Evaluator` runs it: one data-parallel engine over the leader host's learner chips
    (`chips_per_host` of them at most, one data shard each), its prompts prefilled a slot's worth at a time, then continuous batching at
    full occupancy: answers x length / live decode steps, each at `live` answers holding the prompt and half an
    answer of context, plus the scheduler's host work per call (`decode_call`). With `acceptance` (speculation,
    which the evaluation's engine runs too, drafting from the last evaluation's answers) a call's k tokens take the
    expected forwards of the slowest live slot, each over spec_tokens + 1 positions, the drafter's host work beside
    them; the same acceptance as the rollouts' (not measured for the evaluation)."""
    chips = min(self.learner_chips, self.device.chips_per_host)
    engine = dataclasses.replace(self, sampler_chips=chips, sampler_shards=max(1, int(chips)), engines=1,
                                 colocated=False)
    shards, n, length = engine.sampler_shards, self.eval_answers, max(1.0, self.eval_len)
    live = min(n, self.eval_slots)
    per_shard = np.full(shards, live / shards)
    context = per_shard * (self.eval_prompt + length / 2)
    k = self.eval_decode_steps
    calls = n * length / live / k
    if self.acceptance is None:
      device = k * engine.decode_step(per_shard, context)
      drafting = 0.0
    else:  # the evaluation speculates too: a call takes as many forwards as the slowest of its live slots
      at_most = self.acceptance.forwards_cdf(k)[k]  # P(a slot's k tokens take <= f forwards)
      forwards = float(np.sum(1.0 - at_most[:k] ** live))
      positions = self.acceptance.spec_tokens + 1
      device = forwards * (float(engine.forward_s(per_shard, context, positions).max()) + self.eff.decode_step_s)
      drafting = float(live)
    decode = calls * engine.decode_call(device, self.eval_slots, overlap=self.eval_overlap, drafting=drafting)
    prefill = -(-n // live) * engine.prefill(live, max(1, self.eval_prompt))
    return decode + prefill

  def pages_per_shard(self, page_size: int, memory_fraction: float = 0.8) -> int:
    """KV-cache pages one data shard holds: what is left of its chips' HBM beside the weights (and, colocated, beside
    the learner's fp32 parameters, gradients and Adam moments, sharded over every chip, and the scratch its step's
    programs need, `learner_scratch`, which a colocated run's pool leaves free)."""
    free = self.shard_chips * self.device.hbm * memory_fraction - self.params * self.weight_bytes
    if self.colocated:
      free -= self.shard_chips * (self.params * 16 / self.learner_chips + self.learner_scratch)
    return max(0, int(free // (page_size * self.kv_per_token)))
