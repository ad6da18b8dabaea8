"""Interruptible, versioned weight updates: every token's logprob equals the learner-path logprob under the weights
of the version it records, also for answers whose cache was recomputed mid-way; the threaded loop end to end."""

import functools
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.models.logprobs import next_token_logprobs
from areal_jax.sampler import Engine, Request, SamplerConfig, SamplerLoop, SamplingParams, Scheduler
from helpers import TINY, tiny_model

CFG = TINY
TEMPERATURE = 0.8



@functools.lru_cache
def _learner_lp(model):
  return jax.jit(lambda t, p, s: next_token_logprobs(model, t, positions=p, segment_ids=s, temperature=TEMPERATURE))


def check_against_learner(models, trajectories):
  """Each response token's logprob vs the packed learner forward under models[its version]."""
  rows = [np.concatenate([t.prompt_ids, t.response_ids]) for t in trajectories]
  tokens = np.concatenate(rows)[None]
  seg = np.concatenate([np.full(len(r), i + 1) for i, r in enumerate(rows)])[None]
  pos = np.concatenate([np.arange(len(r)) for r in rows])[None]
  lps = {v: np.asarray(_learner_lp(m)(tokens, pos, seg))[0] for v, m in models.items()}
  start = 0
  for t, row in zip(trajectories, rows):
    assert np.all(np.diff(t.versions) >= 0)
    for j, (lp, v) in enumerate(zip(t.logprobs, t.versions)):
      want = lps[int(v)][start + len(t.prompt_ids) - 1 + j]
      assert abs(lp - want) < 1e-5, (t.group_id, j, int(v), lp, want)
    start += len(row)


@pytest.fixture(scope="module")
def models():
  return {v: tiny_model(CFG, seed=10 + v) for v in range(3)}


@pytest.fixture(scope="module")
def engine(models):
  cfg = SamplerConfig(num_slots=8, page_size=4, num_pages=72, max_seq_len=40, max_prefill_tokens=64, decode_steps=3)
  return Engine(model=models[0], config=cfg)


def test_update_mid_generation_recomputes_caches(models, engine):
  """Decoding 3 tokens per device call, an update lands at the next call: every token drawn after `update_params`
  records the new version, and its logprob is the new weights'."""
  params = {v: engine.load_params(m) for v, m in models.items()}
  sched = Scheduler(engine=engine, params=params[0], version=0)
  rng = np.random.default_rng(0)
  for g in range(5):
    sched.submit(Request(group_id=g, prompt_ids=rng.integers(2, 64, size=rng.integers(3, 14)), num_answers=2,
                         sampling=SamplingParams(temperature=TEMPERATURE, max_new_tokens=20, seed=1)))
  done, drawn_before = [], {}  # answer -> tokens it had when version v was published
  for step in range(200):
    if step in (2, 4):  # two updates while every answer is mid-way
      version = 1 if step == 2 else 2
      sched.update_params(params[version], version)
      drawn_before.update({(id(s), version): len(s.tokens) for s in sched.running.values()})
    done += sched.step()
    if sched.idle:
      break
  assert sched.counters["weight_updates"] == 2 and sched.counters["recomputed"] >= 8
  assert sched.counters["decode_steps"] > sched.counters["decode_calls"]
  trajectories = [s.trajectory() for s in done]
  assert len(trajectories) == 10
  spans = [set(t.versions.tolist()) for t in trajectories]
  assert sum(s == {0, 1, 2} for s in spans) >= 8  # interrupted twice, continued under each new version
  for seq, t in zip(done, trajectories):
    for version in (1, 2):
      n = drawn_before.get((id(seq), version))
      if n is not None:
        assert np.all(t.versions[n:] >= version) and np.all(t.versions[:n] < version), (t.versions, n, version)
  check_against_learner(models, trajectories)
  engine.slots.pool.check()
  assert engine.slots.pool.num_free(0) == engine.slots.pool.capacity


def test_loop_thread_end_to_end(models, engine):
  params = {v: engine.load_params(m) for v, m in models.items()}
  decoded = []
  loop = SamplerLoop(engine=engine, params=params[0], version=0, eos_ids=[1],
                     detokenize=lambda ids: decoded.append(list(ids)) or " ".join(map(str, ids)))
  sampling = SamplingParams(temperature=TEMPERATURE, max_new_tokens=24, seed=2)
  rng = np.random.default_rng(1)
  with loop:
    for g in range(4):
      loop.submit(Request(group_id=g, prompt_ids=rng.integers(2, 64, size=rng.integers(3, 14)), num_answers=3,
                          sampling=sampling))
    first = loop.get(timeout=120)
    # The learner publishes from its own thread.
    publisher = threading.Thread(target=loop.update_params, args=(params[1], 1))
    publisher.start()
    publisher.join()
    loop.submit(Request(group_id=4, prompt_ids=[5, 6, 7], num_answers=2, sampling=sampling))
    out = [first] + [loop.get(timeout=120) for _ in range(4 * 3 + 2 - 1)]
    with pytest.raises(ValueError, match="prompt of 40 tokens"):
      loop.submit(Request(group_id=9, prompt_ids=np.ones(40, np.int32)))
    stats = loop.stats()
  assert sorted(t.group_id for t in out) == sorted([g for g in range(4) for _ in range(3)] + [4, 4])
  assert stats["weight_updates"] == 1 and loop.version == 1
  assert all(set(t.versions.tolist()) == {1} for t in out if t.group_id == 4)
  for t in out:
    assert t.finish_reason in ("eos", "length") and t.reward == 0.0
    assert t.response_text == " ".join(map(str, t.response_ids))
    assert t.t_submit <= t.t_first_token <= t.t_finish
    if t.finish_reason == "eos":
      assert t.response_ids[-1] == 1
  check_against_learner({0: models[0], 1: models[1]}, out)
  assert len(decoded) == len(out)


def test_update_rejects_mismatched_weights(models, engine):
  sched = Scheduler(engine=engine, params=engine.load_params(models[0]))
  bad = nnx.state(tiny_model(CFG.replace(dtype="float32", param_dtype="bfloat16"), seed=0))
  with pytest.raises(ValueError, match=r"\['embed'\].*bfloat16"):
    sched.update_params(bad, 1)
  assert not sched.has_update
