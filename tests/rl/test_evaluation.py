"""`heldout_jsonl`: the run's held-out problems written back as a benchmark `tools/evaluate.py` reads."""

import numpy as np

from areal_jax.data import sources
from areal_jax.data.records import PromptRecord
from areal_jax.rl.evaluation import heldout_jsonl


def _record(i, kind="math"):
  return PromptRecord(uid=f"synthetic-arithmetic/eval:{i}", prompt=f"Q: what is {i}+1?\nA:", question=f"what is {i}+1?",
                      prompt_ids=np.zeros(3, np.int32), reference=str(i + 1), kind=kind)


def test_the_held_out_problems_read_back_as_the_same_benchmark(tmp_path):
  records = [_record(i) for i in range(5)]
  path = heldout_jsonl(str(tmp_path), "", records)
  assert path == str(tmp_path / "heldout.jsonl")
  problems, bad = sources.read_jsonl(path)
  assert bad == 0
  assert [(p.uid, p.question, p.reference, p.kind) for p in problems] == [
      (r.uid, r.question, r.reference, "math") for r in records]


def test_a_configured_eval_file_is_named_and_code_problems_are_not_written(tmp_path):
  assert heldout_jsonl(str(tmp_path), "/data/test.jsonl", [_record(0)]) == "/data/test.jsonl"
  assert heldout_jsonl(str(tmp_path), "", [_record(0), _record(1, kind="code")]) == ""
  assert not (tmp_path / "heldout.jsonl").exists()
