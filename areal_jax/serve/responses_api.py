"""OpenAI's Responses API (`POST /v1/responses`, what the Agents SDK's default model sends) over the chat pipeline: a
request becomes a chat request (`to_chat`), its answer a `response` object (`respond`) or typed events
(`ResponseEvents`).

Served: `input` as a string or a list of items (messages with text parts, `function_call`, `function_call_output`),
`instructions` (a system message, not carried over by `previous_response_id`, as OpenAI's), function `tools` with
`tool_choice` "auto" or "none", `max_output_tokens`, `temperature`, `top_p`, `previous_response_id` (the server
keeps the responses it made: `ResponseStore`), `store`, `include=["message.output_text.logprobs"]`, `metadata`,
`stream` (`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`, or `response.incomplete` at
`max_output_tokens`), usage. The chat extensions `top_k`, `seed`, `stop` and `ignore_eos` are accepted too. Every
response carries this project's `policy_version`, `token_ids`, `token_logprobs`, `version_start` and `version_end`.

Not served (400 naming the field): built-in tools (web search, file search, computer use, ...), `tool_choice`
"required" or a named function, reasoning settings, response formats other than text, `truncation="auto"`,
`background`, `conversation`, `prompt`, `max_tool_calls`, `top_logprobs`, input items other than the above (images,
files, reasoning items).
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from typing import Any

import pydantic

from areal_jax.serve import openai_api, streaming, tool_calls
from areal_jax.serve.openai_api import ApiError, Prepared
from areal_jax.tokenizer import Tokenizer

LOGPROBS = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(pydantic.BaseModel):
  """The request body; unknown fields are ignored, as in chat."""

  model: str | None = None
  input: str | list[dict[str, Any]]
  instructions: str | None = None
  tools: list[dict[str, Any]] | None = None
  tool_choice: str | dict[str, Any] | None = None
  parallel_tool_calls: bool | None = None
  max_output_tokens: int | None = None
  temperature: float | None = None
  top_p: float | None = None
  stream: bool = False
  previous_response_id: str | None = None
  store: bool | None = None
  include: list[str] | None = None
  metadata: dict[str, Any] | None = None
  user: str | None = None
  text: dict[str, Any] | None = None
  reasoning: dict[str, Any] | None = None
  truncation: str | None = None
  # Refused when set:
  background: bool | None = None
  conversation: Any = None
  prompt: Any = None
  max_tool_calls: int | None = None
  top_logprobs: int | None = None
  # This server's extensions (as in chat):
  top_k: int = -1
  seed: int | None = None
  stop: str | list[str] | None = None
  ignore_eos: bool = False


def _bad(param: str, message: str) -> ApiError:
  return ApiError(400, message, param=param)


def _refuse_unsupported(body: ResponsesRequest) -> None:
  for name in ("background", "conversation", "prompt", "max_tool_calls"):
    if getattr(body, name) not in (None, False):
      raise _bad(name, f"{name}={getattr(body, name)!r} is not supported by this server")
  if body.top_logprobs:
    raise _bad("top_logprobs", f"top_logprobs={body.top_logprobs}: top alternatives are served by "
                               f"/v1/chat/completions, not here")
  if body.reasoning and any(v is not None for v in body.reasoning.values()):
    raise _bad("reasoning", f"reasoning={body.reasoning!r}: reasoning settings and summaries are not supported")
  fmt = (body.text or {}).get("format")
  if fmt not in (None, {"type": "text"}):
    raise _bad("text.format", f"text.format={fmt!r}: only plain text is served (structured outputs need "
                              f"constrained decoding)")
  if body.truncation not in (None, "disabled"):
    raise _bad("truncation", f"truncation={body.truncation!r}: only 'disabled' is supported")
  for name in body.include or ():
    if name != LOGPROBS:
      raise _bad("include", f"include={body.include!r}: only {LOGPROBS!r} is served")
  for i, t in enumerate(body.tools or ()):
    if t.get("type") != "function":
      raise _bad(f"tools[{i}].type", f"tools[{i}].type={t.get('type')!r}: built-in tools are not served; only "
                                     f"'function' tools")
  choice = body.tool_choice
  if not (choice in (None, "auto", "none")):
    raise _bad("tool_choice", f"tool_choice={choice!r} is not supported: forcing a call needs constrained decoding, "
                              f"which this server lacks; use 'auto' or 'none'")


def _text(content, where: str) -> str:
  """A message's content: a string or a list of text parts."""
  if isinstance(content, str):
    return content
  if not isinstance(content, list):
    raise _bad(where, f"{where}: expected a string or a list of content parts, got {content!r:.80}")
  out = []
  for j, part in enumerate(content):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS:
      raise _bad(f"{where}[{j}].type", f"{where}[{j}].type={kind!r}: only text parts are served "
                                       f"({', '.join(_TEXT_PARTS)})")
    out.append(str(part.get("text", "")))
  return "".join(out)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
  """`input` as chat messages: consecutive `function_call` items join the assistant message before them."""
  if isinstance(items, str):
    return [{"role": "user", "content": items}]
  messages: list[dict[str, Any]] = []
  for i, item in enumerate(items):
    where = f"input[{i}]"
    kind = item.get("type") or ("message" if "role" in item else None)
    if kind == "message":
      role = {"developer": "system"}.get(item.get("role"), item.get("role"))
      if role not in ("user", "assistant", "system"):
        raise _bad(f"{where}.role", f"{where}.role={item.get('role')!r}: expected user, assistant, system or "
                                    f"developer")
      messages.append({"role": role, "content": _text(item.get("content", ""), f"{where}.content")})
    elif kind == "function_call":
      call = {"id": item.get("call_id"), "type": "function",
              "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
      last = messages[-1] if messages else None
      if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
      else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
      output = item.get("output", "")
      messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                       "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
    else:
      raise _bad(f"{where}.type", f"{where}.type={kind!r}: not served (messages, function_call and "
                                  f"function_call_output items are)")
  return messages


class ResponseStore:
  """The conversations of the responses this server made (what `previous_response_id` continues): the newest
  `max_items`, each for `ttl_s` seconds. In training, an episode's responses go with it (`drop`)."""

  def __init__(self, max_items: int = 4096, ttl_s: float = 3600.0):
    self.max_items, self.ttl_s = max_items, ttl_s
    self._items: collections.OrderedDict[str, tuple[float, tuple[dict, ...]]] = collections.OrderedDict()
    self._owned: dict[str, list[str]] = {}
    self._lock = threading.Lock()

  def put(self, response_id: str, messages: list[dict[str, Any]], owner: str | None = None) -> None:
    with self._lock:
      self._items[response_id] = (time.monotonic() + self.ttl_s, tuple(messages))
      if owner is not None:
        self._owned.setdefault(owner, []).append(response_id)
      while len(self._items) > self.max_items:
        self._items.popitem(last=False)

  def __len__(self) -> int:
    return len(self._items)

  def drop(self, owner: str) -> None:
    """Forgets the responses made for `owner` (an episode)."""
    with self._lock:
      for response_id in self._owned.pop(owner, ()):
        self._items.pop(response_id, None)

  def get(self, response_id: str) -> list[dict[str, Any]]:
    with self._lock:
      expires, messages = self._items.get(response_id, (0.0, ()))
    if expires < time.monotonic():
      raise ApiError(404, f"previous_response_id={response_id!r}: no such response is kept here (kept: the newest "
                          f"{self.max_items}, for {self.ttl_s:g} s)", param="previous_response_id",
                     code="previous_response_not_found")
    return list(messages)


class Turn:
  """One Responses request, translated: the chat body to run and what its response echoes and stores."""

  def __init__(self, body: ResponsesRequest, store: ResponseStore, owner: str | None = None):
    _refuse_unsupported(body)
    history = store.get(body.previous_response_id) if body.previous_response_id else []
    self.body, self.store, self.owner = body, store, owner
    self.history = history + input_messages(body.input)  # what a later previous_response_id continues
    self.response_id = f"resp_{uuid.uuid4().hex}"
    self.created = int(time.time())
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                if k in t}} for t in body.tools or ()]
    self.chat = openai_api.ChatRequest(
        model=body.model, messages=instructions + self.history, tools=tools or None, tool_choice=body.tool_choice,
        max_completion_tokens=body.max_output_tokens, stream=body.stream, n=1,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k, seed=body.seed, stop=body.stop,
        ignore_eos=body.ignore_eos, logprobs=LOGPROBS in (body.include or ()))

  def response(self, *, model: str, output: list[dict], finish: str, usage: dict[str, int], answer: dict[str, Any],
               status: str | None = None) -> dict[str, Any]:
    """The `response` object; stored for `previous_response_id` once completed (unless `store=false`)."""
    b = self.body
    status = status or ("incomplete" if finish == "length" else "completed")
    out = {"id": self.response_id, "object": "response", "created_at": self.created, "status": status,
           "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
           "instructions": b.instructions, "model": model, "output": output,
           "parallel_tool_calls": b.parallel_tool_calls is not False,
           "previous_response_id": b.previous_response_id, "temperature": b.temperature, "top_p": b.top_p,
           "max_output_tokens": b.max_output_tokens, "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
           "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": b.metadata or {},
           "store": b.store is not False, "reasoning": None,
           "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": usage["total_tokens"]},
           **answer}
    if status != "in_progress" and b.store is not False:
      self.store.put(self.response_id, self.history + [reply_message(output)], owner=self.owner)
    return out


def message_item(item_id: str, text: str, *, status: str = "completed", logprobs: list | None = None) -> dict:
  part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
  return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def call_item(call: dict[str, Any], *, arguments: str | None = None, status: str = "completed") -> dict:
  fn = call["function"]
  return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
          "name": fn["name"], "arguments": fn["arguments"] if arguments is None else arguments, "status": status}


def reply_message(output: list[dict]) -> dict[str, Any]:
  """The output items as the assistant's chat message (what the store keeps)."""
  text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
  calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
           for it in output if it["type"] == "function_call"]
  return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def _logprob_entries(tokenizer: Tokenizer, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
  return [{"token": (p := tokenizer.decode([t])), "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
          for t, lp in zip(ids, logprobs)]


def respond(turn: Turn, prepared: Prepared, seqs, *, tokenizer: Tokenizer, model: str, score=None) -> dict[str, Any]:
  """The unstreamed response to `turn`."""
  del score
  [request], [[seq]] = prepared.requests, seqs
  a = openai_api.shape_answer(seq, prepared.stops, tokenizer)
  content, calls = tool_calls.parse(a.text) if prepared.tools else (a.text, None)
  output = []
  if content or not calls:
    lps = _logprob_entries(tokenizer, a.token_ids, a.logprobs) if prepared.logprobs else None
    output.append(message_item(f"msg_{uuid.uuid4().hex}", content or "", logprobs=lps))
  output += [call_item(c) for c in calls or ()]
  return turn.response(model=model, output=output, finish=a.finish_reason,
                       usage=openai_api.usage(len(request.prompt_ids), len(a.token_ids)),
                       answer=openai_api.answer_fields(a.token_ids, a.logprobs,
                                                                [a.version_start, a.version_end], 0))


class ResponseEvents:
  """The Responses API's typed events for `turn`'s one answer (`streaming.Events`)."""

  def __init__(self, turn: Turn, prepared: Prepared, *, tokenizer: Tokenizer, model: str, version: int):
    self.turn, self.prepared, self.tokenizer, self.model = turn, prepared, tokenizer, model
    self.request_id = turn.response_id
    self.sequence = 0
    self.output: list[dict] = []
    self.message: dict | None = None  # the open message item
    self.answer = streaming.Streamed(version)
    self.finish = "stop"

  def _event(self, kind: str, **fields) -> str:
    body = {"type": kind, "sequence_number": self.sequence, **fields}
    self.sequence += 1
    return streaming.sse(body, event=kind)

  def _snapshot(self, status: str, usage=None) -> dict[str, Any]:
    return self.turn.response(model=self.model, output=list(self.output), finish=self.finish,
                              usage=usage or openai_api.usage(0, 0), status=status,
                              answer=self.answer.fields())

  def start(self) -> list[str]:
    snapshot = self._snapshot("in_progress")
    return [self._event("response.created", response=snapshot), self._event("response.in_progress",
                                                                             response=snapshot)]

  def _open_message(self) -> list[str]:
    self.message = message_item(f"msg_{uuid.uuid4().hex}", "", status="in_progress")
    self.output.append(self.message)
    index = len(self.output) - 1
    return [self._event("response.output_item.added", output_index=index, item=self.message),
            self._event("response.content_part.added", item_id=self.message["id"], output_index=index,
                        content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

  def _close_message(self) -> list[str]:
    item, index = self.message, len(self.output) - 1
    self.message = None
    item["status"] = "completed"
    part = item["content"][0]
    return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=part["logprobs"]),
            self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part),
            self._event("response.output_item.done", output_index=index, item=item)]

  def _call(self, call: dict[str, Any]) -> list[str]:
    item = call_item(call, arguments="", status="in_progress")
    self.output.append(item)
    index, arguments = len(self.output) - 1, call["function"]["arguments"]
    added = self._event("response.output_item.added", output_index=index, item=dict(item))
    item.update(arguments=arguments, status="completed")
    return [added, self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=arguments),
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=arguments, name=item["name"]),
            self._event("response.output_item.done", output_index=index, item=item)]

  def delta(self, index: int, d: streaming.Delta) -> list[str]:
    del index  # one answer
    self.answer.add(d)
    out = []
    if d.text:
      if self.message is None:
        out += self._open_message()
      lps = _logprob_entries(self.tokenizer, d.token_ids, d.logprobs) if self.prepared.logprobs else []
      part = self.message["content"][0]
      part["text"] += d.text
      part["logprobs"] += lps
      out.append(self._event("response.output_text.delta", item_id=self.message["id"],
                             output_index=len(self.output) - 1, content_index=0, delta=d.text, logprobs=lps))
    if d.finish_reason is not None:
      self.finish = d.finish_reason
      if d.tool_calls:
        out += self._close_message() if self.message is not None else []
        for call in d.tool_calls:
          out += self._call(call)
      elif not self.output:
        out += self._open_message()
      out += self._close_message() if self.message is not None else []
    return out

  def end(self, prompt_tokens: int, completion_tokens: int) -> list[str]:
    final = self._snapshot("incomplete" if self.finish == "length" else "completed",
                           usage=openai_api.usage(prompt_tokens, completion_tokens))
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    return [self._event(kind, response=final)]

  def error(self, err: ApiError) -> list[str]:
    return [self._event("error", code=err.code or err.kind, message=err.message, param=err.param)]
