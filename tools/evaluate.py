r"""Evaluates a run's checkpoints (local or gs://) or a model directory on JSONL or Parquet benchmarks: pass@1 over
k samples, unbiased pass@k, greedy accuracy, mean answer length.

  # the latest checkpoint of a run, 32 samples per question (AReaL's protocol)
  python tools/evaluate.py --checkpoint_dir=gs://bucket/run \
      --benchmarks=gsm8k=/data/gsm8k_test.jsonl,math500=/data/math500.jsonl,aime24=/data/aime24.jsonl
  # a sidecar beside training: every checkpoint as it appears, until the run's last step
  python tools/evaluate.py --checkpoint_dir=gs://bucket/run --benchmarks=... --watch
  # every checkpoint present, or one step
  python tools/evaluate.py --checkpoint_dir=gs://bucket/run --benchmarks=... --step=all    # or --step=40
  # the baseline before RL: a HF model directory, results beside the run's
  python tools/evaluate.py --checkpoint_dir=/ckpt/Qwen2.5-1.5B --benchmarks=... --output_dir=gs://bucket/run/eval

Results: `<run>/eval/<benchmark>/step_<N>.json` (per-question counts included) and TensorBoard scalars in
`<run>/eval/tensorboard`. Checkpoints already evaluated under the same settings are skipped; incomplete or unreadable
checkpoints are reported and skipped. See `areal_jax.evaluate`.
"""

import logging as std_logging

from absl import app, flags, logging

from areal_jax.evaluate import evaluate

_DIR = flags.DEFINE_string("checkpoint_dir", None, "Run directory, its checkpoints/ directory, an Orbax policy "
                           "directory or a local HF model directory; local or gs://.", required=True)
_BENCH = flags.DEFINE_list("benchmarks", None, "NAME=PATH or PATH of JSONL or Parquet files (GSM8K, MATH500, AIME-style).",
                           required=True)
_STEP = flags.DEFINE_string("step", "latest", "'latest', 'all' or a step number (without --watch).")
_WATCH = flags.DEFINE_bool("watch", False, "Evaluate each new checkpoint as it appears.")
_N = flags.DEFINE_integer("num_samples", 32, "Sampled answers per question (pass@1 is their mean accuracy).")
_TEMP = flags.DEFINE_float("temperature", 0.6, "Sampling temperature.")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "Nucleus sampling threshold.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Answer length limit (default: the run's).")
_PASS_K = flags.DEFINE_list("pass_k", [], "k values of pass@k (default: 1 and num_samples).")
_GREEDY = flags.DEFINE_bool("greedy", True, "Also one greedy answer per question (greedy accuracy).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_TEMPLATE = flags.DEFINE_enum("prompt_template", None, ["plain", "chat"], "Prompt template (default: the run's).")
_INSTRUCT = flags.DEFINE_bool("instruct", None, "Append the \\boxed{} instruction (default: the run's choice).")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_len", None, "Longer prompts are dropped (default: the run's).")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "Tokenizer spec (default: the run's; a HF directory's own).")
_DTYPE = flags.DEFINE_string("dtype", "", "Compute dtype for a model directory (default float32).")
_OUT = flags.DEFINE_string("output_dir", None, "Results directory (default: <run>/eval).")
_SLOTS = flags.DEFINE_integer("num_slots", 64, "Sequences decoded at once.")
_PAGE = flags.DEFINE_integer("page_size", 16, "KV cache page size.")
_MEM = flags.DEFINE_float("memory_fraction", 0.8, "Share of free device memory for the KV cache.")
_TP = flags.DEFINE_integer("tensor_parallel", 1, "Tensor-parallel degree of the sampling mesh.")
_WORKERS = flags.DEFINE_integer("reward_workers", 4, "Reward worker processes.")
_REWARD_TIMEOUT = flags.DEFINE_float("reward_timeout_s", 10.0, "Per-answer scoring limit (seconds).")
_POLL = flags.DEFINE_float("poll_seconds", 60.0, "With --watch: seconds between looks for new checkpoints.")
_WATCH_TIMEOUT = flags.DEFINE_float("watch_timeout_s", 0.0, "With --watch: stop after this long without a new "
                                    "checkpoint (0 = only at the run's last step).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace results stored under other settings.")


class _QuietOrbax(std_logging.Filter):
  """Keeps Orbax's per-restore INFO lines out of the log (its warnings and errors still show)."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def main(argv):
  del argv
  for handler in std_logging.getLogger().handlers:
    handler.addFilter(_QuietOrbax())
  results = evaluate(
      _DIR.value, benchmarks=_BENCH.value, step=_STEP.value, watch=_WATCH.value, num_samples=_N.value,
      temperature=_TEMP.value, top_p=_TOP_P.value, max_new_tokens=_MAX_NEW.value,
      pass_k=[int(k) for k in _PASS_K.value], greedy=_GREEDY.value, seed=_SEED.value,
      prompt_template=_TEMPLATE.value, instruct=_INSTRUCT.value, max_prompt_len=_MAX_PROMPT.value,
      tokenizer=_TOKENIZER.value, dtype=_DTYPE.value, output_dir=_OUT.value, num_slots=_SLOTS.value,
      page_size=_PAGE.value, memory_fraction=_MEM.value, tensor_parallel=_TP.value, reward_workers=_WORKERS.value,
      reward_timeout_s=_REWARD_TIMEOUT.value, poll_s=_POLL.value, watch_timeout_s=_WATCH_TIMEOUT.value,
      overwrite=_OVERWRITE.value)
  logging.info("wrote %d result(s)", len(results))


if __name__ == "__main__":
  app.run(main)
