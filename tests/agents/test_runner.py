"""Agents written against the OpenAI API, in training: rewards by AReaL's turn discount, turns merged where the
prompts extend each other (numpy references), and episodes run by the real `openai.AsyncOpenAI` client against the
training sampler, recorded token for token (checked against a dense forward pass); a faulty agent loses only its own
episode; a run trains on an agent's episodes."""

import concurrent.futures
import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax import agents
from areal_jax import config as config_lib
from areal_jax.agents.episodes import Completion
from areal_jax.config import load_config
from areal_jax.errors import SamplerLost
from areal_jax.learner.microbatch import Layout, assemble
from areal_jax.rl.metrics import read_metrics
from areal_jax.distributed.replicas import LocalRollout
from areal_jax.run import trainer
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.requests import SamplingParams
from areal_jax.sharding import make_mesh
from areal_jax.tokenizer import CharTokenizer
from helpers import TINY, memorize, tiny_model
from run_checks import CONFIG

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
  r = LocalRollout(abstract_model=nnx.eval_shape(lambda: model), config=cfg, meshes=[make_mesh(
      jax.devices()[:1], {"data": 1, "tensor": 1})], params=nnx.state(model, nnx.Param), version=0,
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


def test_an_episode_s_requests_carry_its_name(rollout):
  """Every completion an episode asks for is tagged with the episode (`Request.episode`): its turns go to one
  sampler replica, whose prefix cache holds the turn before."""
  import agent_examples  # pylint: disable=g-import-not-at-top

  seen = []

  class Watched:
    def submit(self, request):
      seen.append(request.episode)
      return rollout.submit(request)

  chat = runner(Watched(), agent_examples.two_turn)
  try:
    result = chat.submit(PROBLEMS[0], group_id=5, index=1, min_version=0).result(timeout=300)
  finally:
    chat.stop()
  assert result.failure is None and seen == ["5-1", "5-1"]


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


class LosesSecondRequest:
  """The rollout, except that the answers of its second request fail as when their sampler process is lost."""

  def __init__(self, rollout):
    self.rollout, self.requests = rollout, 0

  def submit(self, request):
    self.requests += 1
    if self.requests != 2:
      return self.rollout.submit(request)
    futures = [concurrent.futures.Future() for _ in range(request.num_answers)]
    for f in futures:
      f.set_exception(SamplerLost("sampler 0 (process 1) is gone"))
    return futures

  def __getattr__(self, name):
    return getattr(self.rollout, name)


def test_an_episode_whose_sampler_is_lost_says_so_for_its_group_to_be_generated_again(rollout):
  import agent_examples  # pylint: disable=g-import-not-at-top

  lossy = runner(LosesSecondRequest(rollout), agent_examples.two_turn)
  try:
    result = lossy.submit(PROBLEMS[0], group_id=4, index=0, min_version=0).result(timeout=300)
  finally:
    lossy.stop()
  assert result.lost and result.turns == 1 and "503" in result.failure  # its second completion never came


def test_agent_config_and_loading_name_what_is_wrong():
  assert agents.load("agent_examples:two_turn").__name__ == "two_turn"
  assert agents.load("agent_examples:Counting").__name__ == "run"
  for path, words in (("agent_examples", "expected 'module:attribute'"), ("no_such_module:run", "cannot import"),
                      ("agent_examples:missing", "has no 'missing'"), ("agent_examples:asyncio", "neither")):
    with pytest.raises(ValueError, match=words):
      agents.load(path) if ":" in path else agents.AgentConfig(path=path)
  with pytest.raises(ValueError, match="agent.turn_discount=1.5"):
    agents.AgentConfig(turn_discount=1.5)
  calculator = "areal_jax.agents.calculator:Calculator"
  assert agents.load(calculator, {"demo_tool_share": 0.5}).__self__.demo_tool_share == 0.5
  with pytest.raises(ValueError, match=r"agent.options=\{'tool_share': 0.5\}: .* does not take them"):
    agents.load(calculator, {"tool_share": 0.5})
  with pytest.raises(ValueError, match="only a class at agent.path takes options"):
    agents.load("agent_examples:two_turn", {"turns": 2})


@pytest.mark.slow
def test_the_bundled_agent_config_warm_starts_on_demonstrations_trains_and_evaluates_episodes(tmp_path, caplog):
  """configs/agent.py end to end (small shapes): the warm-start on the calculator's demonstrations, training on its
  episodes, evaluation by episodes at each evaluated version."""
  config = load_config(os.path.join(os.path.dirname(CONFIG), "agent.py:fast"), total_steps=2,
                       **{"sampler.prefix_cache": True, "warmstart.cache_dir": ""})  # its own warm-start, trained
  with caplog.at_level(logging.INFO):
    rows = trainer.run(config, str(tmp_path))
  assert "demonstrated episodes" in caplog.text and "HTTP Request" not in caplog.text
  assert [r["step"] for r in rows] == [0, 1, 2]
  metrics = read_metrics(str(tmp_path))
  for m in metrics[1:]:
    assert 1 <= m["agent/turns_mean"] <= 2 and m["agent/episode_failures"] == 0, m
    assert m["staleness/max"] <= config.rollout.max_head_offpolicyness
  for m in (metrics[0], metrics[2]):
    assert 0 <= m["eval/accuracy"] <= 1 and 1 <= m["eval/turns_mean"] <= 2, m
  # Every prompt starts with the same rendered system turn and tools (and a second turn's with its first turn's whole
  # context): with the prefix cache on, later prompts find those pages cached.
  assert sum(m["sampler/cached_tokens"] for m in metrics[1:]) > 0


@pytest.mark.slow
def test_256_concurrent_episodes_in_three_apis_all_finish(rollout):
  """256 episodes at once on an 8-slot sampler, chat completions, the Responses API and the Messages API mixed:
  within the time limit every episode finishes with both its completions recorded and merged."""
  import agent_examples  # pylint: disable=g-import-not-at-top

  kinds = [agent_examples.two_turn, agent_examples.two_turn_responses, agent_examples.two_turn_messages]
  runners = [runner(rollout, agent) for agent in kinds]
  problems = [{**PROBLEMS[i % 4], "uid": f"load{i}"} for i in range(256)]
  try:
    futures = [runners[i % 3].submit(p, group_id=100 + i, index=0, min_version=0) for i, p in enumerate(problems)]
    results = [f.result(timeout=600) for f in futures]
  finally:
    for r in runners:
      r.stop()
  assert [r.failure for r in results] == [None] * 256
  assert all(r.turns == 2 and len(r.completions[0].tokens) == 8 and r.retokenized == 0 for r in results)
  assert all(len(r.trajectories) == 1 and r.trajectories[0].group_id == 100 + i for i, r in enumerate(results))


@pytest.mark.slow
def test_the_calculator_written_for_the_messages_api_trains(tmp_path):
  """configs/agent.py (small shapes) with the calculator written against Anthropic's Messages API: its episodes call
  the tool (more than one completion each on average) and train, their turns kept as drawn. The run starts from a
  policy scripted on the demonstrations of its first prompts (`model.init_from`, an Orbax policy directory): the fast
  preset's 30 warm-start steps write no valid call yet, and 300 took most of this test's time."""
  from areal_jax.agents.calculator import ClaudeCalculator  # pylint: disable=g-import-not-at-top
  from areal_jax.data import DataConfig, build_dataset  # pylint: disable=g-import-not-at-top
  from areal_jax.models import orbax_io  # pylint: disable=g-import-not-at-top
  from areal_jax.rl.workflows import problem  # pylint: disable=g-import-not-at-top

  config = load_config(os.path.join(os.path.dirname(CONFIG), "agent.py:fast"), total_steps=2,
                       **{"agent.path": "areal_jax.agents.calculator:ClaudeCalculator"})
  data = DataConfig.from_config(config.data)
  train, held_out = build_dataset(data, TOK, split="train"), build_dataset(data, TOK, split="eval")
  records = [next(train) for _ in range(16)] + list(held_out.records)
  demos = [ClaudeCalculator(demo_tool_share=1.0).demonstration(problem(r)) for r in records]
  policy = memorize(tiny_model(config_lib.model_config(config)), agents.demonstration_pairs(demos, TOK), steps=2000)
  orbax_io.save_orbax(policy, str(tmp_path / "policy"))
  config.model.init_from = str(tmp_path / "policy")
  trainer.run(config, str(tmp_path / "run"))
  metrics = read_metrics(str(tmp_path / "run"))[1:]
  assert [m["step"] for m in metrics] == [1, 2]
  for m in metrics:
    assert m["agent/turns_mean"] > 1 and m["agent/episode_failures"] == 0 and m["agent/retokenized_turns"] == 0, m
    assert np.isfinite(m["reward/trained_mean"]) and m["staleness/max"] <= config.rollout.max_head_offpolicyness


@pytest.mark.slow
@pytest.mark.parametrize("agent", ["Calculator", "ClaudeCalculator"])
def test_the_calculator_agent_calls_its_tool_and_its_turns_merge(agent):
  """The bundled agent (over chat completions, and written again against Anthropic's Messages API) against a policy
  scripted (memorized) on its demonstrations: a tool call, the tool's result, the boxed product, one merged sequence
  whose loss covers only the policy's tokens; a policy that answers in its head, wrongly, scores 0 in one turn.
  `EpisodeEvaluator` reports the same episodes as success and turns."""
  from areal_jax.agents import calculator  # pylint: disable=g-import-not-at-top
  from areal_jax.agents.calculator import Calculator  # pylint: disable=g-import-not-at-top
  from areal_jax.rl.evaluation import EpisodeEvaluator  # pylint: disable=g-import-not-at-top

  problems = [{"uid": f"c{i}", "question": f"what is {a}*{b}?", "reference": str(a * b), "kind": "math",
               "solution": "", "prompt": ""} for i, (a, b) in enumerate([(37, 48), (25, 16), (91, 13)])]
  with_tool, in_head = Calculator(demo_tool_share=1.0), Calculator(demo_tool_share=0.0)
  demos = [with_tool.demonstration(p) for p in problems[:2]]
  demos.append(in_head.demonstration({**problems[2], "reference": "7"}))  # a wrong answer, without the tool
  pairs = agents.demonstration_pairs(demos, TOK)
  assert [len(a) for _, a in pairs] == [68, 13, 68, 12, 10]  # tool call + eos, "\boxed{1776}" + eos, ...
  model = memorize(tiny_model(dataclasses.replace(TINY, hidden_size=64, intermediate_size=128), seed=2), pairs)
  cfg = SamplerConfig(num_slots=8, page_size=16, num_pages=128, max_seq_len=224, max_new_tokens=80,
                      vocab_limit=TOK.vocab_size)
  rollout = LocalRollout(abstract_model=nnx.eval_shape(lambda: model), config=cfg, meshes=[make_mesh(
      jax.devices()[:1], {"data": 1, "tensor": 1})], params=nnx.state(model, nnx.Param), version=0,
                         eos_ids=[TOK.eos_id], detokenize=TOK.decode)
  run = agents.EpisodeRunner(agent=getattr(calculator, agent)().run,
                             config=agents.AgentConfig(max_turns=4, timeout_s=120),
                             rollout=rollout, tokenizer=TOK, sampling=SamplingParams(temperature=0.0, seed=0),
                             limits={"max_seq_len": 224, "vocab_size": 64}, version=lambda: 0)
  try:
    solved, wrong = [run.submit(p, group_id=1, index=i, min_version=0).result(timeout=300)
                     for i, p in zip((0, 2), (problems[0], problems[2]))]
    evaluation = EpisodeEvaluator(runner=run, problems=problems, num_samples=2)(version=0)
  finally:
    run.stop()
    rollout.stop()
  assert (solved.failure, solved.turns, solved.reward, solved.retokenized) == (None, 2, 1.0, 0)
  [t] = solved.trajectories
  np.testing.assert_array_equal(t.prompt_ids, pairs[0][0])
  np.testing.assert_array_equal(t.response_ids[t.loss_mask == 1], np.concatenate([pairs[0][1], pairs[1][1]]))
  assert TOK.decode(t.response_ids[t.loss_mask == 0]) == "\nresult: 1776\nA: " and t.reward == 1.0
  # The warm-start's merged demonstration is the recorded episode, token for token and mask for mask.
  demo, one_turn = agents.demonstration_episodes([demos[0], demos[2]], TOK)
  for got, want in ((demo.prompt_ids, t.prompt_ids), (demo.response_ids, t.response_ids), (demo.loss_mask, t.loss_mask),
                    (one_turn.prompt_ids, pairs[4][0]), (one_turn.response_ids, pairs[4][1])):
    np.testing.assert_array_equal(got, want)
  assert one_turn.loss_mask is None
  assert len(agents.demonstration_episodes(demos, TOK, max_response_len=67)) == 1  # the call turns are 68 tokens
  assert (wrong.failure, wrong.turns, wrong.reward) == (None, 1, 0.0)
  np.testing.assert_array_equal(evaluation.correct, [[1, 1], [1, 1], [0, 0]])
  assert evaluation.accuracy == pytest.approx(2 / 3) and evaluation.turns == pytest.approx(5 / 3)
  assert evaluation.metrics()["eval/turns_mean"] == pytest.approx(5 / 3)


def test_the_calculator_agent_retries_a_wrong_answer_for_a_discounted_reward():
  """`attempts=2` (AReaL's multi-turn rule): a wrong answer is told so, with the question again, and the model tries
  once more; a right second answer earns `retry_discount`. The replies are scripted as the OpenAI client types them."""
  import asyncio  # pylint: disable=g-import-not-at-top
  from openai.types.chat import ChatCompletion  # pylint: disable=g-import-not-at-top
  from areal_jax.agents.calculator import Calculator  # pylint: disable=g-import-not-at-top

  call = {"id": "c0", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "37*48"}'}}
  script = [{"content": "\\boxed{7}"}, {"content": None, "tool_calls": [call]}, {"content": "\\boxed{1776}"}]

  class Client:  # chat.completions.create(...) answers from `script`, keeping each request's messages
    def __init__(self):
      self.chat = self.completions = self
      self.sent, self.replies = [], iter(script)

    async def create(self, *, messages, **_):
      self.sent.append([dict(m) for m in messages])
      return ChatCompletion.model_validate({"id": "r", "object": "chat.completion", "created": 0, "model": "policy",
                                            "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                                "role": "assistant", **next(self.replies)}}]})

  data = {"question": "what is 37*48?", "reference": "1776"}
  once, twice = Client(), Client()
  assert asyncio.run(Calculator().run(data, once)) == 0.0 and len(once.sent) == 1
  assert asyncio.run(Calculator(attempts=2, retry_discount=0.5).run(data, twice)) == 0.5
  assert [[m["role"] for m in sent] for sent in twice.sent] == [
      ["user"], ["user", "assistant", "user"], ["user", "assistant", "user", "assistant", "tool"]]
  assert twice.sent[2][2]["content"] == "wrong, what is 37*48?" and twice.sent[2][4]["content"] == "1776"
  with pytest.raises(ValueError, match="attempts=0 must be >= 1"):
    agents.load("areal_jax.agents.calculator:Calculator", {"attempts": 0})


def test_the_calculator_tool_evaluates_integer_expressions_only():
  from areal_jax.agents.calculator import calc  # pylint: disable=g-import-not-at-top

  assert [calc("37*48"), calc("2*(3-10)"), calc("-4")] == ["1776", "-14", "-4"]
  for bad in ("2**100", "__import__('os')", "1/2", "1.5*2", "9" * 70, None, 12, ""):
    assert calc(bad) == "error"
