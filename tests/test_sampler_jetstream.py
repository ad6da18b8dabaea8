"""The engine against JetStream's engine contract (`areal_jax.sampler.engine_api`): members and argument names, the
packed result layout, a pytree prefix, full slots, late frees, and an orchestrator with JetStream's three threads."""

import inspect
import queue
import random
import threading

import jax
import numpy as np
import pytest

from areal_jax.sampler import Engine, SamplerConfig, engine_api, generate
from helpers import TINY, tiny_model

MAX_SEQ = 32


@pytest.fixture(scope="module")
def model():
  return tiny_model(TINY, seed=7)


@pytest.fixture(scope="module")
def engine(model):
  # The pool holds every slot at full length: a JetStream orchestrator cannot preempt.
  cfg = SamplerConfig(num_slots=8, page_size=4, num_pages=8 * (MAX_SEQ // 4) + 1, max_seq_len=MAX_SEQ,
                      max_new_tokens=MAX_SEQ, decode_steps=4)
  return Engine(model=model, config=cfg)


def test_every_member_with_the_contract_s_arguments(engine):
  assert isinstance(engine, engine_api.Engine)  # instantiable: no abstract member is left
  for name, member in vars(engine_api.Engine).items():
    if name.startswith("_") or not callable(member) and not isinstance(member, property):
      continue
    if isinstance(member, property):
      assert isinstance(getattr(type(engine), name), property), name
      getattr(engine, name)
      continue
    ours = inspect.signature(getattr(type(engine), name)).parameters
    theirs = inspect.signature(member).parameters
    if any(p.kind == p.VAR_POSITIONAL for p in theirs.values()):
      continue  # load_params(*args, **kwargs), init_decode_state(*args, **kwargs): the engine's own arguments
    assert [(p.name, p.kind) for p in ours.values()] == [(p.name, p.kind) for p in theirs.values()], name
  assert engine.max_concurrent_decodes == 8 and engine.samples_per_slot == 1
  assert engine.max_prefill_length == MAX_SEQ - 1 and engine.mesh.shape["data"] == 1
  with pytest.raises(NotImplementedError, match="existing_prefix"):
    engine.prefill(params=None, existing_prefix=object(), padded_tokens=np.ones(4), true_length=2)


def test_prefix_is_a_pytree_that_moves_and_full_slots_report_done(model, engine):
  params = engine.load_params(model)
  state = engine.init_decode_state()
  prompt = np.arange(2, 2 + MAX_SEQ - 3, dtype=np.int32)  # room for 3 tokens: the first and two more
  prefix, first = engine.prefill(params=params, padded_tokens=np.pad(prompt, (0, 3)), true_length=len(prompt),
                                 request_id="r0")
  moved = jax.device_put(prefix, engine.get_prefix_destination_sharding())
  assert jax.tree.structure(moved) == jax.tree.structure(prefix)
  state = engine.insert(moved, state, 5, request_id="r0")
  tokens, valid, lengths = [int(first.get_result_at_slot(0).tokens[0, 0])], [], []
  for _ in range(4):
    state, result = engine.generate(params, state)
    result.copy_to_host_async()
    row = result.convert_to_numpy().get_result_at_slot(5)
    valid.append(bool(row.valid[0, 0]))
    lengths.append(int(row.lengths[0]))
    if valid[-1]:
      tokens.append(int(row.tokens[0, 0]))
  assert valid == [True, True, False, False] and lengths == [2, 3, 3, 3]  # then the cache is full: done
  ref = generate(model, [prompt], max_new_tokens=3, temperature=0.0)[0][0]
  assert tokens == list(ref.tokens)
  engine.free_resource(5)
  engine.slots.check()


def test_a_free_that_arrives_after_the_next_insert_is_ignored(model, engine):
  params = engine.load_params(model)
  state = engine.init_decode_state()
  a, _ = engine.prefill(params=params, padded_tokens=np.arange(2, 11), true_length=9)
  b, _ = engine.prefill(params=params, padded_tokens=np.arange(3, 9), true_length=6)
  state = engine.insert(a, state, 2)
  state = engine.insert(b, state, 2)  # a is done; its free has not come yet
  engine.free_resource(2)  # a's free, late: b keeps its pages
  assert engine.slots.active[2] and engine.slots.cached[2] == 6
  state, _ = engine.generate(params, state)
  engine.free_resource(2)
  engine.free_resource(2)
  engine.slots.check()
  assert not engine.slots.active.any() and engine.slots.pool.num_free(0) == engine.slots.pool.capacity


def _orchestrate(engine, params, requests):
  """JetStream's orchestration, reduced: a prefill thread, a generate thread (inserts into free slots, then one
  generate per loop) and a detokenize thread that completes answers at their length, puts the slot back on the free
  list and only then frees it. For half the answers the free waits until the generate thread has inserted a new
  answer into the slot (its first token arrives), so the stale free is exercised on every run, not by chance."""
  transfer, detok, free_slots = queue.Queue(maxsize=4), queue.Queue(maxsize=8), queue.Queue()
  for s in range(engine.max_concurrent_decodes):
    free_slots.put(s)
  out = [[] for _ in requests]
  complete = [False] * len(requests)
  remaining = [len(requests)]
  finished, errors = threading.Event(), []

  def guard(fn):
    def run():
      try:
        fn()
      except Exception as e:  # pylint: disable=broad-except  # reported by the test
        errors.append(e)
        finished.set()
    return run

  @guard
  def prefill():
    for i, (prompt, _) in enumerate(requests):
      padded = np.pad(prompt, (0, 16 - len(prompt)))
      prefix, first = engine.prefill(params=params, padded_tokens=padded, true_length=len(prompt))
      while not finished.is_set():
        try:
          transfer.put((i, prefix, first), timeout=0.1)
          break
        except queue.Full:
          pass

  @guard
  def generate_loop():
    state = engine.init_decode_state()
    live = {}
    while not finished.is_set():
      while True:
        try:
          slot = free_slots.get_nowait()
        except queue.Empty:
          break
        try:
          i, prefix, first = transfer.get(timeout=0.001)
        except queue.Empty:
          free_slots.put(slot)
          break
        state = engine.insert(prefix, state, slot)
        live[slot] = i
        detok.put(("first", {slot: i}, first))
      state, result = engine.generate(params, state)
      result.copy_to_host_async()
      detok.put(("step", dict(live), result))

  @guard
  def detokenize():
    rng = random.Random(0)
    deferred = set()  # slots back on the free list whose free waits for the next insert into them
    while remaining[0]:
      kind, mapping, result = detok.get()
      result = result.convert_to_numpy()
      for slot, i in mapping.items():
        if kind == "first" and slot in deferred:  # a new answer is in the slot: the late free must not touch it
          deferred.discard(slot)
          engine.free_resource(slot)
        if complete[i]:
          continue
        row = result.get_result_at_slot(0 if kind == "first" else slot)
        if row.valid[0, 0]:
          out[i].append(int(row.tokens[0, 0]))
        if int(row.lengths[0]) >= requests[i][1] or not row.valid[0, 0]:
          complete[i] = True
          remaining[0] -= 1
          free_slots.put(slot)
          if rng.random() < 0.5:
            deferred.add(slot)
          else:
            engine.free_resource(slot)
    finished.set()
    for slot in deferred:  # never filled again
      engine.free_resource(slot)

  threads = [threading.Thread(target=f, daemon=True) for f in (prefill, generate_loop, detokenize)]
  for t in threads:
    t.start()
  finished.wait(300)
  for t in threads:
    t.join(30)
  if errors:
    raise errors[0]
  assert all(complete), f"{sum(complete)} of {len(requests)} complete"
  return out


def test_an_orchestrator_with_three_threads_matches_generate(model, engine):
  rng = np.random.default_rng(0)
  requests = [(rng.integers(2, TINY.vocab_size, size=int(rng.integers(2, 13))).astype(np.int32),
               int(rng.integers(1, 7))) for _ in range(1500)]
  params = engine.load_params(model)
  replaced = engine.slots.replaced
  out = _orchestrate(engine, params, requests)
  assert engine.slots.replaced - replaced >= 100  # inserts that landed before the free (about a third of 1500)
  for n in sorted({m for _, m in requests}):
    idx = [i for i, (_, m) in enumerate(requests) if m == n]
    ref = generate(model, [requests[i][0] for i in idx], max_new_tokens=n, temperature=0.0)
    assert [out[i] for i in idx] == [list(r[0].tokens) for r in ref], n
  engine.slots.check()
  assert not engine.slots.active.any() and engine.slots.pool.num_free(0) == engine.slots.pool.capacity
