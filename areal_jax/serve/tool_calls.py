"""Tool calls in the Hermes format that Qwen2.5/Qwen3, Hermes and many other chat templates define: the model writes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after any plain content.

    fmt = tool_format(tokenizer)  # "hermes" if the chat template renders <tool_call> blocks, else None
    content, calls = parse(text)  # calls: OpenAI `tool_calls` entries; None if the text holds no (valid) call

Messages going into a template get the shape templates expect (`for_template`): an assistant message's
`tool_calls[i].function.arguments` arrives from OpenAI clients as a JSON string and is rendered as an object.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.S)


def tool_format(tokenizer) -> str | None:
  """The tool-call format the tokenizer's chat template renders, or None if it renders none this server parses."""
  template = getattr(tokenizer, "chat_template", None) or ""
  return "hermes" if OPEN in template else None


def parse(text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
  """(content before the first call, or None if blank; the calls) from a model's text. Text with no call block, or
  with a block that is not a JSON object with a string `name`, is plain content: (text, None)."""
  start = text.find(OPEN)
  if start < 0:
    return text, None
  calls = []
  for body in _BLOCK.findall(text, start):
    try:
      obj = json.loads(body)
    except json.JSONDecodeError:
      return text, None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
      return text, None
    args = obj.get("arguments", obj.get("parameters", {}))
    calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": obj["name"],
                               "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
  content = text[:start]
  return (content if content.strip() else None), calls


def _arguments(args: Any) -> Any:
  if isinstance(args, str):
    try:
      return json.loads(args)
    except json.JSONDecodeError:
      return args
  return args


def for_template(message: dict[str, Any]) -> dict[str, Any]:
  """`message` with its tool calls' JSON-string arguments decoded (what templates render with `tojson`)."""
  calls = message.get("tool_calls")
  if not calls:
    return message
  fixed = []
  for call in calls:
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and "arguments" in fn:
      call = {**call, "function": {**fn, "arguments": _arguments(fn["arguments"])}}
    fixed.append(call)
  return {**message, "tool_calls": fixed}
