"""Dynamic micro-batching (paper Alg. 1) and packing into fixed-shape, bucketed arrays.

A micro-batch is `[rows, length]` arrays: one row per batch shard of the learner mesh (data × fsdp devices), each row
several whole sequences back to back (segment ids 1, 2, ... and positions restarting at 0; 0 = padding at the end).
The sequences of a minibatch are first balanced over the rows by token count, then each row's share is cut into
micro-batches by Alg. 1 under `max_tokens`; micro-batch k stacks the k-th piece of every row. The row length is
rounded up to a bucket (`min_bucket` times 1, 1.5, 2, 3, 4, ..., and `max_tokens` itself) so a run compiles a
bounded number of shapes.

Token t of a row holds the prediction of token t + 1: the loss on response token j of a sequence with prompt length
P sits at offset + P + j - 1.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from areal_jax.types import Trajectory


def dynamic_microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
  """Paper Alg. 1: indices grouped into micro-batches of at most `max_tokens` tokens each.

  Longest first; each sequence goes into the micro-batch with the fewest sequences among those it fits in (ties: the
  earliest opened); a new micro-batch is opened when it fits in none.
  """
  lengths = np.asarray(lengths, np.int64)
  too_long = np.flatnonzero(lengths > max_tokens)
  if too_long.size:
    i = int(too_long[0])
    raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than learner.max_tokens_per_mb={max_tokens}")
  order = np.argsort(-lengths, kind="stable")
  groups: list[list[int]] = []
  totals = np.zeros(len(lengths), np.int64)  # at most one micro-batch per sequence
  counts = np.zeros(len(lengths), np.int64)
  for i in order:
    n = len(groups)
    fits = totals[:n] + lengths[i] <= max_tokens
    if fits.any():
      b = int(np.argmin(np.where(fits, counts[:n], np.iinfo(np.int64).max)))
    else:
      b = n
      groups.append([])
    groups[b].append(int(i))
    totals[b] += lengths[i]
    counts[b] += 1
  return groups


def balanced_split(lengths: Sequence[int], n: int) -> list[list[int]]:
  """Indices split into `n` groups of near-equal total length (longest first into the lightest group)."""
  if n < 1:
    raise ValueError(f"cannot split into {n} groups")
  heap = [(0, g) for g in range(n)]
  groups: list[list[int]] = [[] for _ in range(n)]
  for i in np.argsort(-np.asarray(lengths, np.int64), kind="stable"):
    total, g = heapq.heappop(heap)
    groups[g].append(int(i))
    heapq.heappush(heap, (total + int(lengths[i]), g))
  return groups


def bucket_lengths(max_tokens: int, min_bucket: int = 128) -> tuple[int, ...]:
  """The row lengths a run may compile: `min_bucket` times 1, 1.5, 2, 3, 4, 6, ... below `max_tokens`, and
  `max_tokens`. At most 2·log2(max_tokens / min_bucket) + 1 shapes; a row is padded by less than a third."""
  out, b = [], min_bucket
  while b < max_tokens:
    out += [x for x in (b, b + b // 2) if x < max_tokens]
    b *= 2
  return (*out, max_tokens)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
  for b in buckets:
    if n <= b:
      return b
  raise ValueError(f"{n} tokens exceed the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where sequences go: `rows[r]` lists the sequence indices packed into row r, in order; rows are `length` long."""

  rows: tuple[tuple[int, ...], ...]
  length: int


def plan_packed(lengths: Sequence[int], *, max_tokens: int, rows: int, min_bucket: int = 128) -> list[Layout]:
  """Layouts of the micro-batches of one minibatch: balanced over `rows`, Alg. 1 per row, bucketed lengths."""
  lengths = np.asarray(lengths, np.int64)
  buckets = bucket_lengths(max_tokens, min_bucket)
  per_row = []
  for share in balanced_split(lengths, rows):
    mbs = [[share[j] for j in mb] for mb in dynamic_microbatches(lengths[share], max_tokens)]
    per_row.append(sorted(mbs, key=lambda mb: -int(lengths[mb].sum())))
  layouts = []
  for k in range(max(map(len, per_row), default=0)):
    step = tuple(tuple(r[k]) if k < len(r) else () for r in per_row)
    longest = max(int(lengths[list(r)].sum()) for r in step)
    layouts.append(Layout(rows=step, length=bucket_for(longest, buckets)))
  return layouts


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicroBatch:
  """Host arrays [rows, length] of one micro-batch and the layout they were built from."""

  tokens: np.ndarray  # int32
  positions: np.ndarray  # int32
  segment_ids: np.ndarray  # int32, 0 = padding
  loss_mask: np.ndarray  # float32, 1 where the next token is the policy's response token (`Trajectory.loss_mask`)
  behavior_logprobs: np.ndarray  # float32
  advantages: np.ndarray  # float32
  loss_weights: np.ndarray  # float32, each loss token's weight in its sequence (`loss_agg`); 0 elsewhere
  versions: np.ndarray  # int32, the policy version that drew each loss token; 0 elsewhere
  layout: Layout
  # int16 [rows, length, sparse layers, k]: the sampler's experts of each position (`Trajectory.routes`), -1 where
  # none was recorded; None unless asked for (`learner.routing_replay`).
  routes: np.ndarray | None = None

  def arrays(self) -> dict[str, np.ndarray]:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name != "layout" and getattr(self, f.name) is not None}

  @property
  def num_tokens(self) -> int:
    return int(np.count_nonzero(self.segment_ids))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPlan:
  """A learner step's host-side input: minibatches of packed micro-batches and what went into them (built by
  `Learner.prepare`, read by `Learner.update` and `step_stats.learner_stats`)."""

  minibatches: tuple[tuple[MicroBatch, ...], ...]
  loss_tokens: tuple[int, ...]  # response tokens per minibatch
  denominators: tuple[float, ...]  # the loss denominator of each update (`loss_agg`)
  seq_lengths: tuple[int, ...]  # prompt + response tokens of every sequence trained on
  num_filtered: int  # answers dropped with their uniform-reward groups
  host_stats: dict[str, float]


def assemble(layout: Layout, trajectories: Sequence[Trajectory], advantages: Sequence[np.ndarray],
             token_weights: Sequence[float] | None = None, routes: tuple[int, int] | None = None) -> MicroBatch:
  """Packs the sequences named by `layout` into arrays. `advantages[i]` is per response token of trajectory i;
  `token_weights[i]` (default 1) weighs each of its loss tokens. `routes` = (sparse layers, k) also packs the
  trajectories' recorded routing (`MicroBatch.routes`)."""
  shape = (len(layout.rows), layout.length)
  a = {k: np.zeros(shape, np.int32) for k in ("tokens", "positions", "segment_ids")}
  a |= {k: np.zeros(shape, np.float32) for k in ("loss_mask", "behavior_logprobs", "advantages", "loss_weights")}
  a["versions"] = np.zeros(shape, np.int32)
  if routes is not None:
    a["routes"] = np.full(shape + tuple(routes), -1, np.int16)
  for r, row in enumerate(layout.rows):
    offset = 0
    for seg, i in enumerate(row, start=1):
      t = trajectories[i]
      p, n = len(t.prompt_ids), len(t.response_ids)
      if p < 1 or n < 1:
        raise ValueError(f"trajectory {i} has {p} prompt and {n} response tokens; both must be >= 1")
      if offset + p + n > layout.length:
        raise ValueError(f"row {r} of a layout of length {layout.length} cannot hold sequence {i} "
                         f"({p}+{n} tokens at offset {offset})")
      if len(t.logprobs) != n or len(advantages[i]) != n:
        raise ValueError(f"trajectory {i}: {n} response tokens but {len(t.logprobs)} logprobs and "
                         f"{len(advantages[i])} advantages")
      a["tokens"][r, offset:offset + p] = t.prompt_ids
      a["tokens"][r, offset + p:offset + p + n] = t.response_ids
      a["positions"][r, offset:offset + p + n] = np.arange(p + n)
      a["segment_ids"][r, offset:offset + p + n] = seg
      pred = slice(offset + p - 1, offset + p + n - 1)
      mask = 1.0 if t.loss_mask is None else t.loss_mask
      a["loss_mask"][r, pred] = mask
      a["behavior_logprobs"][r, pred] = t.logprobs
      a["advantages"][r, pred] = advantages[i]
      a["loss_weights"][r, pred] = (1.0 if token_weights is None else token_weights[i]) * mask
      a["versions"][r, pred] = t.versions
      if routes is not None and t.routes is not None:
        if t.routes.shape[1:] != tuple(routes) or len(t.routes) > p + n - 1:
          raise ValueError(f"trajectory {i}: routes of shape {t.routes.shape}; expected at most {p + n - 1} "
                           f"positions of {tuple(routes)} (sparse layers, experts per token)")
        a["routes"][r, offset:offset + len(t.routes)] = t.routes
      offset += p + n
  return MicroBatch(layout=layout, **a)


def unpack(layout: Layout, values: np.ndarray, trajectories: Sequence[Trajectory]) -> dict[int, np.ndarray]:
  """Per-response-token values (e.g. logprobs) of each packed sequence, keyed by trajectory index."""
  out = {}
  for r, row in enumerate(layout.rows):
    offset = 0
    for i in row:
      p, n = len(trajectories[i].prompt_ids), len(trajectories[i].response_ids)
      out[i] = np.asarray(values[r, offset + p - 1:offset + p + n - 1])
      offset += p + n
  return out
