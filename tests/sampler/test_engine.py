"""Engine and scheduler on a tiny model: greedy equals uncached argmax, logprobs equal the learner path, sampling is
reproducible, stop conditions, shared prompt pages, bounded compiles, clear errors."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models.logprobs import next_token_logprobs
from areal_jax.sampler import Engine, Placement, Request, SamplerConfig, SamplingParams, Scheduler, generate
from areal_jax.sampler.jetstream import JetStreamEngine
from helpers import TINY, tiny_model

CFG = TINY
PAGE = 4



@pytest.fixture(scope="module")
def model():
  return tiny_model(CFG, seed=3)


@functools.lru_cache
def _forward(model):
  return jax.jit(lambda tokens: model(tokens))


@functools.lru_cache
def _learner_lp(model, temperature):
  return jax.jit(lambda t, p, s: next_token_logprobs(model, t, positions=p, segment_ids=s, temperature=temperature))


def greedy_reference(model, prompt, steps, pad=64):
  """Step-by-step argmax of the full uncached forward (padded to a fixed length: causal, so padding is inert)."""
  seq = list(prompt)
  for _ in range(steps):
    logits = _forward(model)(jnp.asarray([seq + [0] * (pad - len(seq))], jnp.int32))
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  return seq[len(prompt):]


def learner_logprobs(model, prompts, responses, temperature):
  """The learner's logprob of each response token: one packed forward over all sequences."""
  rows = [np.concatenate([p, r]) for p, r in zip(prompts, responses)]
  tokens = np.concatenate(rows)[None]
  seg = np.concatenate([np.full(len(r), i + 1) for i, r in enumerate(rows)])[None]
  pos = np.concatenate([np.arange(len(r)) for r in rows])[None]
  lp = np.asarray(_learner_lp(model, temperature)(tokens, pos, seg))[0]
  out, start = [], 0
  for p, r in zip(prompts, responses):
    out.append(lp[start + len(p) - 1:start + len(p) + len(r) - 1])
    start += len(p) + len(r)
  return out


PROMPTS = [np.array(p, np.int32) for p in ([5], [7, 3, 9, 2], [11, 4, 8, 15, 16], list(range(2, 15)))]


def test_greedy_equals_uncached_argmax(model):
  # Prompt lengths 1, 4 (page-aligned), 5, 13 (across pages); two answers each share the prompt's pages.
  out = generate(model, PROMPTS, max_new_tokens=10, temperature=0.0, n=2, page_size=PAGE)
  for prompt, completions in zip(PROMPTS, out):
    ref = greedy_reference(model, prompt, 10)
    for c in completions:
      assert list(c.tokens) == ref
      assert c.finish_reason == "length" and list(c.versions) == [0] * 10
    # Greedy logprobs are reported under temperature 1.
    np.testing.assert_allclose(completions[0].logprobs, learner_logprobs(model, [prompt], [ref], 1.0)[0], atol=1e-5)


def test_sampled_logprobs_equal_learner_path(model):
  out = generate(model, PROMPTS, max_new_tokens=10, temperature=0.7, top_p=0.9, top_k=20, n=2, seed=1,
                 page_size=PAGE)
  flat = [(p, c) for p, cs in zip(PROMPTS, out) for c in cs]
  want = learner_logprobs(model, [p for p, _ in flat], [c.tokens for _, c in flat], 0.7)
  for (_, c), w in zip(flat, want):
    np.testing.assert_allclose(c.logprobs, w, atol=1e-5)
  # Answers of one prompt differ (independent keys).
  assert len({tuple(c.tokens) for c in out[3]}) > 1


def test_a_rematerialised_model_samples_like_the_plain_one(model):
  """The real-size presets set model.remat="full" (for the learner); the sampler ignores it (nnx.remat inside the
  decode loop raised a TraceContextError) and draws the same tokens with the same logprobs."""
  remat = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: tiny_model(CFG.replace(remat="full")))), nnx.state(model))
  kw = dict(max_new_tokens=6, temperature=1.0, n=2, seed=4, page_size=PAGE)
  for a, b in zip(generate(model, PROMPTS[:2], **kw), generate(remat, PROMPTS[:2], **kw)):
    for x, y in zip(a, b):
      np.testing.assert_array_equal(x.tokens, y.tokens)
      np.testing.assert_array_equal(x.logprobs, y.logprobs)


def test_reproducible_and_independent_of_batching(model):
  kw = dict(max_new_tokens=10, temperature=1.0, n=2, page_size=PAGE)
  a = generate(model, PROMPTS, seed=5, **kw)
  b = generate(model, PROMPTS, seed=5, num_slots=2, **kw)  # other slot count: answers run in other slots/orders
  c = generate(model, PROMPTS, seed=6, **kw)
  tok = lambda out: [tuple(x.tokens) for cs in out for x in cs]
  assert tok(a) == tok(b)
  np.testing.assert_allclose(np.concatenate([x.logprobs for cs in a for x in cs]),
                             np.concatenate([x.logprobs for cs in b for x in cs]), atol=1e-5)
  assert tok(a) != tok(c)


@pytest.mark.slow
def test_tokens_independent_of_decode_steps(model):
  """Several decode steps per device call draw the same tokens as one at a time, and stop where one step at a time
  stops: at EOS (on the device), a stop sequence (on the host, later tokens dropped), max_new_tokens, and for an
  answer whose first token (drawn at prefill) ends it; also with 4 slots, where answers wait and calls end early to
  refill slots."""
  one = generate(model, PROMPTS, max_new_tokens=12, temperature=1.0, n=3, seed=2, page_size=PAGE, decode_steps=1)
  drawn = [t for cs in one for c in cs for t in c.tokens]
  eos, first = collections.Counter(drawn).most_common(1)[0][0], one[0][0].tokens[0]
  # A stop sequence from an answer that no EOS id ends first.
  stop = [next(tuple(c.tokens[2:4]) for cs in one[1:] for c in cs if not {eos, first} & set(c.tokens[:4]))]
  variants = {(1, 64), (5, 64), (16, 64), (5, 4)}  # (decode_steps, num_slots)
  outs = {v: generate(model, PROMPTS, max_new_tokens=12, temperature=1.0, n=3, seed=2, page_size=PAGE,
                      eos_ids=[eos, first], stop=stop, decode_steps=v[0], num_slots=v[1]) for v in variants}
  reasons = collections.Counter(c.finish_reason for cs in outs[1, 64] for c in cs)
  assert set(reasons) == {"eos", "stop", "length"}, reasons
  assert len(outs[1, 64][0][0].tokens) == 1  # ended by its first token
  for v in variants:
    for cs1, csk in zip(outs[1, 64], outs[v]):
      for a, b in zip(cs1, csk):
        assert (a.finish_reason, list(a.tokens)) == (b.finish_reason, list(b.tokens))
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.fixture(scope="module")
def engine(model):
  cfg = SamplerConfig(num_slots=4, page_size=PAGE, num_pages=24, max_seq_len=24, max_prefill_tokens=32)
  return Engine(model=model, config=cfg)


def _run(sched):
  done = []
  while not sched.idle:
    done += sched.step()
  return done


def test_finish_reasons(model, engine):
  prompt = np.array([7, 3, 9, 2, 6, 1], np.int32)
  ref = greedy_reference(model, prompt, 18)
  greedy = dict(temperature=0.0, max_new_tokens=30)
  sched = Scheduler(engine=engine, params=engine.load_params(model), eos_ids=[ref[2]])
  sched.submit(Request(group_id=0, prompt_ids=prompt, sampling=SamplingParams(**greedy)))
  sched.submit(Request(group_id=1, prompt_ids=prompt, sampling=SamplingParams(**greedy, ignore_eos=True,
                                                                               stop=((ref[4], ref[5]),))))
  sched.submit(Request(group_id=2, prompt_ids=prompt, sampling=SamplingParams(temperature=0.0, max_new_tokens=4,
                                                                               ignore_eos=True)))
  sched.submit(Request(group_id=3, prompt_ids=prompt, sampling=SamplingParams(**greedy, ignore_eos=True)))
  got = {s.request.group_id: s for s in _run(sched)}
  assert (got[0].finish_reason, got[0].tokens) == ("eos", ref[:3])
  if ref.index(ref[4]) == 4:  # the stop pair first occurs at 4..5
    assert (got[1].finish_reason, got[1].tokens) == ("stop", ref[:6])
  assert (got[2].finish_reason, got[2].tokens) == ("length", ref[:4])
  # The cache holds 24 tokens: 6 prompt + 18 answer.
  assert (got[3].finish_reason, got[3].tokens) == ("length", ref[:18])
  assert got[3].t_submit <= got[3].t_first_token <= got[3].t_finish
  engine.slots.pool.check()
  assert engine.slots.pool.num_free(0) == engine.slots.pool.capacity


def test_engine_api_shares_prompt_pages(model, engine):
  engine = JetStreamEngine(model=model, config=engine.cfg)  # JetStream's contract over the core engine
  params = engine.load_params(model)
  state = engine.init_decode_state()
  prompt = np.arange(2, 12, dtype=np.int32)  # 10 tokens: 2 full pages + a partial one
  prefix, first = engine.prefill_multisampling(params=params, padded_tokens=np.pad(prompt, (0, 6)),
                                               true_length=len(prompt), rng=jax.random.key(1), num_samples=3)
  data = first.get_result_at_slots((0, 1, 2))
  assert data.tokens.shape == (3, 1) and np.all(np.asarray(data.lengths) == 1) and np.all(np.asarray(data.valid))
  state = engine.bulk_insert(prefix, state, [0, 1, 3])
  table = engine.slots
  shared = table.pages[0][:2]
  assert all(table.pages[s][:2] == shared for s in (0, 1, 3))
  assert [table.pool.refcount(0, p) for p in shared] == [3, 3]
  tails = {table.pages[s][2] for s in (0, 1, 3)}
  assert len(tails) == 3  # the partial page is copied per answer
  assert table.pool.num_free(0) == table.pool.capacity - 5
  with pytest.raises(ValueError, match="answers \\[0, 3\\] asked of prefix row 0, which drew 3"):
    engine.core.insert_many(prefix, state, [Placement(row=0, slots=(2, 4), answers=(0, 3), pending=(-1, -1),
                                                 generated=(1, 1))])
  with pytest.raises(ValueError, match="slot 1 is in use"):
    engine.core.insert_many(prefix, state, [Placement.new(0, [2, 1])])
  assert table.pool.num_free(0) == table.pool.capacity - 5 and not table.active[2]  # nothing taken
  for _ in range(3):
    state, result = engine.generate(params, state)
  result = result.convert_to_numpy()
  assert [bool(result.get_result_at_slot(s).valid[0, 0]) for s in range(4)] == [True, True, False, True]
  assert int(result.get_result_at_slot(0).lengths[0]) == 4  # the first token and three more
  for s in (0, 1, 3):
    engine.free_resource(s)
    engine.free_resource(s)  # idempotent
  table.check()
  assert table.pool.num_free(0) == table.pool.capacity


def test_compiles_stay_bounded(model, engine):
  sched = Scheduler(engine=engine, params=engine.load_params(model))
  rng = np.random.default_rng(0)
  p = engine.programs
  sizes = []
  for round_ in range(2):
    answers = 0
    for g in range(10):
      n = int(rng.integers(1, 3))
      answers += n
      sched.submit(Request(group_id=g, prompt_ids=rng.integers(2, 64, size=rng.integers(1, 20)), num_answers=n,
                           sampling=SamplingParams(max_new_tokens=5)))
    assert len(_run(sched)) == answers
    sizes.append((p.decode._cache_size(), p.sample._cache_size(), p.prefill._cache_size(), p.insert._cache_size()))
  # Nothing new compiles for new prompt lengths; the decode step is one program.
  assert sizes[0] == sizes[1]
  assert p.decode._cache_size() == 1
  # Prefill buckets 4..16 and 24, at most 32 tokens per call: a handful of (rows, length) shapes.
  assert p.prefill._cache_size() <= 6 and p.insert._cache_size() <= 6


def test_errors_name_the_values(model, engine):
  sched = Scheduler(engine=engine, params=engine.load_params(model))
  with pytest.raises(ValueError, match="prompt of 24 tokens exceeds the 23"):
    sched.submit(Request(group_id=0, prompt_ids=np.ones(24, np.int32)))
  with pytest.raises(ValueError, match="token 99 outside the vocabulary"):
    sched.submit(Request(group_id=0, prompt_ids=[1, 99]))
  bad = jax.tree.map(lambda x: x, engine.load_params(model))
  bad["layers"]["mlp"]["up"].set_value(jnp.zeros((model.cfg.num_layers, 32, 65)))
  with pytest.raises(ValueError, match=r"\['layers'\]\['mlp'\]\['up'\].*\[2, 32, 65\]"):
    sched.update_params(bad, 1)
  with pytest.raises(ValueError, match="cannot hold one sequence"):
    Engine(model=model, config=SamplerConfig(num_slots=4, page_size=4, num_pages=4, max_seq_len=24))


def test_pallas_kernel_decodes_like_the_jax_path(model):
  """The decode with the Pallas TPU kernel, run on CPU in TPU interpret mode, draws the tokens of the pure-JAX path,
  greedy and sampled; logprobs differ only by the kernel's bfloat16 reads of the float32 keys and values (< 1e-2
  here; the kernel itself is checked exactly in tests/sampler/test_attention.py)."""
  pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
  prompts = PROMPTS[1:3]
  sampling = [SamplingParams(temperature=0.0, max_new_tokens=5, seed=1),
              SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=5, seed=1)]

  def run(attention):
    cfg = SamplerConfig(num_slots=2, page_size=PAGE, num_pages=9, max_seq_len=16, decode_steps=4, attention=attention)
    engine = Engine(model=model, config=cfg)
    assert engine.programs.attention == attention
    sched = Scheduler(engine=engine, params=engine.load_params(model))
    for i, (p, s) in enumerate(zip(prompts, sampling)):
      sched.submit(Request(group_id=i, prompt_ids=p, sampling=s))
    return sorted(_run(sched), key=lambda s: s.request.group_id)

  want = run("jax")
  with pltpu.force_tpu_interpret_mode():
    got = run("pallas_tpu")
  for a, b in zip(want, got):
    assert a.tokens == b.tokens and len(a.tokens) == 5
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-2)
