"""Tokenizers: HF tokenizer.json (+ chat template, checked against transformers), sentencepiece, char vocabulary."""

import io
import json

import pytest
import sentencepiece as spm
import tokenizers
import transformers

from areal_jax.data import synthetic
from areal_jax.data.prompts import render_prompt
from areal_jax.tokenizer import CharTokenizer, HFTokenizer, SentencePieceTokenizer, load_tokenizer

TEXT = ["What is 12 + 30? The answer is \\boxed{42}.", "Solve x^2 = 9 for x > 0.", "Natalia sold 48 clips in April.",
        "Let's think step by step. First, 7 * 6 = 42."] * 20

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
          "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("hf_tok")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                           "<|im_end|>"],
                                           initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(TEXT, trainer)
  tok.save(str(path / "tokenizer.json"))
  with open(path / "tokenizer_config.json", "w") as f:
    json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
               "tokenizer_class": "PreTrainedTokenizerFast"}, f)
  return str(path)


def test_hf_tokenizer_matches_transformers(hf_dir):
  ours = load_tokenizer(hf_dir)
  assert isinstance(ours, HFTokenizer)
  ref = transformers.AutoTokenizer.from_pretrained(hf_dir)
  text = "Compute 3/4 + 1/8. Put the answer in \\boxed{}."
  ids = ours.encode(text)
  assert ids == ref.encode(text, add_special_tokens=False)
  assert ours.decode(ids) == text
  assert ours.eos_id == ref.convert_tokens_to_ids("<|im_end|>")
  assert ours.pad_id == ref.convert_tokens_to_ids("<|endoftext|>")
  messages = [{"role": "system", "content": "Reason step by step."}, {"role": "user", "content": text}]
  rendered = ours.apply_chat_template(messages)
  assert rendered == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert rendered.endswith("<|im_start|>assistant\n")


def test_chat_template_jinja_file_wins(hf_dir, tmp_path):
  """transformers saves the template to chat_template.jinja (not tokenizer_config.json), and reads that file first."""
  ref = transformers.AutoTokenizer.from_pretrained(hf_dir)
  ref.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
  ref.save_pretrained(tmp_path)
  assert (tmp_path / "chat_template.jinja").exists()
  ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
  messages = [{"role": "user", "content": "What is 12 + 30?"}]
  rendered = load_tokenizer(str(tmp_path)).apply_chat_template(messages)
  assert rendered == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert rendered == "[user] What is 12 + 30?\n[assistant] "
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  config["chat_template"] = CHATML  # an older template beside the file: the file still wins, as in transformers
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  assert load_tokenizer(str(tmp_path)).apply_chat_template(messages) == rendered
  assert transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True) == rendered


def test_sentencepiece_tokenizer(tmp_path):
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_writer=model, vocab_size=60,
                                 model_type="bpe", pad_id=3, minloglevel=2)
  path = tmp_path / "tok.model"
  path.write_bytes(model.getvalue())
  tok = load_tokenizer(str(path))
  assert isinstance(tok, SentencePieceTokenizer)
  text = "Solve x^2 = 9 for x > 0."
  assert tok.decode(tok.encode(text)) == text
  assert tok.eos_id == 2 and tok.pad_id == 3 and tok.vocab_size == 60
  with pytest.raises(ValueError, match="no chat template"):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_char_tokenizer():
  tok = load_tokenizer("char")
  assert isinstance(tok, CharTokenizer)
  text = "Q: 12+7*3=?\nA: 7*3=21, 12+21=33. \\boxed{33}"
  ids = tok.encode(text)
  assert len(ids) == len(text) and tok.decode(ids + [tok.eos_id, tok.pad_id]) == text
  assert min(ids) >= 2 and max(ids) < tok.vocab_size
  with pytest.raises(ValueError, match="'%'"):
    tok.encode("50% off")
  with pytest.raises(ValueError, match=r"'W' .* it has digits, lowercase letters, Q, A, space, newline and \+-\*/="):
    tok.encode("What is 7 * 8?")  # what the message lists is all it takes
  problem = synthetic.generate(1, difficulty=1, seed=0)[0]
  assert tok.apply_chat_template([{"role": "user", "content": problem.question}]) == render_prompt(
      problem, tok, "plain", instruct=False)  # chat requests see the tiny policy's training prompt
  symbols = "".join(c for c in CharTokenizer.CHARS if not c.isalnum() and c not in " \n")
  assert tok.decode(tok.encode("what is 7 * 8? Q A\n" + symbols)) == "what is 7 * 8? Q A\n" + symbols


def test_bad_tokenizer_spec(tmp_path):
  with pytest.raises(ValueError, match="model.tokenizer"):
    load_tokenizer(str(tmp_path))
  with pytest.raises(ValueError, match="model.tokenizer"):
    load_tokenizer("gpt2")


def test_char_chat_template_renders_tools_and_reads_its_tool_calls_back():
  """The char vocabulary's chat format: turns end in <eos> (encoded as the eos id, as HF encodes special tokens in
  text); a Hermes tool call the model writes is parsed by the server and rendered back token for token."""
  from areal_jax.agents.calculator import TOOLS  # pylint: disable=g-import-not-at-top
  from areal_jax.serve import tool_calls  # pylint: disable=g-import-not-at-top

  tok = CharTokenizer()
  assert tok.vocab_size <= 64 and tool_calls.tool_format(tok) == "hermes"  # the tiny model's 64 embedding rows
  question = [{"role": "user", "content": "what is 37*48?"}]
  prompt = tok.apply_chat_template(question, tools=TOOLS)
  assert prompt == "tools: calc(expr)\nQ: what is 37*48?\nA: "
  drawn = '<tool_call>{"arguments":{"expr":"37*48"},"name":"calc"}</tool_call>'
  content, calls = tool_calls.parse(drawn)
  assert content is None and calls[0]["function"] == {"name": "calc", "arguments": '{"expr": "37*48"}'}
  history = question + [tool_calls.for_template({"role": "assistant", "content": None, "tool_calls": calls}),
                        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "1776"}]
  again = tok.apply_chat_template(history, tools=TOOLS)
  assert again == prompt + drawn + "<eos>\nresult: 1776\nA: "
  ids = tok.encode(again)
  assert ids[:len(tok.encode(prompt + drawn)) + 1] == tok.encode(prompt + drawn) + [tok.eos_id]
  assert tok.decode(ids) == again.replace("<eos>", "")
  turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
  assert tok.apply_chat_template(turns) == "Q: a\nA: b<eos>\nQ: c\nA: "
