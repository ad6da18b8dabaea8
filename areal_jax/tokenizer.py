"""Tokenizers behind one small protocol: HF `tokenizer.json`, sentencepiece, and a built-in character vocabulary.

`load_tokenizer("char")` is the tiny default's own vocabulary (no files); `load_tokenizer(path)` reads a HF tokenizer
directory (`tokenizer.json`, `tokenizer_config.json`, the chat template from `chat_template.jinja` or else
`tokenizer_config.json`) or a sentencepiece `.model` file.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Protocol, Sequence

import jinja2.sandbox


class Tokenizer(Protocol):
  vocab_size: int
  eos_id: int
  pad_id: int
  bos_id: int | None  # None: the vocabulary has no BOS token; `encode` never adds one
  eos_token: str | None  # the EOS token's text, as chat templates write it (None: unknown)

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...

  def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                          tools: list[dict] | None = None) -> str: ...


def _render_chat(template: str | None, messages, *, add_generation_prompt: bool, source: str,
                 tools: list[dict] | None = None, **special) -> str:
  """Renders a HF chat template the way `transformers` does (sandboxed jinja2, trim/lstrip blocks); `tools` (OpenAI
  tool definitions) reach the template as `tools`, as there."""
  if not template:
    raise ValueError(f"tokenizer {source} has no chat template; use data.prompt_template='plain'")
  if tools is not None:
    special["tools"] = tools
  return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **special)


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
  def raise_exception(msg):
    raise jinja2.exceptions.TemplateError(msg)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                      extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, **kw: json.dumps(
      x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)  # transformers' signature
  env.globals.update(raise_exception=raise_exception,
                     strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
  return env.from_string(template)


# The char vocabulary's chat format: "Q: " user turns, "A: " assistant turns ending in "<eos>" (the eos token, as
# Qwen's templates end turns in <|im_end|>), "result: " tool outputs; `tools` as one "tools: name(params)" line;
# tool calls in the Hermes format (`serve/tool_calls.py`), compact and arguments first: what a tiny model copies from
# the question then sits closer to where it writes it (a character model learns to copy over short distances sooner). A single user turn renders the plain "Q: ...\nA: " prompt.
CHAR_CHAT_TEMPLATE = (
    "{%- if tools %}tools: {% for t in tools %}"
    "{{ t.function.name }}({{ t.function.parameters.properties | join(',') }}){{ ' ' if not loop.last }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}{{ '\\n' if not loop.first }}"
    "{%- if m.role == 'user' %}Q: {{ m.content }}"
    "{%- elif m.role == 'assistant' %}A: {{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'arguments': c.function.arguments, 'name': c.function.name}"
    " | tojson(separators=(',', ':')) }}</tool_call>{% endfor %}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}result: {{ m.content }}"
    "{%- else %}{{ m.content }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '\\nA: ' }}{% endif %}")


class CharTokenizer:
  """A fixed character vocabulary for the tiny default model: ids 0 <pad>, 1 <eos>, then one id per character. As in
  HF tokenizers, the text "<eos>" encodes to the eos id (the chat template ends assistant turns with it)."""

  CHARS = "0123456789abcdefghijklmnopqrstuvwxyz +-*/=().,:?\\{}\n^#$QA<>\"_"
  SPECIALS = ("<pad>", "<eos>")
  eos_token = SPECIALS[1]
  chat_template = CHAR_CHAT_TEMPLATE

  def __init__(self):
    self.vocab_size = len(self.SPECIALS) + len(self.CHARS)
    self.pad_id, self.eos_id, self.bos_id = 0, 1, None
    self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(self.CHARS)}

  def encode(self, text: str) -> list[int]:
    ids = []
    for i, piece in enumerate(text.split(self.SPECIALS[1])):
      if i:
        ids.append(self.eos_id)
      try:
        ids += [self._ids[c] for c in piece]
      except KeyError as e:
        symbols = "".join(c for c in self.CHARS if not c.isalnum() and c not in " \n")
        raise ValueError(f"character {e.args[0]!r} is not in the char vocabulary (text {text[:60]!r}); it has digits, "
                         f"lowercase letters, Q, A, space, newline and {symbols}") from None
    return ids

  def decode(self, ids: Sequence[int]) -> str:
    n = len(self.SPECIALS)
    return "".join(self.CHARS[i - n] for i in ids if n <= i < self.vocab_size)

  def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, tools=None) -> str:
    """`CHAR_CHAT_TEMPLATE`: one user message gives the plain "Q: ...\\nA: " prompt the tiny policy is trained on."""
    return _render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt, source="char",
                        tools=tools, eos_token=self.eos_token)


class HFTokenizer:
  """A HF tokenizer directory through the `tokenizers` library; chat templates rendered with jinja2."""

  def __init__(self, path: str):
    import tokenizers  # pylint: disable=g-import-not-at-top

    self.path = path
    self._tok = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    cfg = {}
    cfg_path = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(cfg_path):
      with open(cfg_path) as f:
        cfg = json.load(f)
    self._cfg = cfg
    self.chat_template = cfg.get("chat_template")
    if isinstance(self.chat_template, list):  # named templates: take "default"
      self.chat_template = next((t["template"] for t in self.chat_template if t.get("name") == "default"), None)
    jinja = os.path.join(path, "chat_template.jinja")  # where transformers saves it now; it wins, as there
    if os.path.exists(jinja):
      with open(jinja) as f:
        self.chat_template = f.read()
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.eos_token = self._token_str(cfg.get("eos_token"))
    gen_cfg = os.path.join(path, "generation_config.json")
    eos = self._tok.token_to_id(self.eos_token) if self.eos_token else None
    if eos is None and os.path.exists(gen_cfg):
      with open(gen_cfg) as f:
        e = json.load(f).get("eos_token_id")
      eos = e[0] if isinstance(e, list) else e
    if eos is None:
      raise ValueError(f"{path}: no eos token (tokenizer_config.json eos_token / generation_config.json)")
    self.eos_id = int(eos)
    pad = self._token_str(cfg.get("pad_token"))
    pad_id = self._tok.token_to_id(pad) if pad else None
    self.pad_id = self.eos_id if pad_id is None else pad_id
    self.bos_token = self._token_str(cfg.get("bos_token"))
    self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None  # encode never adds it

  @staticmethod
  def _token_str(t):
    return t.get("content") if isinstance(t, dict) else t

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=True)

  def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, tools=None) -> str:
    return _render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                        source=self.path, tools=tools, eos_token=self.eos_token or "", bos_token=self.bos_token or "")


class SentencePieceTokenizer:
  """A sentencepiece `.model` file. Pad falls back to eos when the model has no pad piece."""

  def __init__(self, path: str, *, chat_template: str | None = None):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top

    self.path = path
    self._sp = spm.SentencePieceProcessor(model_file=path)
    self.vocab_size = self._sp.get_piece_size()
    self.eos_id = self._sp.eos_id()
    if self.eos_id < 0:
      raise ValueError(f"{path}: sentencepiece model has no eos piece")
    self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id
    self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None  # encode never adds it
    self.eos_token = self._sp.id_to_piece(self.eos_id)
    self.chat_template = chat_template

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, tools=None) -> str:
    return _render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt, source=self.path,
                        tools=tools, eos_token=self.eos_token, bos_token="")


def load_tokenizer(spec: str) -> Tokenizer:
  """"char", a HF tokenizer directory, a sentencepiece `.model` file, or a directory holding `tokenizer.model`."""
  if spec == "char":
    return CharTokenizer()
  if os.path.isdir(spec):
    if os.path.exists(os.path.join(spec, "tokenizer.json")):
      return HFTokenizer(spec)
    if os.path.exists(os.path.join(spec, "tokenizer.model")):
      return SentencePieceTokenizer(os.path.join(spec, "tokenizer.model"))
    raise ValueError(f"model.tokenizer={spec!r}: directory has neither tokenizer.json nor tokenizer.model")
  if spec.endswith(".model") and os.path.exists(spec):
    return SentencePieceTokenizer(spec)
  raise ValueError(f"model.tokenizer={spec!r}: not 'char', a tokenizer directory or an existing .model file")
