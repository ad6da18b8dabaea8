"""The sampling engine over a paged KV cache: the batched calls our scheduler makes.

    engine = Engine(model=model, config=SamplerConfig(...), mesh=mesh)
    params, state = engine.load_params(model), engine.init_decode_state()
    prefix, first = engine.prefill_batch(params, [prompt], [Draws(keys=...)], shards=[0], decode_state=state)
    state = engine.insert_many(prefix, state, [Placement.new(0, slots)])
    state, steps = engine.generate_steps(params, state, budget)   # up to `sampler.decode_steps` tokens per slot
    engine.slots.advance(steps.count); engine.free_resource(slot)

`prefill_batch` prefills several prompts (G draws each, each after the pages of the prefix cache that hold its
start, if any) with rows split over the data shards, `insert_many` places them (named `Placement`s), `generate_steps`
runs one multi-step decode call and `rewrite` writes recomputed caches after a weight update. Other engine contracts
are adapters over this one, in modules of their own beside it.

The device work is in `programs.py`; the host state of the slots (pages held, tokens cached and generated, the page
pool) is one `SlotTable` (`slots.py`), guarded by its lock. Generation raises `PoolExhausted` before touching the
device when slots need new pages their shard lacks; our scheduler then preempts an answer.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from areal_jax.models.config import ModelConfig
from areal_jax.models.weights import cast, check_compatible, with_dtype
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.paging import SCRATCH_PAGE
from areal_jax.sampler.programs import Chunks, SlotUpdate, build_programs
from areal_jax.sampler.requests import SamplingParams
from areal_jax.sampler.slots import Placement, SlotTable
from areal_jax.sampler.state import (DecodeState, DecodeSteps, FirstTokens, Prefix, decode_state_shapes,
                                     decode_state_shardings, page_bytes)
from areal_jax.sharding import SAMPLER_RULES, make_mesh, state_shardings


MAX_EOS_IDS = 8  # `generate_steps` takes up to this many EOS ids (padded: one compiled decode program)


def _pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def free_device_bytes(device: jax.Device) -> int | None:
  """What `device` has free by its memory stats (limit - in use), or None where it reports no limit (a CPU)."""
  stats = device.memory_stats()
  return stats["bytes_limit"] - stats.get("bytes_in_use", 0) if stats and "bytes_limit" in stats else None


def pages_per_shard(model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Mesh, *, param_bytes_per_device: int = 0,
                    free_bytes: int | None = None, reserved_bytes: int = 0) -> int:
  """Pages each data shard owns: `num_pages / data`, or, with num_pages = 0, what `memory_fraction` of one device's
  free memory holds after the parameters and `reserved_bytes` (per device, kept for another role's programs: a
  colocated learner's step); free memory is `free_bytes`, else the device's (`free_device_bytes`; on CPU, the host's
  available memory split over all devices). Capped at what the shard's slots can use."""
  data = mesh.shape["data"]
  cap = cfg.num_slots // data * cfg.pages_per_seq + 1
  if cfg.num_pages:
    n = cfg.num_pages // data
  else:
    if free_bytes is None:
      free_bytes = free_device_bytes(mesh.devices.flat[0])
    if free_bytes is None:
      free_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(1, len(jax.devices()))
    free_bytes -= param_bytes_per_device + reserved_bytes
    t = mesh.shape.get("tensor", 1)
    per_device = page_bytes(model_cfg, cfg) // (t if model_cfg.num_kv_heads % t == 0 else 1)
    n = min(cap, int(cfg.memory_fraction * max(0, free_bytes)) // per_device)
  if n - 1 < cfg.pages_per_seq:
    raise ValueError(
        f"KV pool of {n} pages per data shard (sampler.num_pages={cfg.num_pages} over {data} data shards) cannot hold "
        f"one sequence of sampler.max_seq_len={cfg.max_seq_len} ({cfg.pages_per_seq} pages of {cfg.page_size} plus "
        f"one scratch page)")
  return n


def param_bytes_per_device(params, mesh: Mesh) -> int:
  """Parameter bytes on one sampler device (replicated over data, split over tensor where the rules allow)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) // mesh.shape["tensor"]


@dataclasses.dataclass(frozen=True)
class Draws:
  """First tokens to draw for one prefilled row: one PRNG key per answer (`keys` [G, 2], G may be 0) and the
  sampling settings they share."""

  keys: np.ndarray
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = -1

  @classmethod
  def of(cls, keys, sampling: SamplingParams) -> Draws:
    return cls(keys=np.asarray(keys, np.uint32).reshape(-1, 2), temperature=sampling.temperature,
               top_p=sampling.top_p, top_k=sampling.top_k)


class EngineBase(abc.ABC):
  """The engine's host side over any `programs` (the compiled ones, or the simulator's cost model): the KV page
  pool's `SlotTable`, prefill buckets and the batched calls the scheduler makes (see the module docstring). A
  subclass gives `init_decode_state` and `_no_draws`."""

  def __init__(self, *, config: SamplerConfig, model_cfg: ModelConfig, num_shards: int, pages_per_shard: int,
               programs):
    self.cfg, self.model_cfg, self.num_shards, self.programs = config, model_cfg, num_shards, programs
    self.pages_per_shard = pages_per_shard
    self.num_pages = pages_per_shard * num_shards
    self.slots = SlotTable(num_slots=config.num_slots, num_shards=num_shards, pages_per_shard=pages_per_shard,
                           page_size=config.page_size, max_seq_len=config.max_seq_len)
    p = config.page_size
    self.min_bucket = -(-config.min_prefill_len // p) * p

  @abc.abstractmethod
  def init_decode_state(self):
    """An empty cache, every slot free (the slot table starts over with it)."""

  @abc.abstractmethod
  def _no_draws(self):
    """First tokens of a prefill that draws none, as `insert` takes them."""

  def free_resource(self, slot: int) -> None:
    """Releases the slot's pages (shared ones with their last holder). Idempotent."""
    self.slots.release(slot)

  # --- batched calls of the scheduler ----------------------------------------------------------------------------

  def generate_steps(self, params, decode_state: DecodeState, budget: np.ndarray, *,
                     stop_eos: np.ndarray | None = None, eos_ids: Sequence[int] = (), refill_at: int = 0,
                     ahead: np.ndarray | None = None, drafts: np.ndarray | None = None,
                     draft_at: np.ndarray | None = None) -> tuple[DecodeState, DecodeSteps]:
    """Up to `budget[s]` (at most `sampler.decode_steps`) tokens for every active slot s in one device call; a slot
    with `stop_eos[s]` stops early once it draws one of `eos_ids` (its pending token is never cached then). With
    `refill_at` > 0 the call ends as soon as that many slots have stopped, so that waiting answers can take them.

    Pages for the whole budget are allocated first (`PoolExhausted` if a shard lacks them), after `ahead[s]` tokens
    that calls dispatched before and not yet read may still cache. The device decides how many tokens each slot
    drew: the caller reads `DecodeSteps.count` and passes it to `slots.advance`.

    With `sampler.speculation`, `drafts` [S, draft_width] (-1 past a slot's draft) are guesses of slot s's answer
    tokens from answer index `draft_at[s]` on (-1: no draft); the call verifies them exactly (`Programs.speculate`),
    up to `sampler.spec_tokens` per step, and may draw several tokens per step. Without drafts the plain decode
    program runs.
    """
    cfg = self.cfg
    with self.slots.lock:
      budget = np.where(self.slots.active, np.minimum(np.asarray(budget, np.int64), cfg.decode_steps), 0)
      held = self.slots.cached + (0 if ahead is None else np.where(self.slots.active, ahead, 0))
      over = np.flatnonzero(held + budget > cfg.max_seq_len)
      if len(over):
        raise ValueError(f"slot {over[0]} holds {held[over[0]]} tokens; {budget[over[0]]} more exceed "
                         f"the cache length sampler.max_seq_len={cfg.max_seq_len}")
      if len(eos_ids) > MAX_EOS_IDS:
        raise ValueError(f"{len(eos_ids)} EOS ids; at most {MAX_EOS_IDS}")
      s = cfg.num_slots
      grow = np.full((3, s * self.pages_ahead), s, np.int32)
      new = self.slots.grow(held - self.slots.cached + budget)
      grow[:, :len(new)] = new.T
    stop = np.zeros(cfg.num_slots, bool) if stop_eos is None else np.asarray(stop_eos, bool)
    eos = np.full(MAX_EOS_IDS, -1, np.int32)
    eos[:len(eos_ids)] = list(eos_ids)
    args = (params, decode_state, budget.astype(np.int32), stop, eos, grow, np.int32(refill_at))
    if cfg.speculation == "off" and drafts is not None:
      raise ValueError("generate_steps: drafts given with sampler.speculation='off'")
    if drafts is None:  # nothing to verify: one position per forward (the speculative call would compute k + 1)
      return self.programs.decode(*args)
    return self.programs.speculate(*args, *self._drafts(drafts, draft_at))

  def _drafts(self, drafts, draft_at) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(drafts [S, draft_width], answer index of each slot's first draft token (-1: none), draft tokens per slot)."""
    s, width = self.cfg.num_slots, self.cfg.draft_width
    if drafts is None:
      return np.full((s, width), -1, np.int32), np.full(s, -1, np.int32), np.zeros(s, np.int32)
    drafts = np.asarray(drafts, np.int32)
    if drafts.shape != (s, width):
      raise ValueError(f"drafts of shape {drafts.shape}; expected (sampler.num_slots, sampler.draft_width) = "
                       f"{(s, width)}")
    length = np.where(drafts >= 0, 1, 0).cumprod(axis=1).sum(axis=1).astype(np.int32)
    return drafts, np.asarray(draft_at, np.int32), length

  @property
  def pages_ahead(self) -> int:
    """The most new pages one slot can need in one `generate_steps` call."""
    return -(-self.cfg.decode_steps // self.cfg.page_size)

  def bucket(self, length: int) -> int:
    """Padded prefill length: a power of two (at least min_prefill_len), a whole number of pages, <= the cache."""
    p = self.cfg.page_size
    top = self.cfg.pages_per_seq * p
    return min(top, max(self.min_bucket, -(-_pow2(length) // p) * p))

  def prefill_batch(self, params, sequences: Sequence[np.ndarray], draws: Sequence[Draws], *,
                    shards: Sequence[int] | None = None, cached: Sequence[tuple[int, Sequence[int]]] = (),
                    decode_state: DecodeState | None = None) -> tuple[Prefix, FirstTokens]:
    """Prefills several sequences in one call, padded to the longest one's bucket, and draws the first tokens of
    `draws[b]` for row b (at most num_slots in all; they come back flat, [num_slots], in row-major answer order: see
    `Prefix.draw_index`).

    `shards[b]`: the data shard whose slots row b's answers go to. Given, the rows are split over the data shards
    (each shard's padded to a power of two, the same for all), and each shard computes and keeps only its own rows'
    keys and values; `insert_many` then places a row only into slots of its shard. Without it (for a caller that
    picks the slots after the prefill), rows are padded to a power of two and every shard computes all of them, so a
    row may go into any slot.

    `cached[b]` = (shard, pages), if given: pages of that data shard (the prefix cache's, `SlotTable.match`) that
    hold row b's first `len(pages) * page_size` tokens; the row is prefilled on that shard after them, reading their
    keys and values from `decode_state`, and goes into slots of that shard with `Placement.cached` = those pages.
    With `sampler.prefix_cache` and a `decode_state`, every sharded batch runs the program that reads cached pages
    (it loops over the pages rows hold, none for most), so rows with and without cached pages share compiled
    programs."""
    s = self.cfg.num_slots
    cached, starts, lengths, num_draws = self._prefill_rows(sequences, draws, cached)
    if shards is None and starts.any():
      shards = [shard for shard, _ in cached]
    array_row, b = self._layout(shards, len(sequences))
    t = self.bucket(int(lengths.max()))
    tokens = np.zeros((b, t), np.int32)
    lens = np.ones(b, np.int32)
    lens[array_row] = lengths
    rows = np.zeros(s, np.int32)
    keys = np.zeros((s, 2), np.uint32)
    temperature, top_p, top_k = np.zeros(s, np.float32), np.ones(s, np.float32), np.full(s, -1, np.int32)
    draw_index = np.full((len(sequences), max([len(d.keys) for d in draws] + [1])), -1, np.int32)
    r = 0
    for i, (x, d) in enumerate(zip(sequences, draws)):
      tokens[array_row[i], :lengths[i]] = x[starts[i]:]
      n = len(d.keys)
      draw_index[i, :n] = np.arange(r, r + n)
      rows[r:r + n], keys[r:r + n] = array_row[i], d.keys
      temperature[r:r + n], top_p[r:r + n], top_k[r:r + n] = d.temperature, d.top_p, d.top_k
      r += n
    if starts.any() and decode_state is None:
      raise ValueError("prefill_batch: rows after cached pages need the decode_state that holds them")
    if shards is not None and (starts.any() or (self.cfg.prefix_cache and decode_state is not None)):
      page_rows = np.full((b, self.cfg.pages_per_seq), SCRATCH_PAGE, np.int32)
      start = np.zeros(b, np.int32)
      for i, (shard, pages) in enumerate(cached):
        if pages and shard != shards[i]:
          raise ValueError(f"prefill_batch: row {i} continues cached pages of data shard {shard} but goes to shard "
                           f"{shards[i]}")
        page_rows[array_row[i], :len(pages)], start[array_row[i]] = pages, starts[i]
      arrays, logits = self.programs.prefill_after(params, decode_state.k, decode_state.v, page_rows, start, tokens,
                                                   lens, rows)
    else:
      arrays, logits = self.programs.prefill(params, tokens, lens, rows, sharded=shards is not None)
    if num_draws:
      first, log_prob = self.programs.sample(logits, keys, np.zeros(s, np.int32), temperature, top_p, top_k)
    else:
      first, log_prob = self._no_draws()
    prefix = Prefix(arrays=arrays, true_length=lengths, start=starts, draw_index=draw_index, array_row=array_row,
                    first=first, keys=keys, temperature=temperature, top_p=top_p, top_k=top_k)
    return prefix, FirstTokens(tokens=first, log_prob=log_prob)

  def _layout(self, shards: Sequence[int] | None, n: int) -> tuple[np.ndarray, int]:
    """(the arrays' row of each of n prefill rows, rows in all): with `shards`, R rows per data shard (the most any
    shard has, rounded to a power of two) and shard d's rows at d * R, d * R + 1, ...; without, rows in order,
    padded to a power of two."""
    if shards is None:
      return np.arange(n, dtype=np.int32), _pow2(n)
    shards = np.asarray(shards, np.int64)
    if len(shards) != n or np.any((shards < 0) | (shards >= self.num_shards)):
      raise ValueError(f"prefill_batch: shards {shards.tolist()} for {n} rows; each must be a data shard in "
                       f"[0, {self.num_shards})")
    counts = np.bincount(shards, minlength=self.num_shards)
    per = _pow2(int(counts.max()))
    order = np.argsort(shards, kind="stable")
    nth = np.empty(n, np.int64)
    nth[order] = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)  # the row's place among its shard's
    return (shards * per + nth).astype(np.int32), per * self.num_shards

  def _prefill_rows(self, sequences, draws, cached) -> tuple[list, np.ndarray, np.ndarray, int]:
    """`prefill_batch`'s arguments checked: (cached pages per row, tokens cached per row, tokens to prefill per row,
    answers drawn); a ValueError names what does not fit."""
    s, p = self.cfg.num_slots, self.cfg.page_size
    totals = np.array([len(x) for x in sequences], np.int32)
    too_long = np.flatnonzero(totals >= self.cfg.max_seq_len)
    if len(too_long) or np.any(totals < 1):
      i = int(too_long[0]) if len(too_long) else int(np.argmin(totals))
      raise ValueError(f"sequence of {totals[i]} tokens cannot be prefilled: it needs 1 to "
                       f"sampler.max_seq_len - 1 = {self.cfg.max_seq_len - 1} tokens")
    num_draws = sum(len(d.keys) for d in draws)
    if num_draws > s:
      raise ValueError(f"{num_draws} answers in one prefill; at most sampler.num_slots={s}")
    cached = list(cached) or [(0, ())] * len(sequences)
    if len(cached) != len(sequences):
      raise ValueError(f"prefill_batch: {len(cached)} cached page lists for {len(sequences)} sequences")
    starts = np.array([len(pages) * p for _, pages in cached], np.int32)
    lengths = totals - starts
    if np.any(lengths < 1):
      raise ValueError(f"row {int(np.argmin(lengths))}: its cached pages hold all its {totals[np.argmin(lengths)]} "
                       "tokens; at least one must be prefilled")
    return cached, starts, lengths, num_draws

  def warmup(self, params, decode_state: DecodeState, max_context: int | None = None) -> DecodeState:
    """Compiles every program the scheduler can call for contexts up to `max_context` tokens (default: the cache
    length): decode, first-token sampling, and prefill + insert for each bucket and power-of-two row count. Runs
    them on dummy inputs that change nothing (no slot is touched); do it before timing or serving to avoid compile
    stalls (with `sampler.prefix_cache`, the prefills that read cached pages)."""
    top = self.bucket(max_context or self.cfg.max_seq_len - 1)
    t = self.min_bucket
    while True:
      per = 1  # rows per data shard, as the scheduler batches them
      while per <= min(self.slots.slots_per_shard, max(1, self.cfg.prefill_budget // t)):
        # t - 1 tokens fill bucket t (at most max_seq_len - 1: the top bucket may round the cache up to pages).
        n, rows = min(t, self.cfg.max_seq_len) - 1, per * self.num_shards
        prefix, _ = self.prefill_batch(params, [np.ones(n, np.int32)] * rows,
                                       [Draws(keys=np.zeros((1, 2), np.uint32), temperature=1.0)] * rows,
                                       shards=np.repeat(np.arange(self.num_shards), per), decode_state=decode_state)
        decode_state = self._insert(prefix, decode_state, [], [])
        per *= 2
      if t >= top:
        break
      t = self.bucket(t + 1)
    s = self.cfg.num_slots
    eos = np.full(MAX_EOS_IDS, -1, np.int32)
    grow = np.full((3, s * self.pages_ahead), s, np.int32)
    args = (params, decode_state, np.zeros(s, np.int32), np.zeros(s, bool), eos, grow, np.int32(0))
    decode_state, _ = self.programs.decode(*args)
    if self.cfg.speculation != "off":
      decode_state, _ = self.programs.speculate(*args[:1], decode_state, *args[2:], *self._drafts(None, None))
    return decode_state

  def insert_many(self, prefix: Prefix, decode_state: DecodeState, placements: Sequence[Placement]) -> DecodeState:
    """One device call for several placements of one prefix's rows (see `Placement`) into free slots. Full pages of a
    row are written once per data shard and shared by reference count; a partial last page is copied per slot."""
    true_length, start = np.asarray(prefix.true_length), np.asarray(prefix.start)
    draw_index, array_row = np.asarray(prefix.draw_index), np.asarray(prefix.array_row)
    for pl in placements:
      self._check_shard(prefix, pl.row, pl.slots)
      drawn = int(np.sum(draw_index[pl.row] >= 0))
      if not drawn and min(pl.pending) < 0:
        raise ValueError(f"prefix row {pl.row} drew no first tokens; pass the pending tokens")
      if drawn and any(not 0 <= a < drawn for a in pl.answers):
        raise ValueError(f"answers {list(pl.answers)} asked of prefix row {pl.row}, which drew {drawn} (one PRNG "
                         f"key each at prefill)")
      if len(pl.cached) * self.cfg.page_size != start[pl.row]:
        raise ValueError(f"prefix row {pl.row} was prefilled after {start[pl.row]} cached tokens; the placement "
                         f"gives {len(pl.cached)} cached pages of {self.cfg.page_size}")
    occupied = self.slots.occupy(placements, true_length)
    keys, settings = np.asarray(prefix.keys), (np.asarray(prefix.temperature), np.asarray(prefix.top_p),
                                               np.asarray(prefix.top_k))
    p, chunks, inits = self.cfg.page_size, [], []
    for pl, by_shard in zip(placements, occupied):
      full = int(true_length[pl.row]) // p
      i_of = {slot: i for i, slot in enumerate(pl.slots)}
      src = int(array_row[pl.row])
      for occ in by_shard:
        chunks += [(src, j, page, occ.shard) for j, page in enumerate(occ.shared)]
        for slot, own in zip(occ.slots, occ.own):
          chunks += [(src, full, page, occ.shard) for page in own]
          i = i_of[slot]
          r = int(draw_index[pl.row, pl.answers[i]]) if draw_index[pl.row, pl.answers[i]] >= 0 else 0
          inits.append(_SlotInit(slot=slot, draw=r, pending=pl.pending[i],
                                 length=int(start[pl.row] + true_length[pl.row]),
                                 index=pl.generated[i], key=keys[r], temperature=float(settings[0][r]),
                                 top_p=float(settings[1][r]), top_k=int(settings[2][r])))
    return self._insert(prefix, decode_state, chunks, inits)

  def rewrite(self, prefix: Prefix, decode_state: DecodeState, rows_to_slots: Sequence[tuple[int, int]],
              written: set | None = None) -> DecodeState:
    """Writes prefix rows over the pages that slots already hold (recomputed keys/values after a weight update);
    pages in `written` (shard, page) are skipped and the ones written are added to it."""
    written = set() if written is None else written
    true_length = np.asarray(prefix.true_length)
    if np.any(np.asarray(prefix.start)):
      raise ValueError("rewrite: a prefix prefilled after cached pages cannot rewrite a slot's pages from its start")
    chunks, array_row = [], np.asarray(prefix.array_row)
    with self.slots.lock:
      for row, slot in rows_to_slots:
        self._check_shard(prefix, row, [slot])
        shard, n = self.slots.shard_of(slot), -(-int(true_length[row]) // self.cfg.page_size)
        for j, page in enumerate(self.slots.pages[slot][:n]):
          if (shard, page) not in written:
            written.add((shard, page))
            chunks.append((int(array_row[row]), j, page, shard))
    return self._insert(prefix, decode_state, chunks, [])

  def _check_shard(self, prefix: Prefix, row: int, slots: Sequence[int]) -> None:
    """A sharded prefix's row goes only into slots of the data shard that holds its keys and values."""
    per = prefix.arrays.rows_per_shard
    if not per:
      return
    shard = int(np.asarray(prefix.array_row)[row]) // per
    wrong = [slot for slot in slots if self.slots.shard_of(slot) != shard]
    if wrong:
      raise ValueError(f"prefix row {row} was prefilled on data shard {shard}; slot {wrong[0]} is on shard "
                       f"{self.slots.shard_of(wrong[0])} (pass the slots' shard to prefill_batch)")

  def _insert(self, prefix: Prefix, decode_state, chunks, inits: Sequence[_SlotInit]) -> DecodeState:
    s, m = self.cfg.num_slots, self.cfg.pages_per_seq
    b, t = prefix.arrays.k.shape[1:3]
    # Fixed per prefill shape: every full chunk once per shard that may take it (a sharded row's: its own), plus one
    # tail copy per slot.
    copies = 1 if prefix.arrays.rows_per_shard else self.num_shards
    ch = np.zeros((4, b * (t // self.cfg.page_size) * copies + s), np.int32)
    ch[3] = -1
    if chunks:
      ch[:, :len(chunks)] = np.array(chunks, np.int32).T
    up = np.zeros((5, s), np.int32)
    up[0] = s
    keys = np.zeros((s, 2), np.uint32)
    samp = np.zeros((3, s), np.float32)
    rows = np.full((s, m), SCRATCH_PAGE, np.int32)
    if inits:
      rows[:len(inits)] = self.slots.page_rows([x.slot for x in inits], m, SCRATCH_PAGE)
    for i, x in enumerate(inits):
      up[:, i] = (x.slot, x.draw, x.pending, x.length, x.index)
      keys[i], samp[:, i] = x.key, (x.temperature, x.top_p, x.top_k)
    upd = SlotUpdate(slot=up[0], rows=rows, src=up[1], override=up[2], lengths=up[3], index=up[4], keys=keys,
                     temperature=samp[0], top_p=samp[1], top_k=samp[2].astype(np.int32))
    return self.programs.insert(decode_state, prefix.arrays, prefix.first, Chunks(*ch), upd)


@dataclasses.dataclass(frozen=True)
class _SlotInit:
  """How `insert` sets up one slot: its pending token is `pending` if >= 0, else draw `draw` of the prefill; it has
  `length` tokens cached and has drawn `index`; it samples with `key` and the settings."""

  slot: int
  draw: int
  pending: int
  length: int
  index: int
  key: np.ndarray
  temperature: float
  top_p: float
  top_k: int


class Engine(EngineBase):
  """The sampler's device side on one mesh: parameters' shardings, the KV page pool and the compiled programs, under
  the host side's batched calls (`EngineBase`)."""

  def __init__(self, *, model: nnx.Module, config: SamplerConfig, mesh: Mesh | None = None, reserved_bytes: int = 0):
    """`model` gives the graph and parameter shapes (an abstract `nnx.eval_shape` model works); parameters are
    passed to each call, their floating leaves in `config.param_dtype` whatever the model's own dtype. The default
    mesh is the first device (data 1 x tensor 1). `reserved_bytes`: per device, left free beside the KV pool for
    another role's programs (`pages_per_shard`)."""
    model_cfg: ModelConfig = model.cfg
    self._mesh = mesh or make_mesh(jax.devices()[:1], {"data": 1, "tensor": 1})
    if set(self._mesh.axis_names) - {"expert"} != {"data", "tensor"}:
      raise ValueError(f"sampler mesh axes {self._mesh.axis_names}: expected ('data', 'tensor') or ('data', 'expert', "
                       "'tensor')")
    if config.max_seq_len > model_cfg.max_position_embeddings:
      raise ValueError(f"sampler.max_seq_len={config.max_seq_len} exceeds model.max_position_embeddings="
                       f"{model_cfg.max_position_embeddings}")
    if config.vocab_limit > model_cfg.vocab_size:
      raise ValueError(f"sampler.vocab_limit={config.vocab_limit} exceeds model.vocab_size={model_cfg.vocab_size}")
    self.graphdef, abstract = nnx.split(model)
    self.param_dtype = config.weight_dtype
    self.abstract_params = with_dtype(abstract, self.param_dtype)
    self.param_shardings = state_shardings(abstract, self._mesh, SAMPLER_RULES)
    # The KV pool (num_pages=0) gets what is left beside weights of param_dtype: bfloat16 leaves it more.
    param_bytes = param_bytes_per_device(self.abstract_params, self._mesh)
    super().__init__(config=config, model_cfg=model_cfg, num_shards=self._mesh.shape["data"],
                     pages_per_shard=pages_per_shard(model_cfg, config, self._mesh, param_bytes_per_device=param_bytes,
                                                     reserved_bytes=reserved_bytes),
                     programs=build_programs(self.graphdef, model_cfg, config, self._mesh))
    self.state_shardings = decode_state_shardings(model_cfg, self._mesh)
    self._zeros = None

  def load_params(self, params) -> nnx.State:
    """Parameters (an NNX model or its state) cast to the engine's `param_dtype`, checked against the engine's and
    placed on the sampler's shardings."""
    if isinstance(params, nnx.Module):
      params = nnx.state(params)
    params = cast(params, self.param_dtype)
    check_compatible(params, self.abstract_params)
    return jax.device_put(params, self.param_shardings)

  def init_decode_state(self) -> DecodeState:
    """An empty cache on the sampler's shardings, every slot free (the slot table starts over with it)."""
    if self._zeros is None:
      shapes = decode_state_shapes(self.model_cfg, self.cfg, self.num_pages)
      self._zeros = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes),
                            out_shardings=self.state_shardings)
    self.slots.reset()
    return self._zeros()

  @property
  def mesh(self) -> Mesh:
    return self._mesh

  def _no_draws(self) -> tuple[jax.Array, jax.Array]:
    """First tokens of a prefill that draws none, placed as `sample` places them: `insert` then runs the program
    already compiled for the prefill's shape (a host array would compile another, mid-run, at a weight swap)."""
    rep = NamedSharding(self._mesh, P())
    s = self.cfg.num_slots
    return jax.device_put(np.zeros(s, np.int32), rep), jax.device_put(np.zeros(s, np.float32), rep)
