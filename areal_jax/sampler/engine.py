"""The sampling engine, in JetStream's Engine API vocabulary, over a paged KV cache.

    engine = Engine(model=model, config=SamplerConfig(...), mesh=mesh)
    params = engine.load_params(model)
    state = engine.init_decode_state()
    prefix, first = engine.prefill(params, padded_tokens, true_length, keys=keys)  # G keys -> G first tokens
    state = engine.bulk_insert(prefix, state, slots)  # the G answers share the prompt's full pages
    state, result = engine.generate(params, state)  # one token for every active slot
    state, steps = engine.generate_steps(params, state, budget)  # up to budget[s] tokens per slot, one device call
    engine.advance(jax.device_get(steps.count))
    engine.free_resource(slot)

The engine owns the host-side bookkeeping of its slots (pages held, tokens cached, active) and the page pool; the
device work is in `programs.py`. Slots are split evenly over the mesh's data shards, and a slot only holds pages of
its own shard. `generate`/`generate_steps` raise `PoolExhausted` before touching the device when the slots need new
pages and their shard has too few left; the caller (the scheduler) preempts a sequence and retries.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax.models.config import ModelConfig
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.paging import SCRATCH_PAGE, PagePool, PoolExhausted
from areal_jax.sampler.programs import Chunks, SlotUpdate, build_programs
from areal_jax.sampler.state import (DecodeState, DecodeSteps, Prefix, ResultTokens, decode_state_shapes,
                                     decode_state_shardings, page_bytes)
from areal_jax.sharding import SAMPLER_RULES, make_mesh, state_shardings
from areal_jax.system.weight_sync import cast, check_compatible, with_dtype


MAX_EOS_IDS = 8  # `generate_steps` takes up to this many EOS ids (padded: one compiled decode program)


def _pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def pages_per_shard(model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Mesh, *, param_bytes_per_device: int = 0,
                    free_bytes: int | None = None) -> int:
  """Pages each data shard owns: `num_pages / data`, or, with num_pages = 0, what `memory_fraction` of one device's
  free memory holds after the parameters (`free_bytes`, else from the device's memory stats; on CPU, the host's
  available memory split over all devices), capped at what the shard's slots can use."""
  data = mesh.shape["data"]
  cap = cfg.num_slots // data * cfg.pages_per_seq + 1
  if cfg.num_pages:
    n = cfg.num_pages // data
  else:
    if free_bytes is None:
      stats = mesh.devices.flat[0].memory_stats()
      if stats and "bytes_limit" in stats:
        free_bytes = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
      else:
        free_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(1, len(jax.devices()))
    free_bytes -= param_bytes_per_device
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


class Engine:

  def __init__(self, *, model: nnx.Module, config: SamplerConfig, mesh: Mesh | None = None):
    """`model` gives the graph and parameter shapes only (an abstract `nnx.eval_shape` model works); parameters are
    passed to `prefill`/`generate`, their floating leaves in `config.param_dtype` whatever the model's own dtype. The
    default mesh is the first device (data 1 x tensor 1)."""
    self.cfg = config
    self.model_cfg: ModelConfig = model.cfg
    self.mesh = mesh or make_mesh(jax.devices()[:1], {"data": 1, "tensor": 1})
    if set(self.mesh.axis_names) != {"data", "tensor"}:
      raise ValueError(f"sampler mesh axes {self.mesh.axis_names}: expected ('data', 'tensor')")
    self.num_shards = self.mesh.shape["data"]
    if config.num_slots % self.num_shards:
      raise ValueError(f"sampler.num_slots={config.num_slots} not divisible by the mesh's data axis "
                       f"({self.num_shards})")
    if config.max_seq_len > self.model_cfg.max_position_embeddings:
      raise ValueError(f"sampler.max_seq_len={config.max_seq_len} exceeds model.max_position_embeddings="
                       f"{self.model_cfg.max_position_embeddings}")
    self.graphdef, abstract = nnx.split(model)
    self.param_dtype = config.weight_dtype
    self.abstract_params = with_dtype(abstract, self.param_dtype)
    self.param_shardings = state_shardings(abstract, self.mesh, SAMPLER_RULES)
    # The KV pool (num_pages=0) gets what is left beside weights of param_dtype: bfloat16 leaves it more.
    param_bytes = param_bytes_per_device(self.abstract_params, self.mesh)
    self.pages_per_shard = pages_per_shard(self.model_cfg, config, self.mesh, param_bytes_per_device=param_bytes)
    self.num_pages = self.pages_per_shard * self.num_shards
    self.pool = PagePool(num_shards=self.num_shards, pages_per_shard=self.pages_per_shard)
    self.programs = build_programs(self.graphdef, self.model_cfg, config, self.mesh)
    self.state_shardings = decode_state_shardings(self.model_cfg, self.mesh)
    s = config.num_slots
    self.slots_per_shard = s // self.num_shards
    self.slot_pages: list[list[int]] = [[] for _ in range(s)]
    self.slot_length = np.zeros(s, np.int64)  # tokens whose keys/values are cached
    self.active = np.zeros(s, bool)
    p = config.page_size
    self.min_bucket = -(-config.min_prefill_len // p) * p
    self._zeros = None

  # --- JetStream Engine API ------------------------------------------------------------------------------------

  def load_params(self, params) -> nnx.State:
    """Parameters (an NNX model or its state) cast to the engine's `param_dtype`, checked against the engine's and
    placed on the sampler's shardings."""
    if isinstance(params, nnx.Module):
      params = nnx.state(params)
    params = cast(params, self.param_dtype)
    check_compatible(params, self.abstract_params)
    return jax.device_put(params, self.param_shardings)

  def init_decode_state(self) -> DecodeState:
    """An empty cache and slot table (all slots idle) on the sampler's shardings."""
    if self._zeros is None:
      shapes = decode_state_shapes(self.model_cfg, self.cfg, self.num_pages)
      self._zeros = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes),
                            out_shardings=self.state_shardings)
    state = self._zeros()
    for slot in np.flatnonzero(self.active):
      self.free_resource(int(slot))
    return state

  def prefill(self, params, padded_tokens, true_length: int, *, keys=None, temperature: float = 0.0,
              top_p: float = 1.0, top_k: int = -1) -> tuple[Prefix, ResultTokens]:
    """One prompt; `keys` [G, 2] uint32 (one PRNG key per answer, default one zero key) draw G first tokens with
    the given sampling settings (default greedy). The result's arrays have shape [G]."""
    padded_tokens = np.asarray(padded_tokens)
    keys = np.zeros((1, 2), np.uint32) if keys is None else np.asarray(keys, np.uint32)
    prefix, result = self.prefill_batch(params, [padded_tokens[:true_length]], keys=[keys],
                                        sampling=[(temperature, top_p, top_k)])
    return prefix, jax.tree.map(lambda x: x[:len(keys)], result)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, **kw) -> DecodeState:
    return self.bulk_insert(prefix, decode_state, [slot], **kw)

  def bulk_insert(self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int], *, row: int = 0,
                  answers: Sequence[int] | None = None, pending: Sequence[int] | None = None,
                  index: Sequence[int] | None = None) -> DecodeState:
    """Inserts prefix row `row` into `slots`; slot i continues answer `answers[i]` (default i) of that row.

    Full pages of the prefix are written once per data shard and shared by reference count; a partial last page is
    copied per slot. `pending` overrides the first tokens (a resumed sequence: its last generated token) and `index`
    the number of tokens the answers have generated (default 1, the first token).
    """
    answers = list(range(len(slots))) if answers is None else list(answers)
    pending = [-1] * len(slots) if pending is None else list(pending)
    index = [1] * len(slots) if index is None else list(index)
    return self.insert_many(prefix, decode_state, [(row, list(slots), answers, pending, index)])

  def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
    """One decode step of every active slot; allocates the pages the step writes into first."""
    act = self.active.copy()
    lengths = self.slot_length + 2
    decode_state, steps = self.generate_steps(params, decode_state, act.astype(np.int32))
    self.advance(act.astype(np.int32))
    return decode_state, ResultTokens(tokens=steps.tokens[:, 0], valid=act, lengths=lengths,
                                      log_prob=steps.log_prob[:, 0])

  def generate_steps(self, params, decode_state: DecodeState, budget: np.ndarray, *,
                     stop_eos: np.ndarray | None = None, eos_ids: Sequence[int] = (),
                     refill_at: int = 0) -> tuple[DecodeState, DecodeSteps]:
    """Up to `budget[s]` (at most `sampler.decode_steps`) tokens for every active slot s in one device call; a slot
    with `stop_eos[s]` stops early once it draws one of `eos_ids` (its pending token is never cached then). With
    `refill_at` > 0 the call ends as soon as that many slots have stopped, so that waiting answers can take them.

    Pages for the whole budget are allocated first (`PoolExhausted` if a shard lacks them). The device decides how
    many tokens each slot drew, so the caller reads `DecodeSteps.count` and passes it to `advance` before the next
    call.
    """
    cfg = self.cfg
    budget = np.where(self.active, np.minimum(np.asarray(budget, np.int64), cfg.decode_steps), 0)
    over = np.flatnonzero(self.slot_length + budget > cfg.max_seq_len)
    if len(over):
      raise ValueError(f"slot {over[0]} holds {self.slot_length[over[0]]} tokens; {budget[over[0]]} more exceed the "
                       f"cache length sampler.max_seq_len={cfg.max_seq_len}")
    if len(eos_ids) > MAX_EOS_IDS:
      raise ValueError(f"{len(eos_ids)} EOS ids; at most {MAX_EOS_IDS}")
    grow = self._grow(budget)
    stop = np.zeros(cfg.num_slots, bool) if stop_eos is None else np.asarray(stop_eos, bool)
    eos = np.full(MAX_EOS_IDS, -1, np.int32)
    eos[:len(eos_ids)] = list(eos_ids)
    return self.programs.decode(params, decode_state, budget.astype(np.int32), stop, eos, grow, np.int32(refill_at))

  def advance(self, count: np.ndarray) -> None:
    """Records that active slots cached `count[s]` more tokens (what a `generate_steps` call reported)."""
    self.slot_length += np.where(self.active, np.asarray(count, np.int64), 0)

  def _new_pages(self, budget: np.ndarray) -> np.ndarray:
    """Per slot: the pages it does not hold yet that `budget[s]` more tokens write into (0 for idle slots)."""
    held = np.array([len(pages) for pages in self.slot_pages], np.int64)
    need = -(-(self.slot_length + budget) // self.cfg.page_size) - held
    return np.where(self.active, np.maximum(0, need), 0)

  def page_demand(self, budget: np.ndarray) -> np.ndarray:
    """New pages per data shard that `budget[s]` more tokens for every active slot s write into."""
    return self._per_shard(self._new_pages(budget))

  def _per_shard(self, per_slot: np.ndarray) -> np.ndarray:
    return np.bincount(np.arange(len(per_slot)) // self.slots_per_shard, weights=per_slot,
                       minlength=self.num_shards).astype(np.int64)

  def _grow(self, budget: np.ndarray) -> np.ndarray:
    """Allocates the pages `budget` needs (all or none); returns the decode program's (slot, column, page) rows."""
    need = self._new_pages(budget)
    demand = self._per_shard(need)
    for shard in range(self.num_shards):
      if demand[shard] > self.pool.num_free(shard):
        raise PoolExhausted(shard, int(demand[shard]), self.pool.num_free(shard))
    s = self.cfg.num_slots
    grow = np.full((3, s * self.pages_ahead), s, np.int32)
    n = 0
    for slot in np.flatnonzero(need):
      for page in self.pool.alloc(self.shard_of(slot), int(need[slot])):
        grow[:, n] = (slot, len(self.slot_pages[slot]), page)
        self.slot_pages[slot].append(page)
        n += 1
    return grow

  @property
  def pages_ahead(self) -> int:
    """The most new pages one slot can need in one `generate_steps` call."""
    return -(-self.cfg.decode_steps // self.cfg.page_size)

  def free_resource(self, slot: int) -> None:
    """Releases the slot's pages (shared ones return to the pool with their last holder) and marks it idle."""
    self.pool.release(self.shard_of(slot), self.slot_pages[slot])
    self.slot_pages[slot] = []
    self.slot_length[slot] = 0
    self.active[slot] = False

  @property
  def max_concurrent_decodes(self) -> int:
    return self.cfg.num_slots

  # --- batched forms and queries used by the scheduler ---------------------------------------------------------

  def shard_of(self, slot: int) -> int:
    return int(slot) // self.slots_per_shard

  def free_slots(self, shard: int) -> list[int]:
    lo = shard * self.slots_per_shard
    return [s for s in range(lo, lo + self.slots_per_shard) if not self.active[s]]

  def pages_to_insert(self, length: int, num_slots: int) -> int:
    """Pages that inserting a prefix of `length` tokens into `num_slots` slots of one shard allocates."""
    full, tail = divmod(int(length), self.cfg.page_size)
    return full + num_slots * (tail > 0)

  def bucket(self, length: int) -> int:
    """Padded prefill length: a power of two (at least min_prefill_len), a whole number of pages, <= the cache."""
    p = self.cfg.page_size
    top = self.cfg.pages_per_seq * p
    return min(top, max(self.min_bucket, -(-_pow2(length) // p) * p))

  def prefill_batch(self, params, sequences: Sequence[np.ndarray], *, keys: Sequence[np.ndarray],
                    sampling: Sequence[tuple[float, float, int]]) -> tuple[Prefix, ResultTokens | None]:
    """Prefills several sequences in one call, padded to the longest one's bucket and rows to a power of two (so
    compiles stay bounded), and draws first tokens: keys[b] [G_b, 2] (G_b may be 0), sampling[b] = (temperature,
    top_p, top_k). The draws (at most num_slots in all) come back flat, [num_slots], in row-major answer order."""
    s = self.cfg.num_slots
    lengths = np.array([len(x) for x in sequences], np.int32)
    too_long = np.flatnonzero(lengths >= self.cfg.max_seq_len)
    if len(too_long) or np.any(lengths < 1):
      i = int(too_long[0]) if len(too_long) else int(np.argmin(lengths))
      raise ValueError(f"sequence of {lengths[i]} tokens cannot be prefilled: it needs 1 to "
                       f"sampler.max_seq_len - 1 = {self.cfg.max_seq_len - 1} tokens")
    num_draws = sum(len(k) for k in keys)
    if num_draws > s:
      raise ValueError(f"{num_draws} answers in one prefill; at most sampler.num_slots={s}")
    t, b = self.bucket(int(lengths.max())), _pow2(len(sequences))
    tokens = np.zeros((b, t), np.int32)
    lens = np.ones(b, np.int32)
    lens[:len(sequences)] = lengths
    rows = np.zeros(s, np.int32)
    draw_keys = np.zeros((s, 2), np.uint32)
    draw = np.zeros((3, s), np.float32)
    draw[1:] = np.array([[1.0], [-1.0]])
    answer_index, settings, r = [], [], 0
    for i, x in enumerate(sequences):
      tokens[i, :len(x)] = x
      answer_index.append(list(range(r, r + len(keys[i]))))
      settings.append([(np.asarray(k, np.uint32), *sampling[i]) for k in keys[i]])
      for k in keys[i]:
        rows[r], draw_keys[r], draw[:, r] = i, k, sampling[i]
        r += 1
    arrays, logits = self.programs.prefill(params, tokens, lens, rows)
    first = result = None
    if num_draws:
      first, log_prob = self.programs.sample(logits, draw_keys, np.zeros(s, np.int32), draw[0], draw[1],
                                             draw[2].astype(np.int32))
      result = ResultTokens(tokens=first, valid=np.arange(s) < num_draws, lengths=lens[rows] + 1, log_prob=log_prob)
    return Prefix(arrays=arrays, true_length=lengths, first=first, answer_index=answer_index,
                  answer_settings=settings), result

  def warmup(self, params, decode_state: DecodeState, max_context: int | None = None) -> DecodeState:
    """Compiles every program the scheduler can call for contexts up to `max_context` tokens (default: the cache
    length): decode, first-token sampling, and prefill + insert for each bucket and power-of-two row count. Runs
    them on dummy inputs that change nothing; do it before timing or serving to avoid compile stalls."""
    top = self.bucket(max_context or self.cfg.max_seq_len - 1)
    t = self.min_bucket
    while True:
      rows = 1
      while rows <= min(self.cfg.num_slots, max(1, self.cfg.prefill_budget // t)):
        prefix, _ = self.prefill_batch(params, [np.ones(t - 1, np.int32)] * rows, keys=[np.zeros((1, 2))] * rows,
                                       sampling=[(1.0, 1.0, -1)] * rows)
        decode_state = self._insert(prefix, decode_state, [], [])
        rows *= 2
      if t >= top:
        break
      t = self.bucket(t + 1)
    decode_state, _ = self.generate_steps(params, decode_state, np.zeros(self.cfg.num_slots, np.int32))
    return decode_state

  def insert_many(self, prefix: Prefix, decode_state: DecodeState, placements) -> DecodeState:
    """One device call for several (row, slots, answers, pending, index) placements of one prefix."""
    p = self.cfg.page_size
    chunks, slots = [], []  # (row, chunk, page, shard); (slot, row, answer, override, length, index)
    # Check everything before allocating anything.
    demand = np.zeros(self.num_shards, np.int64)
    for row, ss, answers, pending, _ in placements:
      for shard in {self.shard_of(s) for s in ss}:
        demand[shard] += self.pages_to_insert(prefix.true_length[row], sum(self.shard_of(s) == shard for s in ss))
      busy = [s for s in ss if self.active[s]]
      if busy:
        raise ValueError(f"slot {busy[0]} is in use; free_resource it before inserting")
      drawn = len(prefix.answer_settings[row])
      if any(not 0 <= a < drawn for a in answers):
        raise ValueError(f"answers {list(answers)} asked of prefix row {row}, which has {drawn} (one PRNG key "
                         f"each at prefill)")
      if prefix.first is None and min(pending) < 0:
        raise ValueError(f"prefix row {row} drew no first tokens; pass the pending tokens")
    for shard in range(self.num_shards):
      if demand[shard] > self.pool.num_free(shard):
        raise PoolExhausted(shard, int(demand[shard]), self.pool.num_free(shard))
    for row, ss, answers, pending, index in placements:
      length = int(prefix.true_length[row])
      full, tail = divmod(length, p)
      for shard in sorted({self.shard_of(s) for s in ss}):
        mine = [i for i, s in enumerate(ss) if self.shard_of(s) == shard]
        shared = self.pool.alloc(shard, full)
        self.pool.retain(shard, shared, len(mine) - 1)
        chunks += [(row, j, page, shard) for j, page in enumerate(shared)]
        for i in mine:
          own = self.pool.alloc(shard, 1) if tail else []
          chunks += [(row, full, page, shard) for page in own]
          slot = ss[i]
          self.slot_pages[slot] = shared + own
          self.slot_length[slot] = length
          self.active[slot] = True
          key, temperature, top_p, top_k = prefix.answer_settings[row][answers[i]]
          slots.append((slot, prefix.answer_index[row][answers[i]], pending[i], length, index[i], key, temperature,
                        top_p, top_k))
    return self._insert(prefix, decode_state, chunks, slots)

  def rewrite(self, prefix: Prefix, decode_state: DecodeState, rows_to_slots: Sequence[tuple[int, int]],
              written: set | None = None) -> DecodeState:
    """Writes prefix rows over the pages that slots already hold (recomputed keys/values after a weight update);
    pages in `written` (shard, page) are skipped and the ones written are added to it."""
    written = set() if written is None else written
    chunks = []
    for row, slot in rows_to_slots:
      shard, n = self.shard_of(slot), -(-int(prefix.true_length[row]) // self.cfg.page_size)
      for j, page in enumerate(self.slot_pages[slot][:n]):
        if (shard, page) not in written:
          written.add((shard, page))
          chunks.append((row, j, page, shard))
    return self._insert(prefix, decode_state, chunks, [])

  def _insert(self, prefix: Prefix, decode_state, chunks, slots) -> DecodeState:
    s, m, p = self.cfg.num_slots, self.cfg.pages_per_seq, self.cfg.page_size
    b, t = prefix.arrays.k[0].shape[:2]
    # Fixed per prefill shape: every full chunk once per shard, plus one tail copy per slot.
    ch = np.zeros((4, b * (t // p) * self.num_shards + s), np.int32)
    ch[3] = -1
    if chunks:
      ch[:, :len(chunks)] = np.array(chunks, np.int32).T
    up = np.zeros((5, s), np.int32)
    up[0] = s
    rows = np.full((s, m), SCRATCH_PAGE, np.int32)
    keys = np.zeros((s, 2), np.uint32)
    samp = np.zeros((3, s), np.float32)
    for i, (slot, src, override, length, index, key, *settings) in enumerate(slots):
      up[:, i] = (slot, src, override, length, index)
      keys[i], samp[:, i] = key, settings
      pages = self.slot_pages[slot]
      rows[i, :len(pages)] = pages
    upd = SlotUpdate(slot=up[0], rows=rows, src=up[1], override=up[2], lengths=up[3], index=up[4], keys=keys,
                     temperature=samp[0], top_p=samp[1], top_k=samp[2].astype(np.int32))
    first = prefix.first if prefix.first is not None else np.zeros(s, np.int32)
    return self.programs.insert(decode_state, prefix.arrays, first, Chunks(*ch), upd)
