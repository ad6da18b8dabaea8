"""The sampler engine in virtual time: the real `Engine`'s host side (slot table, page pool, buckets, insert and
growth bookkeeping) with its device programs replaced by a cost model.

`SimEngine` inherits `generate_steps`, `prefill_batch`, `insert_many`, `rewrite` and `free_resource` from
`EngineBase` (the real engine's host side) unchanged, so the `Scheduler` above it admits, allocates pages, preempts
and swaps weights exactly as in a run. Only the programs differ: a decode call draws filler tokens until each answer reaches the length `lengths(key)` gives it
(its PRNG key, so an answer keeps its length across preemption and re-prefill), then EOS; every program adds its
predicted seconds to `spent_s`, which the simulated sampler sleeps on the virtual clock.

Token scale: one simulated token stands for `scale` real ones (answers of thousands of tokens would otherwise cost the
host thousands of appends each). Lengths, pages, cache and prefill budgets shrink by `scale`; costs count real tokens.
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
               costs: CostModel, lengths: Callable[[np.ndarray], np.ndarray], eos_id: int, scale: int = 1):
    if cfg.speculation != "off":
      raise ValueError(f"sampler.speculation={cfg.speculation!r}: the simulator does not price speculative decoding "
                       "yet; plan with sampler.speculation='off'")
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
    self.spent_s += self._decode_cost(count, steps)
    self.drawn += count
    self.cached += count
    return state, DecodeSteps(tokens=tokens, log_prob=np.zeros(tokens.shape, np.float32), count=count)

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
    calls = math.ceil(steps * self.scale / self.real_cfg.decode_steps)  # real calls this simulated one stands for
    return calls * self.costs.decode_call(seconds / calls, self.real_cfg.num_slots, overlap=self.real_cfg.overlap)
