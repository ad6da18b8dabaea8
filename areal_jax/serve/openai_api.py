"""OpenAI-compatible bodies of `/v1/completions` and `/v1/chat/completions`: request checking, translation to a
sampler `Request`, and responses built from its finished answers.

Served: a prompt (text or token ids) or chat messages (rendered by the tokenizer's chat template), `max_tokens`
(`max_completion_tokens` for chat; default: what the cache holds after the prompt), `temperature` (0 = greedy), `top_p`,
`n`, `seed` (the same seed gives the same answers, whatever else the server runs), `stop` (strings), and the sampled
token's logprob per token (`logprobs=0` for completions, `logprobs=true` for chat). vLLM-style extensions in the
request: `top_k`, `ignore_eos`.

Beyond OpenAI's fields, every response carries `policy_version` (the newest policy version that produced one of its
tokens, also in `system_fingerprint`) and each choice `token_ids`, `version_start` and `version_end`; chat logprob
entries carry `token_id`. A stop string ends the text before it (OpenAI's rule) while `token_ids` and the logprobs
keep the tokens through it, as the policy drew them. `finish_reason` is "stop" (EOS or a stop string) or "length".

Not served (400 when set to anything but its neutral value): streaming, `echo`, `best_of` > 1, `suffix`, penalties,
`logit_bias`, tools, response formats, top alternatives (`logprobs` > 0 for completions, `top_logprobs` > 0 for chat),
several prompts in one request.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import secrets
import time
import uuid
from typing import Any

import pydantic

from areal_jax.sampler.requests import Request, SamplingParams, Sequence
from areal_jax.tokenizer import Tokenizer

MAX_N = 128  # answers per request (OpenAI's own limit)


class ApiError(Exception):
  """A request the server refuses: HTTP `status` and an OpenAI-style error body naming `param`."""

  def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.message, self.param, self.kind = status, message, param, kind

  def body(self) -> dict[str, Any]:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


class _Sampling(pydantic.BaseModel):
  """Fields both endpoints share. Unknown fields are ignored, as OpenAI-compatible servers commonly do."""

  model: str | None = None
  max_tokens: int | None = None
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  n: int = 1
  seed: int | None = None
  stop: str | list[str] | None = None
  ignore_eos: bool = False
  user: str | None = None
  # Refused unless neutral:
  stream: bool = False
  frequency_penalty: float = 0.0
  presence_penalty: float = 0.0
  logit_bias: dict[str, float] | None = None


class CompletionRequest(_Sampling):
  prompt: str | list[int] | list[str] | list[list[int]]
  logprobs: int | None = None
  echo: bool = False
  best_of: int | None = None
  suffix: str | None = None


class ChatMessage(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="allow")  # e.g. `name`, passed on to the chat template

  role: str
  content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
  messages: list[ChatMessage]
  logprobs: bool = False
  top_logprobs: int | None = None
  max_completion_tokens: int | None = None
  tools: list[Any] | None = None
  tool_choice: Any = None
  response_format: dict[str, Any] | None = None


_NEUTRAL = {"stream": (False,), "frequency_penalty": (0.0,), "presence_penalty": (0.0,), "logit_bias": (None, {}),
            "echo": (False,), "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
            "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}), "top_logprobs": (None, 0)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prepared:
  """A checked request: what the sampler runs and what shaping its answers needs."""

  request: Request
  stops: tuple[str, ...]
  logprobs: bool


def _bad(param: str | None, message: str) -> ApiError:
  return ApiError(400, message, param=param)


def _encode(tokenizer: Tokenizer, text: str, param: str) -> list[int]:
  try:
    return tokenizer.encode(text)
  except ValueError as e:  # e.g. a character the char vocabulary lacks
    raise _bad(param, f"{param}: {e}") from None


def completion_prompt(body: CompletionRequest, tokenizer: Tokenizer) -> list[int]:
  p = body.prompt
  if isinstance(p, str):
    return _encode(tokenizer, p, "prompt")
  if p and isinstance(p[0], (str, list)):
    if len(p) > 1:
      raise _bad("prompt", f"prompt: {len(p)} prompts in one request; this server takes one per request")
    return _encode(tokenizer, p[0], "prompt") if isinstance(p[0], str) else list(p[0])
  return list(p)


def chat_prompt(body: ChatRequest, tokenizer: Tokenizer) -> list[int]:
  if not body.messages:
    raise _bad("messages", "messages: empty; at least one message is needed")
  messages = []
  for i, m in enumerate(body.messages):
    content = m.content
    if isinstance(content, list):
      kinds = {part.get("type") for part in content} - {"text"}
      if kinds:
        raise _bad("messages", f"messages[{i}].content: part type(s) {sorted(map(str, kinds))} are not supported "
                               f"(text only)")
      content = "".join(str(part.get("text", "")) for part in content)
    messages.append({**(m.model_extra or {}), "role": m.role, "content": content or ""})
  try:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
  except Exception as e:  # pylint: disable=broad-except  # a template's raise_exception, a missing template
    raise _bad("messages", f"messages: the chat template refused them: {e}") from None
  return _encode(tokenizer, text, "messages")


def prepare(body: CompletionRequest | ChatRequest, prompt_ids: list[int], *, tokenizer: Tokenizer,
            max_seq_len: int, vocab_size: int) -> Prepared:
  """Checks `body` against the server's limits; raises `ApiError` (400) naming the field and its value."""
  for name, ok in _NEUTRAL.items():
    value = getattr(body, name, ok[0])
    if value not in ok:
      raise _bad(name, f"{name}={value!r} is not supported by this server")
  prompt_param = "messages" if isinstance(body, ChatRequest) else "prompt"
  n = len(prompt_ids)
  if n == 0:
    raise _bad(prompt_param, f"{prompt_param}: empty (no tokens)")
  if n > max_seq_len - 1:
    raise _bad(prompt_param, f"prompt too long: {n} tokens > max {max_seq_len - 1} (the server's "
                             f"max_seq_len={max_seq_len} holds prompt and answer, at least one answer token)")
  bad_ids = [t for t in prompt_ids if not 0 <= t < vocab_size]
  if bad_ids:
    raise _bad(prompt_param, f"{prompt_param}: token id {bad_ids[0]} outside the vocabulary [0, {vocab_size})")
  room = max_seq_len - n
  if isinstance(body, ChatRequest):
    limit_name, limit = (("max_completion_tokens", body.max_completion_tokens) if body.max_completion_tokens
                         is not None else ("max_tokens", body.max_tokens))
    logprobs = body.logprobs
  else:
    limit_name, limit = "max_tokens", body.max_tokens
    if body.logprobs is not None and body.logprobs != 0:
      raise _bad("logprobs", f"logprobs={body.logprobs}: only the sampled token's logprob is served; use logprobs=0")
    logprobs = body.logprobs is not None
  if limit is not None and limit < 1:
    raise _bad(limit_name, f"{limit_name}={limit}: must be >= 1")
  if limit is not None and limit > room:
    raise _bad(limit_name, f"{limit_name}={limit}: the prompt's {n} tokens leave room for at most {room} in the "
                           f"server's max_seq_len={max_seq_len}")
  if not (math.isfinite(body.temperature) and body.temperature >= 0):
    raise _bad("temperature", f"temperature={body.temperature}: must be a finite number >= 0 (0 = greedy)")
  if not (math.isfinite(body.top_p) and 0 < body.top_p <= 1):
    raise _bad("top_p", f"top_p={body.top_p}: must lie in (0, 1]")
  if body.top_k == 0 or body.top_k < -1:
    raise _bad("top_k", f"top_k={body.top_k}: must be positive or -1 (off)")
  if not 1 <= body.n <= MAX_N:
    raise _bad("n", f"n={body.n}: must lie in [1, {MAX_N}]")
  stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
  if any(not s for s in stops):
    raise _bad("stop", f"stop={body.stop!r}: stop strings must be non-empty")
  # The sampler also stops on each string's own tokens (found in its thread); a string drawn as other tokens is
  # found in the text afterwards (see `shape_answer`).
  stop_ids = tuple(ids for ids in (tuple(_encode(tokenizer, s, "stop")) for s in stops) if ids)
  try:
    sampling = SamplingParams(
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        max_new_tokens=room if limit is None else limit, ignore_eos=body.ignore_eos, stop=stop_ids,
        seed=secrets.randbits(32) if body.seed is None else body.seed)
  except ValueError as e:  # anything the checks above missed
    raise _bad(None, str(e)) from None
  # Group 0 for every request: answer i draws from key (seed, 0, i), so a seed names its answers.
  request = Request(group_id=0, prompt_ids=prompt_ids, num_answers=body.n, sampling=sampling)
  return Prepared(request=request, stops=stops, logprobs=logprobs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Answer:
  """One answer shaped for a response: its text (cut before a stop string) and the tokens through it."""

  text: str
  token_ids: list[int]
  logprobs: list[float]
  finish_reason: str  # "stop" | "length"
  version_start: int
  version_end: int


def shape_answer(seq: Sequence, stops: tuple[str, ...], tokenizer: Tokenizer) -> Answer:
  tokens, text = list(seq.tokens), tokenizer.decode(seq.tokens)
  finish = "length" if seq.finish_reason == "length" else "stop"
  if any(s in text for s in stops):
    lo, hi = 1, len(tokens)  # the shortest prefix whose text holds a stop string
    while lo < hi:
      mid = (lo + hi) // 2
      if any(s in tokenizer.decode(tokens[:mid]) for s in stops):
        hi = mid
      else:
        lo = mid + 1
    tokens, text = tokens[:lo], tokenizer.decode(tokens[:lo])
    text = text[:min(text.find(s) for s in stops if s in text)]
    finish = "stop"
  return Answer(text=text, token_ids=tokens, logprobs=[float(x) for x in seq.logprobs[:len(tokens)]],
                finish_reason=finish, version_start=int(seq.versions[0]),
                version_end=int(seq.versions[len(tokens) - 1]))


def _envelope(kind: str, answers: list[Answer], prompt_len: int, model: str, choices: list[dict]) -> dict[str, Any]:
  version = max(a.version_end for a in answers)
  completion = sum(len(a.token_ids) for a in answers)
  return {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
          "created": int(time.time()), "model": model, "system_fingerprint": f"areal_jax-policy-v{version}",
          "policy_version": version, "choices": choices,
          "usage": {"prompt_tokens": prompt_len, "completion_tokens": completion,
                    "total_tokens": prompt_len + completion}}


def _choice_extras(a: Answer) -> dict[str, Any]:
  return {"token_ids": a.token_ids, "version_start": a.version_start, "version_end": a.version_end}


def completion_response(prepared: Prepared, seqs: list[Sequence], *, tokenizer: Tokenizer,
                        model: str) -> dict[str, Any]:
  answers = [shape_answer(s, prepared.stops, tokenizer) for s in seqs]
  prompt_text = tokenizer.decode(prepared.request.prompt_ids)
  choices = []
  for i, a in enumerate(answers):
    logprobs = None
    if prepared.logprobs:
      pieces = [tokenizer.decode([t]) for t in a.token_ids]
      offsets = list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=len(prompt_text)))
      logprobs = {"tokens": pieces, "token_logprobs": a.logprobs, "top_logprobs": None, "text_offset": offsets}
    choices.append({"index": i, "text": a.text, "finish_reason": a.finish_reason, "logprobs": logprobs,
                    **_choice_extras(a)})
  return _envelope("text_completion", answers, len(prepared.request.prompt_ids), model, choices)


def chat_response(prepared: Prepared, seqs: list[Sequence], *, tokenizer: Tokenizer, model: str) -> dict[str, Any]:
  answers = [shape_answer(s, prepared.stops, tokenizer) for s in seqs]
  choices = []
  for i, a in enumerate(answers):
    logprobs = None
    if prepared.logprobs:
      content = []
      for t, lp in zip(a.token_ids, a.logprobs):
        piece = tokenizer.decode([t])
        content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": [],
                        "token_id": t})
      logprobs = {"content": content, "refusal": None}
    choices.append({"index": i, "message": {"role": "assistant", "content": a.text},
                    "finish_reason": a.finish_reason, "logprobs": logprobs, **_choice_extras(a)})
  return _envelope("chat.completion", answers, len(prepared.request.prompt_ids), model, choices)
