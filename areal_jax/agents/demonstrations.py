"""Supervised warm-start examples from chat transcripts (OpenAI's chat fine-tuning format), rendered as the server
renders an agent's requests.

    episodes = demonstration_episodes([{"messages": [...], "tools": [...]}], tokenizer, max_response_len=80)
    pairs = demonstration_pairs(...)  # one (prompt ids, answer ids) pair per assistant turn instead

Each assistant message is one turn: its prompt is the chat template's rendering of the messages before it (with the
generation prompt), its answer what the template adds for the message itself, through its end-of-turn token.
`demonstration_episodes` merges a transcript's turns as training merges an agent's recorded episode (`episodes`):
one sequence whose loss covers only the assistant's tokens, where the pairs would repeat the shared history once per
turn. An agent may offer transcripts through a `demonstration(data)` method (see `agents/calculator.py`); the
trainer then warm-starts on its episodes instead of worked solutions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from areal_jax.agents import episodes
from areal_jax.serve import tool_calls
from areal_jax.tokenizer import Tokenizer
from areal_jax.types import Trajectory

_log = logging.getLogger(__name__)


def _turns(example: dict[str, Any], tokenizer: Tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
  """(prompt ids, answer ids + eos) per assistant message of one transcript."""
  messages = [tool_calls.for_template(m) for m in example["messages"]]
  tools = example.get("tools")
  turns = []
  for i, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    prompt = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tools=tools)
    full = tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False, tools=tools)
    if not full.startswith(prompt):
      raise ValueError(f"demonstration {example['messages']!r}: the chat template does not render assistant turn "
                       f"{i} as a continuation of its prompt ({full!r} after {prompt!r})")
    answer = list(tokenizer.encode(full[len(prompt):]))
    answer = answer[:answer.index(tokenizer.eos_id) + 1] if tokenizer.eos_id in answer else answer + [
        tokenizer.eos_id]
    turns.append((np.asarray(tokenizer.encode(prompt), np.int32), np.asarray(answer, np.int32)))
  return turns


def demonstration_pairs(examples: Iterable[dict[str, Any]], tokenizer: Tokenizer, *,
                        max_response_len: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
  """(prompt ids, answer ids) per assistant message; answers longer than `max_response_len` tokens are left out and
  counted in a warning. Raises ValueError when the template does not render a turn as a continuation of its prompt."""
  pairs, too_long = [], 0
  for example in examples:
    for prompt, answer in _turns(example, tokenizer):
      if max_response_len is not None and len(answer) > max_response_len:
        too_long += 1
        continue
      pairs.append((prompt, answer))
  if too_long:
    _log.warning("warm-start: left out %d demonstrated turns longer than %d tokens", too_long, max_response_len)
  return pairs


def demonstration_episodes(examples: Iterable[dict[str, Any]], tokenizer: Tokenizer, *,
                           max_response_len: int | None = None) -> list[Trajectory]:
  """One training sequence per transcript, its turns merged where each prompt extends the previous prompt and
  answer (else one per turn, as `episodes.to_trajectories` splits a recorded episode). A transcript with an answer
  longer than `max_response_len` tokens is left out and counted in a warning."""
  out, too_long = [], 0
  for example in examples:
    turns = _turns(example, tokenizer)
    if max_response_len is not None and any(len(answer) > max_response_len for _, answer in turns):
      too_long += 1
      continue
    completions = [episodes.Completion(response_id=str(i), prompt_ids=prompt, tokens=answer,
                                       logprobs=np.zeros(len(answer), np.float32),
                                       versions=np.zeros(len(answer), np.int32), finish_reason="eos")
                   for i, (prompt, answer) in enumerate(turns)]
    out += episodes.to_trajectories(completions, [0.0] * len(completions), group_id=0)
  if too_long:
    _log.warning("warm-start: left out %d demonstrations with a turn longer than %d tokens", too_long,
                 max_response_len)
  return out
