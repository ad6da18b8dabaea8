"""JSONL and TFDS sources: the common layouts, and bad input reported by file, line and field (or skipped)."""

import json
import logging
import subprocess
import sys

import pytest

from areal_jax.data import sources
from areal_jax.data.records import DataError

GSM8K_ROW = {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                         "May. How many clips did Natalia sell altogether in April and May?",
             "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                       "altogether in April and May.\n#### 72"}
MATH_ROW = {"problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?", "solution": "We get $\\boxed{\\frac{3}{4}}$.",
            "level": "Level 1", "unique_id": "test/algebra/1.json"}
DEEPSCALER_ROW = {"problem": "Find $x$ if $2x=10$.", "answer": "5", "solution": "Divide: $x=\\boxed{5}$."}
TACO_ROW = {"question": "Read two integers and print their sum.",
            "input_output": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})}
LCB_ROW = {"question_content": "Return the indices of two numbers adding up to target.", "question_id": "lcb-1",
           "public_test_cases": json.dumps([{"input": "[2, 7]\n9", "output": "[0, 1]", "testtype": "functional"}]),
           "metadata": json.dumps({"func_name": "twoSum"})}


def _write(path, lines):
  path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))
  return str(path)


def test_common_layouts(tmp_path):
  path = _write(tmp_path / "mixed.jsonl", [GSM8K_ROW, "\n", MATH_ROW, DEEPSCALER_ROW, TACO_ROW, LCB_ROW])
  problems, bad = sources.read_jsonl(path)
  assert bad == 0 and len(problems) == 5
  gsm, math_, dsr, taco, lcb = problems
  assert gsm.uid == "mixed.jsonl:1" and gsm.kind == "math" and gsm.reference == "72"
  assert "<<" not in gsm.solution and gsm.solution.endswith("\\boxed{72}")
  assert math_.uid == "test/algebra/1.json" and math_.reference == "\\frac{3}{4}"
  assert dsr.reference == "5" and dsr.solution == DEEPSCALER_ROW["solution"]
  assert taco.kind == "code" and json.loads(taco.reference) == {"inputs": ["1 2\n"], "outputs": ["3\n"]}
  assert lcb.uid == "lcb-1" and json.loads(lcb.reference)["fn_name"] == "twoSum"


@pytest.mark.parametrize("line,message", [
    ('{"question": "1+1?", "answer": "2"', r"bad\.jsonl:2: malformed JSON"),
    ('[1, 2]', r"bad\.jsonl:2: expected a JSON object, got list"),
    ('{"answer": "2"}', r"bad\.jsonl:2: missing field 'question' \(or 'problem'\)"),
    ('{"question": "1+1?"}', r"bad\.jsonl:2: missing field 'answer'"),
    ('{"question": "1+1?", "answer": ""}', r"bad\.jsonl:2: field 'answer' is empty"),
    ('{"question": ["1+1?"], "answer": "2"}', r"bad\.jsonl:2: field 'question' must be text, got list"),
    ('{"question": "q", "answer": "so #### "}', r"bad\.jsonl:2: field 'answer' has nothing after '####'"),
    ('{"problem": "p", "solution": "no box"}', r"bad\.jsonl:2: field 'solution' has no \\boxed"),
    ('{"question": "q", "input_output": "{oops"}', r"bad\.jsonl:2: field 'input_output' is not valid JSON"),
    ('{"question": "q", "input_output": {"inputs": ["1"]}}', r"bad\.jsonl:2: field 'input_output'.*'outputs'"),
])
def test_bad_rows_name_file_line_and_field(tmp_path, line, message):
  path = _write(tmp_path / "bad.jsonl", [{"question": "2+2?", "answer": "4"}, line + "\n"])
  with pytest.raises(DataError, match=message):
    sources.read_jsonl(path)


def test_skip_bad_rows_counts_them(tmp_path, caplog):
  path = _write(tmp_path / "some_bad.jsonl", [{"question": "2+2?", "answer": "4"}, "{broken\n", {"question": "q"},
                                              {"question": "3+3?", "answer": 6}])
  with caplog.at_level(logging.WARNING):
    problems, bad = sources.read_jsonl(path, skip_bad_rows=True)
  assert bad == 2 and [p.reference for p in problems] == ["4", "6"]
  assert "skipped 2 of 4 rows" in caplog.text and "some_bad.jsonl:2: malformed JSON" in caplog.text


def test_empty_missing_and_all_bad_files(tmp_path):
  with pytest.raises(DataError, match=r"empty\.jsonl: no rows"):
    sources.read_jsonl(_write(tmp_path / "empty.jsonl", ["\n", "  \n"]))
  with pytest.raises(DataError, match="does not exist"):
    sources.read_jsonl(str(tmp_path / "nope.jsonl"))
  with pytest.raises(DataError, match=r"all 2 rows are bad"):
    sources.read_jsonl(_write(tmp_path / "allbad.jsonl", ["{\n", "[]\n"]), skip_bad_rows=True)
  (tmp_path / "latin1.jsonl").write_bytes(b'{"question": "caf\xe9", "answer": "1"}\n')
  with pytest.raises(DataError, match=r"latin1\.jsonl:1: not UTF-8"):
    sources.read_jsonl(str(tmp_path / "latin1.jsonl"))


# Builds a small array_record TFDS dataset (no TensorFlow), then reads it back through `tfds.data_source`.
_BUILD_TFDS = r'''
import sys
import tensorflow_datasets as tfds

class TinyGsm(tfds.core.GeneratorBasedBuilder):
  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
        {"question": tfds.features.Text(), "answer": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(0, 20), "test": self._generate_examples(100, 5)}

  def _generate_examples(self, start, n):
    for i in range(start, start + n):
      answer = f"{i}+1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}" if i != 7 else ""
      yield i, {"question": f"what is {i}+1?", "answer": answer}

TinyGsm(data_dir=sys.argv[1], file_format="array_record").download_and_prepare()
assert "tensorflow" not in sys.modules
'''


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tfds"))
  subprocess.run([sys.executable, "-c", _BUILD_TFDS, path], check=True, capture_output=True, timeout=300)
  return path


def test_tfds_source(tfds_dir):
  problems, bad = sources.read_tfds("tiny_gsm", data_dir=tfds_dir, split="test")
  assert bad == 0 and sorted(int(p.reference) for p in problems) == [101, 102, 103, 104, 105]
  assert all(p.uid.startswith("tiny_gsm/test:") for p in problems)
  assert "tensorflow" not in sys.modules
  with pytest.raises(DataError, match=r"tfds tiny_gsm/train record \d+: field 'answer' is empty"):
    sources.read_tfds("tiny_gsm", data_dir=tfds_dir, split="train")
  problems, bad = sources.read_tfds("tiny_gsm", data_dir=tfds_dir, split="train", skip_bad_rows=True)
  assert bad == 1 and len(problems) == 19 and "what is 7+1?" not in {p.question for p in problems}
  with pytest.raises(DataError, match="split 'validation'"):
    sources.read_tfds("tiny_gsm", data_dir=tfds_dir, split="validation")
