"""Which sampler takes the next prompt group: one rule for the engine replicas of a process (`rl.rollout`), the
sampler processes of a job (`distributed.sampler_hub`) and the simulator's samplers (`sim.job`). A group goes whole to
one sampler, so its answers share the prompt's pages there.

Each owner keeps one `Outstanding` per sampler (the groups it was given and has not finished) and one `Dispatcher`,
which sends an episode's next turn where its last went (`Request.episode`: that sampler's prefix cache holds the turn
before) and anything else to `least_loaded`, the sampler whose outstanding work, in tokens, is least: a sampler
holding 16 answers of 20k tokens left is busier than one holding 16 of 100.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Iterator, Mapping

from areal_jax.sampler.requests import Request


@dataclasses.dataclass(frozen=True)
class Load:
  """What a sampler holds: `tokens` of work outstanding (`Outstanding.tokens`), answers submitted to it and not
  finished, and KV pages free (0 where unknown)."""

  tokens: int
  answers: int
  free_pages: int = 0


def least_loaded(loads: Mapping[Hashable, Load]):
  """The key of the sampler with the fewest tokens of work outstanding, then the most free pages, then the fewest
  answers outstanding, then the lowest key."""
  if not loads:
    raise ValueError("no sampler to dispatch to")
  return min(loads, key=lambda k: (loads[k].tokens, -loads[k].free_pages, loads[k].answers, k))


class Outstanding:
  """The prompt groups one sampler was given and has not finished, and their work in tokens: a group's prompt until
  its first answer is back (prefilled by then), and each answer's budget (`max_new_tokens`) until it is back.

  Not thread-safe: its owner updates it under its own lock (`LocalRollout`) or on its one loop (the hub, the
  simulator)."""

  def __init__(self):
    self._groups: dict[int, tuple[Request, int]] = {}  # group id -> (request, answers still to come)
    self.answers = 0
    self.tokens = 0

  def add(self, request: Request) -> None:
    if request.group_id in self._groups:
      raise ValueError(f"group {request.group_id} is already in flight on this sampler")
    self._groups[request.group_id] = (request, request.num_answers)
    self.answers += request.num_answers
    self.tokens += len(request.prompt_ids) + request.num_answers * request.sampling.max_new_tokens

  def answered(self, group_id: int) -> None:
    """One answer of group `group_id` is back (or will not come: cancelled, failed)."""
    request, left = self._groups[group_id]
    self.answers -= 1
    self.tokens -= request.sampling.max_new_tokens
    if left == request.num_answers:  # its first answer: the prompt was prefilled
      self.tokens -= len(request.prompt_ids)
    if left > 1:
      self._groups[group_id] = (request, left - 1)
    else:
      del self._groups[group_id]

  def remove(self, group_id: int) -> None:
    """Group `group_id` taken back whole (its submission failed)."""
    request, left = self._groups[group_id]
    for _ in range(left):
      self.answered(request.group_id)

  def load(self, free_pages: int = 0) -> Load:
    return Load(tokens=self.tokens, answers=self.answers, free_pages=free_pages)

  def __contains__(self, group_id: int) -> bool:
    return group_id in self._groups

  def __iter__(self) -> Iterator[int]:
    return iter(self._groups)

  def __len__(self) -> int:
    return len(self._groups)


class Dispatcher:
  """Which sampler takes a request: the one that served its episode's last request (`Request.episode`) while that
  one is among `loads` (alive), else `least_loaded`. Remembers the newest `remember` episodes. Not thread-safe, as
  `Outstanding`."""

  def __init__(self, remember: int = 1 << 16):
    self._where: collections.OrderedDict[str, Hashable] = collections.OrderedDict()
    self._remember = remember
    self.kept = 0  # requests that went where their episode's last one did

  def choose(self, request: Request, loads: Mapping[Hashable, Load]):
    episode = request.episode
    if episode is not None and episode in self._where and self._where[episode] in loads:
      self._where.move_to_end(episode)
      self.kept += 1
      return self._where[episode]
    key = least_loaded(loads)
    if episode is not None:
      self._where[episode] = key
      self._where.move_to_end(episode)
      while len(self._where) > self._remember:
        self._where.popitem(last=False)
    return key
