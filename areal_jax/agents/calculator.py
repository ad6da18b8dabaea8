r"""The bundled agent task: products of two-digit numbers, which the tiny model cannot work out in its head, with a
calculator tool it can call (`configs/agent.py`).

    python launch/tpu_run.py --config=configs/agent.py --workdir=/tmp/areal_agent

An episode is a chat with the `calc` tool offered. While the model calls the tool (Hermes `<tool_call>` blocks, at
most `max_calls` rounds), each result goes back as a `tool` message and the model is asked again; the reward is 1
when its last answer is `\boxed{N}` with N the product. A solved episode is two completions:

    tools: calc(expr)
    Q: what is 37*48?
    A: <tool_call>{"arguments":{"expr":"37*48"},"name":"calc"}</tool_call><eos>
    result: 1776
    A: \boxed{1776}<eos>

`demonstration(data)` is the supervised warm-start's example for a problem, in OpenAI's chat fine-tuning format
(`{"messages": [...], "tools": [...]}`). With `demo_tool_share` < 1, that share of them use the tool and the rest
answer in one turn without it, a habit the tiny model cannot make work (it cannot multiply in its head) and RL
unlearns: configs/agent.py sets 0.75 (`agent.options.demo_tool_share`), and RL's gains come from calling the tool
more often as well as from calling it more exactly. Half answering in one turn kept an earlier warm-start (one
example per turn, lr 2e-3) from learning to copy the operands into the call within 1000 steps.

With `attempts` > 1 (AReaL's multi-turn rule) a wrong final answer is told so, with the question again ("wrong, what
is 37*48?"), and the model answers once more from the whole chat; a right answer at attempt k (from 0) earns
`retry_discount ** k`. Two attempts need about 290 tokens of cache (`sampler.max_seq_len=320`) and 4 completions
(`agent.max_turns`).
"""

from __future__ import annotations

import ast
import json
import operator
import re
import zlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  import anthropic

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluates an integer expression with + - * and parentheses.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]
ANTHROPIC_TOOLS = [{"name": "calc", "description": TOOLS[0]["function"]["description"],  # the same tool, as Claude's
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_MAX_EXPR = 64  # characters the tool evaluates
_BOXED = re.compile(r"\\boxed\{(-?\d+)\}")


def calc(expr: Any) -> str:
  """The tool: `expr` evaluated over integers with + - * and parentheses; "error" for anything else."""

  def ev(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:  # pylint: disable=unidiomatic-typecheck
      return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      return _OPS[type(node.op)](ev(node.left), ev(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
      return -ev(node.operand)
    raise ValueError(node)

  if not isinstance(expr, str) or len(expr) > _MAX_EXPR:
    return "error"
  try:
    return str(ev(ast.parse(expr, mode="eval").body))
  except (SyntaxError, ValueError):
    return "error"


def _expression(question: str) -> str:
  return question.removeprefix("what is ").removesuffix("?")


class Calculator:
  """The agent (see the module docstring); `run(data, client)` returns 1.0 for a right final answer (discounted on a
  retry), else 0.0."""

  def __init__(self, *, max_calls: int = 1, max_tokens: int = 80, demo_tool_share: float = 1.0, attempts: int = 1,
               retry_discount: float = 1.0):
    self.max_calls, self.max_tokens, self.demo_tool_share = max_calls, max_tokens, demo_tool_share
    self.attempts, self.retry_discount = attempts, retry_discount
    if attempts < 1 or not 0 <= retry_discount <= 1:
      raise ValueError(f"agent.options: attempts={attempts!r} must be >= 1 and retry_discount={retry_discount!r} in "
                       f"[0, 1]")

  async def run(self, data: dict[str, Any], client) -> float:
    messages = [{"role": "user", "content": data["question"]}]
    for attempt in range(self.attempts):
      if attempt:  # AReaL's multi-turn rule: a wrong answer is told so and tried again, for a discounted reward
        messages.append({"role": "user", "content": f"wrong, {data['question']}"})
      if await self._attempt(messages, client) == data["reference"]:
        return self.retry_discount ** attempt
    return 0.0

  async def _attempt(self, messages: list[dict[str, Any]], client) -> str | None:
    """Asks until the model answers without a tool call (at most `max_calls` rounds of calls), appending each turn to
    `messages`; the boxed number of that answer, if any."""
    for call_round in range(self.max_calls + 1):
      reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                   max_tokens=self.max_tokens)
      message = reply.choices[0].message
      messages.append(message.model_dump(exclude_none=True))
      if not message.tool_calls or call_round == self.max_calls:
        break
      for call in message.tool_calls:
        try:
          expr = json.loads(call.function.arguments).get("expr")
        except (json.JSONDecodeError, AttributeError):
          expr = None
        result = calc(expr) if call.function.name == "calc" else "error"
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    found = None if message.tool_calls else _BOXED.search(message.content or "")
    return found and found.group(1)

  def demonstration(self, data: dict[str, Any]) -> dict[str, Any]:
    """The warm-start example for `data`: with the tool for a `demo_tool_share` of problems (by a hash of the uid),
    else a one-turn answer."""
    expr = _expression(data["question"])
    answer = {"role": "assistant", "content": f"\\boxed{{{data['reference']}}}"}
    messages = [{"role": "user", "content": data["question"]}]
    if zlib.crc32(data["uid"].encode()) % 1000 < self.demo_tool_share * 1000:
      call = {"id": "call_0", "type": "function",
              "function": {"name": "calc", "arguments": json.dumps({"expr": expr})}}
      messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_0", "content": calc(expr)}]
    return {"messages": messages + [answer], "tools": TOOLS}


class ClaudeCalculator(Calculator):
  """The same agent written against Anthropic's Messages API (`client.messages.create`, `tool_use` and `tool_result`
  blocks): the runner hands it an `anthropic.AsyncAnthropic` for its annotation, and its chats render to the same
  prompts as `Calculator`'s (`--config.agent.path=areal_jax.agents.calculator:ClaudeCalculator`)."""

  async def run(self, data: dict[str, Any], client: anthropic.AsyncAnthropic) -> float:
    return await super().run(data, client)

  async def _attempt(self, messages: list[dict[str, Any]], client) -> str | None:
    for call_round in range(self.max_calls + 1):
      reply = await client.messages.create(model="policy", messages=messages, tools=ANTHROPIC_TOOLS,
                                           max_tokens=self.max_tokens)
      messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
      uses = [b for b in reply.content if b.type == "tool_use"]
      if not uses or call_round == self.max_calls:
        break
      messages.append({"role": "user", "content": [
          {"type": "tool_result", "tool_use_id": b.id, "content": calc(b.input.get("expr")) if b.name == "calc"
           else "error"} for b in uses]})
    text = "".join(b.text for b in reply.content if b.type == "text")
    found = None if uses else _BOXED.search(text)
    return found and found.group(1)
