"""A whole run as a user brings one: a Qwen2 checkpoint built and saved by `transformers`, its BPE `tokenizer.json`
with a Qwen-style (ChatML) chat template, a math dataset released as Parquet. `model.init_from` + `model.tokenizer` +
`data.prompt_template=chat`, a warm-start of the checkpoint on `\\boxed{}` solutions, RL steps, checkpoints, and
`tools/convert_hf.py` back to a HF directory that `transformers` loads and answers from greedily as our sampler does."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers

from areal_jax.config import load_config
from areal_jax.data import synthetic
from areal_jax.data.prompts import INSTRUCTIONS, render_prompt
from areal_jax.models import load_hf
from areal_jax.rl.metrics import read_metrics
from areal_jax.run import trainer
from areal_jax.sampler import generate
from areal_jax.tokenizer import HFTokenizer
from helpers import write_bpe_tokenizer
from run_checks import FAST, ROOT, rollouts

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only


def _released(path, problems):
  """MATH / DeepScaleR-style rows (`problem`, `answer`, `solution` ending in `\\boxed{}`) as a Parquet file."""
  pq.write_table(pa.Table.from_pylist([{"problem": p.question, "answer": p.reference, "solution": p.solution}
                                       for p in problems]), str(path))
  return str(path)


def test_a_whole_run_from_a_hf_directory_back_to_one(tmp_path):
  held = synthetic.generate(8, difficulty=1, seed=0, split="eval", distinct=True)
  train = synthetic.generate(600, difficulty=1, seed=0, split="train", exclude=frozenset(p.question for p in held))
  data = {"train": _released(tmp_path / "train-00000-of-00001.parquet", train),
          "eval": _released(tmp_path / "test-00000-of-00001.parquet", held)}

  # The checkpoint as released: a tokenizer trained on the task's text, and a tiny Qwen2 saved by transformers.
  ckpt = str(tmp_path / "Qwen2-tiny")
  write_bpe_tokenizer(ckpt, [f"{p.question}\n\n{INSTRUCTIONS['math']}" for p in train] + [p.solution for p in train],
                      vocab_size=400)
  tokenizer = HFTokenizer(ckpt)
  torch.manual_seed(0)
  transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
      vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True,
      eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.eos_id)).save_pretrained(ckpt)

  workdir = tmp_path / "run"
  config = load_config(FAST, total_steps=2, **{
      "model.init_from": ckpt, "model.tokenizer": ckpt, "data.source": "files", "data.path": data["train"],
      "data.eval_path": data["eval"], "data.prompt_template": "chat", "data.max_prompt_len": 48,
      "warmstart.on_init_from": True, "warmstart.steps": 60, "warmstart.cache_dir": ""})
  rows = trainer.run(config, str(workdir))
  assert [r["step"] for r in rows] == [0, 1, 2]
  metrics = read_metrics(str(workdir))
  assert [m["step"] for m in metrics if "eval/accuracy" in m] == [0, 2]  # on the released eval file
  assert all(r["uid"].startswith("train-00000-of-00001.parquet:") for r in rollouts(workdir))
  assert (workdir / "warmstart" / "model_config.json").exists()  # the checkpoint was warm-started
  assert os.path.isdir(workdir / "checkpoints" / "2")

  # Back to a HF directory: the run's last checkpoint, with the checkpoint's tokenizer beside it.
  out = tmp_path / "exported"
  done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_hf.py"), f"--orbax_dir={workdir}",
                         f"--hf_dir={out}", "--to=hf"], env=dict(os.environ, JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(ckpt, name), out / name)

  # A held-out prompt, rendered as the run renders it; transformers' greedy answer is our sampler's.
  prompt = render_prompt(held[0], HFTokenizer(str(out)), "chat", instruct=True)
  ids = list(HFTokenizer(str(out)).encode(prompt))
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
  with torch.no_grad():
    theirs = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eos_id,
                         pad_token_id=tokenizer.eos_id)[0, len(ids):].tolist()
  ours = generate(load_hf(str(out)), [ids], max_new_tokens=24, temperature=0.0, eos_ids=[tokenizer.eos_id])[0][0]
  print("held-out answer:", repr(tokenizer.decode(theirs)))
  assert ours.tokens.tolist() == theirs, (tokenizer.decode(ours.tokens.tolist()), tokenizer.decode(theirs))
  assert len(theirs) > 3  # an answer, not a bare end of turn
  assert np.isfinite(ours.logprobs).all()
