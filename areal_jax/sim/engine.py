"""The sampler engine in virtual time: the real `Engine`'s host side (slot table, page pool, buckets, insert and
growth bookkeeping) with its device programs replaced by a cost model.

`SimEngine` inherits `generate_steps`, `prefill_batch`, `insert_many`, `rewrite` and `free_resource` from
`EngineBase` (the real engine's host side) unchanged, so the `Scheduler` above it admits, allocates pages, preempts
and swaps weights exactly as in a run. Only the programs differ: a decode call draws filler tokens until each answer reaches the length `lengths(key)` gives it
(its PRNG key, so an answer keeps its length across preemption and re-prefill), then EOS; every program adds its
predicted seconds to `spent_s`, which the simulated sampler sleeps on the virtual clock.

Token scale: one simulated token stands for `scale` real ones (answers of thousands of tokens would otherwise cost the
host thousands of appends each). Lengths, pages, cache and prefill budgets shrink by `scale`; costs count real tokens.

Speculation (`sampler.speculation`): the real scheduler drafts from the simulated (filler) tokens and calls
`speculate`; the slots draw the tokens `decode` would, and the call is priced by the forwards they take under the
measured acceptance (`costs.Acceptance`), drawn per real call with the engine's `seed`. The drafter's host work is
priced per slot a real call (`Efficiency.draft_slot_s`), in every call, with or without drafts; the wall time the real
drafter takes here (on filler tokens) is not counted, as no host time of the simulation is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from areal_jax.models.config import ModelConfig
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.engine import EngineBase
from areal_jax.sampler.state import DecodeSteps, PrefixArrays
from areal_jax.sim.costs import CostModel

FILLER = 1  # the token a simulated answer draws until its last one


@dataclasses.dataclass
class _State:
  """What the programs pass around instead of a device `DecodeState`."""

  k: object = None
  v: object = None


def scaled(cfg: SamplerConfig, scale: int) -> SamplerConfig:
  """`cfg` in simulated tokens of `scale` real ones (at least one of each)."""
  up = lambda n: max(1, math.ceil(n / scale))
  return cfg.replace(page_size=up(cfg.page_size), max_seq_len=up(cfg.max_seq_len),
                     max_new_tokens=up(cfg.max_new_tokens), min_prefill_len=up(cfg.min_prefill_len),
                     decode_steps=up(cfg.decode_steps), max_prefill_tokens=up(cfg.prefill_budget), num_pages=0,
                     warmup=False)


class SimEngine(EngineBase):
  """See the module docstring. `cfg` is the real sampler config; `pages_per_shard` counts real pages."""

  def __init__(self, *, model_cfg: ModelConfig, cfg: SamplerConfig, num_shards: int, pages_per_shard: int,
               costs: CostModel, lengths: Callable[[np.ndarray], np.ndarray], eos_id: int, scale: int = 1,
               seed: int | tuple[int, ...] = 0):
    if cfg.speculation != "off" and costs.acceptance is None:
      raise ValueError(f"sampler.speculation={cfg.speculation!r}: the simulator prices it from a measured acceptance "
                       "(CostModel.acceptance; tools/plan.py --spec_accept)")
    if costs.acceptance is not None and costs.acceptance.spec_tokens != cfg.spec_tokens:
      raise ValueError(f"an acceptance of {costs.acceptance.spec_tokens} draft positions for "
                       f"sampler.spec_tokens={cfg.spec_tokens}")
    self.real_cfg, self.scale, self.costs, self.eos_id = cfg, scale, costs, eos_id
    self._lengths = lengths  # real tokens per answer, from PRNG keys [..., 2]
    sim = scaled(cfg, scale)
    # The pool holds as many real tokens as the run's: pages of `scale` x the simulated page size.
    super().__init__(config=sim, model_cfg=model_cfg, num_shards=num_shards, programs=self,
                     pages_per_shard=max(sim.pages_per_seq + 1,
                                         pages_per_shard * cfg.page_size // (sim.page_size * scale)))
    self.abstract_params = {}  # the weights `Scheduler.update_params` checks: none
    self.target = np.zeros(cfg.num_slots, np.int64)  # each slot's answer length, in simulated tokens
    # What the device state holds per slot (`DecodeState.index`, `.lengths`): tokens drawn and cached, which the
    # host's slot table learns only when it reads a call (a call later, with `sampler.overlap`).
    self.drawn = np.zeros(cfg.num_slots, np.int64)
    self.cached = np.zeros(cfg.num_slots, np.int64)
    self.spent_s = 0.0  # predicted device seconds not yet slept by the caller
    self.drafts = cfg.speculation != "off"
    if self.drafts:  # forwards a slot takes for t tokens of a real call, drawn from the acceptance
      self._forwards_cdf = costs.acceptance.forwards_cdf(cfg.decode_steps)
      self._rng = np.random.default_rng(seed)

  def take_spent(self) -> float:
    spent, self.spent_s = self.spent_s, 0.0
    return spent

  def length_of(self, keys: np.ndarray) -> np.ndarray:
    """The lengths (simulated tokens, EOS included) that the answers with PRNG `keys` [..., 2] run to."""
    return np.maximum(1, -(-self._lengths(keys) // self.scale))

  def init_decode_state(self) -> _State:
    self.slots.reset()
    return _State()

  # --- the programs (`Engine.programs`) --------------------------------------------------------------------------

  def prefill(self, params, tokens, lengths, rows, sharded=False):
    del params, rows
    b, t = tokens.shape
    self.spent_s += self.costs.prefill(rows=b, length=t * self.scale, sharded=sharded)
    return PrefixArrays(k=None, v=None, rows_per_shard=b // self.num_shards if sharded else 0), None

  def prefill_after(self, params, k_pool, v_pool, page_rows, start, tokens, lengths, rows):
    del k_pool, v_pool, page_rows, start
    return self.prefill(params, tokens, lengths, rows, sharded=True)

  def sample(self, logits, keys, index, temperature, top_p, top_k):
    """First tokens: EOS for an answer one token long."""
    del logits, index, temperature, top_p, top_k
    first = np.where(self.length_of(keys) == 1, self.eos_id, FILLER).astype(np.int32)
    return first, np.zeros(len(first), np.float32)

  def _no_draws(self):
    return np.zeros(self.cfg.num_slots, np.int32), np.zeros(self.cfg.num_slots, np.float32)

  def _insert(self, prefix, decode_state, chunks, inits):
    if inits:
      slots = [i.slot for i in inits]
      self.target[slots] = self.length_of(np.stack([i.key for i in inits]))
      self.drawn[slots], self.cached[slots] = [i.index for i in inits], [i.length for i in inits]
    return decode_state

  def decode(self, params, state, budget, stop_eos, eos, grow, refill_at):
    """Every live slot draws up to its budget, stopping at its answer's length; the call ends early once
    `refill_at` slots have stopped, as the device loop does."""
    del params, eos, grow
    tokens, count, steps = self._draw(budget, stop_eos, refill_at)
    self.spent_s += self._decode_cost(count, steps)
    return state, self._advance(tokens, count)

  def speculate(self, params, state, budget, stop_eos, eos, grow, refill_at, drafts, draft_at, draft_len):
    """`decode` with drafts (`sampler.speculation`): the slots draw the same tokens (the call's grain is the
    scheduler's), the drafts' content is not looked at (the simulation's tokens are filler); what they save in
    forwards is priced from `CostModel.acceptance` (`_speculate_cost`). The call's counters of drafts count real
    slot-forwards, each taken as drafting every position with probability `drafted`, accepted at `accepted`."""
    del params, eos, grow, drafts, draft_at, draft_len
    tokens, count, _ = self._draw(budget, stop_eos, refill_at)
    seconds, forwards = self._speculate_cost(count)
    self.spent_s += seconds
    acceptance = self.costs.acceptance
    drafted = np.full(acceptance.spec_tokens, forwards * acceptance.drafted)
    return state, self._advance(tokens, count, forwards=np.int64(forwards), drafted_at=drafted.astype(np.int64),
                                accepted_at=(drafted * np.asarray(acceptance.accepted)).astype(np.int64))

  def _draw(self, budget, stop_eos, refill_at) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens [S, decode_steps], count [S], steps) of a decode call: filler, EOS at each answer's length."""
    s = self.cfg.num_slots
    remaining = np.maximum(self.target - self.drawn, 0)
    live = (budget > 0) & ~(stop_eos & (remaining == 0))  # as on the device: a pending EOS is not live
    stops = np.where(live, np.where(stop_eos, np.minimum(budget, remaining), budget), 0)
    steps = int(stops.max(initial=0))
    if refill_at > 0 and live.any():
      ends = np.sort(stops[live])
      if len(ends) >= refill_at:
        steps = min(steps, int(ends[refill_at - 1]))
    count = np.minimum(stops, steps).astype(np.int32)
    tokens = np.full((s, self.cfg.decode_steps), -1, np.int32)
    for slot in np.flatnonzero(count):
      n = count[slot]
      tokens[slot, :n] = FILLER
      if stop_eos[slot] and self.drawn[slot] + n >= self.target[slot]:
        tokens[slot, n - 1] = self.eos_id
    return tokens, count, steps

  def _advance(self, tokens: np.ndarray, count: np.ndarray, **spec) -> DecodeSteps:
    """The call's `DecodeSteps`, its tokens drawn and cached on the (simulated) device."""
    self.drawn += count
    self.cached += count
    return DecodeSteps(tokens=tokens, log_prob=np.zeros(tokens.shape, np.float32), count=count, **spec)

  def _decode_cost(self, count: np.ndarray, steps: int) -> float:
    """Seconds of `steps` simulated decode steps (each `scale` real ones) of the slots that drew `count` tokens."""
    if steps == 0:
      return 0.0
    shard = np.arange(self.cfg.num_slots) // self.slots.slots_per_shard
    context = self.cached * self.scale
    seconds = 0.0
    for j in range(steps):
      live = count > j
      batch = np.bincount(shard[live], minlength=self.num_shards)
      tokens = np.bincount(shard[live], weights=context[live], minlength=self.num_shards) + batch * j * self.scale
      seconds += self.scale * self.costs.decode_step(batch, tokens)
    k = self.real_cfg.decode_steps
    calls = math.ceil(steps * self.scale / k)  # real calls this simulated one stands for
    # With speculation the drafter works for every slot that draws, in a call without drafts too (slot-calls a call)
    drafting = float(np.ceil(count * self.scale / k).sum()) / calls if self.drafts else 0.0
    return calls * self.costs.decode_call(seconds / calls, self.real_cfg.num_slots, overlap=self.real_cfg.overlap,
                                          drafting=drafting)

  def _speculate_cost(self, count: np.ndarray) -> tuple[float, int]:
    """(seconds, slot-forwards) of a speculative call whose slots drew `count` simulated tokens: the real calls it
    stands for, each slot drawing `decode_steps` real tokens a call (its last call the rest); a real call runs as
    many forwards as its slowest slot needs, a slot's forwards for its t tokens drawn from the acceptance
    (`Acceptance.forwards_cdf`); each forward reads the weights and every live slot's cache once and computes
    spec_tokens + 1 positions for each (`CostModel.forward_s`), the slots that have drawn their tokens no longer
    live. The context grows by the tokens a slot has emitted, evenly over its forwards. The host's work per real call
    (`CostModel.decode_call`) counts the drafter's for each slot that draws in it."""
    cfg, k = self.real_cfg, self.real_cfg.decode_steps
    tokens = count.astype(np.int64) * self.scale
    live = np.flatnonzero(tokens)
    if not len(live):
      return 0.0, 0
    calls = -(-int(tokens.max()) // k)
    start = k * np.arange(calls)[:, None]
    t = np.clip(tokens[live][None, :] - start, 0, k)  # [calls, live slots]
    u = 1.0 - self._rng.random(t.shape)  # (0, 1]: t > 0 tokens take at least one forward
    forwards = (self._forwards_cdf[t] < u[..., None]).sum(axis=-1)
    f = np.arange(int(forwards.max()))[None, :, None]
    on = forwards[:, None, :] > f  # [calls, forward, live slots]
    grown = f * (t / np.maximum(forwards, 1))[:, None, :]
    context = np.where(on, (self.cached[live] * self.scale)[None, None, :] + start[..., None] + grown, 0.0)
    shards = np.eye(self.num_shards)[np.arange(self.cfg.num_slots)[live] // self.slots.slots_per_shard]
    batch, context = on @ shards, context @ shards  # [calls, forward, data shards]
    per = self.costs.forward_s(batch, context, positions=cfg.spec_tokens + 1).max(axis=-1)
    seconds = float(np.where(batch.sum(axis=-1) > 0, per + self.costs.eff.decode_step_s, 0.0).sum())
    drafting = np.count_nonzero(t) / calls  # the slots the drafter works for, a real call
    return (calls * self.costs.decode_call(seconds / calls, cfg.num_slots, overlap=cfg.overlap, drafting=drafting),
            int(forwards.sum()))
