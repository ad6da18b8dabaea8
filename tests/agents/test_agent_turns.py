"""Token in, token out across an agent's turns, in every API an agent speaks (chat completions, the Responses API by
`previous_response_id` or by input items, the Agents SDK's default model, Anthropic's Messages API), through the real
`openai`, `openai-agents` and `anthropic` clients in process: the second turn's prompt holds the tool call as the
policy drew it, though the template re-serialises it otherwise (the char template writes arguments first) or BPE
merges it otherwise; the turns merge into one training sequence; an edited history is re-encoded and counted. A
scripted rollout answers (a tool call, then the boxed product), so what is drawn is known."""

import concurrent.futures
import re

import numpy as np
import pytest

from areal_jax import agents
from areal_jax.agents import calculator
from areal_jax.agents.runner import wants_anthropic
from areal_jax.rl.step_metrics import agent_metrics
from areal_jax.sampler.requests import SamplingParams
from areal_jax.tokenizer import CharTokenizer, load_tokenizer
from areal_jax.types import Trajectory
from helpers import write_bpe_tokenizer

TOK = CharTokenizer()
CHAT_TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluates", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]
RESPONSES_TOOLS = [{"type": "function", **CHAT_TOOLS[0]["function"]}]
ANTHROPIC_TOOLS = [{"name": "calc", "description": "evaluates",
                    "input_schema": CHAT_TOOLS[0]["function"]["parameters"]}]


def drawn_call(expr):  # name first, spaces: not how the char template renders a call back
  return '<tool_call>{"name": "calc", "arguments": {"expr": "' + expr + '"}}</tool_call>'


class ScriptedRollout:
  """Answers a prompt that holds no tool result with a call of `calc` on the question's product, then the boxed
  product (`Rollout.submit`'s interface: a future per answer)."""

  def __init__(self, tok, answer=None):
    self.tok, self.prompts = tok, []
    self.answer = answer or self.calculator

  def calculator(self, text):
    a, b = re.findall(r"what is (\d+)\*(\d+)\?", text)[0]
    if "result: " in text or "<tool_response>" in text:
      return self.tok.encode("\\boxed{" + str(int(a) * int(b)) + "}") + [self.tok.eos_id]
    return self.tok.encode(drawn_call(f"{a}*{b}")) + [self.tok.eos_id]

  def submit(self, request):
    prompt = request.prompt_ids.tolist()
    self.prompts.append(prompt)
    ids = np.asarray(self.answer(self.tok.decode(prompt)), np.int32)
    f = concurrent.futures.Future()
    f.set_result(Trajectory(prompt_ids=request.prompt_ids, response_ids=ids, logprobs=np.full(len(ids), -0.5,
                                                                                                np.float32),
                            versions=np.zeros(len(ids), np.int32), finish_reason="stop"))
    return [f] * request.num_answers

  def stats(self):
    return {}


def product(data):
  return str(eval(data["question"].removeprefix("what is ").removesuffix("?")))  # pylint: disable=eval-used


async def chat_agent(data, client):
  messages = [{"role": "user", "content": data["question"]}]
  reply = (await client.chat.completions.create(model="m", messages=messages, tools=CHAT_TOOLS)).choices[0].message
  [call] = reply.tool_calls
  messages += [reply.model_dump(exclude_none=True),  # arguments as the server wrote them: '{"expr": "3*4"}'
               {"role": "tool", "tool_call_id": call.id, "content": product(data)}]
  final = await client.chat.completions.create(model="m", messages=messages, tools=CHAT_TOOLS)
  return float(product(data) in final.choices[0].message.content)


async def responses_by_id(data, client):
  first = await client.responses.create(model="m", input=data["question"], tools=RESPONSES_TOOLS)
  [call] = first.output
  result = {"type": "function_call_output", "call_id": call.call_id, "output": product(data)}
  final = await client.responses.create(model="m", input=[result], previous_response_id=first.id,
                                        tools=RESPONSES_TOOLS)
  return float(product(data) in final.output_text)


async def responses_by_items(data, client):
  question = {"role": "user", "content": data["question"]}
  first = await client.responses.create(model="m", input=[question], tools=RESPONSES_TOOLS, stream=True)
  [call] = [e async for e in first][-1].response.output
  items = [question, call.model_dump(exclude_none=True),
           {"type": "function_call_output", "call_id": call.call_id, "output": product(data)}]
  final = await client.responses.create(model="m", input=items, tools=RESPONSES_TOOLS)
  return float(product(data) in final.output_text)


async def anthropic_agent(data, client: "anthropic.AsyncAnthropic"):  # noqa: F821  (the annotation picks the client)
  messages = [{"role": "user", "content": data["question"]}]
  first = await client.messages.create(model="m", max_tokens=64, messages=messages, tools=ANTHROPIC_TOOLS)
  [use] = first.content
  messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": product(data)}]}]
  async with client.messages.stream(model="m", max_tokens=64, messages=messages, tools=ANTHROPIC_TOOLS) as s:
    final = await s.get_final_message()
  return float(product(data) in final.content[0].text)


def calc(expr: str) -> str:
  """evaluates"""
  return str(eval(expr))  # pylint: disable=eval-used


async def agents_sdk_default(data, client):
  """The Agents SDK's default model (the Responses API) through a global default client."""
  import agents as sdk  # pylint: disable=g-import-not-at-top

  sdk.set_default_openai_client(client, use_for_tracing=False)
  sdk.set_tracing_disabled(True)
  agent = sdk.Agent(name="calculator", instructions="use calc.", tools=[sdk.function_tool(calc)], model="m")
  result = await sdk.Runner.run(agent, data["question"], max_turns=3)
  return float(product(data) in str(result.final_output))


async def agents_sdk_streamed(data, client):
  """The same, streamed (`Runner.run_streamed`: the Responses API's events)."""
  import agents as sdk  # pylint: disable=g-import-not-at-top

  sdk.set_default_openai_client(client, use_for_tracing=False)
  sdk.set_tracing_disabled(True)
  agent = sdk.Agent(name="calculator", instructions="use calc.", tools=[sdk.function_tool(calc)], model="m")
  result = sdk.Runner.run_streamed(agent, data["question"], max_turns=3)
  kinds = {event.type async for event in result.stream_events()}
  assert "raw_response_event" in kinds
  return float(product(data) in str(result.final_output))


async def edits_history(data, client):
  """Sends its first answer back rewritten: no drawn answer matches it."""
  messages = [{"role": "user", "content": data["question"]}]
  await client.chat.completions.create(model="m", messages=messages, tools=CHAT_TOOLS)
  messages += [{"role": "assistant", "content": "let me see."}, {"role": "user", "content": "go on"}]
  await client.chat.completions.create(model="m", messages=messages, tools=CHAT_TOOLS)
  return 0.0


PROBLEMS = [{"uid": f"p{i}", "question": f"what is {i + 3}*{i + 4}?"} for i in range(8)]
API_AGENTS = {"chat": chat_agent, "responses_by_id": responses_by_id, "responses_by_items": responses_by_items,
              "anthropic": anthropic_agent, "agents_sdk_default": agents_sdk_default,
              "agents_sdk_streamed": agents_sdk_streamed}


def run_episodes(agent, rollout, tok, problems=PROBLEMS[:1]):
  runner = agents.EpisodeRunner(agent=agent, config=agents.AgentConfig(max_turns=4, timeout_s=60), rollout=rollout,
                                tokenizer=tok, sampling=SamplingParams(temperature=1.0),
                                limits={"max_seq_len": 512, "vocab_size": tok.vocab_size}, version=lambda: 0)
  try:
    futures = [runner.submit(p, group_id=i, index=0, min_version=0) for i, p in enumerate(problems)]
    results = [f.result(timeout=120) for f in futures]
    assert len(runner.responses) == 0  # the Responses API's stored responses went with their episodes
    return results
  finally:
    runner.stop()


@pytest.mark.parametrize("api", list(API_AGENTS))
def test_each_api_trains_the_drawn_tokens_across_turns(api):
  rollout = ScriptedRollout(TOK)
  [r] = run_episodes(API_AGENTS[api], rollout, TOK)
  assert r.failure is None and (r.turns, r.reward, r.retokenized) == (2, 1.0, 0), r.failure
  first, second = r.completions
  drawn = TOK.encode(drawn_call("3*4")) + [TOK.eos_id]
  assert first.tokens.tolist() == drawn
  # The second prompt continues the first prompt and the call as drawn, though the template writes the call back
  # another way (arguments first, no spaces): re-encoding its text would have given other ids.
  assert second.prompt_ids.tolist()[:len(first.prompt_ids) + len(drawn)] == first.prompt_ids.tolist() + drawn
  assert drawn_call("3*4") in TOK.decode(rollout.prompts[1])  # what the sampler was prompted with
  # So the episode is one training sequence: the call and the answer trained, the tool's result context.
  [traj] = r.trajectories
  assert traj.num_loss_tokens == len(drawn) + len(second.tokens)
  assert "result: 12" in TOK.decode(traj.response_ids[traj.loss_mask == 0])


def test_the_rendered_call_differs_from_the_drawn_one():
  """What the test above relies on: re-encoding the template's rendering does not give the drawn ids."""
  call = {"id": "c", "type": "function", "function": {"name": "calc", "arguments": {"expr": "3*4"}}}
  text = TOK.apply_chat_template([{"role": "user", "content": "what is 3*4?"},
                                  {"role": "assistant", "content": "", "tool_calls": [call]}],
                                 add_generation_prompt=False, tools=CHAT_TOOLS)
  assert drawn_call("3*4") not in text


def test_a_bpe_merge_across_the_turn_is_kept_as_drawn(tmp_path):
  """Drawn as two tokens "4" "6" where the tokenizer merges "46": the next prompt keeps the two."""
  tok = load_tokenizer(write_bpe_tokenizer(str(tmp_path), ["46 46 46 46 46", "what is 12+34?"] * 10))
  split = tok.encode("4") + tok.encode("6")
  assert len(tok.encode("46")) == 1 and len(split) == 2
  answers = iter([split + [tok.eos_id], tok.encode("ok") + [tok.eos_id]])
  rollout = ScriptedRollout(tok, answer=lambda text: next(answers))

  async def two_turns(data, client):
    messages = [{"role": "user", "content": "what is 12+34?"}]
    reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message
    messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "sure?"}]
    await client.chat.completions.create(model="m", messages=messages)
    return 1.0

  [r] = run_episodes(two_turns, rollout, tok)
  first, second = r.completions
  assert r.retokenized == 0 and len(r.trajectories) == 1
  assert second.prompt_ids.tolist()[:len(first.prompt_ids) + 3] == first.prompt_ids.tolist() + split + [tok.eos_id]
  rendered = tok.apply_chat_template([{"role": "user", "content": "what is 12+34?"},
                                      {"role": "assistant", "content": "46"}, {"role": "user", "content": "sure?"}])
  assert tok.encode(rendered) != second.prompt_ids.tolist()  # what re-encoding would have trained


def test_an_edited_history_is_reencoded_and_counted():
  rollout = ScriptedRollout(TOK)
  [r] = run_episodes(edits_history, rollout, TOK)
  assert (r.turns, r.retokenized, len(r.trajectories)) == (2, 1, 2)
  assert "A: let me see.<eos>" not in TOK.decode(r.completions[1].prompt_ids)  # (decode drops <eos>)
  assert "A: let me see." in TOK.decode(r.completions[1].prompt_ids)

  class Controller:
    episodes, counters = True, {"episode_failures": 0, "retokenized_turns": r.retokenized}

  class Group:
    turns = (r.turns,)

  assert agent_metrics(Controller, [Group])["agent/retokenized_turns"] == 1


def test_concurrent_episodes_on_a_global_default_client_stay_apart():
  """Eight Agents SDK episodes at once, each setting the SDK's global default client: every request is recorded in
  the episode whose task made it."""
  results = run_episodes(agents_sdk_default, ScriptedRollout(TOK), TOK, problems=PROBLEMS)
  for p, r in zip(PROBLEMS, results):
    assert r.failure is None and r.reward == 1.0 and r.turns == 2, r.failure
    assert all(p["question"] in TOK.decode(c.prompt_ids) for c in r.completions)


def test_episode_clients_follow_the_agents_annotation():
  import anthropic  # pylint: disable=g-import-not-at-top

  class Claude:
    async def run(self, data, client: anthropic.AsyncAnthropic):
      del data, client

  assert wants_anthropic(anthropic_agent) and wants_anthropic(Claude().run)
  assert not wants_anthropic(chat_agent) and not wants_anthropic(calculator.Calculator().run)
  assert wants_anthropic(calculator.ClaudeCalculator().run)
