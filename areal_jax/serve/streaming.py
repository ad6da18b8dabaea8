"""Streamed answers (`stream=true`): the sampler's new tokens after each decode call become server-sent events.

    stream = ChoiceStream(tokenizer, stops=("\\n\\n",), tools=False)
    delta = stream.push(tokens)  # a `sampler.Tokens` report; None when nothing can be sent yet
    delta.text, delta.token_ids, delta.finish_reason  # finish_reason set on the choice's last delta

Each API writes its own events from the deltas (an `Events`): `ChunkEvents` OpenAI's completion and chat chunks,
`responses_api.ResponseEvents` the Responses API's typed events, `messages_api.MessageEvents` Anthropic's.

Text is sent once it is settled: a trailing piece that may still become a stop string, or an incomplete UTF-8
character, waits for the next tokens. A stop string ends the choice at once (its text stops before it, its tokens
run through the one that completed it, as in unstreamed answers). With tools, text from the first `<tool_call>` on
is held until the answer ends; then its calls go out in one `tool_calls` delta, or, if they do not parse, the text.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Protocol

from areal_jax.serve import openai_api, tool_calls
from areal_jax.sampler.sampler import Tokens
from areal_jax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class Delta:
  text: str
  token_ids: list[int]
  logprobs: list[float]
  versions: list[int]
  finish_reason: str | None = None
  tool_calls: list[dict[str, Any]] | None = None


def _held(text: str, markers: tuple[str, ...]) -> int:
  """Length of the longest end of `text` that begins one of `markers` (it may still become that marker)."""
  longest = 0
  for m in markers:
    for k in range(min(len(m) - 1, len(text)), longest, -1):
      if text.endswith(m[:k]):
        longest = k
        break
  return longest


@dataclasses.dataclass
class Streamed:
  """One answer as streamed so far: its text sent, tokens, logprobs and versions, and the newest policy version."""

  version: int
  text: str = ""
  token_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)

  def add(self, d: Delta) -> None:
    self.version = max([self.version, *d.versions])
    self.text += d.text
    self.token_ids += d.token_ids
    self.logprobs += d.logprobs
    self.versions += d.versions

  def fields(self) -> dict[str, Any]:
    """This project's fields of the answer (`openai_api.answer_fields`)."""
    return openai_api.answer_fields(self.token_ids, self.logprobs, self.versions, self.version)


class ChoiceStream:
  """One choice's stream: the answer's tokens so far and how much of its text and tokens went out."""

  def __init__(self, tokenizer: Tokenizer, *, stops: tuple[str, ...], tools: bool):
    self.tokenizer, self.stops, self.tools = tokenizer, stops, tools
    self.markers = stops + ((tool_calls.OPEN,) if tools else ())
    self.tokens: list[int] = []
    self.logprobs: list[float] = []
    self.versions: list[int] = []
    self.sent_text = 0
    self.sent_tokens = 0
    self.done = False

  def push(self, t: Tokens) -> Delta | None:
    if self.done:
      return None
    self.tokens += t.tokens
    self.logprobs += t.logprobs
    self.versions += t.versions
    n, text = len(self.tokens), self.tokenizer.decode(self.tokens)
    finish = None
    if (cut := openai_api.cut_at_stop(self.tokens, text, self.stops, self.tokenizer)) is not None:
      (ids, text), finish = cut, "stop"
      n, end = len(ids), len(text)
    elif t.finish_reason:
      end, finish = len(text), openai_api.finish_reason(t.finish_reason)
    else:
      settled = text.rstrip("\ufffd")
      end = len(settled) - _held(settled, self.markers)
    calls = None
    if self.tools:
      start = text.find(tool_calls.OPEN)
      if finish is not None and start >= 0:
        content, calls = tool_calls.parse(text[:end])
        end = start if calls else end
        finish = "tool_calls" if calls else finish
      elif start >= 0:
        end = min(end, start)
    end = max(end, self.sent_text)
    delta = Delta(text=text[self.sent_text:end], token_ids=self.tokens[self.sent_tokens:n],
                  logprobs=self.logprobs[self.sent_tokens:n], versions=self.versions[self.sent_tokens:n],
                  finish_reason=finish, tool_calls=calls)
    self.sent_text, self.sent_tokens = end, n
    self.done = finish is not None
    if not (delta.text or delta.token_ids or delta.finish_reason):
      return None
    return delta


def completion_choice(index: int, d: Delta, tokenizer: Tokenizer, *, logprobs: bool, offset: int) -> dict[str, Any]:
  lp = (openai_api.completion_logprobs(tokenizer, d.token_ids, d.logprobs, 0, None, offset) if logprobs else None)
  return {"index": index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason, "token_ids": d.token_ids}


def chat_choice(index: int, d: Delta, tokenizer: Tokenizer, *, logprobs: bool) -> dict[str, Any]:
  delta: dict[str, Any] = {"content": d.text} if d.text or not d.tool_calls else {}
  if d.tool_calls:
    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(d.tool_calls)]
  lp = openai_api.chat_logprobs(tokenizer, d.token_ids, d.logprobs, 0, None, 0) if logprobs else None
  return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason, "token_ids": d.token_ids}


class Events(Protocol):
  """One streamed response's server-sent events, in order: `start`, `delta` for each choice's deltas, then `end`
  (or `error` in place of the rest)."""

  request_id: str

  def start(self) -> list[str]: ...

  def delta(self, index: int, d: Delta) -> list[str]: ...

  def end(self, prompt_tokens: int, completion_tokens: int) -> list[str]: ...

  def error(self, err: openai_api.ApiError) -> list[str]: ...


def sse(body: dict[str, Any], event: str | None = None) -> str:
  """One server-sent event (with an `event:` line when named, as the Responses and Messages APIs send them)."""
  head = f"event: {event}\n" if event else ""
  return f"{head}data: {json.dumps(body)}\n\n"


class ChunkEvents:
  """OpenAI's `text_completion` / `chat.completion.chunk` chunks, ending in `data: [DONE]`."""

  def __init__(self, prepared: openai_api.Prepared, *, chat: bool, tokenizer: Tokenizer, model: str, version: int):
    self.prepared, self.chat, self.tokenizer, self.model, self.version = prepared, chat, tokenizer, model, version
    self.kind = "chat.completion.chunk" if chat else "text_completion"
    self.request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    n = prepared.n
    self.offsets = ({} if chat else {i * n + j: len(tokenizer.decode(r.prompt_ids))
                                     for i, r in enumerate(prepared.requests) for j in range(n)})

  def _event(self, choices: list[dict], usage=None) -> str:
    body = openai_api.envelope(self.kind, choices, model=self.model, version=self.version,
                               request_id=self.request_id, usage=usage)
    if self.prepared.include_usage and usage is None:
      body["usage"] = None
    return sse(body)

  def start(self) -> list[str]:
    if not self.chat:
      return []
    k = len(self.prepared.requests) * self.prepared.n
    return [self._event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(k)])]

  def delta(self, index: int, d: Delta) -> list[str]:
    self.version = max([self.version, *d.versions])
    if self.chat:
      return [self._event([chat_choice(index, d, self.tokenizer, logprobs=self.prepared.logprobs)])]
    choice = completion_choice(index, d, self.tokenizer, logprobs=self.prepared.logprobs, offset=self.offsets[index])
    self.offsets[index] += len(self.tokenizer.decode(d.token_ids))
    return [self._event([choice])]

  def end(self, prompt_tokens: int, completion_tokens: int) -> list[str]:
    usage = [self._event([], usage=openai_api.usage(prompt_tokens, completion_tokens))]
    return (usage if self.prepared.include_usage else []) + ["data: [DONE]\n\n"]

  def error(self, err: openai_api.ApiError) -> list[str]:
    return [sse(err.body())]
