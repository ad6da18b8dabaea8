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
