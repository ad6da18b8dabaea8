"""Datasets as released: Parquet and JSONL rows in the GSM8K, MATH, DeepScaleR and AReaL-boba layouts, read by
`data.source=files` and by evaluation benchmarks alike, local or gs://; `tools/prepare_data.py` turns them into the
train and eval files a run and an evaluation read, with duplicates and benchmark questions taken out."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gcs_emulator
from areal_jax.data import DataConfig, DataError, build_dataset, prepare, sources
from areal_jax.evaluate.benchmarks import load_benchmarks
from areal_jax.tokenizer import HFTokenizer
from helpers import write_bpe_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# One handmade row per released layout, as the HF hub (or AReaL's release) has them.
GSM8K = [{"question": f"Tom has {i} apples and buys {i} more. How many apples does he have?",
          "answer": f"He has {i} + {i} = <<{i}+{i}={2 * i}>>{2 * i} apples.\n#### {2 * i}"} for i in range(1, 7)]
MATH = [{"problem": f"What is ${i} \\cdot 3$?", "level": "Level 1", "type": "Prealgebra",
         "solution": f"We multiply: ${i} \\cdot 3 = \\boxed{{{3 * i}}}$."} for i in range(1, 5)]
DEEPSCALER = [{"problem": f"Find $x$ if $x - {i} = 1$.", "answer": str(i + 1),
               "solution": f"Add {i}: $x = \\boxed{{{i + 1}}}$."} for i in range(1, 5)]
BOBA = [{"prompt": f"<｜begin▁of▁sentence｜><｜User｜>What is {i} squared?\n{INSTRUCTION}<｜Assistant｜><think>\n",
         "task": "math", "query_id": f"boba-{i}", "solutions": [f"\\boxed{{{i * i}}}"]} for i in range(1, 5)]


def _parquet(path, rows):
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  return str(path)


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
  return str(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("tok"))
  write_bpe_tokenizer(directory, [json.dumps(r) for r in GSM8K + MATH + DEEPSCALER + BOBA])
  return HFTokenizer(directory)


def test_each_released_layout_reads_from_parquet_and_jsonl(tmp_path):
  for name, rows in (("gsm8k", GSM8K), ("math", MATH), ("deepscaler", DEEPSCALER), ("boba", BOBA)):
    from_parquet, _ = sources.read_file(_parquet(tmp_path / f"{name}.parquet", rows))
    from_jsonl, _ = sources.read_file(_jsonl(tmp_path / f"{name}.jsonl", rows))
    assert [(p.question, p.reference, p.solution) for p in from_parquet] == \
        [(p.question, p.reference, p.solution) for p in from_jsonl], name
  gsm, = sources.read_file(_parquet(tmp_path / "one.parquet", GSM8K[:1]))[0]
  assert gsm.uid == "one.parquet:0" and gsm.reference == "2" and gsm.solution.endswith("\\boxed{2}")
  boba = sources.read_file(str(tmp_path / "boba.parquet"))[0][2]
  assert (boba.uid, boba.question, boba.reference, boba.solution) == ("boba-3", "What is 3 squared?", "9", "")
  math_ = sources.read_file(str(tmp_path / "math.jsonl"))[0][1]
  assert math_.reference == "6" and math_.question == "What is $2 \\cdot 3$?"


def test_a_json_array_reads_as_its_rows_and_a_json_file_of_lines_as_lines(tmp_path):
  """DeepScaleR is released as one JSON array (`deepscaler.json`); other `.json` files hold JSON lines."""
  (tmp_path / "deepscaler.json").write_text(json.dumps(DEEPSCALER, indent=2))
  array, _ = sources.read_file(str(tmp_path / "deepscaler.json"))
  lines, _ = sources.read_file(_jsonl(tmp_path / "lines.json", DEEPSCALER))
  assert [p.reference for p in array] == [p.reference for p in lines] == ["2", "3", "4", "5"]
  assert array[0].uid == "deepscaler.json:0" and lines[0].uid == "lines.json:1"
  (tmp_path / "bad.json").write_text(json.dumps([DEEPSCALER[0], {"problem": "p"}]))
  with pytest.raises(DataError, match=r"bad\.json row 1: missing field 'answer'"):
    sources.read_file(str(tmp_path / "bad.json"))
  (tmp_path / "torn.json").write_text("[{")
  with pytest.raises(DataError, match=r"torn\.json: not a JSON array of rows"):
    sources.read_file(str(tmp_path / "torn.json"))


def test_a_bad_parquet_row_is_named_by_file_and_row(tmp_path):
  path = _parquet(tmp_path / "bad.parquet", [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": ""}])
  with pytest.raises(DataError, match=r"bad\.parquet row 1: field 'answer' is empty"):
    sources.read_file(path)
  assert len(sources.read_file(path, skip_bad_rows=True)[0]) == 1
  (tmp_path / "torn.parquet").write_bytes(b"PAR1 not really")
  with pytest.raises(DataError, match=r"torn\.parquet: not a readable Parquet file"):
    sources.read_file(str(tmp_path / "torn.parquet"))
  with pytest.raises(DataError, match=r"data\.path: data file .*missing\.parquet' does not exist"):
    sources.read_file(str(tmp_path / "missing.parquet"), field="data.path")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_prepare_data_writes_files_a_run_and_an_evaluation_read(tmp_path, tokenizer, fmt):
  """Released files in every layout (Parquet shards as the hub serves them, JSONL as AReaL's release) go through
  `tools/prepare_data.py`: a benchmark's questions and repeated questions leave both files, `--eval_size` are held
  out, and a `data.source=files` run and `tools/evaluate.py`'s benchmarks read the files back to the same answers."""
  inputs = [_parquet(tmp_path / "train-00000-of-00002.parquet", GSM8K[:4] + GSM8K[:1]),  # a repeated question
            _parquet(tmp_path / "train-00001-of-00002.parquet", GSM8K[4:]),
            _parquet(tmp_path / "math.parquet", MATH), _jsonl(tmp_path / "deepscaler.jsonl", DEEPSCALER),
            _jsonl(tmp_path / "boba_106k.jsonl", BOBA)]
  # The benchmark, as released: GSM8K's test split asks one of the training questions (spaced differently).
  bench = _parquet(tmp_path / "test-00000-of-00001.parquet",
                   [GSM8K[5] | {"question": "  " + GSM8K[5]["question"].replace(" ", "  ")},
                    {"question": "What is 7 + 7?", "answer": "#### 14"}])
  out = tmp_path / "out"
  done = subprocess.run([sys.executable, "tools/prepare_data.py", f"--inputs={','.join(inputs)}",
                         f"--out_dir={out}", "--eval_size=3", f"--exclude={bench}", f"--format={fmt}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  counts = json.loads(done.stdout.strip().splitlines()[-1])
  assert counts == {"read": 19, "bad_rows": 0, "duplicates": 1, "in_benchmarks": 1, "train": 14, "eval": 3,
                    "train_file": f"{out}/train.{fmt}", "eval_file": f"{out}/eval.{fmt}"}

  data = DataConfig(source="files", path=counts["train_file"], eval_path=counts["eval_file"], prompt_template="chat",
                    max_prompt_len=1000)
  train = build_dataset(data, tokenizer, split="train")
  evalset = build_dataset(data, tokenizer, split="eval")
  assert (len(train), len(evalset)) == (14, 3)
  got = {r.uid: r for r in train.records + evalset.records}
  assert not {r.uid for r in train.records} & {r.uid for r in evalset.records}
  expected = {f"train-00000-of-00002.parquet:{i}": str(2 * (i + 1)) for i in range(4)}
  expected |= {"train-00001-of-00002.parquet:0": "10"}  # GSM8K[5] is the benchmark's: gone
  expected |= {f"math.parquet:{i}": str(3 * (i + 1)) for i in range(4)}
  expected |= {f"deepscaler.jsonl:{i + 1}": str(i + 2) for i in range(4)}
  expected |= {f"boba-{i}": str(i * i) for i in range(1, 5)}
  assert {uid: r.reference for uid, r in got.items()} == expected
  assert got["train-00000-of-00002.parquet:1"].solution.endswith("\\boxed{4}")  # GSM8K's worked solution kept
  boba = got["boba-2"].prompt
  assert boba.startswith("<|im_start|>user\nWhat is 2 squared?\n\nPlease reason") and "｜" not in boba

  benchmarks = load_benchmarks([f"gsm8k={bench}", counts["eval_file"]], tokenizer, template="chat", instruct=True,
                               max_prompt_len=1000)
  assert [b.name for b in benchmarks] == ["gsm8k", "eval"]
  assert [r.reference for r in benchmarks[0].records] == ["12", "14"]
  assert [r.reference for r in benchmarks[1].records] == [r.reference for r in evalset.records]


def test_prepare_refuses_to_hold_out_everything(tmp_path):
  path = _jsonl(tmp_path / "few.jsonl", DEEPSCALER)
  with pytest.raises(DataError, match=r"eval_size=4 leaves nothing to train on \(4 problems after 0 duplicates"):
    prepare.prepare([path], eval_size=4)
  split = prepare.prepare([path], eval_size=0)
  assert prepare.write(split, str(tmp_path / "all")) == {"train": f"{tmp_path}/all/train.jsonl"}


def test_files_on_gcs(tmp_path):
  """Parquet and JSONL read from gs:// (training data and benchmarks alike) and prepared files written there."""
  with gcs_emulator.running(bucket="areal-data-test"):
    import etils.epath as epath  # pylint: disable=g-import-not-at-top

    local = _parquet(tmp_path / "math.parquet", MATH)
    remote = "gs://areal-data-test/released/math.parquet"
    epath.Path(remote).write_bytes(open(local, "rb").read())
    split = prepare.prepare([remote, _jsonl(tmp_path / "dsr.jsonl", DEEPSCALER)], eval_size=2)
    paths = prepare.write(split, "gs://areal-data-test/prepared", fmt="parquet")
    assert paths == {"train": "gs://areal-data-test/prepared/train.parquet",
                     "eval": "gs://areal-data-test/prepared/eval.parquet"}
    train, _ = sources.read_file(paths["train"])
    held, _ = sources.read_file(paths["eval"])
    assert sorted(p.reference for p in train + held) == sorted(["3", "6", "9", "12", "2", "3", "4", "5"])
    jsonl = "gs://areal-data-test/prepared/more.jsonl"
    prepare.write_file(split.train, jsonl)
    assert [p.reference for p in sources.read_file(jsonl)[0]] == [p.reference for p in train]
    with pytest.raises(DataError, match=r"data file 'gs://areal-data-test/nothing\.parquet' does not exist"):
      sources.read_file("gs://areal-data-test/nothing.parquet")
