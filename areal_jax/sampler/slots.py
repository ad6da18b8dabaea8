"""The host state of the engine's slots, in one owner: which slots hold an answer, the KV pages each holds, how many
tokens each has cached and generated, and the page pool they draw from.

Slots are split evenly over the mesh's data shards and a slot only holds pages of its own shard. Every method takes
the table's lock, so an orchestrator may free slots from one thread while another inserts and generates. `release` is
idempotent; `occupy` takes free slots only (release a slot before inserting into it again).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np

from areal_jax.sampler.paging import PagePool, PoolExhausted
from areal_jax.sampler.prefix_cache import PrefixCache


@dataclasses.dataclass(frozen=True)
class Placement:
  """Prefix row `row` placed into `slots`: slot i continues answer `answers[i]` of the row, with `pending[i]` as the
  token to cache next (-1: the token drawn at prefill) and `generated[i]` tokens drawn so far (1 for a new answer).
  `cached`: pages of the slots' shard that already hold the row's first tokens (`SlotTable.match`, whose reference
  the placement takes over); the row was prefilled after them."""

  row: int
  slots: tuple[int, ...]
  answers: tuple[int, ...]
  pending: tuple[int, ...]
  generated: tuple[int, ...]
  cached: tuple[int, ...] = ()

  @classmethod
  def new(cls, row: int, slots: Sequence[int]) -> Placement:
    """Answers 0.. of the row into `slots`, each starting from its first token."""
    n = len(slots)
    return cls(row=row, slots=tuple(slots), answers=tuple(range(n)), pending=(-1,) * n, generated=(1,) * n)


@dataclasses.dataclass(frozen=True)
class Occupancy:
  """Pages given to one prefix row placed into `slots` of one shard: `shared` full pages (held by every slot, written
  once) and each slot's own partial last page (`own[i]`, empty when the prefix ends on a page boundary)."""

  shard: int
  slots: tuple[int, ...]
  shared: tuple[int, ...]
  own: tuple[tuple[int, ...], ...]


class SlotTable:

  def __init__(self, *, num_slots: int, num_shards: int, pages_per_shard: int, page_size: int, max_seq_len: int):
    if num_slots % num_shards:
      raise ValueError(f"sampler.num_slots={num_slots} not divisible by the mesh's data axis ({num_shards})")
    self.num_slots, self.num_shards, self.page_size, self.max_seq_len = num_slots, num_shards, page_size, max_seq_len
    self.slots_per_shard = num_slots // num_shards
    self.pool = PagePool(num_shards=num_shards, pages_per_shard=pages_per_shard)
    self.prefixes = PrefixCache(self.pool, page_size)
    self.pages: list[list[int]] = [[] for _ in range(num_slots)]
    self.held = np.zeros(num_slots, np.int64)  # len(self.pages[s])
    self.cached = np.zeros(num_slots, np.int64)  # tokens whose keys/values are in the slot's pages
    self.generated = np.zeros(num_slots, np.int64)  # tokens the slot's answer has drawn (the pending one included)
    self.active = np.zeros(num_slots, bool)
    self.lock = threading.RLock()

  def reset(self) -> None:
    """Every slot free and every page back in the pool (a fresh decode state)."""
    with self.lock:
      self.pool = PagePool(num_shards=self.num_shards, pages_per_shard=self.pool.pages_per_shard)
      self.prefixes = PrefixCache(self.pool, self.page_size)
      self.pages = [[] for _ in range(self.num_slots)]
      self.cached[:] = self.generated[:] = self.held[:] = 0
      self.active[:] = False

  # --- queries -----------------------------------------------------------------------------------------------------

  def shard_of(self, slot: int) -> int:
    return int(slot) // self.slots_per_shard

  def free_slots(self, shard: int) -> list[int]:
    lo = shard * self.slots_per_shard
    with self.lock:
      return (np.flatnonzero(~self.active[lo:lo + self.slots_per_shard]) + lo).tolist()

  def free_pages(self, shard: int) -> int:
    """Pages of the shard free to allocate: the pool's free ones and cached ones that nothing else holds."""
    with self.lock:
      return self.pool.num_free(shard) + self.prefixes.evictable(shard)

  def match(self, shard: int, tokens: np.ndarray, max_pages: int) -> list[int]:
    """Cached pages of the shard that hold `tokens`' first full pages (`PrefixCache.match`: the caller gets one
    reference to each, for `Placement.cached`, or gives it back with `unpin`)."""
    with self.lock:
      return self.prefixes.match(shard, tokens, max_pages)

  def longest_match(self, shard: int, tokens: np.ndarray, max_pages: int) -> int:
    with self.lock:
      return self.prefixes.longest(shard, tokens, max_pages)

  def unpin(self, shard: int, pages: Sequence[int]) -> None:
    with self.lock:
      self.pool.release(shard, pages)

  def forget_prefixes(self) -> None:
    """Drops the cached prefixes (their keys/values are of weights no longer in use)."""
    with self.lock:
      self.prefixes.clear()

  def _reserve(self, demand: np.ndarray) -> None:
    """Evicts cached prefixes until every shard has `demand[shard]` free pages, else `PoolExhausted`."""
    for shard in range(self.num_shards):
      self.prefixes.evict(shard, int(demand[shard]))
      if demand[shard] > self.pool.num_free(shard):
        raise PoolExhausted(shard, int(demand[shard]), self.pool.num_free(shard))

  def pages_to_insert(self, length: int, num_slots: int) -> int:
    """Pages that placing a prefix of `length` tokens into `num_slots` slots of one shard allocates."""
    full, tail = divmod(int(length), self.page_size)
    return full + num_slots * (tail > 0)

  def _new_pages(self, budget: np.ndarray) -> np.ndarray:
    """Per slot: the pages it does not hold yet that `budget[s]` more cached tokens write into (0 when idle)."""
    need = -(-(self.cached + budget) // self.page_size) - self.held
    return np.where(self.active, np.maximum(0, need), 0)

  def _per_shard(self, per_slot: np.ndarray) -> np.ndarray:
    return np.bincount(np.arange(len(per_slot)) // self.slots_per_shard, weights=per_slot,
                       minlength=self.num_shards).astype(np.int64)

  def demand(self, budget: np.ndarray) -> np.ndarray:
    """New pages per shard that `budget[s]` more cached tokens for every active slot s write into."""
    with self.lock:
      return self._per_shard(self._new_pages(np.asarray(budget, np.int64)))

  def page_rows(self, slots: Sequence[int], width: int, fill: int) -> np.ndarray:
    """[len(slots), width] page ids of the slots (`fill` past the pages each holds)."""
    rows = np.full((len(slots), width), fill, np.int32)
    with self.lock:
      for i, slot in enumerate(slots):
        rows[i, :len(self.pages[slot])] = self.pages[slot]
    return rows

  # --- changes -----------------------------------------------------------------------------------------------------

  def occupy(self, placements: Sequence[Placement], lengths: Sequence[int]) -> list[list[Occupancy]]:
    """Takes the placements' slots for prefix rows of `lengths[row]` tokens after their `cached` pages; returns each
    placement's new pages, by shard. `PoolExhausted` (nothing taken) if a shard lacks pages, after evicting cached
    prefixes; a ValueError (nothing taken) if a slot is still in use."""
    with self.lock:
      demand = np.zeros(self.num_shards, np.int64)
      for pl in placements:
        for shard in {self.shard_of(s) for s in pl.slots}:
          demand[shard] += self.pages_to_insert(lengths[pl.row], sum(self.shard_of(s) == shard for s in pl.slots))
        busy = [s for s in pl.slots if self.active[s]]
        if busy:
          raise ValueError(f"slot {busy[0]} is in use; release it before inserting")
        if pl.cached and len({self.shard_of(s) for s in pl.slots}) > 1:
          raise ValueError(f"placement of row {pl.row} with cached pages spans slots {pl.slots} of several shards")
      self._reserve(demand)
      out = []
      for pl in placements:
        full, tail = divmod(int(lengths[pl.row]), self.page_size)
        out.append([])
        for shard in sorted({self.shard_of(s) for s in pl.slots}):
          mine = [i for i, s in enumerate(pl.slots) if self.shard_of(s) == shard]
          shared = self.pool.alloc(shard, full)
          self.pool.retain(shard, shared, len(mine) - 1)
          self.pool.retain(shard, pl.cached, len(mine) - 1)  # the first slot takes the caller's reference
          own = []
          for i in mine:
            slot = pl.slots[i]
            own.append(tuple(self.pool.alloc(shard, 1) if tail else ()))
            self.pages[slot] = list(pl.cached) + shared + list(own[-1])
            self.held[slot] = len(self.pages[slot])
            self.cached[slot] = len(pl.cached) * self.page_size + lengths[pl.row]
            self.generated[slot], self.active[slot] = pl.generated[i], True
          out[-1].append(Occupancy(shard=shard, slots=tuple(pl.slots[i] for i in mine), shared=tuple(shared),
                                   own=tuple(own)))
      return out

  def grow(self, budget: np.ndarray) -> np.ndarray:
    """Allocates the pages `budget[s]` more cached tokens write into, for every active slot (all or none:
    `PoolExhausted`); returns [new pages, 3] rows of (slot, column in its page table, page)."""
    with self.lock:
      need = self._new_pages(np.asarray(budget, np.int64))
      self._reserve(self._per_shard(need))
      slots = np.flatnonzero(need)
      out = np.zeros((int(need.sum()), 3), np.int64)
      if not len(slots):
        return out
      out[:, 0] = np.repeat(slots, need[slots])
      starts = np.cumsum(need[slots]) - need[slots]
      out[:, 1] = np.repeat(self.held[slots] - starts, need[slots]) + np.arange(len(out))
      shard_of = slots // self.slots_per_shard
      for shard in np.unique(shard_of).tolist():  # slots in order, so each shard's pages are one run of `out`
        rows = np.repeat(shard_of == shard, need[slots])
        out[rows, 2] = self.pool.alloc(shard, int(rows.sum()))
      pages = out[:, 2].tolist()
      for slot, start, n in zip(slots.tolist(), starts.tolist(), need[slots].tolist()):
        self.pages[slot] += pages[start:start + n]
      self.held[slots] += need[slots]
      return out

  def advance(self, count: np.ndarray) -> None:
    """Active slots cached `count[s]` more tokens and drew as many."""
    with self.lock:
      count = np.where(self.active, np.asarray(count, np.int64), 0)
      self.cached += count
      self.generated += count

  def release(self, slot: int, tokens: np.ndarray | None = None) -> None:
    """Frees the slot's pages (shared ones return to the pool with their last holder). With `tokens`, the sequence
    the slot held (its cached tokens first), its full pages go to the prefix cache first. Idempotent."""
    with self.lock:
      if self.active[slot]:
        if tokens is not None:
          n = min(int(self.cached[slot]), len(tokens)) // self.page_size
          self.prefixes.add(self.shard_of(slot), tokens, self.pages[slot][:n])
        self._free(slot)

  def _free(self, slot: int) -> None:
    self.pool.release(self.shard_of(slot), self.pages[slot])
    self.pages[slot] = []
    self.cached[slot] = self.generated[slot] = self.held[slot] = 0
    self.active[slot] = False

  def check(self) -> None:
    """Raises if the pool and the slots' pages disagree (a leaked or double-freed page)."""
    with self.lock:
      self.pool.check()
      for shard in range(self.num_shards):
        refs = np.zeros(self.pool.pages_per_shard, np.int64)
        lo = shard * self.slots_per_shard
        for slot in range(lo, lo + self.slots_per_shard):
          np.add.at(refs, self.pages[slot], 1)
        np.add.at(refs, self.prefixes.pages(shard), 1)
        expected = np.array([self.pool.refcount(shard, p) for p in range(self.pool.pages_per_shard)])
        if not np.array_equal(refs, expected):
          bad = int(np.flatnonzero(refs != expected)[0])
          raise AssertionError(f"shard {shard} page {bad}: held by {refs[bad]} slots, reference count "
                               f"{expected[bad]}")
