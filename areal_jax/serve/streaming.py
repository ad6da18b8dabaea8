"""Streamed answers (`stream=true`): the sampler's new tokens after each decode call become OpenAI chunks.

    stream = ChoiceStream(tokenizer, stops=("\\n\\n",), tools=False)
    delta = stream.push(tokens)  # a `backend.Tokens` report; None when nothing can be sent yet
    delta.text, delta.token_ids, delta.finish_reason  # finish_reason set on the choice's last delta

Text is sent once it is settled: a trailing piece that may still become a stop string, or an incomplete UTF-8
character, waits for the next tokens. A stop string ends the choice at once (its text stops before it, its tokens
run through the one that completed it, as in unstreamed answers). With tools, text from the first `<tool_call>` on
is held until the answer ends; then its calls go out in one `tool_calls` delta, or, if they do not parse, the text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from areal_jax.serve import openai_api, tool_calls
from areal_jax.serve.backend import Tokens
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
