"""Page pool reference counting, no leaks after thousands of requests, and preemption that completes every request
with the tokens an unconstrained pool gives."""

import types

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import create
from areal_jax.sampler import Engine, PagePool, PoolExhausted, Request, SamplerConfig, SamplingParams, Scheduler
from areal_jax.sampler.slots import Placement, SlotTable
from areal_jax.sampler.state import DecodeSteps
from helpers import TINY, tiny_model

CFG = TINY



def test_pool_refcounts():
  pool = PagePool(num_shards=2, pages_per_shard=6)
  assert pool.capacity == 5
  a = pool.alloc(1, 3)
  assert 0 not in a and pool.num_free(1) == 2 and pool.num_free(0) == 5
  pool.retain(1, a[:2], times=2)
  pool.release(1, a)
  assert pool.num_free(1) == 3 and pool.refcount(1, a[0]) == 2
  with pytest.raises(PoolExhausted, match="shard 1 has 3 free pages, 4 needed"):
    pool.alloc(1, 4)
  assert pool.num_free(1) == 3  # nothing taken by the failed call
  pool.release(1, a[:2])
  pool.release(1, a[:2])
  pool.check()
  assert pool.num_free(1) == 5
  with pytest.raises(ValueError, match="released more often"):
    pool.release(1, a[:1])


def test_slot_table_inserts_into_free_slots_only():
  table = SlotTable(num_slots=4, num_shards=2, pages_per_shard=6, page_size=4, max_seq_len=16)
  table.occupy([Placement.new(0, [1])], [6])
  held = list(table.pages[1])
  with pytest.raises(ValueError, match="slot 1 is in use; release it before inserting"):
    table.occupy([Placement.new(0, [0, 1])], [5])
  assert not table.active[0] and table.pages[1] == held and table.pool.num_free(0) == 5 - 2  # nothing taken
  table.release(1)
  table.release(1)  # idempotent
  table.occupy([Placement.new(0, [1])], [5])
  table.release(1)
  table.check()
  assert table.pool.num_free(0) == table.pool.capacity


class FakePrograms:
  """Device functions replaced by host stand-ins: random tokens (EOS = 1 now and then), no arrays touched."""

  def __init__(self, num_slots, decode_steps, seed, data):
    self.rng = np.random.default_rng(seed)
    self.data = data
    self.s, self.decode_steps = num_slots, decode_steps
    self.attention = "jax"

  def prefill(self, params, tokens, lengths, rows, sharded=False):
    per = len(tokens) // self.data if sharded else 0  # [layers, B, T]: only the shape and layout are read
    return types.SimpleNamespace(k=np.zeros((1,) + tokens.shape), rows_per_shard=per), None

  def sample(self, logits, keys, index, temperature, top_p, top_k):
    return self.rng.integers(1, 64, self.s).astype(np.int32), np.zeros(self.s, np.float32)

  def insert(self, state, prefix, first, chunks, upd):
    return state

  def decode(self, params, state, budget, stop_eos, eos, grow, refill_at):
    tokens = self.rng.integers(1, 64, (self.s, self.decode_steps)).astype(np.int32)
    ends = stop_eos[:, None] & np.isin(tokens, eos)
    first_end = np.where(ends.any(1), ends.argmax(1) + 1, self.decode_steps)
    count = np.minimum(budget, first_end).astype(np.int32)
    if refill_at > 0:  # the call ends after the step at which `refill_at` slots have stopped
      stops = np.sort(count[budget > 0])
      if len(stops) >= refill_at:
        count = np.minimum(count, stops[refill_at - 1])
    return state, DecodeSteps(tokens=tokens, log_prob=np.zeros(tokens.shape, np.float32), count=count)


@pytest.mark.parametrize("data,groups,decode_steps", [(1, 500, 1), (2, 1000, 6)])
def test_thousands_of_requests_leave_no_page_behind(data, groups, decode_steps):
  """The host side alone (allocator, slot table, admission, preemption) over thousands of answers of random
  lengths, on one and on two data shards."""
  model = nnx.eval_shape(lambda: create(CFG))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:data]).reshape(data, 1), ("data", "tensor"))
  cfg = SamplerConfig(num_slots=8, page_size=4, num_pages=data * 16, max_seq_len=48, max_prefill_tokens=64,
                      decode_steps=decode_steps)
  engine = Engine(model=model, config=cfg, mesh=mesh)
  engine.programs = FakePrograms(cfg.num_slots, decode_steps, seed=data, data=data)
  sched = Scheduler(engine=engine, params=None, eos_ids=[1])
  sched.state = None
  rng = np.random.default_rng(0)
  expected = {}
  for g in range(groups):
    n = int(rng.integers(1, 4))
    expected[g] = n
    sched.submit(Request(group_id=g, prompt_ids=rng.integers(2, 64, size=rng.integers(1, 30)), num_answers=n,
                         sampling=SamplingParams(max_new_tokens=int(rng.integers(1, 40)))))
  done = {}
  steps = 0
  while not sched.idle:
    for seq in sched.step():
      done.setdefault(seq.request.group_id, []).append(seq)
      assert seq.finish_reason in ("eos", "length")
      assert len(seq.tokens) <= seq.request.sampling.max_new_tokens
      assert len(seq.prompt) + len(seq.tokens) <= cfg.max_seq_len
    steps += 1
    if steps % 97 == 0:
      engine.slots.pool.check()
      # A slot holds the pages its cached tokens fill, and one call's more (two with a call in flight).
      ahead = decode_steps * (1 + len(sched._inflight))  # pylint: disable=protected-access
      for slot, seq in sched.running.items():
        held, length = len(engine.slots.pages[slot]), engine.slots.cached[slot]
        assert -(-length // cfg.page_size) <= held <= -(-(length + ahead) // cfg.page_size)
  assert sum(expected.values()) > groups
  assert {g: len(v) for g, v in done.items()} == expected
  assert sched.counters["preemptions"] > 0
  engine.slots.pool.check()
  for shard in range(data):
    assert engine.slots.pool.num_free(shard) == engine.slots.pool.capacity
  assert not engine.slots.active.any()


def test_preemption_with_a_tiny_pool_gives_the_same_tokens():
  model = tiny_model(CFG, seed=7)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(2, 64, size=rng.integers(2, 12)) for _ in range(6)]
  sampling = [SamplingParams(temperature=t, max_new_tokens=18, seed=3) for t in (0.0, 1.0)]

  def run(num_pages):
    cfg = SamplerConfig(num_slots=4, page_size=4, num_pages=num_pages, max_seq_len=32, max_prefill_tokens=32)
    engine = Engine(model=model, config=cfg)
    sched = Scheduler(engine=engine, params=engine.load_params(model))
    for g, p in enumerate(prompts):
      sched.submit(Request(group_id=g, prompt_ids=p, num_answers=2, sampling=sampling[g % 2]))
    out = {}
    while not sched.idle:
      out.update({(s.request.group_id, s.answer): s for s in sched.step()})
    engine.slots.pool.check()
    assert engine.slots.pool.num_free(0) == engine.slots.pool.capacity
    return out, sched.counters["preemptions"]

  big, big_preempted = run(num_pages=33)  # every slot can hold a full sequence
  small, small_preempted = run(num_pages=9)  # one full sequence (8 pages) + scratch
  assert big_preempted == 0 and small_preempted > 0
  assert sorted(big) == sorted(small) and len(big) == 12
  for key in big:
    assert small[key].tokens == big[key].tokens
    np.testing.assert_allclose(small[key].logprobs, big[key].logprobs, atol=1e-5)
  assert any(s.preemptions for s in small.values())
