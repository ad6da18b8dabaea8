"""Agents written with real agent frameworks and clients, unchanged, in training and in serving: the OpenAI Agents SDK
(`Agent`, `function_tool`, `Runner`) over chat completions and with its default model (the Responses API, on a global
default client), LangChain (`ChatOpenAI.bind_tools`), `openai`'s `responses.create` and `anthropic`'s
`messages.create`. A tiny policy is scripted (trained in the test until its greedy answers are a tool call, then the
answer after the tool's result); each agent then trains through `EpisodeRunner` (recorded token for token, reward 1)
and runs against the policy server with a plain `openai.AsyncOpenAI` (or `anthropic.AsyncAnthropic`)."""

import asyncio
import dataclasses
import json

import anthropic
import jax
import openai
import pytest
from flax import nnx

import agent_examples
from areal_jax import agents
from areal_jax.agents.runner import wants_anthropic
from areal_jax.models import load_hf, save_hf
from areal_jax.distributed.replicas import LocalRollout
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.requests import SamplingParams
from areal_jax.serve import build
from areal_jax.sharding import make_mesh
from areal_jax.tokenizer import load_tokenizer
from helpers import TINY, TOOLS_CHATML, memorize, tiny_model, write_bpe_tokenizer

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

MAX_SEQ_LEN = 512
PROBLEM = {"uid": "p0", "question": "What is 12 + 34?", "reference": "46", "kind": "math", "solution": "",
           "prompt": "What is 12 + 34?"}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 34}}</tool_call>'
ANSWER = "The answer is 46."
FRAMEWORKS = {"agents_sdk": agent_examples.agents_sdk_calculator, "langchain": agent_examples.langchain_calculator,
              "agents_sdk_default": agent_examples.agents_sdk_default_calculator,
              "responses": agent_examples.responses_calculator, "anthropic": agent_examples.anthropic_calculator}
SCHEMAS = [  # what the two frameworks send for `add` (their own converters' output), so the tokenizer compresses it
    '{"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": '
    '{"properties": {"a": {"title": "A", "type": "integer"}, "b": {"title": "B", "type": "integer"}}, "required": '
    '["a", "b"], "title": "add_args", "type": "object", "additionalProperties": false}, "strict": true}}',
    '{"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": '
    '{"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"], "type": "object"}}}']


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("frameworks_hf"))
  texts = [*SCHEMAS * 4, TOOLS_CHATML, CALL * 4, ANSWER * 4, PROBLEM["question"] * 4, "Use the add tool." * 4]
  tok = load_tokenizer(write_bpe_tokenizer(path, texts, vocab_size=400, template=TOOLS_CHATML))
  cfg = dataclasses.replace(TINY, vocab_size=tok.vocab_size, max_position_embeddings=MAX_SEQ_LEN)
  save_hf(tiny_model(cfg, seed=5), path)
  return path


@pytest.fixture(scope="module")
def tok(hf_dir):
  return load_tokenizer(hf_dir)


@pytest.fixture(scope="module")
def rollout(hf_dir, tok):
  model = load_hf(hf_dir)
  cfg = SamplerConfig(num_slots=4, page_size=16, num_pages=4 * MAX_SEQ_LEN // 16 + 1, max_seq_len=MAX_SEQ_LEN,
                      max_new_tokens=64, vocab_limit=tok.vocab_size)
  r = LocalRollout(abstract_model=nnx.eval_shape(lambda: model), config=cfg, params=nnx.state(model, nnx.Param),
                   meshes=[make_mesh(jax.devices()[:1], {"data": 1, "tensor": 1})], version=0, eos_ids=[tok.eos_id],
                   detokenize=tok.decode)
  yield r
  r.stop()


def episodes(rollout, tok, *, may_fail=False):
  """One training episode of each framework's agent (greedy sampling, so the scripted policy answers as taught)."""
  runner = agents.EpisodeRunner(agent=None, config=agents.AgentConfig(max_turns=4, timeout_s=300), rollout=rollout,
                                tokenizer=tok, sampling=SamplingParams(temperature=0.0),
                                limits={"max_seq_len": MAX_SEQ_LEN, "vocab_size": tok.vocab_size},
                                version=lambda: 0)
  try:
    out = {}
    for name, agent in FRAMEWORKS.items():
      runner.agent = agent
      out[name] = runner.submit(PROBLEM, group_id=0, index=0, min_version=0).result(timeout=300)
      assert may_fail or out[name].failure is None, (name, out[name].failure)
    return out
  finally:
    runner.stop()


def test_agent_frameworks_train_and_serve_unchanged(hf_dir, tok, rollout):
  model = load_hf(hf_dir)
  call, answer = tok.encode(CALL) + [tok.eos_id], tok.encode(ANSWER) + [tok.eos_id]
  # Round 1, the random policy: what each framework sends first (its tools rendered by the chat template). Its
  # rambling answer may make the next request too long for the cache: that episode fails, its first request is kept.
  first = {name: r.completions[0].prompt_ids.tolist() for name, r in episodes(rollout, tok, may_fail=True).items()}
  scripted = memorize(model, [(p, call) for p in first.values()])
  rollout.publish(nnx.state(scripted, nnx.Param), version=1)
  # Round 2: each framework runs the tool and sends its result back.
  results = episodes(rollout, tok)
  second = {}
  for name, r in results.items():
    assert r.completions[0].tokens.tolist() == call, name
    second[name] = r.completions[1].prompt_ids.tolist()
    assert "<tool_response>46</tool_response>" in tok.decode(second[name]), name  # the tool ran: add(12, 34)
  scripted = memorize(model, [(p, call) for p in first.values()] + [(p, answer) for p in second.values()])
  params = nnx.state(scripted, nnx.Param)
  rollout.publish(params, version=2)
  # Training: two recorded completions per episode, the tool call and the answer, rewarded 1.
  for name, r in episodes(rollout, tok).items():
    assert (r.turns, r.reward, r.retokenized) == (2, 1.0, 0), name
    assert [c.tokens.tolist() for c in r.completions] == [call, answer]
    assert all(set(c.versions.tolist()) == {2} for c in r.completions)
    assert sum(t.num_loss_tokens for t in r.trajectories) == len(call) + len(answer)
  # Serving: the same functions against the policy server, through a plain AsyncOpenAI client.
  with build(hf_dir, port=0, devices=jax.devices()[:1], max_seq_len=MAX_SEQ_LEN, num_slots=4, page_size=16,
             model_name=agent_examples.MODEL, warmup=False) as server:
    server.sampler.update_params(server.sampler.scheduler.engine.load_params(params), version=2)

    async def serve(agent):
      client = (anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0)
                if wants_anthropic(agent) else openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                                                  max_retries=0))
      async with client:
        return await agent(dict(PROBLEM), client)

    for name, agent in FRAMEWORKS.items():
      assert asyncio.run(serve(agent)) == 1.0, name
    assert json.loads(json.dumps(server.sampler.stats()))["finished"] == 2 * len(FRAMEWORKS)
