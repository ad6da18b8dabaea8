r"""Prompt templates: "plain" (`Q: ...\nA: `) or "chat" (the tokenizer's chat template, generation prompt added).

Problems from real datasets get an instruction appended to the question (`\boxed{}` for math, a ```python block for
code), as reasoning models are prompted; the synthetic problems do not (their worked solutions teach the format and
the tiny model's prompts must stay short).
"""

from __future__ import annotations

from areal_jax.data.records import Problem

TEMPLATES = ("plain", "chat")
INSTRUCTIONS = {
    "math": "Please reason step by step, and put your final answer within \\boxed{}.",
    "code": ("Write a Python 3 solution. Put the complete program (or the requested function) in a single "
             "```python code block."),
}


def render_prompt(problem: Problem, tokenizer, template: str, *, instruct: bool) -> str:
  """The prompt text for `problem`; `instruct` appends the instruction for its kind."""
  content = f"{problem.question}\n\n{INSTRUCTIONS[problem.kind]}" if instruct else problem.question
  if template == "plain":
    return f"Q: {content}\nA: "
  if template == "chat":
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
  raise ValueError(f"data.prompt_template={template!r}: choose one of {TEMPLATES}")


def follow_up(text: str, tokenizer, template: str, *, ended: bool) -> str:
  """What follows an answer to open a next user turn saying `text` and prompt the next answer, in `template`'s
  format: "plain" gives `\\nQ: text\\nA: `; "chat" the chat template's end of the assistant turn, the user turn and
  the generation prompt. `ended`: the answer's tokens end with the end-of-turn token (its text is then left out)."""
  if template == "plain":
    return f"\nQ: {text}\nA: "
  if template != "chat":
    raise ValueError(f"data.prompt_template={template!r}: choose one of {TEMPLATES}")
  marker = "\u2063answer\u2063"  # content no template writes itself
  chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}]
  through = tokenizer.apply_chat_template(chat, add_generation_prompt=False)
  full = tokenizer.apply_chat_template(chat + [{"role": "user", "content": text}], add_generation_prompt=True)
  if not full.startswith(through) or marker not in through:
    raise ValueError("data.prompt_template='chat': the tokenizer's chat template does not render a conversation as "
                     "its earlier turns followed by the next one, so a follow-up turn cannot continue an answer")
  end = through[through.rindex(marker) + len(marker):]  # the template's end of the assistant turn
  eos = getattr(tokenizer, "eos_token", None)
  if ended and eos and eos in end:
    end = end[end.index(eos) + len(eos):]
  return end + full[len(through):]
