"""Token in, token out across an episode's turns: a chat turn whose history holds an answer the policy drew is
prompted with the ids it drew, not with a re-encoding of the text the agent sent back.

    history = TurnHistory(tokenizer)
    ids, retokenized = history.prompt(conversation)  # None: encode the rendered text as usual
    history.add(conversation, prompt_ids, tokens, text, eos=True)  # after each answer, as drawn

Re-encoding an answer's text seldom gives the drawn ids back: BPE merges across the turn's end, a tool call the agent
(or the template) re-serialises with other whitespace, a reasoning block the template drops. Training on the
re-encoding would train on tokens the policy never drew; here the next prompt is the earlier prompt's ids, the drawn
answer's, then the encoding of what the template adds after that answer (the end of its turn, tool results, the next
user turn). So the turns also merge into one training sequence (`episodes.to_trajectories`).

A conversation continues an earlier answer when the messages before one of its assistant messages render to that
answer's prompt text (same tools), and that assistant message says what the answer said (its text, or its content and
tool calls, arguments compared as JSON). The template's rendering of that message is replaced by the drawn tokens:
directly when it starts with the answer's text, else (re-serialised) up to the end-of-turn token the answer ended
with. An assistant message that cannot be matched so (the agent edited or summarised it, an answer cut by a stop
string came back without it) is re-encoded and the turn counted as retokenized (`agent/retokenized_turns`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from areal_jax.serve import tool_calls
from areal_jax.serve.openai_api import Conversation
from areal_jax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Drawn:
  conversation: Conversation
  prompt_text: str
  prompt_ids: tuple[int, ...]
  tokens: tuple[int, ...]
  text: str  # the answer's text as the agent received it (cut before a stop string)
  eos: bool  # the answer ended with the end-of-turn token


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
  out = []
  for call in message.get("tool_calls") or ():
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments")
    if isinstance(args, str):
      try:
        args = json.loads(args)
      except json.JSONDecodeError:
        pass
    out.append((fn.get("name"), args))
  return out


def _says(message: dict[str, Any], drawn: _Drawn) -> bool:
  """Whether an assistant message holds what `drawn` answered (content and tool calls)."""
  content, calls = (tool_calls.parse(drawn.text) if drawn.conversation.tools else (drawn.text, None))
  reply = {"content": content, "tool_calls": calls}
  return ((message.get("content") or "").strip() == (content or "").strip()
          and _calls(message) == _calls(tool_calls.for_template(reply)))


class TurnHistory:
  """One episode's drawn answers and the prompts that continue them (see the module docstring)."""

  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer
    self.eos_text = getattr(tokenizer, "eos_token", None)
    self._drawn: list[_Drawn] = []

  def add(self, conversation: Conversation, prompt_ids, tokens, text: str, *, eos: bool) -> None:
    self._drawn.append(_Drawn(conversation=conversation, prompt_text=conversation.render(self.tokenizer),
                              prompt_ids=tuple(int(t) for t in prompt_ids), tokens=tuple(int(t) for t in tokens),
                              text=text, eos=eos))

  def prompt(self, conversation: Conversation) -> tuple[list[int] | None, bool]:
    """(the prompt ids that keep the drawn answers of `conversation`'s history, or None to encode its text; whether
    an assistant message in it had to be re-encoded)."""
    messages = conversation.messages
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    if last < 0:
      return None, False
    for drawn in reversed(self._drawn):  # the latest answer it continues
      k = len(drawn.conversation.messages)
      if (k >= len(messages) or messages[k].get("role") != "assistant" or drawn.conversation.tools != conversation.tools
          or not _says(messages[k], drawn)):
        continue
      try:
        ids = self._continued(drawn, conversation, k)
      except Exception:  # pylint: disable=broad-except  # a template that refuses a part of the chat: no match
        ids = None
      if ids is not None:
        return ids, k < last
    return None, True

  def _continued(self, drawn: _Drawn, conversation: Conversation, k: int) -> list[int] | None:
    if conversation.render(self.tokenizer, upto=k) != drawn.prompt_text:
      return None
    through = conversation.render(self.tokenizer, upto=k + 1, add_generation_prompt=False)
    full = conversation.render(self.tokenizer)
    if not (through.startswith(drawn.prompt_text) and full.startswith(through)):
      return None
    rendered = through[len(drawn.prompt_text):]  # the template's text of the answer's turn
    answer = self.tokenizer.decode(drawn.tokens)
    if rendered.startswith(answer):
      after = rendered[len(answer):]
    elif drawn.eos and self.eos_text and self.eos_text in rendered:
      after = rendered[rendered.rindex(self.eos_text):]
    else:
      return None
    if drawn.eos and self.eos_text and after.startswith(self.eos_text):
      after = after[len(self.eos_text):]  # the drawn end-of-turn token is the template's
    return [*drawn.prompt_ids, *drawn.tokens, *self.tokenizer.encode(after + full[len(through):])]
