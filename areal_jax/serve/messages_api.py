"""Anthropic's Messages API (`POST /v1/messages`) over the chat pipeline: a request becomes a chat request
(`to_chat`), its answer a `message` (`respond`) or Anthropic's event sequence (`MessageEvents`).

Served: `system` (a string or text blocks), `messages` with text, `tool_use` and `tool_result` blocks, `tools`
(`name`, `description`, `input_schema`), `tool_choice` `{"type": "auto"}` or `{"type": "none"}`, `max_tokens`,
`stop_sequences`, `temperature`, `top_p`, `top_k`, `metadata`, `stream` (`message_start`, `content_block_start`,
`content_block_delta` with `text_delta` / `input_json_delta`, `content_block_stop`, `message_delta`,
`message_stop`), usage; `stop_reason` "end_turn", "max_tokens", "stop_sequence" or "tool_use". The extensions
`seed` and `ignore_eos` are accepted, and every message (in a stream: its `message_delta`) carries this project's
`policy_version`, `token_ids`, `token_logprobs`, `version_start` and `version_end`. Errors come in Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`, `error_body`).

Not served (400 naming the field): `tool_choice` "any" or a named tool (constrained decoding), server tools (web
search, code execution, ...), extended `thinking`, `output_config` (effort, structured outputs), images, documents and
thinking blocks in messages, `container`, `mcp_servers`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pydantic

from areal_jax.serve import openai_api, streaming, tool_calls
from areal_jax.serve.openai_api import ApiError, Prepared
from areal_jax.tokenizer import Tokenizer

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def error_body(err: ApiError) -> dict[str, Any]:
  return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


class MessagesRequest(pydantic.BaseModel):
  """The request body; unknown fields are ignored, as in chat."""

  model: str
  max_tokens: int
  messages: list[dict[str, Any]]
  system: str | list[dict[str, Any]] | None = None
  tools: list[dict[str, Any]] | None = None
  tool_choice: dict[str, Any] | None = None
  stop_sequences: list[str] | None = None
  temperature: float | None = None
  top_p: float | None = None
  top_k: int | None = None
  stream: bool = False
  metadata: dict[str, Any] | None = None
  # Refused when set:
  thinking: dict[str, Any] | None = None
  container: Any = None
  mcp_servers: Any = None
  output_config: dict[str, Any] | None = None
  # This server's extensions:
  seed: int | None = None
  ignore_eos: bool = False


def _bad(param: str, message: str) -> ApiError:
  return ApiError(400, message, param=param)


def _text(content, where: str) -> str:
  """A string, or text blocks."""
  if isinstance(content, str):
    return content
  parts = []
  for j, block in enumerate(content if isinstance(content, list) else [content]):
    kind = block.get("type") if isinstance(block, dict) else None
    if kind != "text":
      raise _bad(f"{where}[{j}].type", f"{where}[{j}].type={kind!r}: only text blocks are served here")
    parts.append(str(block.get("text", "")))
  return "".join(parts)


def _user(content, where: str) -> list[dict[str, Any]]:
  """A user turn's blocks: tool results become tool messages, text between them user messages, in order."""
  if isinstance(content, str):
    return [{"role": "user", "content": content}]
  out, text = [], []
  for j, block in enumerate(content):
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text":
      text.append(str(block.get("text", "")))
    elif kind == "tool_result":
      if text:
        out.append({"role": "user", "content": "".join(text)})
        text = []
      result = _text(block.get("content", ""), f"{where}[{j}].content")
      out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                  "content": f"Error: {result}" if block.get("is_error") else result})
    else:
      raise _bad(f"{where}[{j}].type", f"{where}[{j}].type={kind!r}: user turns may hold text and tool_result "
                                       f"blocks here")
  return out + ([{"role": "user", "content": "".join(text)}] if text or not out else [])


def _assistant(content, where: str) -> dict[str, Any]:
  if isinstance(content, str):
    return {"role": "assistant", "content": content}
  text, calls = [], []
  for j, block in enumerate(content):
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text":
      text.append(str(block.get("text", "")))
    elif kind == "tool_use":
      calls.append({"id": block.get("id"), "type": "function",
                    "function": {"name": block.get("name"), "arguments": block.get("input", {})}})
    else:
      raise _bad(f"{where}[{j}].type", f"{where}[{j}].type={kind!r}: assistant turns may hold text and tool_use "
                                       f"blocks here")
  return {"role": "assistant", "content": "".join(text), **({"tool_calls": calls} if calls else {})}


def chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
  """`system` and `messages` as chat messages."""
  out = [{"role": "system", "content": _text(body.system, "system")}] if body.system else []
  for i, m in enumerate(body.messages):
    role, where = m.get("role"), f"messages[{i}].content"
    if role == "user":
      out += _user(m.get("content", ""), where)
    elif role == "assistant":
      out.append(_assistant(m.get("content", ""), where))
    else:
      raise _bad(f"messages[{i}].role", f"messages[{i}].role={role!r}: expected 'user' or 'assistant' (the system "
                                        f"prompt goes in `system`)")
  return out


def _tools(body: MessagesRequest) -> list[dict[str, Any]] | None:
  tools = []
  for i, t in enumerate(body.tools or ()):
    if t.get("type") not in (None, "custom"):
      raise _bad(f"tools[{i}].type", f"tools[{i}].type={t.get('type')!r}: server tools are not served; only "
                                     f"custom tools (name, description, input_schema)")
    fn = {"name": t.get("name"), **({"description": t["description"]} if t.get("description") else {}),
          "parameters": t.get("input_schema", {"type": "object"})}
    tools.append({"type": "function", "function": fn})  # keys in chat's order: the template renders them alike
  return tools or None


def to_chat(body: MessagesRequest) -> openai_api.ChatRequest:
  """The chat request that runs `body`; raises `ApiError` (400) naming what is not served."""
  for name in ("container", "mcp_servers"):
    if getattr(body, name) is not None:
      raise _bad(name, f"{name} is not supported by this server")
  for key, value in (body.output_config or {}).items():
    if value is not None:
      raise _bad(f"output_config.{key}", f"output_config.{key}={value!r}: not supported (structured outputs need "
                                         f"constrained decoding; there is no effort setting)")
  if body.thinking and body.thinking.get("type") != "disabled":
    raise _bad("thinking", f"thinking={body.thinking!r}: extended thinking is not supported")
  choice = (body.tool_choice or {}).get("type", "auto")
  if choice not in ("auto", "none"):
    raise _bad("tool_choice", f"tool_choice={body.tool_choice!r} is not supported: forcing a tool needs "
                              f"constrained decoding, which this server lacks; use auto or none")
  if body.top_k is not None and body.top_k < 1:
    raise _bad("top_k", f"top_k={body.top_k}: must be >= 1")
  return openai_api.ChatRequest(
      model=body.model, messages=chat_messages(body), tools=_tools(body), tool_choice=choice,
      max_completion_tokens=body.max_tokens, stop=body.stop_sequences, stream=body.stream, n=1,
      temperature=1.0 if body.temperature is None else body.temperature,
      top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or -1, seed=body.seed,
      ignore_eos=body.ignore_eos)


def _stop(finish: str, calls, token_ids: list[int], text: str, stops: tuple[str, ...],
          tokenizer: Tokenizer) -> tuple[str, str | None]:
  """(stop_reason, stop_sequence)."""
  if calls:
    return "tool_use", None
  if finish == "length":
    return "max_tokens", None
  rest = tokenizer.decode(token_ids)[len(text):]
  matched = next((s for s in stops if rest.startswith(s)), None)
  return ("stop_sequence", matched) if matched else ("end_turn", None)


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
  """A parsed call as a `tool_use` block; arguments that are not a JSON object come as `{"arguments": ...}`."""
  fn = call["function"]
  try:
    args = json.loads(fn["arguments"])
  except json.JSONDecodeError:
    args = fn["arguments"]
  return {"type": "tool_use", "id": f"toolu_{call['id'].removeprefix('call_')}", "name": fn["name"],
          "input": args if isinstance(args, dict) else {"arguments": args}}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
  return {"input_tokens": prompt_tokens, "output_tokens": completion_tokens, "cache_creation_input_tokens": 0,
          "cache_read_input_tokens": 0}


def respond(prepared: Prepared, seqs, *, tokenizer: Tokenizer, model: str, score=None) -> dict[str, Any]:
  """The unstreamed `message`."""
  del score
  [request], [[seq]] = prepared.requests, seqs
  a = openai_api.shape_answer(seq, prepared.stops, tokenizer)
  content, calls = tool_calls.parse(a.text) if prepared.tools else (a.text, None)
  blocks = [{"type": "text", "text": content or ""}] if content or not calls else []
  blocks += [_tool_use(c) for c in calls or ()]
  reason, sequence = _stop(a.finish_reason, calls, a.token_ids, a.text, prepared.stops, tokenizer)
  return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
          "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
          "usage": _usage(len(request.prompt_ids), len(a.token_ids)),
          **openai_api.answer_fields(a.token_ids, a.logprobs, [a.version_start, a.version_end], 0)}


class MessageEvents:
  """Anthropic's streamed events for the one answer (`streaming.Events`)."""

  def __init__(self, prepared: Prepared, *, tokenizer: Tokenizer, model: str, version: int):
    self.prepared, self.tokenizer, self.model = prepared, tokenizer, model
    self.request_id = f"msg_{uuid.uuid4().hex}"
    self.blocks = 0  # content blocks started
    self.open = False  # a text block is open
    self.answer = streaming.Streamed(version)
    self.calls, self.finish = None, "stop"

  def start(self) -> list[str]:
    message = {"id": self.request_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": _usage(len(self.prepared.requests[0].prompt_ids), 0)}
    return [streaming.sse({"type": "message_start", "message": message}, "message_start"),
            streaming.sse({"type": "ping"}, "ping")]

  def _block(self, block: dict[str, Any], delta: dict[str, Any] | None) -> list[str]:
    """A block started (and, with `delta`, that delta and its end)."""
    index = self.blocks
    self.blocks += 1
    out = [streaming.sse({"type": "content_block_start", "index": index, "content_block": block},
                         "content_block_start")]
    if delta is not None:
      out += [streaming.sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta"),
              streaming.sse({"type": "content_block_stop", "index": index}, "content_block_stop")]
    return out

  def _close(self) -> list[str]:
    if not self.open:
      return []
    self.open = False
    return [streaming.sse({"type": "content_block_stop", "index": self.blocks - 1}, "content_block_stop")]

  def delta(self, index: int, d: streaming.Delta) -> list[str]:
    del index  # one answer
    self.answer.add(d)
    out = []
    if d.text:
      if not self.open:
        out += self._block({"type": "text", "text": ""}, None)
        self.open = True
      out.append(streaming.sse({"type": "content_block_delta", "index": self.blocks - 1,
                                "delta": {"type": "text_delta", "text": d.text}}, "content_block_delta"))
    if d.finish_reason is not None:
      self.finish, self.calls = d.finish_reason, d.tool_calls
      out += self._close()
      for call in d.tool_calls or ():
        block = _tool_use(call)
        out += self._block({**block, "input": {}}, {"type": "input_json_delta",
                                                    "partial_json": call["function"]["arguments"]})
      if not self.blocks:
        out += self._block({"type": "text", "text": ""}, None)
        self.open = True
        out += self._close()
    return out

  def end(self, prompt_tokens: int, completion_tokens: int) -> list[str]:
    del prompt_tokens
    a = self.answer
    reason, sequence = _stop(self.finish, self.calls, a.token_ids, a.text, self.prepared.stops, self.tokenizer)
    body = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": completion_tokens},
            **a.fields()}
    return [streaming.sse(body, "message_delta"), streaming.sse({"type": "message_stop"}, "message_stop")]

  def error(self, err: ApiError) -> list[str]:
    return [streaming.sse(error_body(err), "error")]
