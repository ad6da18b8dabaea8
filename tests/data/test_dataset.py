"""build_dataset and the resumable prompt stream: shuffling, resuming across epochs, held-out eval, long prompts."""

import json
import logging
import os
import threading

import numpy as np
import pytest

from areal_jax.config import load_config
from areal_jax.data import DataConfig, DataError, PromptDataset, build_dataset, warmstart_pairs
from areal_jax.reward.math import verify_math
from areal_jax.tokenizer import CharTokenizer, HFTokenizer
from helpers import write_bpe_tokenizer

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "math.py")


def _config(**overrides):
  return load_config(CONFIG, **overrides)


def _data(c):
  """The config's typed `data` record (what a run passes to `build_dataset`)."""
  return DataConfig.from_config(c.data)


def _uids(dataset, n):
  return [next(dataset).uid for _ in range(n)]


def test_synthetic_default_builds_train_and_held_out_eval():
  c = _config(**{"data.synthetic_size": 3000})
  tok = CharTokenizer()
  train = build_dataset(_data(c), tok, split="train")
  evalset = build_dataset(_data(c), tok, split="eval")
  assert len(train) == 3000 and len(evalset) == c.data.eval_size
  assert not {r.prompt for r in train.records} & {r.prompt for r in evalset.records}
  record = next(train)
  assert record.prompt.startswith("Q: what is ") and record.prompt.endswith("\nA: ")
  assert record.prompt_ids.dtype == np.int32 and tok.decode(record.prompt_ids) == record.prompt
  assert record.num_prompt_tokens <= c.data.max_prompt_len and record.kind == "math"
  assert verify_math(record.solution, record.reference)
  assert [r.uid for r in evalset.records] == _uids(evalset, len(evalset))  # eval: fixed order, no shuffle
  pairs = warmstart_pairs(train.records, tok, max_response_len=64)
  assert len(pairs) == 3000 and pairs[0][1][-1] == tok.eos_id
  assert tok.decode(pairs[0][1]) == train.records[0].solution


def test_shuffle_is_seeded_and_reshuffles_each_epoch():
  records = build_dataset(_data(_config()), CharTokenizer(), split="eval").records
  a = PromptDataset(records, seed=1)
  b = PromptDataset(records, seed=1)
  c = PromptDataset(records, seed=2)
  n = len(records)
  first, second = _uids(a, n), _uids(a, n)
  assert first == _uids(b, n) and first != _uids(c, n)
  assert sorted(first) == sorted(second) == sorted(r.uid for r in records)  # each epoch visits every record once
  assert first != second and a.epoch == 1


@pytest.mark.parametrize("stop_at", [0, 1, 127, 128, 129, 300, 640])
def test_resume_continues_exactly_across_epochs(stop_at):
  records = build_dataset(_data(_config()), CharTokenizer(), split="eval").records  # 128 records
  reference = _uids(PromptDataset(records, seed=5), 800)
  interrupted = PromptDataset(records, seed=5)
  before = _uids(interrupted, stop_at)
  state = json.loads(json.dumps(interrupted.state()))  # what a checkpoint stores
  resumed = PromptDataset(records, seed=5)
  resumed.restore(state)
  assert before + _uids(resumed, 800 - stop_at) == reference
  assert set(state) == {"epoch", "index", "seed", "size"}


def test_restore_rejects_a_different_dataset():
  records = build_dataset(_data(_config()), CharTokenizer(), split="eval").records
  state = PromptDataset(records, seed=5).state()
  with pytest.raises(DataError, match="saved for seed 5 and 128 records"):
    PromptDataset(records, seed=6).restore(state)
  with pytest.raises(DataError, match="saved for seed 5 and 128 records"):
    PromptDataset(records[:100], seed=5).restore(state)
  with pytest.raises(DataError, match="lacks 'epoch'"):
    PromptDataset(records, seed=5).restore({"index": 0, "seed": 5, "size": 128})


def test_next_is_thread_safe():
  records = build_dataset(_data(_config()), CharTokenizer(), split="eval").records
  dataset = PromptDataset(records, seed=0)
  seen = []
  lock = threading.Lock()

  def take():
    for _ in range(256):
      uid = next(dataset).uid
      with lock:
        seen.append(uid)

  threads = [threading.Thread(target=take) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert dataset.state()["epoch"] == 7 and dataset.state()["index"] == 128  # the 9th epoch starts on next()
  assert sorted(seen) == sorted(r.uid for r in records * 8)  # every epoch complete, nothing twice


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
  """A tiny byte-level BPE tokenizer with a ChatML chat template."""
  directory = str(tmp_path_factory.mktemp("hf_tok"))
  write_bpe_tokenizer(directory, ["What is the answer? Please reason step by step, and put it within \\boxed{}."])
  return HFTokenizer(directory)


def test_jsonl_with_chat_template_long_prompts_dropped_and_held_out_eval(tmp_path, caplog, hf_tokenizer):
  rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(40)]
  rows[5]["question"] = "What is this? " * 200  # far over max_prompt_len
  path = tmp_path / "gsm8k.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  tok = hf_tokenizer
  c = _config(**{"data.source": "jsonl", "data.path": str(path), "data.prompt_template": "chat",
                 "data.max_prompt_len": 200, "data.eval_size": 8})
  with caplog.at_level(logging.WARNING):
    train = build_dataset(_data(c), tok, split="train")
  evalset = build_dataset(_data(c), tok, split="eval")
  assert "dropped 1 of 32 prompts longer than data.max_prompt_len=200" in caplog.text or \
      "dropped 1 of 8 prompts" in caplog.text
  assert train.stats["too_long"] + evalset.stats["too_long"] == 1
  assert len(train) + len(evalset) == 39 and not {r.uid for r in train.records} & {r.uid for r in evalset.records}
  record = train.records[0]
  assert record.prompt.startswith("<|im_start|>user\nWhat is") and record.prompt.endswith("<|im_start|>assistant\n")
  assert "\\boxed{}" in record.prompt  # the math instruction
  assert all(len(r.prompt_ids) <= 200 for r in train.records)
  assert record.reference == str(2 * int(record.uid.split(":")[1]) - 2)  # uid = file:line, line = i + 1


def test_eval_path_and_bad_rows_through_the_config(tmp_path, hf_tokenizer):
  train_path, eval_path = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
  train_path.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"\n{"problem": "3+3", "answer": "6"}\n')
  eval_path.write_text('{"problem": "5+5", "answer": "10"}\n')
  c = _config(**{"data.source": "jsonl", "data.path": str(train_path), "data.eval_path": str(eval_path),
                 "data.prompt_template": "plain", "data.max_prompt_len": 1000})
  with pytest.raises(DataError, match=r"train\.jsonl:2: malformed JSON"):
    build_dataset(_data(c), hf_tokenizer, split="train")
  c.data.skip_bad_rows = True
  train = build_dataset(_data(c), hf_tokenizer, split="train")
  assert len(train) == 2 and train.stats["bad_rows"] == 1
  assert train.records[0].prompt.startswith("Q: 1+1\n\nPlease reason") and train.records[0].prompt.endswith("A: ")
  evalset = build_dataset(_data(c), hf_tokenizer, split="eval")
  assert [r.reference for r in evalset.records] == ["10"]


def test_every_prompt_too_long_is_an_error():
  c = _config(**{"data.max_prompt_len": 5})
  with pytest.raises(DataError, match="all 128 prompts are longer than data.max_prompt_len=5"):
    build_dataset(_data(c), CharTokenizer(), split="eval")


def test_resume_after_rebuilding_from_the_config():
  c = _config(**{"data.synthetic_size": 500})
  reference = _uids(build_dataset(_data(c), CharTokenizer(), split="train"), 1700)
  first = build_dataset(_data(c), CharTokenizer(), split="train")
  head = _uids(first, 1234)
  second = build_dataset(_data(c), CharTokenizer(), split="train")  # a new process would rebuild, then restore
  second.restore(first.state())
  assert head + _uids(second, 1700 - 1234) == reference
