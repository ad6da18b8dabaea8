"""Host-side page allocator: reference-counted pages in one pool per data shard.

Each data shard of the sampler mesh owns `pages_per_shard` pages of the KV cache and serves only its own slots, so
attention never reads another device's pages. Page ids are local to their shard; page 0 of every shard is the scratch
page that idle slots write to and is never handed out. A page shared by the G answers of one prompt is retained once
per answer and returns to the free list when the last one releases it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SCRATCH_PAGE = 0


class PoolExhausted(RuntimeError):
  """Not enough free pages on a shard; the caller frees some (preemption) and retries."""

  def __init__(self, shard: int, needed: int, free: int):
    super().__init__(f"KV page pool of data shard {shard} has {free} free pages, {needed} needed")
    self.shard, self.needed, self.free = shard, needed, free


class PagePool:

  def __init__(self, *, num_shards: int, pages_per_shard: int):
    if pages_per_shard < 2:
      raise ValueError(f"pages_per_shard={pages_per_shard}: need the scratch page and at least one more")
    self.num_shards, self.pages_per_shard = num_shards, pages_per_shard
    self._refs = np.zeros((num_shards, pages_per_shard), np.int32)
    # LIFO free lists (low ids handed out first), scratch page excluded.
    self._free = [list(range(pages_per_shard - 1, SCRATCH_PAGE, -1)) for _ in range(num_shards)]

  @property
  def capacity(self) -> int:
    """Allocatable pages per shard."""
    return self.pages_per_shard - 1

  def num_free(self, shard: int) -> int:
    return len(self._free[shard])

  def alloc(self, shard: int, n: int) -> list[int]:
    """n fresh pages (reference count 1), or PoolExhausted with nothing allocated."""
    free = self._free[shard]
    if n > len(free):
      raise PoolExhausted(shard, n, len(free))
    pages = free[len(free) - n:][::-1]  # as n pops
    del free[len(free) - n:]
    self._refs[shard, pages] = 1
    return pages

  def retain(self, shard: int, pages: Sequence[int], times: int = 1) -> None:
    pages = list(pages)
    if pages and np.any(self._refs[shard, pages] <= 0):
      raise ValueError(f"retain of unallocated pages {pages} on shard {shard}")
    np.add.at(self._refs[shard], pages, times)

  def release(self, shard: int, pages: Sequence[int]) -> None:
    refs = self._refs[shard]
    for p in pages:
      if refs[p] <= 0:
        raise ValueError(f"page {p} of shard {shard} released more often than allocated")
      refs[p] -= 1
      if refs[p] == 0:
        self._free[shard].append(p)

  def refcount(self, shard: int, page: int) -> int:
    return int(self._refs[shard, page])

  def check(self) -> None:
    """Raises if the free lists and reference counts disagree (a leaked or double-freed page)."""
    for s in range(self.num_shards):
      free = self._free[s]
      in_use = int(np.count_nonzero(self._refs[s]))
      if len(set(free)) != len(free) or in_use + len(free) != self.capacity or np.any(self._refs[s, free]):
        raise AssertionError(f"shard {s}: {len(free)} free + {in_use} in use != {self.capacity} pages")
