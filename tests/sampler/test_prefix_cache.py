"""The prefix cache: a prompt that extends a released sequence (an agent's next turn) is prefilled after the pages
that sequence left, and generates what a full prefill does, on one device and on a data 2 x tensor 2 mesh; pages are
evicted when a shard runs short and dropped with new weights."""

import jax
import numpy as np
import pytest

from areal_jax.sampler import Engine, Request, SamplerConfig, SamplingParams, Scheduler
from areal_jax.sampler.paging import PagePool
from areal_jax.sampler.prefix_cache import PrefixCache
from areal_jax.sharding import make_mesh
from helpers import TINY, tiny_model

PAGE = 4


@pytest.fixture(scope="module")
def model():
  return tiny_model(TINY, seed=7)


def _run(sched, requests):
  for r in requests:
    sched.submit(r)
  out = {}
  while not sched.idle:
    out.update({s.request.group_id: s for s in sched.step()})
  return [out[r.group_id] for r in requests]


def _turns(model, *, prefix_cache, mesh=None, num_pages=66, num_slots=8):
  """Two turns of 6 episodes (temperature 0.8): turn 2's prompt is turn 1's prompt + answer + 3 "tool" tokens."""
  cfg = SamplerConfig(num_slots=num_slots, page_size=PAGE, num_pages=num_pages, max_seq_len=48, max_prefill_tokens=96,
                      prefix_cache=prefix_cache)
  engine = Engine(model=model, config=cfg, mesh=mesh)
  sched = Scheduler(engine=engine, params=engine.load_params(model))
  rng = np.random.default_rng(0)
  sampling = SamplingParams(temperature=0.8, max_new_tokens=12, ignore_eos=True, seed=3)
  first = [Request(group_id=g, prompt_ids=rng.integers(2, 64, size=int(rng.integers(3, 11))), sampling=sampling)
           for g in range(6)]
  one = _run(sched, first)
  second = [Request(group_id=10 + g, sampling=sampling,
                   prompt_ids=np.concatenate([r.prompt_ids, s.tokens, rng.integers(2, 64, size=3)]).astype(np.int32))
            for g, (r, s) in enumerate(zip(first, one))]
  two = _run(sched, second)
  return engine, sched, one + two


@pytest.mark.parametrize("mesh_shape", [None, {"data": 2, "tensor": 2}])
def test_next_turn_reuses_pages_and_samples_as_a_full_prefill(model, mesh_shape):
  mesh = make_mesh(jax.devices()[4:], mesh_shape) if mesh_shape else None
  _, plain, want = _turns(model, prefix_cache=False)
  engine, sched, got = _turns(model, prefix_cache=True, mesh=mesh)
  assert plain.counters["cached_tokens"] == 0
  # Every second-turn prompt starts with its first turn's full pages: prompt + answer less the pending last token.
  cached = sum((len(s.prompt) + len(s.tokens) - 1) // PAGE * PAGE for s in want[:6])
  assert sched.counters["cached_tokens"] >= cached > 0
  assert sched.counters["prefill_tokens"] + sched.counters["cached_tokens"] == plain.counters["prefill_tokens"]
  for g, w in zip(got, want):
    assert g.tokens == w.tokens, g.request.group_id
    np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
  engine.slots.check()
  held = sum(len(engine.slots.prefixes.pages(s)) for s in range(engine.num_shards))
  assert held == len(engine.slots.prefixes) > 0
  engine.slots.forget_prefixes()
  for shard in range(engine.num_shards):
    assert engine.slots.pool.num_free(shard) == engine.slots.pool.capacity


def test_a_tight_pool_evicts_cached_pages_and_preempts_as_without_them(model):
  _, _, want = _turns(model, prefix_cache=False, num_pages=26)
  engine, sched, got = _turns(model, prefix_cache=True, num_pages=26)  # 25 pages for 8 slots of up to 12
  assert sched.counters["preemptions"] > 0 and sched.counters["cached_tokens"] > 0
  assert [g.tokens for g in got] == [w.tokens for w in want]
  engine.slots.check()


def test_new_weights_drop_the_cached_pages(model):
  cfg = SamplerConfig(num_slots=4, page_size=PAGE, num_pages=40, max_seq_len=48, prefix_cache=True)
  engine = Engine(model=model, config=cfg)
  params = engine.load_params(model)
  sched = Scheduler(engine=engine, params=params)
  sampling = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
  prompt = np.arange(2, 12, dtype=np.int32)
  (first,) = _run(sched, [Request(group_id=0, prompt_ids=prompt, sampling=sampling)])
  assert len(engine.slots.prefixes) == (10 + 8 - 1) // PAGE
  sched.update_params(params, version=1)
  turn = np.concatenate([prompt, first.tokens, [5]]).astype(np.int32)
  _run(sched, [Request(group_id=1, prompt_ids=turn, sampling=sampling)])
  assert sched.counters["cached_tokens"] == 0  # the old weights' pages went with them
  _run(sched, [Request(group_id=2, prompt_ids=turn, sampling=sampling)])
  assert sched.counters["cached_tokens"] == (len(turn) - 1) // PAGE * PAGE  # the same prompt again: all but a token
  engine.slots.check()


def test_cache_matches_runs_of_whole_pages_and_evicts_their_ends_first():
  pool = PagePool(num_shards=2, pages_per_shard=8)
  cache = PrefixCache(pool, page_size=2)
  seq = np.array([1, 2, 3, 4, 5, 6, 7], np.int32)
  pages = pool.alloc(0, 3)
  cache.add(0, seq, pages)  # 3 full pages of 2; token 7 is not a page
  pool.release(0, pages)  # the sequence's own references: only the cache holds them now
  assert cache.evictable(0) == 3 and cache.evictable(1) == 0
  assert cache.match(1, seq, 3) == []  # another shard's pages are not this one's
  assert cache.longest(0, [1, 2, 3, 9, 5, 6], 3) == 1  # a run stops at the first page that differs
  got = cache.match(0, seq, 2)  # at most max_pages
  assert got == pages[:2] and pool.refcount(0, pages[0]) == 2  # retained for the caller
  cache.add(0, seq, pool.alloc(0, 3))  # the same tokens again: the cached pages stay, the copies are not kept
  assert len(cache) == 3
  cache.evict(0, need=pool.num_free(0) + 1)  # only the third page is held by the cache alone
  assert len(cache) == 2 and cache.longest(0, seq, 3) == 2
  pool.release(0, got)
  cache.evict(0, need=pool.num_free(0) + 1)  # the run's end goes first: its start stays findable
  assert cache.longest(0, seq, 3) == 1
  cache.clear()
  assert len(cache) == 0 and cache.evictable(0) == 0
