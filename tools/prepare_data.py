r"""Writes a run's train and eval files from datasets as released (GSM8K, MATH, DeepScaleR, AReaL-boba, code sets),
JSONL or Parquet, local or gs://: each question once, none that an evaluation benchmark asks, `--eval_size` held out.

  # GSM8K's train split as the HF hub serves it, its test split kept out (and used as the benchmark)
  python tools/prepare_data.py --inputs=/data/gsm8k/train-00000-of-00001.parquet --out_dir=/data/gsm8k_rl \
      --eval_size=200 --exclude=/data/gsm8k/test-00000-of-00001.parquet
  # DeepScaleR (or AReaL-boba JSONL) for a math run, MATH-500 and AIME 2024 kept out
  python tools/prepare_data.py --inputs=/data/deepscaler.json.parquet --out_dir=gs://bucket/data/dsr \
      --eval_size=500 --exclude=/data/math500.jsonl,/data/aime24.parquet

Then `--config.data.source=files --config.data.path=OUT_DIR/train.jsonl --config.data.eval_path=OUT_DIR/eval.jsonl`.
Row layouts: docs/evaluation.md. Prints one JSON line: rows read, bad rows skipped, duplicates and benchmark
questions taken out, problems in each file, and the files.
"""

import json

from absl import app, flags

from areal_jax.data import prepare

_INPUTS = flags.DEFINE_list("inputs", None, "Released files (JSONL, Parquet ending in .parquet, a .json array), "
                            "local or gs://.", required=True)
_OUT = flags.DEFINE_string("out_dir", None, "Where train.FORMAT and eval.FORMAT go (local or gs://).", required=True)
_EVAL = flags.DEFINE_integer("eval_size", 0, "Problems held out into eval.FORMAT (a seeded draw); 0 = none.")
_EXCLUDE = flags.DEFINE_list("exclude", [], "Benchmark files whose questions neither file may hold.")
_FORMAT = flags.DEFINE_enum("format", "jsonl", list(prepare.FORMATS), "Output format.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the held-out draw.")
_SKIP = flags.DEFINE_bool("skip_bad_rows", False, "Skip (and count) rows no layout reads instead of stopping.")


def main(argv):
  del argv
  split = prepare.prepare(_INPUTS.value, eval_size=_EVAL.value, exclude=_EXCLUDE.value, seed=_SEED.value,
                          skip_bad_rows=_SKIP.value)
  files = prepare.write(split, _OUT.value, fmt=_FORMAT.value)
  print(json.dumps(split.counts | {f"{role}_file": path for role, path in files.items()}))


if __name__ == "__main__":
  app.run(main)
