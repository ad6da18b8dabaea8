"""The Responses API and Anthropic's Messages API on the policy server, with the real `openai` and `anthropic` clients:
greedy answers equal chat completions' (both APIs run the same chat template), streamed events add up to the
unstreamed answer, tool calls come back as `function_call` items and `tool_use` blocks and their results go back in,
`previous_response_id` continues a conversation, unsupported fields get a 400 naming them (Anthropic errors in
Anthropic's shape), `x-api-key` authenticates, and mixed streamed requests under load all finish or get 429."""

import asyncio
import dataclasses
import json

import anthropic
import jax
import openai
import pytest
from flax import nnx

from areal_jax.models import save_hf
from areal_jax.serve import build
from areal_jax.tokenizer import load_tokenizer
from helpers import TINY, TOOLS_CHATML, memorize, tiny_model, write_bpe_tokenizer

MODEL = "tiny-qwen"
MAX_SEQ_LEN = 512
SIZING = dict(max_seq_len=MAX_SEQ_LEN, num_slots=4, page_size=8, warmup=False)
SCHEMA = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": SCHEMA}}]
RESPONSES_TOOLS = [{"type": "function", "name": "add", "description": "a + b", "parameters": SCHEMA}]
ANTHROPIC_TOOLS = [{"name": "add", "description": "a + b", "input_schema": SCHEMA}]
QUESTION = "What is 12 + 34?"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 34}}</tool_call>'
ANSWER = "The answer is 46."
GREEDY = {"temperature": 0, "ignore_eos": True}  # (the anthropic client sends sampling settings as extra fields)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("agent_apis_hf"))
  texts = [QUESTION, ANSWER, CALL * 4, *[json.dumps(t) for t in CHAT_TOOLS] * 4, TOOLS_CHATML,
           "Please reason step by step: 7 * 8 = 56."]
  tok = load_tokenizer(write_bpe_tokenizer(path, texts, vocab_size=400, template=TOOLS_CHATML))
  save_hf(tiny_model(dataclasses.replace(TINY, vocab_size=tok.vocab_size, max_position_embeddings=MAX_SEQ_LEN),
                     seed=4), path)
  return path


@pytest.fixture(scope="module")
def tok(hf_dir):
  return load_tokenizer(hf_dir)


@pytest.fixture(scope="module")
def server(hf_dir):
  srv = build(hf_dir, port=0, devices=jax.devices()[:1], max_queue=64, model_name=MODEL, **SIZING).start()
  yield srv
  srv.stop()


@pytest.fixture(scope="module")
def oai(server):
  return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
  return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def chat_greedy(oai, messages, **kw):
  return oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw).choices[0]


def test_responses_equal_chat_completions(oai):
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
  want = chat_greedy(oai, messages, max_tokens=12, extra_body={"ignore_eos": True})
  r = oai.responses.create(model=MODEL, instructions="Be brief.", input=QUESTION, max_output_tokens=12,
                           temperature=0, extra_body={"ignore_eos": True})
  assert r.output_text == want.message.content and r.model_extra["token_ids"] == want.token_ids
  assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
  prompt_tokens = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens
  assert (r.usage.input_tokens, r.usage.output_tokens) == (prompt_tokens, 12)
  assert len(r.model_extra["token_logprobs"]) == 12 and r.model_extra["policy_version"] == 0
  # Input items: the same conversation as a list of messages with text parts, streamed.
  items = [{"type": "message", "role": "developer", "content": "Be brief."},
           {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
  events = list(oai.responses.create(model=MODEL, input=items, max_output_tokens=12, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True}))
  kinds = [e.type for e in events]
  assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                       "response.content_part.added"]
  assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.incomplete"]
  assert [e.sequence_number for e in events] == list(range(len(events)))
  assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
  assert events[-1].response.output_text == r.output_text
  assert events[-1].response.model_extra["token_ids"] == want.token_ids


def test_messages_equal_chat_completions(oai, claude):
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
  want = chat_greedy(oai, messages, max_tokens=12, extra_body={"ignore_eos": True})
  m = claude.messages.create(model=MODEL, system="Be brief.", messages=[{"role": "user", "content": QUESTION}],
                             max_tokens=12, extra_body=GREEDY)
  assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.message.content
  assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 12
  assert m.model_extra["token_ids"] == want.token_ids
  with claude.messages.stream(model=MODEL, system=[{"type": "text", "text": "Be brief."}], max_tokens=12,
                              messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
                              extra_body=GREEDY) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
  assert text == final.content[0].text == want.message.content and final.stop_reason == "max_tokens"
  # A stop sequence drawn mid-answer: the text stops before it and the message names it.
  stop = want.message.content[4:6]
  cut = claude.messages.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], system="Be brief.",
                               max_tokens=12, stop_sequences=[stop], extra_body=GREEDY)
  assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
  assert cut.content[0].text == want.message.content[:want.message.content.find(stop)]


@pytest.fixture(scope="module")
def tool_policy(server, hf_dir, tok):
  """The server's policy scripted to call `add` for the question and to answer once it has the result."""
  from areal_jax.models import load_hf  # pylint: disable=g-import-not-at-top

  first = [{"role": "user", "content": QUESTION}]
  called = [*first, {"role": "assistant", "content": "", "tool_calls": [
      {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 34}}}]},
            {"role": "tool", "tool_call_id": "c", "content": "46"}]
  pairs = [(tok.encode(tok.apply_chat_template(first, tools=CHAT_TOOLS)), tok.encode(CALL) + [tok.eos_id]),
           (tok.encode(tok.apply_chat_template(called, tools=CHAT_TOOLS)), tok.encode(ANSWER) + [tok.eos_id])]
  scripted = memorize(load_hf(hf_dir), pairs)
  sampler = server.sampler
  before, version = sampler.scheduler.params, sampler.version
  sampler.update_params(sampler.scheduler.engine.load_params(nnx.state(scripted, nnx.Param)), version=version + 1)
  yield
  sampler.update_params(before, version=version)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_tool_call_round_trip(oai, tool_policy, stream):
  del tool_policy
  kw = dict(model=MODEL, tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=40)
  if stream:
    events = list(oai.responses.create(input=QUESTION, stream=True, **kw))
    assert "response.function_call_arguments.delta" in [e.type for e in events]
    r = events[-1].response
  else:
    r = oai.responses.create(input=QUESTION, **kw)
  [call] = r.output
  assert (call.type, call.name, json.loads(call.arguments), r.status) == ("function_call", "add",
                                                                          {"a": 12, "b": 34}, "completed")
  # The result goes back by previous_response_id, or with the whole history as input items.
  result = {"type": "function_call_output", "call_id": call.call_id, "output": "46"}
  after = oai.responses.create(input=[result], previous_response_id=r.id, **kw)
  assert after.output_text == ANSWER and after.previous_response_id == r.id
  history = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), result]
  assert oai.responses.create(input=history, **kw).output_text == ANSWER


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_use_round_trip(claude, tool_policy, stream):
  del tool_policy
  kw = dict(model=MODEL, tools=ANTHROPIC_TOOLS, max_tokens=40, extra_body={"temperature": 0})
  question = [{"role": "user", "content": QUESTION}]
  if stream:
    with claude.messages.stream(messages=question, **kw) as s:
      kinds = [e.type for e in s]
      m = s.get_final_message()
    assert kinds.count("content_block_start") == 1 and "input_json" in kinds
  else:
    m = claude.messages.create(messages=question, **kw)
  [use] = m.content
  assert (use.type, use.name, use.input, m.stop_reason) == ("tool_use", "add", {"a": 12, "b": 34}, "tool_use")
  result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "46"}]}
  after = claude.messages.create(messages=question + [{"role": "assistant", "content": m.content}, result], **kw)
  assert after.content[0].text == ANSWER and after.stop_reason == "end_turn"


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": "hi", "tool_choice": "required", "tools": RESPONSES_TOOLS}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
])
def test_responses_refuse_what_they_do_not_serve(oai, body, param):
  with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
    oai.responses.create(model=MODEL, max_output_tokens=4, **body)
  assert e.value.body["param"] == param and param.split("[")[0] in e.value.body["message"]
  assert oai.responses.create(model=MODEL, input="hi", max_output_tokens=2).status  # the next is served


@pytest.mark.parametrize("body, where", [
    ({"tool_choice": {"type": "any"}, "tools": ANTHROPIC_TOOLS}, "tool_choice"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
])
def test_messages_refuse_in_anthropics_error_shape(claude, body, where):
  kw = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **body}
  with pytest.raises(anthropic.BadRequestError) as e:
    claude.messages.create(**kw)
  assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
  assert where in e.value.body["error"]["message"]
  with pytest.raises(anthropic.NotFoundError) as e:
    claude.messages.create(model="claude-other", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
  assert e.value.body["error"]["type"] == "not_found_error"


def test_x_api_key_authenticates_anthropic_clients(hf_dir):
  with build(hf_dir, port=0, devices=jax.devices()[:1], model_name=MODEL, api_key="s3cret", **SIZING) as srv:
    ok = anthropic.Anthropic(base_url=srv.url, api_key="s3cret", max_retries=0)
    assert ok.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]).content
    bad = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
      bad.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    bearer = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0)
    assert bearer.responses.create(model=MODEL, input="hi", max_output_tokens=2).output


@pytest.mark.slow
def test_mixed_streams_under_load_finish_or_get_429(server):
  """64 concurrent streamed requests, the three APIs mixed, on 4 slots and a queue of 16: each one either streams to
  its end or is refused with 429 at once; then every later request is served."""
  server.sampler.max_queue = 16

  async def one(i, oai, claude):
    kw = dict(temperature=1.0, extra_body={"ignore_eos": True, "seed": i})
    try:
      if i % 3 == 0:
        n = 0
        async for chunk in await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}],
                                                             max_tokens=24, stream=True, **kw):
          n += len(chunk.choices[0].model_extra.get("token_ids") or []) if chunk.choices else 0
        return n
      if i % 3 == 1:
        events = [e async for e in await oai.responses.create(model=MODEL, input="q", max_output_tokens=24,
                                                               stream=True, **kw)]
        return len(events[-1].response.model_extra["token_ids"])
      async with claude.messages.stream(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "q"}],
                                        extra_body={"ignore_eos": True, "seed": i}) as s:
        return (await s.get_final_message()).usage.output_tokens
    except (openai.RateLimitError, anthropic.RateLimitError):
      return "429"

  async def run(n):
    oai = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)
    claude = anthropic.AsyncAnthropic(base_url=server.url, api_key="x", max_retries=0, timeout=300)
    return await asyncio.wait_for(asyncio.gather(*(one(i, oai, claude) for i in range(n))), 600)

  try:
    results = asyncio.run(run(64))
  finally:
    server.sampler.max_queue = 64
  refused = results.count("429")
  assert 0 < refused < 64 and all(r == 24 for r in results if r != "429"), results
  assert asyncio.run(run(3)) == [24, 24, 24]
