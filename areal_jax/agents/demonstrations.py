"""Supervised warm-start examples from chat transcripts (OpenAI's chat fine-tuning format), rendered as the server
renders an agent's requests.

    pairs = demonstration_pairs([{"messages": [...], "tools": [...]}], tokenizer, max_response_len=80)

Each assistant message becomes one (prompt ids, answer ids + eos) pair: the prompt is the chat template's rendering
of the messages before it (with the generation prompt), the answer what the template adds for the message itself,
through its end-of-turn token. An agent may offer these through a `demonstration(data)` method (see
`agents/calculator.py`); the trainer then warm-starts on them instead of worked solutions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from areal_jax.serve import tool_calls
from areal_jax.tokenizer import Tokenizer

_log = logging.getLogger(__name__)


def demonstration_pairs(examples: Iterable[dict[str, Any]], tokenizer: Tokenizer, *,
                        max_response_len: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
  """(prompt ids, answer ids) per assistant message; answers longer than `max_response_len` tokens are left out and
  counted in a warning. Raises ValueError when the template does not render a turn as a continuation of its prompt."""
  pairs, too_long = [], 0
  for example in examples:
    messages = [tool_calls.for_template(m) for m in example["messages"]]
    tools = example.get("tools")
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
      if max_response_len is not None and len(answer) > max_response_len:
        too_long += 1
        continue
      pairs.append((np.asarray(tokenizer.encode(prompt), np.int32), np.asarray(answer, np.int32)))
  if too_long:
    _log.warning("warm-start: left out %d demonstrated turns longer than %d tokens", too_long, max_response_len)
  return pairs
