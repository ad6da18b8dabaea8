"""Interruptible, versioned weight updates: every token's logprob equals the learner-path logprob under the weights
of the version it records (float32 sampler: within 1e-5), also for answers whose cache was recomputed mid-way; the
threaded loop end to end. A bfloat16 sampler: weights arrive cast, its logprobs differ measurably from the float32
learner's, and the learner's `sampler/logprob_gap` is that difference."""

import functools
import threading
import time
from concurrent.futures import as_completed

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.distributed import weight_transfer
from areal_jax.learner.config import LearnerConfig
from areal_jax.learner.learner import Learner
from areal_jax.learner.step import make_learner_mesh
from areal_jax.learner.step_stats import gap_stats
from areal_jax.models import weights
from areal_jax.models.logprobs import next_token_logprobs
from areal_jax.sampler import Engine, Request, Sampler, SamplerConfig, SamplingParams, Scheduler
from areal_jax.sharding import LEARNER_RULES, make_mesh, state_shardings
from helpers import TINY, tiny_model

CFG = TINY
TEMPERATURE = 0.8



@functools.lru_cache
def _learner_lp(model):
  return jax.jit(lambda t, p, s: next_token_logprobs(model, t, positions=p, segment_ids=s, temperature=TEMPERATURE))


def learner_logprobs(model, trajectories):
  """Each trajectory's response-token logprobs from one packed learner forward (float32) under `model`."""
  rows = [np.concatenate([t.prompt_ids, t.response_ids]) for t in trajectories]
  tokens = np.concatenate(rows)[None]
  seg = np.concatenate([np.full(len(r), i + 1) for i, r in enumerate(rows)])[None]
  pos = np.concatenate([np.arange(len(r)) for r in rows])[None]
  lp = np.asarray(_learner_lp(model)(tokens, pos, seg))[0]
  out, start = [], 0
  for t, row in zip(trajectories, rows):
    out.append(lp[start + len(t.prompt_ids) - 1:start + len(row) - 1])
    start += len(row)
  return out


def check_against_learner(models, trajectories):
  """Each response token's logprob vs the packed learner forward under models[its version]: within 1e-5."""
  lps = {v: learner_logprobs(m, trajectories) for v, m in models.items()}
  for i, t in enumerate(trajectories):
    assert np.all(np.diff(t.versions) >= 0)
    for j, (lp, v) in enumerate(zip(t.logprobs, t.versions)):
      want = lps[int(v)][i][j]
      assert abs(lp - want) < 1e-5, (t.group_id, j, int(v), lp, want)


@pytest.fixture(scope="module")
def models():
  return {v: tiny_model(CFG, seed=10 + v) for v in range(3)}


ENGINE_CFG = SamplerConfig(num_slots=8, page_size=4, num_pages=72, max_seq_len=40, max_prefill_tokens=64,
                           decode_steps=3)


@pytest.fixture(scope="module")
def engine(models):
  return Engine(model=models[0], config=ENGINE_CFG)


@pytest.fixture(scope="module")
def bf16_engine(models):
  return Engine(model=models[0], config=ENGINE_CFG.replace(param_dtype="bfloat16"))


def generate_all(engine, params, *, groups=6, answers=2, seed=0):
  """Trajectories of `groups` random prompts x `answers`, generated to the end under one version (0)."""
  sched = Scheduler(engine=engine, params=params, version=0)
  rng = np.random.default_rng(seed)
  for g in range(groups):
    sched.submit(Request(group_id=g, prompt_ids=rng.integers(2, 64, size=rng.integers(3, 14)), num_answers=answers,
                         sampling=SamplingParams(temperature=TEMPERATURE, max_new_tokens=24, seed=seed)))
  done = []
  while not sched.idle:
    done += sched.step()
  return sorted((s.trajectory() for s in done), key=lambda t: (t.group_id, t.t_submit, len(t.response_ids)))


def test_update_mid_generation_recomputes_caches(models, engine):
  """Decoding 3 tokens per device call, an update lands at the next call: every token drawn after `update_params`
  (and the call in flight then) records the new version, and its logprob is the new weights'."""
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
  # With sampler.overlap one call (3 tokens) may be in flight, unread, at the update: it was drawn under the old weights.
  lag = ENGINE_CFG.decode_steps if sched.overlap else 0
  for seq, t in zip(done, trajectories):
    assert np.all(np.diff(t.versions) >= 0), t.versions
    for version in (1, 2):
      n = drawn_before.get((id(seq), version))
      if n is not None:
        assert np.all(t.versions[n + lag:] >= version) and np.all(t.versions[:n] < version), (t.versions, n, version)
  check_against_learner(models, trajectories)
  engine.slots.pool.check()
  assert engine.slots.pool.num_free(0) == engine.slots.pool.capacity


class _UpdateAtFirstLock:
  """Stands in for a scheduler's lock: once armed, the first time the stepping thread takes it, the armed update is
  published from another thread first (joined), as a learner's publish landing at that instant would be. Today's
  `Scheduler.step` takes its lock once, at its top; a step that asked for an update before taking the lock would
  see none and then swap with a decode call still unread."""

  def __init__(self, sched):
    self.sched, self.lock, self.armed, self.landed = sched, threading.Lock(), None, False
    self.stepper = threading.current_thread()

  def __enter__(self):
    if self.armed is not None and threading.current_thread() is self.stepper:
      update, self.armed = self.armed, None
      publisher = threading.Thread(target=self.sched.update_params, args=update)
      publisher.start()
      publisher.join(60)
      assert not publisher.is_alive()
      self.landed = True
    return self.lock.__enter__()

  def __exit__(self, *exc):
    return self.lock.__exit__(*exc)


def test_an_update_landing_inside_a_step_reads_the_call_in_flight_first(models, engine):
  """The race at a swap with `sampler.overlap`: an update arriving while a step runs, at its first take of the lock,
  with a decode call in flight and unread. The answers (tokens, logprobs, versions) are the non-overlapped path's
  with the update landing at the same step, and every logprob is the dense forward's under its token's version: the
  recompute's rewrite of whole pages never overwrites keys and values the unread call wrote."""
  params = {v: engine.load_params(m) for v, m in models.items()}

  def answers(overlap: bool):
    sched = Scheduler(engine=engine, params=params[0], version=0)
    sched.overlap = overlap
    lock = sched._lock = _UpdateAtFirstLock(sched)  # pylint: disable=protected-access
    rng = np.random.default_rng(3)
    for g in range(5):
      sched.submit(Request(group_id=g, prompt_ids=rng.integers(2, 64, size=rng.integers(3, 14)), num_answers=2,
                           sampling=SamplingParams(temperature=TEMPERATURE, max_new_tokens=20, seed=4)))
    done = []
    for step in range(200):
      if step == 3:
        assert bool(sched._inflight) == overlap  # pylint: disable=protected-access  # a call unread, with overlap
        lock.armed = (params[1], 1)
      done += sched.step()
      if sched.idle and not sched.has_update:
        break
    assert lock.landed and sched.counters["weight_updates"] == 1 and sched.counters["recomputed"] >= 8
    return {(s.request.group_id, s.answer): s.trajectory() for s in done}

  plain, overlapped = answers(overlap=False), answers(overlap=True)
  assert plain.keys() == overlapped.keys() and len(plain) == 10
  for key, a in plain.items():
    b = overlapped[key]
    np.testing.assert_array_equal(a.response_ids, b.response_ids, err_msg=str(key))
    np.testing.assert_array_equal(a.versions, b.versions, err_msg=str(key))
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6, err_msg=str(key))
  assert sum(set(t.versions.tolist()) == {0, 1} for t in plain.values()) >= 8  # interrupted mid-way, continued
  check_against_learner(models, list(overlapped.values()))
  engine.slots.pool.check()


def test_an_update_without_recompute_keeps_the_caches_it_finds(models):
  """`sampler.recompute_on_swap=False`: an update mid-way recomputes nothing; the tokens drawn after it record the
  new version, and with the same weights published again the greedy answers are the ones no update gives."""
  engine = Engine(model=models[0], config=ENGINE_CFG.replace(recompute_on_swap=False))
  params = engine.load_params(models[0])

  def answers(update: bool):
    sched = Scheduler(engine=engine, params=params, version=0)
    for g in range(4):
      sched.submit(Request(group_id=g, prompt_ids=np.arange(3, 8 + g, dtype=np.int32), num_answers=2,
                           sampling=SamplingParams(temperature=0.0, max_new_tokens=16, seed=1)))
    done = sched.step()
    if update:
      sched.update_params(params, 1)
    while not sched.idle or sched.has_update:
      done += sched.step()
    assert sched.counters["recomputed"] == 0
    return {(s.request.group_id, s.answer): (s.tokens, s.versions) for s in done}

  before, after = answers(update=False), answers(update=True)
  assert {k: t for k, (t, _) in before.items()} == {k: t for k, (t, _) in after.items()}
  assert all(v[0] == 0 and v[-1] == 1 for _, v in after.values())


def test_loop_thread_end_to_end(models, engine):
  params = {v: engine.load_params(m) for v, m in models.items()}
  decoded = []
  loop = Sampler(engine=engine, params=params[0], version=0, eos_ids=[1], gather=True,
                  detokenize=lambda ids: decoded.append(list(ids)) or " ".join(map(str, ids)))
  sampling = SamplingParams(temperature=TEMPERATURE, max_new_tokens=24, seed=2)
  rng = np.random.default_rng(1)
  with loop:
    futures = [f for g in range(4)
               for f in loop.submit(Request(group_id=g, prompt_ids=rng.integers(2, 64, size=rng.integers(3, 14)),
                                            num_answers=3, sampling=sampling))]
    # Group 4 asks for policy version 1: the loop holds it until the learner publishes that version.
    held = loop.submit(Request(group_id=4, prompt_ids=[5, 6, 7], num_answers=2, sampling=sampling, min_version=1))
    next(as_completed(futures, timeout=120))
    assert not any(f.done() for f in held)
    # The learner publishes from its own thread.
    publisher = threading.Thread(target=loop.update_params, args=(params[1], 1))
    publisher.start()
    publisher.join()
    never = loop.submit(Request(group_id=5, prompt_ids=[5, 6], sampling=sampling, min_version=2))
    out = [f.result(timeout=120) for f in futures + held]
    with pytest.raises(ValueError, match="prompt of 40 tokens"):
      loop.submit(Request(group_id=9, prompt_ids=np.ones(40, np.int32)))
    with pytest.raises(ValueError, match="group 5 is already in flight"):
      loop.submit(Request(group_id=5, prompt_ids=[5, 6]))
    stats = loop.stats()
  assert never[0].cancelled()  # stop() cancels what is still in flight or held
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


def test_an_idle_loop_gathers_a_burst_of_requests_into_one_step(models, engine):
  """Requests arriving one by one a few ms apart (an agent's next turns) start together: one decode call."""
  loop = Sampler(engine=engine, params=engine.load_params(models[0]), version=0, gather=True)
  sampling = SamplingParams(temperature=TEMPERATURE, max_new_tokens=ENGINE_CFG.decode_steps, ignore_eos=True)
  with loop:
    [warm] = loop.submit(Request(group_id=0, prompt_ids=[5, 6, 7], sampling=sampling))
    warm.result(timeout=120)
    loop._last_step_s = 1.0  # pylint: disable=protected-access  # a long step: a 0.25 s window
    calls = loop.stats()["decode_calls"]
    futures = []
    for g in range(1, 7):
      futures += loop.submit(Request(group_id=g, prompt_ids=[5, 6, 7 + g], sampling=sampling))
      time.sleep(0.003)
    out = [f.result(timeout=120) for f in futures]
    # Every answer's tokens came out of one decode call: all were admitted in the step after the burst.
    assert loop.stats()["decode_calls"] - calls == 1 and len(out) == 6, loop.stats()


def test_update_rejects_mismatched_weights(models, engine):
  sched = Scheduler(engine=engine, params=engine.load_params(models[0]))
  bad = nnx.state(tiny_model(CFG.replace(dtype="float32", param_dtype="bfloat16"), seed=0))
  with pytest.raises(ValueError, match=r"\['embed'\].*bfloat16"):
    sched.update_params(bad, 1)
  assert not sched.has_update


def test_pushed_weights_arrive_in_the_samplers_dtype(models, bf16_engine):
  """The trainer's push: float32 learner weights (fsdp over other devices) cast on the learner's devices, then moved
  onto the bfloat16 engine's shardings; the scheduler takes them. Uncast float32 weights are refused by name."""
  devices = jax.devices()
  learner_mesh = make_mesh(devices[4:6], {"fsdp": 2, "tensor": 1})
  state = nnx.state(models[1])
  on_learner = jax.device_put(state, state_shardings(state, learner_mesh, LEARNER_RULES))
  cast = weights.cast(on_learner, jnp.bfloat16)
  for x, y in zip(jax.tree.leaves(on_learner), jax.tree.leaves(cast)):  # cast where the weights live
    assert y.dtype == jnp.bfloat16 and y.sharding.is_equivalent_to(x.sharding, x.ndim)
  assert weights.cast(on_learner, jnp.float32) is on_learner
  moved = weight_transfer.transfer(on_learner, bf16_engine.param_shardings, dtype=bf16_engine.param_dtype)
  sched = Scheduler(engine=bf16_engine, params=bf16_engine.load_params(models[0]))
  sched.update_params(moved, 1)
  sched.step()  # the swap happens at the start of a step
  assert sched.version == 1
  for (path, w), got, want in zip(jax.tree_util.tree_flatten_with_path(sched.params)[0],
                                  jax.tree.leaves(bf16_engine.abstract_params), jax.tree.leaves(state)):
    assert w.dtype == got.dtype == jnp.bfloat16, jax.tree_util.keystr(path)
    assert w.sharding.device_set == {devices[0]}
    np.testing.assert_array_equal(np.asarray(w), np.asarray(want.astype(jnp.bfloat16)))
  with pytest.raises(ValueError, match=r"float32.*expected bfloat16"):
    sched.update_params(weight_transfer.transfer(on_learner, bf16_engine.param_shardings), 2)


@pytest.mark.slow
def test_bfloat16_sampler_logprobs_differ_and_the_learner_logs_the_gap(models, bf16_engine):
  """bfloat16 sampler weights (float32 compute, float32 learner): the behaviour logprobs differ from the learner's by
  a small but nonzero amount. `Learner.train_step` reports as `sampler/logprob_gap` the mean |behaviour - learner
  logprob| over the tokens drawn by its current version only (a numpy reference here), and nothing with loglinear."""
  model = models[0]
  trajectories = generate_all(bf16_engine, bf16_engine.load_params(model))
  want = learner_logprobs(model, trajectories)
  diff = np.concatenate([np.abs(t.logprobs - w) for t, w in zip(trajectories, want)])
  assert 1e-4 < diff.mean() < 0.05 and diff.max() < 0.5, (diff.mean(), diff.max())

  # Half the answers are relabelled as drawn by an older version: the gap must leave them out.
  learner_version = 3
  rng = np.random.default_rng(0)
  current = rng.permutation(len(trajectories)) % 2 == 0
  trajectories = [t.replace(versions=np.full(len(t.response_ids), learner_version if c else learner_version - 1,
                                             np.int32), reward=float(i % 2))
                  for i, (t, c) in enumerate(zip(trajectories, current))]
  ref = np.concatenate([np.abs(t.logprobs - w) for t, w, c in zip(trajectories, want, current) if c])
  cfg = LearnerConfig(ppo_n_minibatches=2, max_tokens_per_mb=64, min_bucket=64, filter_uniform_groups=False)
  mesh = make_learner_mesh(jax.devices()[:2])
  for method in ("recompute", "loglinear"):
    learner = Learner(model_cfg=TINY, config=cfg.replace(prox_logp_method=method), mesh=mesh,
                      temperature=TEMPERATURE, params=nnx.state(model))
    learner.restore_counters(version=learner_version, updates=0)
    stats = learner.train_step(trajectories)
    if method == "loglinear":  # no proximal pass: nothing measured
      assert not any(k.startswith("sampler/logprob_gap") for k in stats), stats
      continue
    assert stats["sampler/logprob_gap_tokens"] == len(ref)
    np.testing.assert_allclose(stats["sampler/logprob_gap"], ref.mean(), rtol=1e-3)
    np.testing.assert_allclose(stats["sampler/logprob_gap_max"], ref.max(), rtol=1e-3)
  assert gap_stats([]) == {"sampler/logprob_gap_tokens": 0.0}  # no comparable token: a count, no NaN


def test_bfloat16_compute_makes_the_weight_dtype_irrelevant(models):
  """With bfloat16 compute (the real-size presets), every weight is cast to bfloat16 before use anyway: a bfloat16
  sampler draws the same tokens with the same logprobs as a float32 one."""
  cfg = TINY.replace(dtype="bfloat16")
  model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: tiny_model(cfg))), nnx.state(models[0]))
  runs = {}
  for dtype in ("float32", "bfloat16"):
    engine = Engine(model=model, config=ENGINE_CFG.replace(param_dtype=dtype))
    runs[dtype] = generate_all(engine, engine.load_params(model), groups=3)
  for a, b in zip(runs["float32"], runs["bfloat16"]):
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
