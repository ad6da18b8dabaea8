"""Answer lengths for a simulated run: a table of quantiles, read by each answer's PRNG key (so an answer keeps its
length through preemption and weight swaps).

    Lengths.parametric(mean=8000, max=27648)       # log-normal with a long tail, cut at max (cut answers end there)
    Lengths.from_file("run/rollouts.jsonl")        # a run's own answers (or a text file of lengths)
    RecordedGroups.from_rollouts(["run/rollouts.jsonl"])  # its groups whole: lengths and rewards (`Job.recorded`)
"""

from __future__ import annotations

import json
import math

import numpy as np
import scipy.stats
from etils import epath

_QUANTILES = 4096


class Lengths:

  def __init__(self, samples, *, source: str):
    samples = np.sort(np.asarray(samples, np.int64))
    if not len(samples) or samples[0] < 1:
      raise ValueError(f"{source}: answer lengths must be >= 1 and there must be some")
    self.table, self.source = samples, source

  @property
  def mean(self) -> float:
    return float(self.table.mean())

  @property
  def max(self) -> int:
    return int(self.table[-1])

  def __call__(self, keys: np.ndarray) -> np.ndarray:
    """The lengths of the answers drawn with PRNG key data `keys` (uint32 [..., 2])."""
    keys = np.asarray(keys, np.uint64)
    h = (keys[..., 0] * np.uint64(0x9E3779B1) + keys[..., 1]) & np.uint64(0xFFFFFFFF)
    h = ((h ^ (h >> np.uint64(16))) * np.uint64(0x45D9F3B)) & np.uint64(0xFFFFFFFF)
    h = h ^ (h >> np.uint64(16))
    return self.table[(h * np.uint64(len(self.table))) >> np.uint64(32)]

  @classmethod
  def parametric(cls, mean: float, max: int, sigma: float = 1.0) -> Lengths:  # pylint: disable=redefined-builtin
    """Log-normal lengths of spread `sigma` (1.0: a p99 ~10x the median, like reasoning traces), cut at `max`,
    with the median chosen so the mean after the cut is `mean`."""
    if not 1 <= mean <= max:
      raise ValueError(f"length mean {mean} must lie in [1, length max={max}]")
    z = scipy.stats.norm.ppf((np.arange(_QUANTILES) + 0.5) / _QUANTILES)
    lo, hi = 0.0, math.log(max) + 1
    for _ in range(60):  # bisect the log-median
      mid = (lo + hi) / 2
      if np.minimum(np.exp(mid + sigma * z), max).mean() < mean:
        lo = mid
      else:
        hi = mid
    samples = np.clip(np.round(np.exp(lo + sigma * z)), 1, max)
    return cls(samples, source=f"log-normal, mean {mean:g}, max {max}")

  @classmethod
  def from_file(cls, path: str) -> Lengths:
    """From a run's `rollouts.jsonl` (its answers' `lengths`) or a text file of whitespace-separated lengths."""
    text = epath.Path(path).read_text()
    if path.endswith(".jsonl"):
      lengths = []
      for i, line in enumerate(text.splitlines(), 1):
        try:
          lengths += json.loads(line)["lengths"]
        except (ValueError, KeyError) as e:
          raise ValueError(f"{path}:{i}: not a rollouts.jsonl line with 'lengths' ({e})") from None
    else:
      try:
        lengths = [int(w) for w in text.split()]
      except ValueError as e:
        raise ValueError(f"{path}: expected whitespace-separated integer lengths ({e})") from None
    return cls(lengths, source=path)


class RecordedGroups:
  """A run's prompt groups as recorded in its `rollouts.jsonl` (each group's answer lengths and rewards, dropped
  groups included), for a simulation that replays whole groups: lengths and rewards stay paired, so groups that
  were dropped as uniform are as long as they were (a group's answers often have near-equal lengths). `ids`: the
  run's group ids (admission order), where recorded, so that a replay can give group g the run's own group g."""

  def __init__(self, groups, *, source: str, ids=()):
    self.groups = [(tuple(int(n) for n in lengths), tuple(float(r) for r in rewards)) for lengths, rewards in groups]
    if not self.groups or any(not lengths or min(lengths) < 1 or len(lengths) != len(rewards)
                              for lengths, rewards in self.groups):
      raise ValueError(f"{source}: no groups, or a group without lengths >= 1 and one reward per answer")
    self.by_id = {int(g): i for i, g in enumerate(ids)}
    self.source = source

  def lengths(self) -> Lengths:
    """Every recorded answer's length, as a table."""
    return Lengths([n for lengths, _ in self.groups for n in lengths], source=self.source)

  @classmethod
  def from_rollouts(cls, paths) -> RecordedGroups:
    groups, ids = [], []
    for path in paths:
      for i, line in enumerate(epath.Path(path).read_text().splitlines(), 1):
        try:
          row = json.loads(line)
          groups.append((row["lengths"], row["rewards"]))
        except (ValueError, KeyError) as e:
          raise ValueError(f"{path}:{i}: not a rollouts.jsonl line with 'lengths' and 'rewards' ({e})") from None
        ids.append(row.get("group"))
    one_run = len(paths) == 1 and None not in ids
    return cls(groups, source=", ".join(paths), ids=ids if one_run else ())
