"""Continuous batching on the host: admission into free slots, preemption when pages run out, stop conditions, and
versioned weight swaps between decode steps.

One `step()`:
1. swap in new weights if `update_params` left some, recomputing every running answer's cache (re-prefill of prompt +
   tokens so far) under them;
2. admit waiting answers into free slots (preempted ones first, then new groups, oldest first), one batched prefill
   per length bucket; a group's answers share the prompt's pages. Each data shard prefills only the rows of its own
   slots (up to `sampler.max_prefill_tokens` of them per shard and call) and keeps their keys and values; the
   recompute at a weight swap is batched the same way. With `sampler.prefix_cache` a context whose first full pages a
   released sequence left (an agent's previous turn) goes to their shard and is prefilled after them;
3. make room: while a shard lacks the pages this step's decode call writes into, preempt its youngest answer (freed,
   requeued, resumed later by re-prefill);
4. one decode call of up to `sampler.decode_steps` steps for every running answer (one `lax.while_loop` on the
   device); one read of the device brings its tokens and the first tokens of the answers admitted in 2. Tokens are
   recorded with the version they were drawn under; answers finish at EOS, a stop sequence, `max_new_tokens` or the
   cache length, and free their slots and pages (full pages go to the prefix cache, if on; new weights empty it).
   With `sampler.record_routes` the same read brings a mixture of experts' routing of the prompts' positions and of
   each step's input token, kept per answer (`Sequence.routes`).

With `sampler.overlap` (the default) the read of step k's call comes after step k+1's call is dispatched (JAX
dispatches asynchronously), so the host's bookkeeping runs while the device decodes: the device stops a slot at EOS
or at its budget by itself, budgets and pages count the call still in flight as if it drew its whole budget (never
more than an answer may draw), and slots an answer left in call k take new answers from step k+2. A call's tokens
for a slot whose answer ended on the host meanwhile (a stop sequence, a preemption) are dropped; a preempted answer
draws them again (same keys, same tokens). A step takes a pending update once, under the lock, at its top, and
reads every call in flight before the swap rewrites a page (`tests/sampler/test_weights.py`). Answers,
logprobs, versions and routes are the same as without overlap (`tests/sampler/test_overlap.py`).

Recording is vectorised over the call's [slots, steps] block: where an answer stops (EOS, its length) is found with
numpy, and the tokens go into per-slot buffers in a few numpy operations; an answer's lists take them when read
(`Sequence.tokens` syncs), when it ends, or every 32 calls (a 32nd of the slots in turn). Answers with stop sequences
are recorded token by token.

With `sampler.speculation="suffix"` each call also carries, per slot, the tokens `drafts.SuffixDrafter` predicts
after those the host has read of its answer (from the answer's own context, the finished answers to the same
prompt and recent answers); the device verifies them exactly (`Programs.speculate`), up to `sampler.spec_tokens`
per forward, picking up where the call in flight left the answer (`Engine.generate_steps`). A call still draws at
most `sampler.decode_steps` tokens per slot: accepted drafts take fewer forwards to draw them.

Priority is by arrival, so the oldest answer always progresses: no request starves, and the pool (at least one full
sequence per shard) can never deadlock.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import heapq
import itertools
import threading
import time

import jax
import numpy as np

from areal_jax.sampler.drafts import SuffixDrafter
from areal_jax.sampler.engine import Draws, Engine
from areal_jax.sampler.requests import Request, Sequence
from areal_jax.sampler.sampling import request_key
from areal_jax.sampler.slots import Placement
from areal_jax.sampler.state import DecodeSteps
from areal_jax.models.weights import check_compatible


@dataclasses.dataclass(frozen=True)
class _Call:
  """A decode call dispatched and not yet read: its device results, the first tokens of the answers admitted just
  before it (see `Scheduler._fresh`), which answer held each slot (`owners`, `Scheduler._occupant` serials), the
  tokens each slot could draw and the version they were drawn under."""

  steps: DecodeSteps
  fresh: list
  owners: np.ndarray
  budget: np.ndarray
  version: int


class Scheduler:
  """Single-threaded except `update_params`, which may be called from any thread."""

  def __init__(self, *, engine: Engine, params, version: int = 0, eos_ids=(), drafter: SuffixDrafter | None = None):
    self.engine = engine
    self.params, self.version = params, version
    self.eos_ids = frozenset(int(e) for e in eos_ids)
    self.state = engine.init_decode_state()
    self.waiting: collections.deque[list[Sequence]] = collections.deque()  # not started, one entry per group
    self.resume: list[tuple[tuple[int, int], Sequence]] = []  # preempted, heap by priority
    self.running: dict[int, Sequence] = {}  # slot -> answer
    self.counters = collections.Counter(dict.fromkeys(
        ("decode_calls", "decode_steps", "tokens", "prefill_rows", "prefill_tokens", "cached_tokens", "preemptions",
         "weight_updates", "recomputed"), 0))
    # With `sampler.speculation`: drafts from the rollouts drawn so far (`drafts.SuffixDrafter`), keyed by the serial
    # of the slot's answer; per slot, the tokens of its answer the drafter holds. Counters: slots' forwards over drafts,
    # tokens they emitted, drafts verified and accepted (also per draft position, `spec_drafted_at`/`_accepted_at`).
    # A `drafter` given keeps its histories from an earlier scheduler (an evaluation's, of the same prompts).
    self.drafter = None
    if drafter is not None and engine.cfg.speculation != "suffix":
      raise ValueError(f"a drafter given with sampler.speculation={engine.cfg.speculation!r}")
    if engine.cfg.speculation == "suffix":
      self.drafter = drafter or SuffixDrafter(max_draft=engine.cfg.draft_width)
      self.drafter.abandon()
      self.counters.update(dict.fromkeys(("spec_forwards", "spec_tokens", "spec_drafted", "spec_accepted"), 0))
      self.spec_drafted_at = np.zeros(engine.cfg.spec_tokens, np.int64)
      self.spec_accepted_at = np.zeros(engine.cfg.spec_tokens, np.int64)
    self._known = np.zeros(engine.cfg.num_slots, np.int64)
    # Wall time of `step` by part: weight swaps (re-prefills included); admission, page allocation and dispatch;
    # waiting for the device (prefill, insert and decode compute not yet overlapped); recording tokens. `drafts`: the
    # drafter's share of the host parts (indexing, matching), with speculation.
    self.seconds: collections.Counter[str] = collections.Counter()
    self._arrivals = itertools.count()
    self._pending: tuple[object, int] | None = None
    self.overlap = engine.cfg.overlap
    self._inflight: collections.deque[_Call] = collections.deque()
    # Per slot, set when an answer takes it: a serial naming the answer (0: free), the tokens it may draw in all
    # (max_new_tokens and the cache), whether EOS ends it, whether it has stop sequences (checked token by token).
    s = engine.cfg.num_slots
    self._serials = itertools.count(1)
    self._occupant = np.zeros(s, np.int64)
    self._limit = np.zeros(s, np.int64)
    self._stop_eos = np.zeros(s, bool)
    self._has_stop = np.zeros(s, bool)
    self._eos_array = np.array(sorted(self.eos_ids), np.int64)
    # Tokens recorded for each slot's answer and not yet in its lists (`_buffer`, `_sync`): up to 32 calls' worth
    # (12 bytes a token: 25 MB at 8192 slots of 8 steps).
    width = min(32 * engine.cfg.decode_steps, engine.cfg.max_seq_len)
    self._buf_tokens, self._buf_versions = np.zeros((s, width), np.int32), np.zeros((s, width), np.int32)
    self._buf_logp = np.zeros((s, width), np.float32)
    self._buf_n = np.zeros(s, np.int64)
    self._turns, self._turn = np.arange(s) % 32, 0  # each slot's turn to move its buffer, and this call's
    # Admitted this step, per prefill: ((answer, its index into the draw, its row), first tokens, logprobs, experts
    # of the rows' positions or None, tokens before each row in the prefix cache, each row's row of the arrays).
    self._fresh: list = []
    self._lock = threading.Lock()
    self._waited = 0.0  # seconds this step waited for the device

  # --- inputs ---------------------------------------------------------------------------------------------------

  def validate(self, request: Request) -> None:
    limit = self.engine.cfg.max_seq_len - 1
    if len(request.prompt_ids) > limit:
      raise ValueError(f"group {request.group_id}: prompt of {len(request.prompt_ids)} tokens exceeds the "
                       f"{limit} a sequence may hold before its first answer token (sampler.max_seq_len - 1)")
    vocab = self.engine.model_cfg.vocab_size
    bad = request.prompt_ids[(request.prompt_ids < 0) | (request.prompt_ids >= vocab)]
    if len(bad):
      raise ValueError(f"group {request.group_id}: prompt token {int(bad[0])} outside the vocabulary [0, {vocab})")

  def submit(self, request: Request) -> None:
    self.validate(request)
    n, sp, now = next(self._arrivals), request.sampling, time.monotonic()
    self.waiting.append([
        Sequence(request=request, answer=i, key=request_key(sp.seed, request.group_id, i), order=(n, i), t_submit=now)
        for i in range(request.num_answers)])

  def update_params(self, params, version: int) -> None:
    """Takes effect at the start of the next step; shapes/dtypes are checked here, in the caller's thread."""
    check_compatible(params, self.engine.abstract_params)
    with self._lock:
      self._pending = (params, int(version))

  @property
  def idle(self) -> bool:
    return not (self.running or self.waiting or self.resume or self._inflight)

  @property
  def has_update(self) -> bool:
    return self._pending is not None

  @property
  def next_params(self):
    """The weights the next step generates from: a pending update's, else the current ones."""
    with self._lock:
      return self._pending[0] if self._pending is not None else self.params

  @property
  def next_version(self) -> int:
    """The policy version the next step generates from: a pending update's, else the current one."""
    with self._lock:
      return self._pending[1] if self._pending is not None else self.version

  # --- the step -------------------------------------------------------------------------------------------------

  def step(self) -> list[Sequence]:
    """One scheduling round and one decode call (up to `sampler.decode_steps` tokens per answer); returns the
    answers that finished in the call it read (this step's own, or with `overlap` the previous step's).

    The host reads the device once per call: its tokens together with the first tokens of answers admitted just
    before it (drawn at prefill), so prefill, insert and decode are dispatched back to back. Answers stop on the
    device at EOS or their token budget; a stop sequence is found here, and tokens drawn after it are dropped.
    """
    t0 = time.perf_counter()
    finished = []
    with self._lock:  # taken once: an update that lands later in this step waits for the next one
      update, self._pending = self._pending, None
    if update is not None:
      # The recompute rewrites whole pages, the last partly filled one too: every call in flight is read first, so
      # that the context it recomputes holds every token drawn so far (and no unread call wrote past it).
      finished += self._read_all()
      self._swap_weights(*update)
    t1 = time.perf_counter()
    self._admit()
    budget, stop_eos, ahead = self._budgets()
    self._make_room(budget, ahead)
    dispatched = bool(budget.any() or self._fresh)
    if dispatched:
      # With answers waiting, end the call once an eighth of the slots (at least one) can take them.
      refill_at = max(1, len(budget) // 8) if (self.waiting or self.resume) else 0
      owners = self._occupant.copy()
      drafts = self._propose(budget, ahead) if self.drafter is not None else {}
      self.state, steps = self.engine.generate_steps(self.params, self.state, budget, stop_eos=stop_eos,
                                                     eos_ids=sorted(self.eos_ids), refill_at=refill_at, ahead=ahead,
                                                     **drafts)
      self._inflight.append(_Call(steps=steps, fresh=self._fresh, owners=owners, budget=budget,
                                  version=self.version))
      self._fresh = []
    t2, self._waited = time.perf_counter(), 0.0
    while len(self._inflight) > (1 if self.overlap and dispatched else 0):
      finished += self._read(self._inflight.popleft())
    self.seconds["weight_swap"] += t1 - t0
    self.seconds["host_dispatch"] += t2 - t1
    self.seconds["device_wait"] += self._waited
    self.seconds["host_record"] += time.perf_counter() - t2 - self._waited
    return finished

  def _propose(self, budget: np.ndarray, ahead: np.ndarray) -> dict:
    """`generate_steps`' drafts: for each slot that draws, what the drafter predicts after the tokens it holds, long
    enough to reach past what calls in flight and unread may draw (`ahead`) by one forward's drafts. None if no slot
    has a draft (the plain decode program then runs)."""
    cfg = self.engine.cfg
    drafts = np.full((cfg.num_slots, cfg.draft_width), -1, np.int32)
    draft_at = np.full(cfg.num_slots, -1, np.int32)
    unread = np.where(self._occupant > 0, self.engine.slots.generated - self._known + ahead, 0)
    with self._timed("drafts"):
      for slot in np.flatnonzero(budget > 0).tolist():
        guess = self.drafter.propose(int(self._occupant[slot]), cfg.draft_width,
                                     at_least=int(unread[slot]) + cfg.spec_tokens)
        if len(guess):
          drafts[slot, :len(guess)], draft_at[slot] = guess, self._known[slot]
    return {"drafts": drafts, "draft_at": draft_at} if (draft_at >= 0).any() else {}

  @contextlib.contextmanager
  def _timed(self, part: str):
    t = time.perf_counter()
    try:
      yield
    finally:
      self.seconds[part] += time.perf_counter() - t

  def _tell(self, slot: int, tokens) -> None:
    """Gives the drafter tokens of the answer in `slot` (in order, once each)."""
    if self.drafter is not None and len(tokens):
      with self._timed("drafts"):
        self.drafter.extend(int(self._occupant[slot]), tokens)
      self._known[slot] += len(tokens)

  def _read_all(self) -> list[Sequence]:
    finished = []
    while self._inflight:
      finished += self._read(self._inflight.popleft())
    return finished

  def _read(self, call: _Call) -> list[Sequence]:
    """Records a decode call's tokens (and the first tokens of the answers admitted before it); returns the answers
    that finished."""
    steps, t = call.steps, time.perf_counter()
    tokens, logp, count, experts, firsts, spec = jax.device_get(
        (steps.tokens, steps.log_prob, steps.count, steps.experts, [f[1:5] for f in call.fresh],
         (steps.forwards, steps.drafted_at, steps.accepted_at)))
    self._waited += time.perf_counter() - t
    mine = (call.owners == self._occupant) & (call.owners > 0)  # slots still held by the answer that drew
    count = np.where(mine, count, 0)
    self.engine.slots.advance(count)
    self.counters["decode_calls"] += 1
    self.counters["decode_steps"] += int(count.max(initial=0))
    if spec[0] is not None:
      self._count_drafts(count, *spec)
    finished = []
    for (seqs, *_, array_row), (first_tokens, first_logp, prompt_experts, starts) in zip(call.fresh, firsts):
      for seq, r, row in seqs:
        if seq.slot < 0 or self._occupant[seq.slot] != call.owners[seq.slot]:
          continue
        if prompt_experts is not None:
          seq.routes = [_row_routes(prompt_experts, int(array_row[row]), int(starts[row]), len(seq.prompt))]
        self._tell(seq.slot, [int(first_tokens[r])])
        if self._append(seq, first_tokens[r], first_logp[r], call.version):
          finished.append(seq)
    slots = np.flatnonzero((count > 0) & (call.owners == self._occupant))  # not ended by its first token
    if not len(slots):
      return finished
    if self.drafter is not None:
      for slot in slots.tolist():
        self._tell(slot, tokens[slot, :count[slot]])
    # Where each answer stops, without a stop sequence: the device ends a slot at EOS (when it stops there) and at
    # its budget, so only the call's last token can end it.
    last = tokens[slots, count[slots] - 1]
    eos = self._stop_eos[slots] & np.isin(last, self._eos_array)
    length = self.engine.slots.generated[slots] >= self._limit[slots]  # advanced: tokens drawn, the pending included
    bulk = ~self._has_stop[slots]
    for i in np.flatnonzero(~bulk).tolist():  # token by token: a stop sequence may end the answer anywhere
      slot = int(slots[i])
      seq = self.running[slot]
      for j in range(int(count[slot])):
        if experts is not None:
          seq.routes.append(experts[slot, j:j + 1])
        if self._append(seq, tokens[slot, j], logp[slot, j], call.version):
          finished.append(seq)
          break
    ending = bulk & (eos | length)
    ends, by_eos = slots[ending], eos[ending]
    slots = slots[bulk]
    self._buffer(slots, count[slots], tokens, logp, call.version)
    if experts is not None:
      for slot in slots.tolist():
        self.running[slot].routes.append(experts[slot, :count[slot]])
    now = time.monotonic()
    for slot, at_eos in zip(ends.tolist(), by_eos.tolist()):
      seq = self.running[slot]
      seq.finish_reason, seq.t_finish = ("eos" if at_eos else "length"), now
      self._release(seq)
      finished.append(seq)
    self.counters["tokens"] += int(count[slots].sum())
    return finished

  def _count_drafts(self, count: np.ndarray, forwards, drafted_at, accepted_at) -> None:
    self.counters["spec_forwards"] += int(forwards)
    self.counters["spec_tokens"] += int(count.sum())
    self.counters["spec_drafted"] += int(drafted_at.sum())
    self.counters["spec_accepted"] += int(accepted_at.sum())
    self.spec_drafted_at += drafted_at
    self.spec_accepted_at += accepted_at

  def _buffer(self, slots: np.ndarray, n: np.ndarray, tokens: np.ndarray, logp: np.ndarray, version: int) -> None:
    """Records n[i] tokens of a call's block for each of `slots` in their buffers, in a few numpy operations (a
    buffer about to overflow is moved into its answer's lists first; `_sync` moves the rest when they are read, or
    in turn)."""
    width = self._buf_tokens.shape[1]
    for slot in slots[self._buf_n[slots] + n > width].tolist():
      self._sync(self.running[slot])
    rows = np.repeat(slots, n)
    j = np.arange(len(rows)) - np.repeat(np.cumsum(n) - n, n)  # each token's step within the call
    cols = np.repeat(self._buf_n[slots], n) + j
    self._buf_tokens[rows, cols] = tokens[rows, j]
    self._buf_logp[rows, cols] = logp[rows, j]
    self._buf_versions[rows, cols] = version
    self._buf_n[slots] += n
    # A 32nd of the slots, in turn, moves its buffer into the lists at each call: the moves cost the same every call
    # (slots that started together do not all fill up in the same one).
    due = np.flatnonzero((self._buf_n > 0) & (self._turns == self._turn))
    for slot in due.tolist():
      self._sync(self.running[slot])
    self._turn = (self._turn + 1) % 32

  def _sync(self, seq: Sequence) -> None:
    """Moves the tokens buffered for `seq`'s slot into its lists (`Sequence.sync`)."""
    slot = seq.slot
    k = int(self._buf_n[slot]) if slot >= 0 else 0
    if k:
      self._buf_n[slot] = 0
      seq._tokens += self._buf_tokens[slot, :k].tolist()  # pylint: disable=protected-access
      seq._logprobs += self._buf_logp[slot, :k].tolist()  # pylint: disable=protected-access
      seq._versions += self._buf_versions[slot, :k].tolist()  # pylint: disable=protected-access

  def _budgets(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per slot: the tokens its answer may draw in the next call (what it may still draw, capped by
    `sampler.decode_steps`; a call in flight counts as drawing its whole budget), whether EOS ends it, and the tokens
    calls in flight may still cache for it (`ahead`)."""
    table = self.engine.slots
    ahead = np.zeros(self.engine.cfg.num_slots, np.int64)
    for call in self._inflight:
      ahead += np.where(call.owners == self._occupant, call.budget, 0)
    room = self._limit - table.generated - ahead
    budget = np.where(table.active & (self._occupant > 0), np.clip(room, 0, self.engine.cfg.decode_steps), 0)
    return budget, self._stop_eos.copy(), ahead

  def _append(self, seq: Sequence, token, logprob, version: int) -> bool:
    """Records a token; releases the slot of a finished answer."""
    done = seq.append(int(token), float(logprob), version, eos_ids=self.eos_ids,
                      max_seq_len=self.engine.cfg.max_seq_len)
    self.counters["tokens"] += 1
    if done:
      self._release(seq)
    return done

  def _occupy(self, seq: Sequence, slot: int) -> None:
    sp = seq.request.sampling
    seq.slot = slot
    self.running[slot] = seq
    self._occupant[slot] = next(self._serials)
    self._buf_n[slot] = 0
    if self.drafter is not None:
      with self._timed("drafts"):
        self.drafter.start(int(self._occupant[slot]), seq.prompt)
      self._known[slot] = 0
      self._tell(slot, seq.tokens)
    seq.sync = self._sync
    self._limit[slot] = min(sp.max_new_tokens, self.engine.cfg.max_seq_len - len(seq.prompt))
    self._stop_eos[slot], self._has_stop[slot] = not sp.ignore_eos, bool(sp.stop)

  def _release(self, seq: Sequence, *, finished: bool = True) -> None:
    """Frees the answer's slot; a `finished` answer's tokens join the drafter's histories."""
    self._sync(seq)
    seq.sync = None
    if self.drafter is not None:
      with self._timed("drafts"):
        self.drafter.finish(int(self._occupant[seq.slot]), keep=finished)
    if self.engine.cfg.prefix_cache:  # its full pages stay for a prompt that extends it (an agent's next turn)
      self.engine.slots.release(seq.slot, tokens=np.concatenate([seq.prompt, np.asarray(seq.tokens, np.int32)]))
    else:
      self.engine.free_resource(seq.slot)
    del self.running[seq.slot]
    self._occupant[seq.slot] = 0
    seq.slot = -1

  def _swap_weights(self, params, version: int) -> None:
    """Generates from `params` (policy `version`) from now on, recomputing every running answer's cache under them
    (`sampler.recompute_on_swap`); no decode call may be in flight."""
    assert not self._inflight, "a weight swap with a decode call unread"
    self.params, self.version = params, version
    self.counters["weight_updates"] += 1
    self.engine.slots.forget_prefixes()
    if not self.engine.cfg.recompute_on_swap:
      return
    seqs = list(self.running.values())
    written: set = set()
    shard_of = self.engine.slots.shard_of
    for batch in self._batches(seqs, lambda s: len(s.context()), lambda s: shard_of(s.slot)):
      prefix, _ = self._prefill([[s] for s in batch], [shard_of(s.slot) for s in batch], draw=False)
      self.state = self.engine.rewrite(prefix, self.state, [(row, s.slot) for row, s in enumerate(batch)], written)
      self.counters["recomputed"] += len(batch)

  def _next_unit(self) -> list[Sequence] | None:
    if self.resume:
      return [self.resume[0][1]]
    if self.waiting:
      return self.waiting[0]
    return None

  def _admit(self) -> None:
    eng, table = self.engine, self.engine.slots
    free_slots = [table.free_slots(s) for s in range(eng.num_shards)]
    planned = [0] * eng.num_shards  # pages the plan allocates, per shard
    free_pages = lambda s: table.free_pages(s) - planned[s]
    # (answers, slots, shard, cached pages that hold the context's start); each unit is one prefill row.
    plan: list[tuple[list[Sequence], list[int], int, list[int]]] = []
    while (unit := self._next_unit()) is not None:
      context = unit[0].context()
      reuse = (len(context) - 1) // table.page_size if eng.cfg.prefix_cache else 0  # leave a token to prefill
      hits = [table.longest_match(s, context, reuse) if reuse and free_slots[s] else 0 for s in range(eng.num_shards)]
      shard = max(range(eng.num_shards), key=lambda s: (bool(free_slots[s]), hits[s], len(free_slots[s]),
                                                        free_pages(s)))
      cached = table.match(shard, context, reuse) if hits[shard] else []
      length = len(context) - len(cached) * table.page_size
      # Pages to grow into during one decode call per answer, unless nothing runs.
      headroom = eng.pages_ahead if (self.running or plan) else 0
      k = min(len(unit), len(free_slots[shard]))
      while k and table.pages_to_insert(length, k) + headroom * k > free_pages(shard):
        k -= 1
      if not k:
        table.unpin(shard, cached)
        break
      if self.resume and unit[0] is self.resume[0][1]:
        heapq.heappop(self.resume)
      elif k == len(unit):
        self.waiting.popleft()
      else:
        self.waiting[0] = unit[k:]
      plan.append((unit[:k], free_slots[shard][:k], shard, cached))
      del free_slots[shard][:k]
      planned[shard] += table.pages_to_insert(length, k)

    # By the tokens to prefill; rows after few cached pages and after many share a call (and its compiled program).
    for batch in self._batches(plan, lambda u: len(u[0][0].context()) - len(u[3]) * table.page_size,
                               lambda u: u[2]):
      prefix, first = self._prefill([seqs for seqs, *_ in batch], [shard for _, _, shard, _ in batch],
                                    cached=[(shard, c) for _, _, shard, c in batch])
      placements, drawn = [], []
      for row, (seqs, slots, _, cached) in enumerate(batch):
        # Preempted answers resume with their last token pending; new ones with the token drawn at prefill.
        resumed = bool(seqs[0].tokens)
        for seq, slot in zip(seqs, slots):
          self._occupy(seq, slot)
        if not resumed:
          drawn += [(seq, int(prefix.draw_index[row, i]), row) for i, seq in enumerate(seqs)]
        placements.append(Placement(row=row, slots=tuple(slots), answers=tuple(range(len(seqs))),
                                    pending=tuple(s.tokens[-1] if resumed else -1 for s in seqs),
                                    generated=tuple(max(1, len(s.tokens)) for s in seqs), cached=tuple(cached)))
      self.counters["prefill_rows"] += len(batch)
      self.counters["prefill_tokens"] += int(np.sum(prefix.true_length))
      self.counters["cached_tokens"] += int(np.sum(prefix.start))
      self.state = eng.insert_many(prefix, self.state, placements)
      if drawn:
        experts = prefix.arrays.experts if eng.cfg.record_routes else None
        self._fresh.append((drawn, first.tokens, first.log_prob, experts, prefix.start, prefix.array_row))

  def _prefill(self, units: list[list[Sequence]], shards: list[int], draw: bool = True, cached=()):
    """One batched prefill; row b is the shared context of units[b], prefilled on data shard `shards[b]` (its slots'),
    drawing a first token per answer (or none: a recompute), after `cached[b]` = (shard, pages) already in the pool,
    if given."""
    return self.engine.prefill_batch(self.params, [u[0].context() for u in units], [
        Draws.of([s.key for s in u] if draw else np.zeros((0, 2)), u[0].request.sampling) for u in units],
        shards=shards, cached=cached, decode_state=self.state)

  def _batches(self, items: list, length_of, shard_of) -> list[list]:
    """Items grouped by prefill bucket, in batches that give each data shard at most sampler.max_prefill_tokens of
    rows (a power of two of them, padded), every shard's items taken in turn."""
    budget = self.engine.cfg.prefill_budget
    by_bucket = collections.defaultdict(lambda: collections.defaultdict(list))
    for item in items:
      by_bucket[self.engine.bucket(length_of(item))][shard_of(item)].append(item)
    batches = []
    for bucket, by_shard in sorted(by_bucket.items()):
      rows = max(1, budget // bucket)
      rows = 1 << (rows.bit_length() - 1)  # largest power of two within the budget
      for i in range(0, max(map(len, by_shard.values())), rows):
        batches.append([item for shard in sorted(by_shard) for item in by_shard[shard][i:i + rows]])
    return batches

  def _make_room(self, budget: np.ndarray, ahead: np.ndarray) -> None:
    """Preempts the youngest answers of each shard until the pages this step's decode call writes into (`budget`
    tokens per slot, after the `ahead` of calls in flight) fit; a preempted answer's budget becomes 0 (tokens it drew
    in a call in flight are dropped: it draws them again when it resumes)."""
    table = self.engine.slots
    demand = table.demand(budget + ahead)
    for shard in [s for s in range(self.engine.num_shards) if demand[s] > table.free_pages(s)]:
      youngest = sorted((seq for slot, seq in self.running.items() if table.shard_of(slot) == shard),
                        key=lambda s: s.order, reverse=True)
      for victim in youngest:
        if table.demand(budget + ahead)[shard] <= table.free_pages(shard):
          break
        budget[victim.slot] = 0
        # Admitted in this step, its first token unread: it restarts as new (same draw).
        self._release(victim, finished=False)
        victim.preemptions += 1
        heapq.heappush(self.resume, (victim.order, victim))
        self.counters["preemptions"] += 1


def _row_routes(experts: np.ndarray, row: int, start: int, length: int) -> np.ndarray:
  """The routing of a prefill row's `length` positions, [length, sparse layers, k]: -1 for the first `start` (in the
  prefix cache, not computed), then the prefill's `experts` [sparse layers, rows, T, k]."""
  out = np.full((length, experts.shape[0], experts.shape[3]), -1, np.int16)
  out[start:] = np.swapaxes(experts[:, row, :length - start], 0, 1)
  return out
