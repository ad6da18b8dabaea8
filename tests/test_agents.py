"""Agents written against the OpenAI API, in training: rewards by AReaL's turn discount, turns merged where the
prompts extend each other (numpy references), and episodes run by the real `openai.AsyncOpenAI` client against the
training sampler, recorded token for token (checked against a dense forward pass); a faulty agent loses only its own
episode; a run trains on an agent's episodes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax import agents
from areal_jax.agents.episodes import Completion
from areal_jax.config import load_config
from areal_jax.learner.microbatch import Layout, assemble
from areal_jax.rl import trainer
from areal_jax.rl.metrics import read_metrics
from areal_jax.rl.rollout import LocalRollout
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.requests import SamplingParams
from areal_jax.sharding import make_mesh
from areal_jax.tokenizer import CharTokenizer
from helpers import FAST, TINY, tiny_model
from test_system_e2e import CONFIG

TOK = CharTokenizer()
PROBLEMS = [{"uid": f"p{i}", "question": f"what is {i}+{i + 1}?", "reference": str(2 * i + 1), "kind": "math",
             "solution": "", "prompt": f"Q: what is {i}+{i + 1}?\nA: "} for i in range(4)]


def completion(rid, prompt, tokens, version=0):
  n = len(tokens)
  return Completion(response_id=rid, prompt_ids=np.asarray(prompt, np.int32), tokens=np.asarray(tokens, np.int32),
                    logprobs=-np.arange(1, n + 1, dtype=np.float32), versions=np.full(n, version, np.int32),
                    finish_reason="length")


def test_rewards_go_back_with_the_turn_discount():
  c = [completion(f"r{i}", [1], [2]) for i in range(3)]
  assert agents.assign_rewards(c, 1.0, 0.5) == [0.25, 0.5, 1.0]
  assert agents.assign_rewards(c, {"r1": 0.8}, 0.5) == [0.4, 0.8, 0.0]  # unset: 0
  assert agents.assign_rewards(c, {"r0": 0.3, "r2": 1.0}, 0.5) == [0.55, 0.5, 1.0]  # a set reward adds the later ones
  assert agents.assign_rewards([], 1.0, 0.9) == []
  for bad, error in ((float("nan"), TypeError), ("1", TypeError), (True, TypeError), ({"r9": 1.0}, ValueError)):
    with pytest.raises(error):
      agents.assign_rewards(c, bad, 1.0)


def test_turns_that_extend_each_other_merge_into_one_sequence():
  first = completion("a", [5, 6], [7, 8], version=3)
  second = completion("b", [5, 6, 7, 8, 9, 9], [10], version=4)  # prompt = first's prompt + answer + 2 context tokens
  third = completion("c", [5, 6, 11], [12, 13], version=4)  # a rewritten history: a sequence of its own
  merged, alone = agents.to_trajectories([first, second, third], [0.5, 0.7, 1.0], group_id=9)
  np.testing.assert_array_equal(merged.prompt_ids, [5, 6])
  np.testing.assert_array_equal(merged.response_ids, [7, 8, 9, 9, 10])
  np.testing.assert_array_equal(merged.loss_mask, [1, 1, 0, 0, 1])
  np.testing.assert_array_equal(merged.logprobs, [-1, -2, 0, 0, -1])
  np.testing.assert_array_equal(merged.versions, [3, 3, 3, 3, 4])
  assert (merged.reward, merged.group_id, merged.num_loss_tokens, merged.version_start) == (0.7, 9, 3, 3)
  assert alone.loss_mask is None and alone.reward == 1.0 and alone.num_loss_tokens == 2
  # Packed for the learner: loss only on the policy's tokens, their loss weights likewise.
  mb = assemble(Layout(rows=((0,),), length=8), [merged], [np.ones(5, np.float32)])
  np.testing.assert_array_equal(mb.loss_mask[0], [0, 1, 1, 0, 0, 1, 0, 0])
  np.testing.assert_array_equal(mb.loss_weights[0], mb.loss_mask[0])


@pytest.fixture(scope="module")
def model():
  return tiny_model(dataclasses.replace(TINY, max_position_embeddings=128), seed=1)


@pytest.fixture(scope="module")
def rollout(model):
  cfg = SamplerConfig(num_slots=8, page_size=8, num_pages=64, max_seq_len=128, max_new_tokens=16,
                      vocab_limit=TOK.vocab_size)
  r = LocalRollout(abstract_model=nnx.eval_shape(lambda: model), config=cfg, mesh=make_mesh(
      jax.devices()[:1], {"data": 1, "tensor": 1}), params=nnx.state(model, nnx.Param), version=0,
                   eos_ids=[TOK.eos_id], detokenize=TOK.decode)
  yield r
  r.stop()


def runner(rollout, agent, **config):
  return agents.EpisodeRunner(agent=agent, config=agents.AgentConfig(**{"max_turns": 4, "timeout_s": 120, **config}),
                              rollout=rollout, tokenizer=TOK, sampling=SamplingParams(temperature=1.0, seed=0),
                              limits={"max_seq_len": 128, "vocab_size": TINY.vocab_size}, version=lambda: 0)


def dense_logprobs(model, prompt, response):
  seq = np.concatenate([prompt, response]).astype(np.int32)
  logits = jax.jit(lambda t: model(t))(jnp.asarray(seq[None]))[0]
  rows = np.asarray(jax.nn.log_softmax(logits[len(prompt) - 1:-1], axis=-1))
  return rows[np.arange(len(response)), response]


def test_episodes_are_recorded_as_the_sampler_drew_them(rollout, model):
  import agent_examples  # pylint: disable=g-import-not-at-top

  chat = runner(rollout, agent_examples.two_turn, turn_discount=0.5)
  tokens = runner(rollout, agent_examples.token_turns)
  try:
    results = [chat.submit(p, group_id=1, index=i, min_version=0) for i, p in enumerate(PROBLEMS)]
    results = [f.result(timeout=300) for f in results]
    merged = tokens.submit(PROBLEMS[0], group_id=2, index=0, min_version=0).result(timeout=300)
  finally:
    chat.stop()
    tokens.stop()
  for p, r in zip(PROBLEMS, results):
    assert r.failure is None and r.turns == 2
    first = r.trajectories[0]
    np.testing.assert_array_equal(first.prompt_ids, TOK.encode(p["prompt"]))
    assert first.group_id == 1 and r.reward in (0.0, 1.0)
    if len(r.trajectories) == 1:  # the chat template rendered the first answer back token for token: merged
      mask = first.loss_mask.astype(bool)
      assert mask[:8].all() and TOK.decode(first.response_ids[~mask]) == f"\nQ: check: {p['question']}\nA: "
      assert first.reward == r.reward
    else:  # the answer drew ids that decode to nothing (pad, EOS ignored): the turns stay apart
      assert TOK.encode(TOK.decode(first.response_ids)) != first.response_ids.tolist()
      assert first.loss_mask is None and (first.reward, r.trajectories[1].reward) == (0.5 * r.reward, r.reward)
    for t in r.trajectories:
      mask = np.ones(len(t.response_ids), bool) if t.loss_mask is None else t.loss_mask.astype(bool)
      assert set(t.versions.tolist()) == {0}
      np.testing.assert_allclose(t.logprobs[mask], dense_logprobs(model, t.prompt_ids, t.response_ids)[mask],
                                 atol=1e-4)
  [t] = merged.trajectories
  assert merged.turns == 2 and t.reward == 1.0 and t.num_loss_tokens == 9  # rewards by response id: the last one's
  assert TOK.decode(t.response_ids[~t.loss_mask.astype(bool)]) == "\nok "


@pytest.mark.parametrize("agent,config,why,turns", [
    ("raises", {}, "ValueError: the tool crashed", 1),
    ("sleeps", {"timeout_s": 0.5}, "timed out after agent.timeout_s=0.5 s", 0),
    ("says_yes", {}, "TypeError: reward='yes'", 1),
    ("loops", {"max_turns": 2}, "agent.max_turns=2 completions reached", 2),
    ("too_long", {}, "too long", 0),
])
def test_a_faulty_agent_loses_only_its_episode(rollout, agent, config, why, turns):
  import agent_examples  # pylint: disable=g-import-not-at-top

  bad, good = runner(rollout, getattr(agent_examples, agent), **config), runner(rollout, agent_examples.two_turn)
  try:
    failed = bad.submit(PROBLEMS[0], group_id=3, index=0, min_version=0)
    fine = good.submit(PROBLEMS[1], group_id=3, index=1, min_version=0)
    failed, fine = failed.result(timeout=300), fine.result(timeout=300)
  finally:
    bad.stop()
    good.stop()
  assert why in failed.failure and failed.turns == turns and bad.failures == 1
  assert all(t.reward == 0.0 for t in failed.trajectories) and len(failed.trajectories) == turns
  assert fine.failure is None and fine.turns == 2 and good.failures == 0


def test_agent_config_and_loading_name_what_is_wrong():
  assert agents.load("agent_examples:two_turn").__name__ == "two_turn"
  assert agents.load("agent_examples:Counting").__name__ == "run"
  for path, words in (("agent_examples", "expected 'module:attribute'"), ("no_such_module:run", "cannot import"),
                      ("agent_examples:missing", "has no 'missing'"), ("agent_examples:asyncio", "neither")):
    with pytest.raises(ValueError, match=words):
      agents.load(path) if ":" in path else agents.AgentConfig(path=path)
  with pytest.raises(ValueError, match="agent.turn_discount=1.5"):
    agents.AgentConfig(turn_discount=1.5)


def test_a_run_trains_on_an_agents_episodes(tmp_path):
  config = load_config(CONFIG, total_steps=2, **{**FAST, "agent.path": "agent_examples:two_turn",
                                                 "sampler.max_seq_len": 128})
  rows = trainer.run(config, str(tmp_path))
  assert [r["step"] for r in rows] == [0, 1, 2]
  for m in read_metrics(str(tmp_path))[1:]:
    assert m["agent/turns_mean"] == 2.0 and m["agent/episode_failures"] == 0, m
    assert m["staleness/max"] <= config.rollout.max_head_offpolicyness
