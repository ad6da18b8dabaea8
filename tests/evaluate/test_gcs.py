"""Evaluation against a local GCS emulator: a short real run writes its checkpoints to gs://; the evaluator finds and
scores them, skips what it has done, passes over partial and corrupt checkpoints, watches for new ones, evaluates a HF
baseline, and works from the command line."""

import json
import logging
import os
import struct
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from etils import epath
from flax import nnx

import gcs_emulator
from areal_jax.checkpoint import sources
from areal_jax.config import load_config
from areal_jax.data import synthetic
from areal_jax.evaluate import evaluate, pass_at_k
from areal_jax.models import orbax_io, save_hf
from areal_jax.reward.math import verify_math
from areal_jax.rl.metrics import read_metrics
from areal_jax.run import trainer
from areal_jax.sampler import generate
from areal_jax.tokenizer import load_tokenizer
from waiting import wait_until

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "math.py")
BUCKET = "areal-eval-test"
RUN = f"gs://{BUCKET}/run"
# The tiny default made small: two learner steps with a checkpoint after each, TensorBoard on (written to gs://).
SHORT_RUN = {
    "total_steps": 2, "checkpoint.every_steps": 1, "eval.every_steps": 2, "metrics.tensorboard": True,
    "model.hidden_size": 64, "model.intermediate_size": 128, "model.num_layers": 2, "model.num_heads": 2,
    "model.num_kv_heads": 1, "model.head_dim": 32,
    "warmstart.steps": 8, "warmstart.batch_size": 32, "warmstart.target_match": 0.0,
    "warmstart.cache_dir": "",  # the run trains its own warm-start and writes it to gs:// with the rest
    "data.eval_size": 4,
    "data.synthetic_size": 500,
    "rollout.batch_size": 4, "rollout.group_size": 4, "rollout.max_concurrent_rollouts": 8,
    "learner.ppo_n_minibatches": 2, "learner.max_tokens_per_mb": 256, "learner.min_bucket": 64,
    "learner.filter_uniform_groups": False,  # an untrained model's groups are all wrong; keep them so steps finish
    "sampler.num_slots": 32, "sampler.num_pages": 256, "sampler.max_new_tokens": 24, "sampler.max_seq_len": 64,
    "data.max_prompt_len": 32, "reward.num_workers": 1,
}
EVAL = {"num_samples": 4, "pass_k": (1, 2, 4), "reward_workers": 1, "num_slots": 16}


@pytest.fixture(scope="module")
def gcs():
  with gcs_emulator.running(bucket=BUCKET) as url:
    yield url


@pytest.fixture(scope="module")
def fs(gcs):
  """A gcsfs client of its own (no listing cache): writes through it are invisible to etils' cached listings, as
  writes from another process would be."""
  del gcs
  import gcsfs  # pylint: disable=g-import-not-at-top

  return gcsfs.GCSFileSystem(skip_instance_cache=True, use_listings_cache=False)


@pytest.fixture(scope="module")
def gcs_run(gcs):
  config = load_config(CONFIG, **SHORT_RUN)
  trainer.run(config, RUN)
  return config


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
  path = tmp_path_factory.mktemp("bench") / "arith.jsonl"
  problems = synthetic.generate(6, difficulty=1, seed=3, split="eval", distinct=True)
  path.write_text("".join(json.dumps({"problem": p.question, "answer": p.reference}) + "\n" for p in problems))
  return str(path)


def _copy(fs, src: str, dst: str, *, skip=lambda rel: False) -> None:
  """Copies every object under gs://src to gs://dst through `fs` (relative names for which `skip` holds are left)."""
  src, dst = src.removeprefix("gs://"), dst.removeprefix("gs://")
  for path in fs.find(src):
    rel = path[len(src) + 1:]
    if not skip(rel):
      fs.pipe(f"{dst}/{rel}" if rel else dst, fs.cat(path))


def _tensorboard_scalars(logdir: str) -> dict[str, dict[int, float]]:
  """tag -> {step: value} from the TFRecord event files in `logdir`."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top

  out = {}
  for path in epath.Path(logdir).iterdir():
    data, i = path.read_bytes(), 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      for v in event.summary.value:
        out.setdefault(v.tag, {})[event.step] = v.simple_value
  return out


def _check_result(r):
  n = r["settings"]["num_samples"]
  counts = [q["correct"] for q in r["questions"]]
  assert len(counts) == r["num_questions"] == 6 and all(q["samples"] == n for q in r["questions"])
  for k in r["settings"]["pass_k"]:
    assert r["metrics"][f"pass@{k}"] == pytest.approx(np.mean([pass_at_k(n, c, k) for c in counts]))
  assert r["metrics"]["pass@1"] == pytest.approx(sum(counts) / (n * len(counts)))
  assert r["metrics"]["greedy_accuracy"] == pytest.approx(np.mean([q["greedy_correct"] for q in r["questions"]]))
  assert 1 <= r["metrics"]["mean_length"] <= r["settings"]["max_new_tokens"]


def test_short_run_writes_everything_to_gcs(gcs_run):
  run = epath.Path(RUN)
  assert [m["step"] for m in read_metrics(RUN)] == [0, 1, 2]  # appended, not overwritten, on an object store
  rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
  assert len([r for r in rollouts if not r["filtered"]]) == 2 * gcs_run.rollout.batch_size
  assert sources.scan(run / "checkpoints").complete == [1, 2]
  assert (run / "warmstart" / "model_config.json").exists()
  scalars = _tensorboard_scalars(f"{RUN}/tensorboard")
  assert set(scalars["learner/loss"]) == {1, 2} and set(scalars["eval/accuracy"]) == {0, 2}


def test_every_checkpoint_is_scored_then_skipped(gcs_run, bench):
  del gcs_run
  results = evaluate(RUN, benchmarks=[f"arith={bench}"], step="all", **EVAL)
  assert [(r["step"], r["version"]) for r in results] == [(1, 1), (2, 2)]
  for r in results:
    _check_result(r)
    stored = json.loads(epath.Path(f"{RUN}/eval/arith/step_{r['step']}.json").read_text())
    assert stored == json.loads(json.dumps(r))
    assert not [p for p in epath.Path(f"{RUN}/checkpoints/{r['step']}").iterdir() if "eval" in p.name]
  scalars = _tensorboard_scalars(f"{RUN}/eval/tensorboard")
  assert scalars["arith/pass_at_4"] == pytest.approx({r["step"]: r["metrics"]["pass@4"] for r in results})
  assert evaluate(RUN, benchmarks=[f"arith={bench}"], step="all", **EVAL) == []  # already evaluated
  assert json.loads(epath.Path(f"{RUN}/eval/arith/step_2.json").read_text())["finished"] == results[1]["finished"]

  # The greedy answers are those of the sampler's own generate() on the checkpoint's parameters.
  meta = sources.read_meta(f"{RUN}/checkpoints", 2)
  model_cfg = meta.model_cfg
  graphdef, abstract = orbax_io.abstract_params(model_cfg)
  shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
  model = nnx.merge(graphdef, sources.load_params(f"{RUN}/checkpoints", 2, model_cfg, shardings=shardings))
  tok = load_tokenizer("char")
  lines = [json.loads(line) for line in open(bench)]
  prompts = [tok.encode(f"Q: {row['problem']}\nA: ") for row in lines]
  outs = generate(model, prompts, max_new_tokens=results[1]["settings"]["max_new_tokens"], temperature=0.0,
                  eos_ids=[tok.eos_id])
  texts = [tok.decode([t for t in o[0].tokens if t != tok.eos_id]) for o in outs]
  assert [verify_math(t, row["answer"]) for t, row in zip(texts, lines)] == [
      q["greedy_correct"] for q in results[1]["questions"]]
  assert results[1]["metrics"]["greedy_mean_length"] == pytest.approx(np.mean([len(o[0].tokens) for o in outs]))


def test_partial_and_corrupt_checkpoints_are_skipped_with_a_message(gcs_run, bench, fs, caplog):
  del gcs_run
  run = f"gs://{BUCKET}/planted"
  _copy(fs, f"{RUN}/config.json", f"{run}/config.json")
  _copy(fs, f"{RUN}/checkpoints/2", f"{run}/checkpoints/2")
  # 3: a GCS save cut short -- the items are there, the commit file Orbax writes last is not.
  _copy(fs, f"{RUN}/checkpoints/2", f"{run}/checkpoints/3", skip=lambda rel: rel == "commit_success.txt")
  # 4: committed, but its parameter data files were cut short.
  _copy(fs, f"{RUN}/checkpoints/2", f"{run}/checkpoints/4")
  data = [p for p in fs.find(f"{BUCKET}/planted/checkpoints/4/params") if "/d/" in p]
  assert data
  for p in data:
    fs.pipe(p, fs.cat(p)[:7])
  # 5: a local-style temporary directory (a save in progress, renamed when finished).
  fs.pipe(f"{BUCKET}/planted/checkpoints/5.orbax-checkpoint-tmp-1795340000/meta/metadata", b"{")
  with caplog.at_level(logging.WARNING):
    results = evaluate(run, benchmarks=[f"arith={bench}"], step="all", **EVAL)
  assert [r["step"] for r in results] == [2]
  _check_result(results[0])
  warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
  assert "skipping 3 in" in warnings and "no commit_success.txt" in warnings, warnings
  assert "skipping step 4 of" in warnings and "cannot be read" in warnings, warnings
  assert "skipping 5.orbax-checkpoint-tmp-1795340000 in" in warnings, warnings
  assert sorted(p.name for p in epath.Path(f"{run}/eval/arith").iterdir()) == ["step_2.json"]


def test_watch_evaluates_each_checkpoint_as_it_appears(gcs_run, bench, fs, caplog):
  del gcs_run
  run = f"gs://{BUCKET}/watched"
  _copy(fs, f"{RUN}/config.json", f"{run}/config.json")  # total_steps 2: the watcher stops after step 2
  out, errors = [], []

  def watch():
    try:
      out.extend(evaluate(run, benchmarks=[f"arith={bench}"], watch=True, poll_s=0.2, watch_timeout_s=120, **EVAL))
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  def wait_for(what, condition):
    def watching():
      assert not errors, errors
      return condition()
    wait_until(watching, timeout_s=120, what=what, poll_s=0.1)

  caplog.set_level(logging.WARNING)
  watcher = threading.Thread(target=watch)
  watcher.start()
  try:
    time.sleep(1.0)  # the watcher looks at a run without checkpoints first
    _copy(fs, f"{RUN}/checkpoints/1", f"{run}/checkpoints/1")
    wait_for("step 1's result", lambda: fs.exists(f"{BUCKET}/watched/eval/arith/step_1.json"))
    _copy(fs, f"{RUN}/checkpoints/2", f"{run}/checkpoints/2", skip=lambda rel: rel == "commit_success.txt")
    wait_for("the partial step 2 to be reported",
             lambda: any("skipping 2 in" in r.getMessage() for r in list(caplog.records)))
    assert watcher.is_alive()  # a partial checkpoint does not stop the watcher
    _copy(fs, f"{RUN}/checkpoints/2/commit_success.txt", f"{run}/checkpoints/2/commit_success.txt")
  finally:
    watcher.join(timeout=180)
  assert not watcher.is_alive() and not errors, errors
  assert [r["step"] for r in out] == [1, 2]
  for r in out:
    _check_result(r)


def test_hf_baseline_scores_like_the_checkpoint_it_was_exported_from(gcs_run, bench, tmp_path):
  del gcs_run
  meta = sources.read_meta(f"{RUN}/checkpoints", 2)
  model_cfg = meta.model_cfg
  graphdef, abstract = orbax_io.abstract_params(model_cfg)
  shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
  hf_dir = str(tmp_path / "hf")
  save_hf(nnx.merge(graphdef, sources.load_params(f"{RUN}/checkpoints", 2, model_cfg, shardings=shardings)),
          hf_dir)
  prompts = {"tokenizer": "char", "prompt_template": "plain", "instruct": False, "max_prompt_len": 32,
             "max_new_tokens": 24}  # the run's own settings, which a HF directory does not carry
  out = f"gs://{BUCKET}/baseline/eval"
  [base] = evaluate(hf_dir, benchmarks=[f"arith={bench}"], output_dir=out, **prompts, **EVAL)
  assert (base["step"], base["version"], base["source"]) == (None, 0, hf_dir)
  _check_result(base)
  assert json.loads(epath.Path(f"{out}/arith/model.json").read_text())["metrics"] == base["metrics"]
  assert set(_tensorboard_scalars(f"{out}/tensorboard")["arith/pass_at_1"]) == {0}
  [step2] = evaluate(RUN, benchmarks=[f"arith={bench}"], step="2", output_dir=f"gs://{BUCKET}/step2/eval", **EVAL)
  assert step2["settings"] == base["settings"]
  assert [q["correct"] for q in base["questions"]] == [q["correct"] for q in step2["questions"]]
  assert base["metrics"] == pytest.approx(step2["metrics"])
  assert evaluate(hf_dir, benchmarks=[f"arith={bench}"], output_dir=out, **prompts, **EVAL) == []


def test_command_line_evaluates_the_latest_checkpoint(gcs_run, bench):
  del gcs_run
  out = f"gs://{BUCKET}/cli/eval"
  cmd = [sys.executable, os.path.join(ROOT, "tools", "evaluate.py"), f"--checkpoint_dir={RUN}",
         f"--benchmarks=arith={bench}", f"--output_dir={out}", "--num_samples=2", "--pass_k=1,2", "--nogreedy",
         "--reward_workers=1", "--num_slots=8"]
  proc = subprocess.run(cmd, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "wrote 1 result(s)" in proc.stderr
  result = json.loads(epath.Path(f"{out}/arith/step_2.json").read_text())
  assert result["step"] == 2 and result["settings"]["pass_k"] == [1, 2]
  assert "greedy_accuracy" not in result["metrics"] and 0 <= result["metrics"]["pass@2"] <= 1
