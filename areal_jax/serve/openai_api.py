"""OpenAI-compatible bodies of `/v1/completions` and `/v1/chat/completions`: request checking, translation to sampler
`Request`s, and responses built from their finished answers (streamed chunks: `streaming`).

Served: one or several prompts (text or token ids) or chat messages (rendered by the tokenizer's chat template, with
`tools`; `tool` and assistant `tool_calls` messages rendered back), `max_tokens` (`max_completion_tokens` for chat;
default 16 for completions, as OpenAI, and what the cache holds after the prompt for chat), `temperature` (0 =
greedy), `top_p`, `n`, `seed` (the same seed gives the same answers, whatever else the server runs), `stop` (strings),
`stream` (server-sent events; `stream_options.include_usage`), logprobs of the sampled tokens with up to 20 top
alternatives (`logprobs` = k for completions; `logprobs` and `top_logprobs` = k for chat), and `echo` (the prompt
before the answer in text and logprobs; what lm-evaluation-harness scores choices with). vLLM-style extensions in
the request: `top_k`, `ignore_eos`.

Tool calls: when `tools` are given and the template renders Hermes `<tool_call>` blocks (`tool_calls`), the answer's
calls become `message.tool_calls` and `finish_reason` "tool_calls"; output that does not parse stays plain content.

Beyond OpenAI's fields, every response carries `policy_version` (the newest policy version that produced one of its
tokens, also in `system_fingerprint`) and each choice `token_ids`, `version_start` and `version_end`; chat logprob
entries carry `token_id`. A stop string ends the text before it (OpenAI's rule) while `token_ids` and the logprobs
keep the tokens through it, as the policy drew them. `finish_reason` is "stop" (EOS or a stop string), "length" or
"tool_calls". A `model` other than the served one is 404, as OpenAI answers.

Not served (400 when set to anything but its neutral value): `best_of` > 1, `suffix`, penalties, `logit_bias`,
response formats, `tool_choice` "required" or a named function (they need constrained decoding), top alternatives or
`echo` while streaming.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import secrets
import time
import uuid
from collections.abc import Callable
from typing import Any

import pydantic

from areal_jax.sampler.requests import Request, SamplingParams, Sequence
from areal_jax.serve import tool_calls
from areal_jax.sampler.scoring import TOP, Scores
from areal_jax.tokenizer import Tokenizer

MAX_N = 128  # answers per request (OpenAI's own limit)
MAX_PROMPTS = 256  # prompts per completions request
DEFAULT_MAX_TOKENS = 16  # completions without max_tokens (OpenAI's default)


class ApiError(Exception):
  """A request the server refuses: HTTP `status` and an OpenAI-style error body naming `param`."""

  def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

  def body(self) -> dict[str, Any]:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(pydantic.BaseModel):
  include_usage: bool = False


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
  stream: bool = False
  stream_options: StreamOptions | None = None
  # Refused unless neutral:
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
  model_config = pydantic.ConfigDict(extra="allow")  # e.g. `name`, `tool_calls`, `tool_call_id`: to the template

  role: str
  content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
  messages: list[ChatMessage]
  logprobs: bool = False
  top_logprobs: int | None = None
  max_completion_tokens: int | None = None
  tools: list[dict[str, Any]] | None = None
  tool_choice: Any = None
  parallel_tool_calls: bool | None = None
  response_format: dict[str, Any] | None = None


_NEUTRAL = {"frequency_penalty": (0.0,), "presence_penalty": (0.0,), "logit_bias": (None, {}), "best_of": (None, 1),
            "suffix": (None, ""), "response_format": (None, {"type": "text"})}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Conversation:
  """A chat request's messages as the chat template gets them (every API's messages end up in this shape: OpenAI
  chat messages, tool calls' arguments decoded), and the tools it renders (None: none in use)."""

  messages: tuple[dict[str, Any], ...]
  tools: list[dict[str, Any]] | None = None

  def render(self, tokenizer: Tokenizer, *, upto: int | None = None, add_generation_prompt: bool = True) -> str:
    """The template's text of the first `upto` messages (all by default)."""
    return tokenizer.apply_chat_template(list(self.messages[:upto]), add_generation_prompt=add_generation_prompt,
                                         tools=self.tools)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prepared:
  """A checked request: what the sampler runs (one `Request` per prompt) and what shaping its answers needs."""

  requests: list[Request]
  conversation: Conversation | None  # a chat request's (None for completions)
  stops: tuple[str, ...]
  logprobs: bool  # the sampled tokens' logprobs
  top: int  # alternatives per token (0: none)
  echo: bool
  tools: bool  # parse tool calls out of answers
  stream: bool
  include_usage: bool

  @property
  def n(self) -> int:
    return self.requests[0].num_answers

  @property
  def temperature(self) -> float:
    return self.requests[0].sampling.temperature


def _bad(param: str | None, message: str) -> ApiError:
  return ApiError(400, message, param=param)


def _encode(tokenizer: Tokenizer, text: str, param: str) -> list[int]:
  try:
    return tokenizer.encode(text)
  except ValueError as e:  # e.g. a character the char vocabulary lacks
    raise _bad(param, f"{param}: {e}") from None


def completion_prompts(body: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
  p = body.prompt
  if isinstance(p, str):
    return [_encode(tokenizer, p, "prompt")]
  if p and isinstance(p[0], (str, list)):
    if len(p) > MAX_PROMPTS:
      raise _bad("prompt", f"prompt: {len(p)} prompts in one request; at most {MAX_PROMPTS}")
    return [_encode(tokenizer, x, f"prompt[{i}]") if isinstance(x, str) else list(x) for i, x in enumerate(p)]
  return [list(p)]


def _tools_in_use(body: ChatRequest, tokenizer: Tokenizer) -> bool:
  choice = body.tool_choice
  if choice in ("required",) or isinstance(choice, dict):
    raise _bad("tool_choice", f"tool_choice={choice!r} is not supported: forcing a call needs constrained decoding, "
                              f"which this server lacks; use 'auto' or 'none'")
  if choice not in (None, "auto", "none"):
    raise _bad("tool_choice", f"tool_choice={choice!r}: expected 'auto', 'none', 'required' or a function")
  if not body.tools or choice == "none":
    return False
  if tool_calls.tool_format(tokenizer) is None:
    raise _bad("tools", "tools: this tokenizer's chat template defines no tool-call format this server parses "
                        f"(Hermes {tool_calls.OPEN} blocks, as Qwen2.5/Qwen3 templates render)")
  return True


def conversation(body: ChatRequest, tokenizer: Tokenizer) -> Conversation:
  """`body`'s messages as the template gets them, and its tools if they are in use."""
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
    messages.append(tool_calls.for_template({**(m.model_extra or {}), "role": m.role, "content": content or ""}))
  return Conversation(messages=tuple(messages), tools=body.tools if _tools_in_use(body, tokenizer) else None)


def chat_prompts(body: ChatRequest, tokenizer: Tokenizer) -> list[list[int]]:
  try:
    text = conversation(body, tokenizer).render(tokenizer)
  except ApiError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # a template's raise_exception, a missing template
    raise _bad("messages", f"messages: the chat template refused them: {e}") from None
  return [_encode(tokenizer, text, "messages")]


def _top(body: CompletionRequest | ChatRequest) -> tuple[bool, int]:
  """(the sampled tokens' logprobs wanted, alternatives per token)."""
  if isinstance(body, ChatRequest):
    top = body.top_logprobs or 0
    if top and not body.logprobs:
      raise _bad("top_logprobs", f"top_logprobs={top} needs logprobs=true")
    param, wanted = "top_logprobs", body.logprobs
  else:
    top, param, wanted = body.logprobs or 0, "logprobs", body.logprobs is not None
  if not 0 <= top <= TOP:
    raise _bad(param, f"{param}={top}: must lie in [0, {TOP}]")
  return wanted, top


def _max_tokens(body: CompletionRequest | ChatRequest) -> tuple[str, int | None]:
  if isinstance(body, ChatRequest):
    if body.max_completion_tokens is not None:
      return "max_completion_tokens", body.max_completion_tokens
    return "max_tokens", body.max_tokens
  return "max_tokens", DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens


def _check_prompt(ids: list[int], where: str, param: str, limit_name: str, limit: int | None, *, max_seq_len: int,
                  vocab_size: int) -> None:
  """One prompt against the server's limits: not empty, room for an answer token (and `limit` of them), ids in
  the vocabulary."""
  n = len(ids)
  if n == 0:
    raise _bad(param, f"{where}: empty (no tokens)")
  if n > max_seq_len - 1:
    raise _bad(param, f"{where} too long: {n} tokens > max {max_seq_len - 1} (the server's "
                      f"max_seq_len={max_seq_len} holds prompt and answer, at least one answer token)")
  bad_ids = [t for t in ids if not 0 <= t < vocab_size]
  if bad_ids:
    raise _bad(param, f"{where}: token id {bad_ids[0]} outside the vocabulary [0, {vocab_size})")
  if limit is not None and limit > max_seq_len - n:
    raise _bad(limit_name, f"{limit_name}={limit}: the prompt's {n} tokens leave room for at most "
                           f"{max_seq_len - n} in the server's max_seq_len={max_seq_len}")


def _check_sampling(body: CompletionRequest | ChatRequest) -> None:
  if not (math.isfinite(body.temperature) and body.temperature >= 0):
    raise _bad("temperature", f"temperature={body.temperature}: must be a finite number >= 0 (0 = greedy)")
  if not (math.isfinite(body.top_p) and 0 < body.top_p <= 1):
    raise _bad("top_p", f"top_p={body.top_p}: must lie in (0, 1]")
  if body.top_k == 0 or body.top_k < -1:
    raise _bad("top_k", f"top_k={body.top_k}: must be positive or -1 (off)")
  if not 1 <= body.n <= MAX_N:
    raise _bad("n", f"n={body.n}: must lie in [1, {MAX_N}]")


def prepare(body: CompletionRequest | ChatRequest, prompts: list[list[int]], *, tokenizer: Tokenizer,
            max_seq_len: int, vocab_size: int) -> Prepared:
  """Checks `body` against the server's limits; raises `ApiError` (400) naming the field and its value."""
  for name, ok in _NEUTRAL.items():
    value = getattr(body, name, ok[0])
    if value not in ok:
      raise _bad(name, f"{name}={value!r} is not supported by this server")
  chat = isinstance(body, ChatRequest)
  logprobs, top = _top(body)
  echo = not chat and body.echo
  if body.stream and (top or echo):
    raise _bad("stream", f"stream=true with {'echo' if echo else 'top alternatives'} is not supported; ask without "
                         f"streaming")
  tools = chat and _tools_in_use(body, tokenizer)
  prompt_param = "messages" if chat else "prompt"
  if not prompts:
    raise _bad(prompt_param, f"{prompt_param}: no prompt")
  limit_name, limit = _max_tokens(body)
  if limit is not None and limit < 1:
    raise _bad(limit_name, f"{limit_name}={limit}: must be >= 1")
  for i, ids in enumerate(prompts):
    _check_prompt(ids, f"{prompt_param}[{i}]" if len(prompts) > 1 else prompt_param, prompt_param, limit_name,
                  limit, max_seq_len=max_seq_len, vocab_size=vocab_size)
  _check_sampling(body)
  stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
  if any(not s for s in stops):
    raise _bad("stop", f"stop={body.stop!r}: stop strings must be non-empty")
  # The sampler also stops on each string's own tokens (found in its thread); a string drawn as other tokens is
  # found in the text afterwards (see `cut_at_stop`).
  stop_ids = tuple(ids for ids in (tuple(_encode(tokenizer, s, "stop")) for s in stops) if ids)
  seed = secrets.randbits(32) if body.seed is None else body.seed
  requests = []
  for i, ids in enumerate(prompts):
    try:
      sampling = SamplingParams(
          temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
          max_new_tokens=max_seq_len - len(ids) if limit is None else limit, ignore_eos=body.ignore_eos,
          stop=stop_ids, seed=seed)
    except ValueError as e:  # anything the checks above missed
      raise _bad(None, str(e)) from None
    # Prompt i is group i: answer j draws from key (seed, i, j), so a seed names its answers.
    requests.append(Request(group_id=i, prompt_ids=ids, num_answers=body.n, sampling=sampling))
  conv = conversation(body, tokenizer) if chat else None
  return Prepared(requests=requests, conversation=conv, stops=stops, logprobs=logprobs, top=top, echo=echo,
                  tools=tools, stream=body.stream,
                  include_usage=bool(body.stream_options and body.stream_options.include_usage))


# --- shaping answers ------------------------------------------------------------------------------------------------


def finish_reason(reason: str | None) -> str:
  return "length" if reason == "length" else "stop"


def cut_at_stop(tokens: list[int], text: str, stops: tuple[str, ...], tokenizer: Tokenizer):
  """(tokens through the one that completes the first stop string, the text before it), or None if `text` holds
  no stop string."""
  if not any(s in text for s in stops):
    return None
  lo, hi = 1, len(tokens)  # the shortest prefix whose text holds a stop string
  while lo < hi:
    mid = (lo + hi) // 2
    if any(s in tokenizer.decode(tokens[:mid]) for s in stops):
      hi = mid
    else:
      lo = mid + 1
  text = tokenizer.decode(tokens[:lo])
  return tokens[:lo], text[:min(text.find(s) for s in stops if s in text)]


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
  finish = finish_reason(seq.finish_reason)
  if (cut := cut_at_stop(tokens, text, stops, tokenizer)) is not None:
    (tokens, text), finish = cut, "stop"
  return Answer(text=text, token_ids=tokens, logprobs=[float(x) for x in seq.logprobs[:len(tokens)]],
                finish_reason=finish, version_start=int(seq.versions[0]),
                version_end=int(seq.versions[len(tokens) - 1]))


def answer_fields(token_ids: list[int], logprobs: list[float], versions: list[int], version: int) -> dict[str, Any]:
  """This project's fields: the answer's token ids, their logprobs, the versions of its first and last token and the
  newest version that produced one (`versions`: each token's, or just the first and last)."""
  start, end = (int(versions[0]), int(versions[-1])) if versions else (version, version)
  return {"policy_version": max(version, end), "token_ids": token_ids, "token_logprobs": logprobs,
          "version_start": start, "version_end": end}


def envelope(kind: str, choices: list[dict], *, model: str, version: int, request_id: str | None = None,
             usage: dict[str, int] | None = None) -> dict[str, Any]:
  prefix = "chatcmpl" if kind.startswith("chat.completion") else "cmpl"
  out = {"id": request_id or f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
         "model": model, "system_fingerprint": f"areal_jax-policy-v{version}", "policy_version": version,
         "choices": choices}
  if usage is not None:
    out["usage"] = usage
  return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def choice_extras(a: Answer) -> dict[str, Any]:
  return {"token_ids": a.token_ids, "version_start": a.version_start, "version_end": a.version_end}


def _pieces(tokenizer: Tokenizer, ids) -> list[str]:
  return [tokenizer.decode([int(t)]) for t in ids]


def completion_logprobs(tokenizer: Tokenizer, ids: list[int], logprobs: list[float | None], top: int,
                        scores: Scores | None, offset: int, first: int = 0) -> dict[str, Any]:
  """A completions `logprobs` object for tokens `ids` at positions `first`... of the scored sequence."""
  pieces = _pieces(tokenizer, ids)
  tops = None
  if top:
    tops = []
    for k in range(len(ids)):
      row = first + k - 1
      if row < 0:
        tops.append(None)
        continue
      alts = {}
      for piece, lp in zip(_pieces(tokenizer, scores.top_ids[row, :top]), scores.top_logprobs[row, :top].tolist()):
        alts.setdefault(piece, lp)  # the likelier of two ids that decode to one piece
      tops.append(alts)
  offsets = list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=offset))
  return {"tokens": pieces, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, ids: list[int], logprobs: list[float], top: int, scores: Scores | None,
                  first: int) -> dict[str, Any]:
  content = []
  for k, (t, lp) in enumerate(zip(ids, logprobs)):
    piece = tokenizer.decode([t])
    alts = []
    if top:
      row = first + k - 1
      for alt_id, alt_lp in zip(scores.top_ids[row, :top].tolist(), scores.top_logprobs[row, :top].tolist()):
        alt = tokenizer.decode([alt_id])
        alts.append({"token": alt, "logprob": alt_lp, "bytes": list(alt.encode()), "token_id": alt_id})
    content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": alts,
                    "token_id": t})
  return {"content": content, "refusal": None}


Score = Callable[[list[int]], Scores]


def completion_response(prepared: Prepared, seqs: list[list[Sequence]], *, tokenizer: Tokenizer, model: str,
                        score: Score | None = None) -> dict[str, Any]:
  """The body for `seqs[i][j]`, answer j to prompt i (choice i * n + j). `score` gives the alternatives and the
  echoed prompt's logprobs (needed when `prepared.top` or `prepared.echo`)."""
  choices, answers = [], []
  for request, group in zip(prepared.requests, seqs):
    prompt = request.prompt_ids.tolist()
    prompt_text = tokenizer.decode(prompt)
    for seq in group:
      a = shape_answer(seq, prepared.stops, tokenizer)
      answers.append(a)
      scores = score(prompt + a.token_ids) if (prepared.top or prepared.echo) else None
      text, logprobs = a.text, None
      if prepared.echo:
        text = prompt_text + a.text
        if prepared.logprobs:
          lps = [None] + scores.logprobs[:len(prompt) - 1].tolist() + a.logprobs
          logprobs = completion_logprobs(tokenizer, prompt + a.token_ids, lps, prepared.top, scores, 0)
      elif prepared.logprobs:
        logprobs = completion_logprobs(tokenizer, a.token_ids, a.logprobs, prepared.top, scores, len(prompt_text),
                                       first=len(prompt))
      choices.append({"index": len(choices), "text": text, "finish_reason": a.finish_reason, "logprobs": logprobs,
                      **choice_extras(a)})
  prompt_tokens = sum(len(r.prompt_ids) for r in prepared.requests)
  return envelope("text_completion", choices, model=model, version=max(a.version_end for a in answers),
                  usage=usage(prompt_tokens, sum(len(a.token_ids) for a in answers)))


def chat_message(text: str, tools: bool) -> tuple[dict[str, Any], str | None]:
  """The assistant message for `text` and "tool_calls" if it holds calls (when `tools`), else None."""
  if tools:
    content, calls = tool_calls.parse(text)
    if calls:
      return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
  return {"role": "assistant", "content": text}, None


def chat_response(prepared: Prepared, seqs: list[list[Sequence]], *, tokenizer: Tokenizer, model: str,
                  score: Score | None = None) -> dict[str, Any]:
  [request], [group] = prepared.requests, seqs
  prompt = request.prompt_ids.tolist()
  choices, answers = [], []
  for i, seq in enumerate(group):
    a = shape_answer(seq, prepared.stops, tokenizer)
    answers.append(a)
    logprobs = None
    if prepared.logprobs:
      scores = score(prompt + a.token_ids) if prepared.top else None
      logprobs = chat_logprobs(tokenizer, a.token_ids, a.logprobs, prepared.top, scores, first=len(prompt))
    message, called = chat_message(a.text, prepared.tools)
    choices.append({"index": i, "message": message, "finish_reason": called or a.finish_reason,
                    "logprobs": logprobs, **choice_extras(a)})
  return envelope("chat.completion", choices, model=model, version=max(a.version_end for a in answers),
                  usage=usage(len(prompt), sum(len(a.token_ids) for a in answers)))
