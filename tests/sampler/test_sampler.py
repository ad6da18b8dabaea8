"""The one sampler: its options hold together for every user (the run, the server, `generate()`, evaluation),
e.g. a server request that asks for a newer policy waits for it, streams and counts against the queue limit."""

import numpy as np
import pytest

from areal_jax.sampler import Engine, Request, SamplerConfig, SamplingParams, generate
from areal_jax.sampler.sampler import QueueFull, Sampler
from helpers import TINY, tiny_model


@pytest.fixture(scope="module")
def model():
  return tiny_model(TINY, seed=3)


@pytest.fixture(scope="module")
def engine(model):
  return Engine(model=model, config=SamplerConfig(num_slots=2, page_size=4, num_pages=2 * 8 + 1, max_seq_len=32,
                                                  max_new_tokens=8, decode_steps=4))


def test_a_held_request_streams_after_its_version_and_queued_ones_count_against_the_limit(model, engine):
  params = engine.load_params(model)
  sampler = Sampler(engine=engine, params=params, version=0, max_queue=1).start()
  sampling = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
  streamed = []
  try:
    [held] = sampler.submit_many([Request(group_id=0, prompt_ids=np.array([5, 6, 7]), num_answers=2,
                                          sampling=sampling, min_version=1)],
                                 on_tokens=lambda i, t: streamed.append((t.answer, t.tokens, t.finish_reason)))
    # Two slots free, one queued request allowed beyond them: 2 + 1 requests are accepted, the next one is not.
    sampler.submit_many([Request(group_id=g, prompt_ids=np.array([5, 6]), sampling=sampling, min_version=1)
                         for g in (1, 2)])
    with pytest.raises(QueueFull, match="max_queue=1"):
      sampler.submit_many([Request(group_id=3, prompt_ids=np.array([5]), sampling=sampling)])
    assert not held.done() and sampler.stats()["running"] == 0  # waits for weights of version 1
    sampler.update_params(params, version=1)
    answers = held.result(timeout=120)
  finally:
    sampler.stop()
  assert [a.versions for a in answers] == [[1] * 6, [1] * 6]
  assert sorted(a for a, _, why in streamed if why) == [0, 1]  # each answer's last report says why it ended
  for answer in (0, 1):  # the streamed pieces add up to the answer
    assert sum((t for a, t, _ in streamed if a == answer), []) == answers[answer].tokens
  assert sampler.stats()["rejected"] == 1


def test_run_steps_in_the_caller_s_thread_and_matches_generate(model, engine):
  params = engine.load_params(model)
  prompts = [np.array([5, 6, 7]), np.array([8, 9])]
  sampling = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
  out = Sampler(engine=engine, params=params).run([Request(group_id=j, prompt_ids=p, sampling=sampling)
                                                   for j, p in enumerate(prompts)])
  want = generate(model, prompts, max_new_tokens=5, temperature=0.0)
  assert [row[0].tokens for row in out] == [list(row[0].tokens) for row in want]
  with pytest.raises(ValueError, match="waits for policy version 2"):
    Sampler(engine=engine, params=params).run([Request(group_id=0, prompt_ids=prompts[0], sampling=sampling,
                                                       min_version=2)])
