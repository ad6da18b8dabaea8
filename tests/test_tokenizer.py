"""Tokenizers: HF tokenizer.json (+ chat template, checked against transformers), sentencepiece, char vocabulary."""

import io
import json

import pytest
import sentencepiece as spm
import tokenizers
import transformers

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


def test_bad_tokenizer_spec(tmp_path):
  with pytest.raises(ValueError, match="model.tokenizer"):
    load_tokenizer(str(tmp_path))
  with pytest.raises(ValueError, match="model.tokenizer"):
    load_tokenizer("gpt2")
