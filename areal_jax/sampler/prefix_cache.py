"""Keys/values reused across requests: the full pages of released sequences, found again by the tokens they hold.

A multi-turn agent's next prompt is its previous prompt + answer + a tool result, and the G episodes of a group start
from one prompt: without reuse, every turn prefills its whole history again. A page is keyed exactly by its tokens and
the entry of the page before it (a chain from the sequence's first token), per data shard, so a lookup finds the
longest run of a prompt's leading full pages that some released sequence wrote.

The cache holds one pool reference per page. It drops the least recently used pages that nothing else holds when a
shard runs short (`evict`), and every page when the weights change (`clear`: those keys/values are the old policy's).
Only the slot table uses it, under the table's lock.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np

from areal_jax.sampler.paging import PagePool


class PrefixCache:

  def __init__(self, pool: PagePool, page_size: int):
    self.pool, self.page_size = pool, page_size
    # (shard, entry before it (0: none), the page's tokens) -> (entry id, page); least recently used first.
    self._entries: collections.OrderedDict[tuple[int, int, bytes], tuple[int, int]] = collections.OrderedDict()
    self._ids = itertools.count(1)

  def __len__(self) -> int:
    return len(self._entries)

  def _walk(self, shard: int, tokens: np.ndarray, num_pages: int):
    """(key, entry or None) for the first `num_pages` full pages of `tokens`, stopping after the first missing one."""
    parent, p = 0, self.page_size
    tokens = np.asarray(tokens, np.int32)
    for j in range(min(num_pages, len(tokens) // p)):
      key = (shard, parent, tokens[j * p:(j + 1) * p].tobytes())
      entry = self._entries.get(key)
      yield key, entry
      if entry is None:
        return
      parent = entry[0]

  def _touch(self, keys: list) -> None:
    for key in reversed(keys):  # a run's first pages end most recent: they go last, after the pages that extend them
      self._entries.move_to_end(key)

  def longest(self, shard: int, tokens: np.ndarray, max_pages: int) -> int:
    """How many of `tokens`' first full pages `match` would find (nothing retained or touched)."""
    return sum(entry is not None for _, entry in self._walk(shard, tokens, max_pages))

  def match(self, shard: int, tokens: np.ndarray, max_pages: int) -> list[int]:
    """Pages of `shard` holding the longest cached run of `tokens`' first full pages (at most `max_pages`), each
    retained once for the caller, who passes that reference on (`Placement.cached`) or releases it."""
    found = [(key, entry[1]) for key, entry in self._walk(shard, tokens, max_pages) if entry is not None]
    self._touch([key for key, _ in found])
    pages = [page for _, page in found]
    self.pool.retain(shard, pages)
    return pages

  def add(self, shard: int, tokens: np.ndarray, pages: list[int]) -> None:
    """Caches the full pages of a sequence: `pages[j]` holds `tokens[j * page_size:(j + 1) * page_size]`. A page
    whose tokens are cached already (another copy of the same keys/values) is left to its holder."""
    keys, parent, p = [], 0, self.page_size
    tokens = np.asarray(tokens, np.int32)
    for j in range(min(len(pages), len(tokens) // p)):
      key = (shard, parent, tokens[j * p:(j + 1) * p].tobytes())
      entry = self._entries.get(key)
      if entry is None:
        entry = self._entries[key] = (next(self._ids), pages[j])
        self.pool.retain(shard, [pages[j]])
      parent = entry[0]
      keys.append(key)
    self._touch(keys)

  def evictable(self, shard: int) -> int:
    """Pages of `shard` that only the cache holds: free for the asking."""
    return sum(key[0] == shard and self.pool.refcount(shard, page) == 1 for key, (_, page) in self._entries.items())

  def evict(self, shard: int, need: int) -> None:
    """Drops least recently used pages that only the cache holds until `need` pages of `shard` are free (or none is
    left to drop)."""
    for key in list(self._entries):
      if self.pool.num_free(shard) >= need:
        return
      _, page = self._entries[key]
      if key[0] == shard and self.pool.refcount(shard, page) == 1:
        del self._entries[key]
        self.pool.release(shard, [page])

  def clear(self) -> None:
    """Drops every page (new weights: the cached keys/values are stale)."""
    for (shard, _, _), (_, page) in self._entries.items():
      self.pool.release(shard, [page])
    self._entries.clear()

  def pages(self, shard: int) -> list[int]:
    return [page for key, (_, page) in self._entries.items() if key[0] == shard]
