"""Agents the tests run and train: plain async functions against the OpenAI client, as a user writes them."""

import asyncio
import json

import anthropic

from areal_jax.tokenizer import CharTokenizer


async def two_turn(data, client):
  """Answers, is asked to check, answers again: two chat completions per episode; reward 1 if the final answer holds
  the reference."""
  messages = [{"role": "user", "content": data["question"]}]
  first = await client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=8,
                                               extra_body={"ignore_eos": True})
  messages += [{"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "check: " + data["question"]}]
  second = await client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=8)
  return float(data["reference"] in second.choices[0].message.content)


async def two_turn_responses(data, client):
  """`two_turn` through the Responses API, the second turn by `previous_response_id`."""
  first = await client.responses.create(model="m", input=data["question"], max_output_tokens=8,
                                        extra_body={"ignore_eos": True})
  second = await client.responses.create(model="m", input="check: " + data["question"], max_output_tokens=8,
                                         previous_response_id=first.id)
  return float(data["reference"] in second.output_text)


async def two_turn_messages(data, client: anthropic.AsyncAnthropic):
  """`two_turn` through Anthropic's Messages API, the second turn streamed."""
  messages = [{"role": "user", "content": data["question"]}]
  first = await client.messages.create(model="m", messages=messages, max_tokens=8, extra_body={"ignore_eos": True})
  messages += [{"role": "assistant", "content": first.content[0].text},
               {"role": "user", "content": "check: " + data["question"]}]
  async with client.messages.stream(model="m", messages=messages, max_tokens=8) as stream:
    final = await stream.get_final_message()
  return float(data["reference"] in final.content[0].text)


async def token_turns(data, client):
  """Token in, token out: the second prompt is the first prompt's ids, the answer's and a note's."""
  tok = CharTokenizer()
  prompt = tok.encode(data["prompt"])
  first = await client.completions.create(model="any", prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True})
  again = prompt + first.choices[0].token_ids + tok.encode("\nok ")
  second = await client.completions.create(model="any", prompt=again, max_tokens=4, extra_body={"ignore_eos": True})
  return {first.id: 0.25, second.id: 1.0}


async def raises(data, client):
  await client.chat.completions.create(model="m", messages=[{"role": "user", "content": data["question"]}],
                                       max_tokens=2)
  raise ValueError("the tool crashed")


async def sleeps(data, client):
  await asyncio.sleep(60)
  return 1.0


async def says_yes(data, client):
  await client.completions.create(model="m", prompt=data["prompt"], max_tokens=2)
  return "yes"


async def loops(data, client):
  while True:
    await client.completions.create(model="m", prompt=data["prompt"], max_tokens=2)


async def too_long(data, client):
  await client.completions.create(model="m", prompt=data["prompt"] * 100, max_tokens=2)
  return 1.0


class Counting:
  """An agent as a class with an async `run` (instantiated once)."""

  async def run(self, data, client):
    return await two_turn(data, client)


# --- agents built with agent frameworks, unchanged between training and serving ------------------------------------

MODEL = "tiny-qwen"  # the served model's name (in training any name is served)


def add(a: int, b: int) -> int:
  """Adds two integers."""
  return a + b


async def agents_sdk_calculator(data, client):
  """The OpenAI Agents SDK: an `Agent` with a function tool, run by `Runner` over chat completions."""
  import agents as sdk  # pylint: disable=g-import-not-at-top

  sdk.set_tracing_disabled(True)  # no traces leave the machine
  agent = sdk.Agent(name="calculator", instructions="Use the add tool.", tools=[sdk.function_tool(add)],
                    model=sdk.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                    model_settings=sdk.ModelSettings(temperature=0.0))  # (in training the run's settings hold)
  result = await sdk.Runner.run(agent, data["question"], max_turns=3, run_config=sdk.RunConfig(tracing_disabled=True))
  return float(data["reference"] in str(result.final_output))


async def agents_sdk_default_calculator(data, client):
  """The OpenAI Agents SDK with its default model (the Responses API) on a global default client."""
  import agents as sdk  # pylint: disable=g-import-not-at-top

  sdk.set_tracing_disabled(True)
  sdk.set_default_openai_client(client, use_for_tracing=False)
  agent = sdk.Agent(name="calculator", instructions="Use the add tool.", tools=[sdk.function_tool(add)], model=MODEL,
                    model_settings=sdk.ModelSettings(temperature=0.0))
  result = await sdk.Runner.run(agent, data["question"], max_turns=3)
  return float(data["reference"] in str(result.final_output))


ADD_SCHEMA = {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
              "type": "object"}


async def responses_calculator(data, client):
  """`client.responses.create` by hand: a function tool, its output sent back by `previous_response_id`."""
  tools = [{"type": "function", "name": "add", "description": "Adds two integers.", "parameters": ADD_SCHEMA}]
  first = await client.responses.create(model=MODEL, instructions="Use the add tool.", input=data["question"],
                                        tools=tools, temperature=0.0)
  outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": str(add(**json.loads(c.arguments)))}
             for c in first.output if c.type == "function_call"]
  final = await client.responses.create(model=MODEL, instructions="Use the add tool.", input=outputs, tools=tools,
                                        previous_response_id=first.id, temperature=0.0)
  return float(data["reference"] in final.output_text)


async def anthropic_calculator(data, client: anthropic.AsyncAnthropic):
  """Anthropic's Messages API: a tool with `input_schema`, `tool_use` answered with `tool_result` blocks."""
  tools = [{"name": "add", "description": "Adds two integers.", "input_schema": ADD_SCHEMA}]
  messages = [{"role": "user", "content": data["question"]}]
  first = await client.messages.create(model=MODEL, system="Use the add tool.", messages=messages, tools=tools,
                                       max_tokens=64, extra_body={"temperature": 0.0})
  messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": str(add(**b.input))}
                                            for b in first.content if b.type == "tool_use"]}]
  final = await client.messages.create(model=MODEL, system="Use the add tool.", messages=messages, tools=tools,
                                       max_tokens=64, extra_body={"temperature": 0.0})
  return float(data["reference"] in "".join(b.text for b in final.content if b.type == "text"))


async def langchain_calculator(data, client):
  """LangChain: `ChatOpenAI` with `bind_tools`, tool calls answered with `ToolMessage`s."""
  from langchain_core.messages import HumanMessage, ToolMessage  # pylint: disable=g-import-not-at-top
  from langchain_core.tools import tool  # pylint: disable=g-import-not-at-top
  from langchain_openai import ChatOpenAI  # pylint: disable=g-import-not-at-top

  add_tool = tool(add)
  llm = ChatOpenAI(model=MODEL, api_key="unused", base_url=str(client.base_url), root_async_client=client,
                   async_client=client.chat.completions, max_retries=0, temperature=0.0).bind_tools([add_tool])
  messages = [HumanMessage(data["question"])]
  reply = await llm.ainvoke(messages)
  messages.append(reply)
  for call in reply.tool_calls:
    messages.append(ToolMessage(str(add_tool.invoke(call["args"])), tool_call_id=call["id"]))
  final = await llm.ainvoke(messages)
  return float(data["reference"] in final.content)
