"""Speculative decoding (`sampler.speculation`): drafted tokens verified exactly.

`sampling.verify` against `sampling.sample` and against the target distribution by a chi-square test on a small
vocabulary (with the residual's draft mass left in, the test fails); the engine's speculative call against its plain
decode call, greedy, with drafts right, wrong, partly right and absent (also on the verify attention's Pallas TPU
kernel, interpreted); the scheduler with the suffix drafter against the scheduler without, greedy, with a weight swap
mid-answer, and every logprob against a dense forward."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from areal_jax.models.logprobs import logprobs_of
from areal_jax.sampler import Engine, Request, SamplerConfig, SamplingParams, Scheduler, sampling
from areal_jax.sampler.engine import Draws
from areal_jax.sampler.slots import Placement
from helpers import TINY, tiny_model


def _keys(n: int, seed: int = 0) -> np.ndarray:
  return np.stack([sampling.request_key(seed, i) for i in range(n)])


def test_verify_without_drafts_draws_what_sample_draws():
  rng = np.random.default_rng(0)
  b, q, v = 64, 4, 50
  logits = jnp.asarray(rng.normal(size=(b, q, v)) * 3, jnp.float32)
  keys, index = _keys(b), rng.integers(0, 100, b).astype(np.int32)
  temperature = np.where(np.arange(b) % 4 == 0, 0.0, 0.7).astype(np.float32)
  top_p = np.where(np.arange(b) % 3 == 0, 0.8, 1.0).astype(np.float32)
  top_k = np.where(np.arange(b) % 5 == 0, 7, -1).astype(np.int32)
  tokens, logp, emitted = sampling.verify(logits, np.zeros((b, q - 1), np.int32), np.zeros(b, np.int32), keys, index,
                                          temperature, top_p, top_k, vocab_limit=40)
  want, want_lp = sampling.sample(logits[:, 0], keys, index, temperature, top_p, top_k, vocab_limit=40)
  np.testing.assert_array_equal(emitted, 1)
  np.testing.assert_array_equal(tokens[:, 0], want)
  np.testing.assert_allclose(logp[:, 0], want_lp, atol=1e-5)  # another reduction shape: float rounding


def _emitted_distribution(verify, p_logits: np.ndarray, drafts: np.ndarray, n: int, temperature: float,
                          top_k: int) -> tuple[np.ndarray, np.ndarray]:
  """(counts of the first emitted token, counts of the second among rows that accepted the first draft) over n draws
  with the same logits and drafts and n keys."""
  q, v = p_logits.shape
  logits = jnp.broadcast_to(jnp.asarray(p_logits, jnp.float32), (n, q, v))
  tokens, _, emitted = verify(logits, np.broadcast_to(drafts, (n, q - 1)), np.full(n, q - 1, np.int32), _keys(n),
                              np.zeros(n, np.int32), np.full(n, temperature, np.float32), np.ones(n, np.float32),
                              np.full(n, top_k, np.int32))
  tokens, emitted = np.asarray(tokens), np.asarray(emitted)
  first = np.bincount(tokens[:, 0], minlength=v)
  went_on = (emitted >= 2) & (tokens[:, 0] == drafts[0])
  second = np.bincount(tokens[went_on, 1], minlength=v)
  return first, second


def _target(p_logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
  scaled = p_logits.astype(np.float64) / temperature
  kth = -np.sort(-scaled, axis=-1)[:, top_k - 1:top_k] if top_k > 0 else -np.inf
  scaled = np.where(scaled >= kth, scaled, -np.inf)
  p = np.exp(scaled - scaled.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


def _wrong_residual(logits, drafts, num_drafted, keys, index, temperature, top_p, top_k):
  """`verify` as it would be with the rejected draft's mass left in the residual: a draw from p itself."""
  tokens, logp, emitted = sampling.verify(logits, drafts, num_drafted, keys, index, temperature, top_p, top_k)
  fresh = jax.vmap(lambda k, row: jax.random.categorical(jax.random.fold_in(
      jax.random.fold_in(jax.random.wrap_key_data(k, impl=sampling.KEY_IMPL), 0), 2), row))(
          keys, logits[:, 0] / temperature[:, None])
  rejected = (emitted == 1) & (num_drafted > 0)
  return tokens.at[:, 0].set(jnp.where(rejected, fresh, tokens[:, 0])), logp, emitted


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, 3)])
def test_verify_emits_the_target_distribution(temperature, top_k):
  """Over 40,000 draws, the first token follows p_0 and, after an accepted first draft, the second follows p_1: a
  chi-square test at p > 1e-3 (the draft's token is the likeliest, so acceptance is frequent and the residual
  matters). The same test rejects a residual that keeps the draft's mass."""
  rng = np.random.default_rng(1)
  v = 6
  p_logits = rng.normal(size=(3, v)).astype(np.float32) * 1.5
  drafts = np.array([int(np.argmax(p_logits[0])), int(np.argmin(p_logits[1]))], np.int32)
  n = 40_000
  first, second = _emitted_distribution(sampling.verify, p_logits, drafts, n, temperature, top_k)
  p = _target(p_logits, temperature, top_k)
  keep = p[0] > 0
  assert stats.chisquare(first[keep], p[0][keep] / p[0][keep].sum() * n).pvalue > 1e-3
  assert first[~keep].sum() == 0
  keep1 = p[1] > 0
  assert second.sum() > 1000
  assert stats.chisquare(second[keep1], p[1][keep1] / p[1][keep1].sum() * second.sum()).pvalue > 1e-3
  if top_k < 0:
    wrong, _ = _emitted_distribution(_wrong_residual, p_logits, drafts, n, temperature, top_k)
    assert stats.chisquare(wrong, p[0] * n).pvalue < 1e-6


CFG = SamplerConfig(num_slots=4, page_size=4, num_pages=4 * 12 + 1, max_seq_len=44, max_prefill_tokens=64,
                    decode_steps=4)


def _engine_answers(model, cfg: SamplerConfig, prompts, length: int, drafts_of=None):
  """Greedy answers of `length` tokens to each prompt (one slot each) by repeated engine calls; `drafts_of(slot,
  tokens so far)` gives a slot's drafts (a list, from the answer's next token on)."""
  engine = Engine(model=model, config=cfg)
  params, state = engine.load_params(model), engine.init_decode_state()
  prefix, first = engine.prefill_batch(params, prompts, [Draws(keys=_keys(1, i)) for i in range(len(prompts))],
                                       shards=[0] * len(prompts), decode_state=state)
  state = engine.insert_many(prefix, state, [Placement.new(i, [i]) for i in range(len(prompts))])
  tokens = [[int(t)] for t in np.asarray(first.tokens)[:len(prompts)]]
  logps = [[float(x)] for x in np.asarray(first.log_prob)[:len(prompts)]]
  drafted = accepted = 0
  while min(map(len, tokens)) < length:
    budget = np.array([length - len(t) for t in tokens] + [0] * (cfg.num_slots - len(prompts)))
    kw = {}
    if drafts_of is not None:
      d = np.full((cfg.num_slots, cfg.draft_width), -1, np.int32)
      at = np.full(cfg.num_slots, -1, np.int32)
      for s, t in enumerate(tokens):
        guess = drafts_of(s, t)[:cfg.draft_width]
        if guess:
          d[s, :len(guess)], at[s] = guess, len(t)
      kw = {"drafts": d, "draft_at": at}
    state, steps = engine.generate_steps(params, state, budget, **kw)
    count = np.asarray(steps.count)
    engine.slots.advance(count)
    for s in range(len(prompts)):
      tokens[s] += np.asarray(steps.tokens)[s, :count[s]].tolist()
      logps[s] += np.asarray(steps.log_prob)[s, :count[s]].tolist()
    if steps.drafted_at is not None:
      drafted, accepted = drafted + int(np.sum(steps.drafted_at)), accepted + int(np.sum(steps.accepted_at))
  return tokens, logps, drafted, accepted


@pytest.mark.parametrize("attention,length", [("jax", 30), ("pallas_tpu", 9)])
def test_the_speculative_call_emits_the_greedy_tokens_of_the_plain_call(attention, length):
  """Greedy, 4 slots: drafts that are the answer's own continuation (all accepted), wrong from the first token, right
  for two tokens then wrong, and none. Tokens equal the plain call's; logprobs to float rounding (another forward
  shape); right drafts are accepted, wrong ones not. With `pallas_tpu` every speculative forward runs the verify
  attention's Pallas TPU kernel (`verify_kernel`), interpreted on CPU: slow, so two calls (8 tokens) only."""
  model = tiny_model(TINY, seed=5)
  rng = np.random.default_rng(2)
  prompts = [rng.integers(2, 64, size=n).astype(np.int32) for n in (5, 9, 3, 12)]
  want, want_lp, _, _ = _engine_answers(model, CFG, prompts, 30)

  def drafts_of(slot, sofar):
    n = len(sofar)
    right = want[slot][n:]
    if slot == 0:
      return right
    if slot == 1:
      return [(t + 1) % 64 for t in right]
    if slot == 2:
      return right[:2] + [(t + 1) % 64 for t in right[2:]]
    return []

  spec = CFG.replace(speculation="suffix", spec_tokens=3, attention=attention)
  interpret = contextlib.nullcontext()
  if attention == "pallas_tpu":
    interpret = pytest.importorskip("jax.experimental.pallas.tpu").force_tpu_interpret_mode()
  with interpret:
    got, got_lp, drafted, accepted = _engine_answers(model, spec, prompts, length, drafts_of)
  for s in range(4):
    assert got[s][:length] == want[s][:length], s
    np.testing.assert_allclose(got_lp[s][:length], want_lp[s][:length], atol=2e-5)
  # Slot 0: 3 drafts accepted per forward (fewer at the end); slot 2: 2 at its first forward, then
  # none; slot 1: none.
  assert (20 if length == 30 else 6) <= accepted < drafted


SCHED_CFG = SamplerConfig(num_slots=8, page_size=4, num_pages=8 * 12 + 1, max_seq_len=44, max_prefill_tokens=64,
                          decode_steps=4)


def _dense_logprobs(model, trajectory, temperature: float = 1.0) -> np.ndarray:
  """The response tokens' logprobs by one dense forward of prompt + response under `model`."""
  ids = np.concatenate([trajectory.prompt_ids, trajectory.response_ids]).astype(np.int32)
  logits = model(jnp.asarray(ids)[None])[0]
  lp = logprobs_of(logits[:-1] / temperature, jnp.asarray(ids[1:]))
  return np.asarray(lp)[len(trajectory.prompt_ids) - 1:]


def _run(models, cfg: SamplerConfig, rounds, *, swap_at: int | None = None):
  """Greedy answers (group, answer) -> trajectory over `rounds` (lists of requests, each round submitted when the
  previous one is done; all of a round fit in the slots), weights of version 1 published at step `swap_at` of the
  last round; the scheduler; its counters after each round."""
  engine = Engine(model=models[0], config=cfg)
  sched = Scheduler(engine=engine, params=engine.load_params(models[0]), eos_ids=(1,))
  out, counters = {}, []
  for i, requests in enumerate(rounds):
    for r in requests:
      sched.submit(r)
    step = 0
    while not sched.idle or sched.has_update:
      if i == len(rounds) - 1 and step == swap_at:
        sched.update_params(engine.load_params(models[1]), 1)
      out.update({(s.request.group_id, s.answer): s.trajectory() for s in sched.step()})
      step += 1
    counters.append(dict(sched.counters))
  engine.slots.check()
  return out, sched, counters


def test_suffix_drafts_change_no_greedy_answer_and_logprobs_are_the_dense_forward_s():
  """Greedy, with EOS: 4 prompts in 3 epochs (the earlier epochs' answers are the drafts), the third with a weight
  swap mid-answer. Tokens and versions equal the plain scheduler's, logprobs to float rounding and to the dense
  forward under each token's version; the second epoch's drafts are the first's answers, all accepted."""
  models = {v: tiny_model(TINY, seed=20 + v) for v in range(2)}
  rng = np.random.default_rng(4)
  prompts = [rng.integers(2, 64, size=n).astype(np.int32) for n in (4, 7, 10, 13)]
  sp = SamplingParams(temperature=0.0, max_new_tokens=28, seed=0)
  rounds = [[Request(group_id=e * 10 + g, prompt_ids=p, num_answers=2, sampling=sp) for g, p in enumerate(prompts)]
            for e in range(3)]
  plain, _, _ = _run(models, SCHED_CFG, rounds, swap_at=3)
  spec, sched, counters = _run(models, SCHED_CFG.replace(speculation="suffix", spec_tokens=3), rounds, swap_at=3)
  assert plain.keys() == spec.keys() and len(plain) == 24
  for key, a in plain.items():
    b = spec[key]
    np.testing.assert_array_equal(a.response_ids, b.response_ids, err_msg=str(key))
    np.testing.assert_array_equal(a.versions, b.versions, err_msg=str(key))
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5, err_msg=str(key))
    for v in (0, 1):
      at = b.versions == v
      np.testing.assert_allclose(b.logprobs[at], _dense_logprobs(models[v], b)[at], atol=2e-5, err_msg=str(key))
  assert sum(set(t.versions.tolist()) == {0, 1} for t in spec.values()) >= 6  # swapped mid-answer
  second = {k: counters[1][k] - counters[0][k] for k in counters[0]}
  assert second["spec_accepted"] == second["spec_drafted"] > 0
  assert second["spec_tokens"] / second["spec_forwards"] > 3  # decode_steps = 4 tokens per call, most in 1 forward
  assert sched.spec_accepted_at.sum() == sched.counters["spec_accepted"]


def test_a_drafter_handed_to_a_new_scheduler_drafts_from_the_last_one_s_answers():
  """As the evaluation does between evaluations: a second scheduler given the first's drafter drafts the same
  prompts' greedy answers from the first's finished ones, from its first call on, and its answers are the first's.
  An answer the drafter still holds from a scheduler that stopped mid-answer is abandoned, not kept."""
  from areal_jax.sampler.drafts import SuffixDrafter  # pylint: disable=g-import-not-at-top

  model = tiny_model(TINY, seed=20)
  cfg = SCHED_CFG.replace(speculation="suffix", spec_tokens=3)
  engine = Engine(model=model, config=cfg)
  params = engine.load_params(model)
  rng = np.random.default_rng(5)
  prompts = [rng.integers(2, 64, size=n).astype(np.int32) for n in (5, 9)]
  sp = SamplingParams(temperature=0.0, max_new_tokens=24, seed=0)
  drafter = SuffixDrafter(max_draft=cfg.draft_width)
  answers = []
  for _ in range(2):
    sched = Scheduler(engine=engine, params=params, eos_ids=(1,), drafter=drafter)
    for g, p in enumerate(prompts):
      sched.submit(Request(group_id=g, prompt_ids=p, num_answers=1, sampling=sp))
    done = {}
    while not sched.idle:
      done.update({s.request.group_id: list(s.tokens) for s in sched.step()})
    answers.append((done, dict(sched.counters)))
    drafter.start(1, prompts[0][:3])  # as if an answer were running when its scheduler stopped (the next's serial 1)
  (first, c1), (second, c2) = answers
  assert first == second and len(first) == 2
  assert c2["spec_accepted"] == c2["spec_drafted"] > c1["spec_drafted"] and c2["spec_accepted"] > 0
  with pytest.raises(ValueError, match="speculation='off'"):
    Scheduler(engine=Engine(model=model, config=SCHED_CFG), params=params, drafter=drafter)


def test_the_evaluation_drafts_from_the_last_evaluation_s_answers():
  """`Evaluator` keeps one drafter across its calls: the second evaluation of the same held-out prompts (greedy, the
  same weights) drafts from the first's answers and gives the same answers."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from areal_jax.data.records import PromptRecord  # pylint: disable=g-import-not-at-top
  from areal_jax.rl.evaluation import Evaluator  # pylint: disable=g-import-not-at-top
  from areal_jax.sharding import make_mesh  # pylint: disable=g-import-not-at-top

  model = tiny_model(TINY, seed=20)
  rng = np.random.default_rng(6)
  records = [PromptRecord(uid=str(i), prompt="", prompt_ids=rng.integers(2, 64, size=n).astype(np.int32),
                          reference="") for i, n in enumerate((5, 9, 6))]
  evaluator = Evaluator(model_cfg=TINY, records=records, mesh=make_mesh(jax.devices()[:2], {"data": -1, "tensor": 1}),
                        sampler_cfg=SCHED_CFG.replace(speculation="suffix", spec_tokens=3, max_new_tokens=20),
                        eos_ids=(1,), detokenize=lambda ids: " ".join(map(str, ids)),
                        score=lambda items: [0.0] * len(items))
  params = nnx.state(model, nnx.Param)
  first = evaluator(params)
  from_prompts = evaluator.drafter.stats["prompt"]
  second = evaluator(params)
  np.testing.assert_array_equal(first.lengths, second.lengths)
  assert evaluator.drafter.sizes()["prompts"] == 3 and evaluator.drafter.stats["prompt"] > from_prompts


def test_sampled_answers_with_suffix_drafts_follow_the_model_s_distribution():
  """Temperature 0.7 over 3 drawable ids (`vocab_limit`), answers of 4 tokens: 3,000 answers to one prompt, drafted
  from the earlier ones, against the exact distribution of the 81 sequences by the dense forward (chi-square); the
  recorded logprobs are the dense forward's."""
  model = tiny_model(TINY, seed=7)
  cfg = SCHED_CFG.replace(num_slots=32, num_pages=32 * 12 + 1, speculation="suffix", spec_tokens=3, vocab_limit=3)
  prompt = np.array([5, 0, 1, 2, 0, 1], np.int32)
  sp = SamplingParams(temperature=0.7, max_new_tokens=4, ignore_eos=True, seed=3)
  rounds = [[Request(group_id=g, prompt_ids=prompt, num_answers=30, sampling=sp) for g in range(100)]]
  answers, sched, _ = _run({0: model}, cfg, rounds)
  assert len(answers) == 3000 and sched.counters["spec_accepted"] > 500
  seqs = np.array([t.response_ids for t in answers.values()])
  counts = np.bincount(seqs @ np.array([27, 9, 3, 1]), minlength=81)
  # Exact: p(x1..x4 | prompt) over all 81 sequences, from dense forwards at temperature 0.7 restricted to ids < 3.
  grid = np.stack(np.meshgrid(*[np.arange(3)] * 4, indexing="ij"), -1).reshape(-1, 4)
  ids = np.concatenate([np.broadcast_to(prompt, (81, len(prompt))), grid], axis=1)
  logits = np.asarray(model(jnp.asarray(ids)), np.float64)[:, len(prompt) - 1:-1, :3] / 0.7
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  p = np.exp(np.take_along_axis(logp, grid[..., None], -1)[..., 0].sum(-1))
  assert stats.chisquare(counts, p / p.sum() * len(seqs)).pvalue > 1e-3
  for t in list(answers.values())[::60]:  # every recorded logprob is the dense forward's (the whole vocabulary's)
    np.testing.assert_allclose(t.logprobs, _dense_logprobs(model, t, temperature=0.7), atol=2e-5)
