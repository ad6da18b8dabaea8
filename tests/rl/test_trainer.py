"""End-to-end runs of the asynchronous trainer on 8 CPU devices split 4 sampler / 4 learner."""

import os
import threading

import pytest

from areal_jax.config import load_config
from areal_jax.rl.controller import Stalled
from areal_jax.rl.metrics import read_metrics
from areal_jax.run import trainer
from run_checks import FAST, assert_every_prompt_once, rollouts

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

REQUIRED = ("step", "version", "reward/mean", "staleness/mean", "staleness/max", "learner/loss",
            "learner/importance_weight_max", "sampler/tokens_per_s", "sampler/decode_steps",
            "sampler/tokens_per_decode_step", "sampler/prefill_rows", "sampler/prefill_tokens", "sampler/cached_tokens",
            "sampler/recomputed", "learner/tokens_per_s",
            "sync/seconds", "time/elapsed_s")


def test_async_run_respects_staleness_and_writes_metrics(tmp_path):
  """With bfloat16 sampler weights (the real-size presets' setting): the float32 learner's weights reach the sampler
  cast, and every step logs how far the sampler's logprobs are from the learner's (`sampler/logprob_gap`)."""
  eta = 1
  config = load_config(FAST, total_steps=4,
                       **{"rollout.max_head_offpolicyness": eta, "sampler.param_dtype": "bfloat16"})
  rows = trainer.run(config, str(tmp_path))
  assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
  metrics = read_metrics(str(tmp_path))
  assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
  for m in metrics[1:]:
    assert set(REQUIRED) <= set(m), set(REQUIRED) - set(m)
    assert m["version"] == m["step"] and m["staleness/max"] <= eta
    if m["sampler/logprob_gap_tokens"]:
      assert 0 < m["sampler/logprob_gap"] < 0.05, m
    # A decode step draws at most a token per slot; a prefill row draws the first token of each of its (G) answers.
    tokens = m["sampler/tokens_per_decode_step"] * m["sampler/decode_steps"]
    assert 0 <= tokens <= (m["sampler/decode_steps"] * config.sampler.num_slots
                           + m["sampler/prefill_rows"] * config.rollout.group_size), m
    assert m["sampler/prefill_tokens"] >= m["sampler/prefill_rows"] and m["sampler/cached_tokens"] == 0, m
  assert sum(m["sampler/logprob_gap_tokens"] for m in metrics[1:]) > 0
  assert sum(m["sampler/decode_steps"] for m in metrics[1:]) > 0
  assert sum(m["sampler/prefill_rows"] for m in metrics[1:]) > 0
  evals = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
  assert len(evals) == 3 and all(0.0 <= a <= 1.0 for a in evals)  # steps 0, 2, 4
  trained = [r for r in rollouts(tmp_path) if not r["filtered"]]
  assert len(trained) == 4 * config.rollout.batch_size
  for r in trained:
    # Staleness at training time = (learner version before the step) - (version of the first token) <= eta.
    assert all((r["step"] - 1) - v <= eta for v in r["version_start"]), r
    assert all(a <= b for a, b in zip(r["version_start"], r["version_end"]))
  assert os.path.isdir(tmp_path / "checkpoints" / "4")


def test_a_run_that_cannot_learn_stops_naming_the_cause(tmp_path):
  """No warm-start: the random policy solves no prompt, every group scores all 0 and is dropped, and the run stops
  after `rollout.stall_timeout_s` with an error that says why (instead of waiting forever)."""
  config = load_config(FAST, total_steps=4, **{
      "warmstart.steps": 0, "learner.filter_uniform_groups": True, "rollout.stall_timeout_s": 30.0})
  outcome = {}

  def run():  # in a thread: were the stop broken, the run would wait forever
    try:
      trainer.run(config, str(tmp_path))
    except BaseException as e:  # pylint: disable=broad-except
      outcome["error"] = e

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  thread.join(600)
  assert not thread.is_alive(), "the run did not stop within 600 s"
  with pytest.raises(Stalled, match=r"step 1: no prompt group accepted for 30 s .* every answer scored the "
                                            r"same .*warmstart.steps"):
    raise outcome.get("error") or AssertionError("the run finished without stopping")
  assert [m["step"] for m in read_metrics(str(tmp_path))] == [0]  # the step-0 evaluation, whole


def test_a_run_with_sampler_replicas_trains(tmp_path):
  """The 4 sampler devices as 4 independent engines (2, in a sampler process: test_local_job.py): every replica is
  given groups, none fails, the replicas generate and the run's weights are swapped in.

  A 4-step run guarantees no more: each replica compiles its own programs, and on a loaded 2-core machine one
  replica's first step (its compiles) can outlast the whole run while the others feed the learner; its counters move
  only when that step ends. That each replica generates and swaps on its own is `test_replicas.py`'s."""
  replicas = 4
  config = load_config(FAST, total_steps=4, **{"mesh.sampler_replicas": replicas})
  rows = trainer.run(config, str(tmp_path))
  assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
  last = read_metrics(str(tmp_path))[-1]
  for i in range(replicas):
    assert last[f"sampler/replica{i}/answers"] > 0 and last[f"sampler/replica{i}/failed"] == 0, last
  assert sum(last[f"sampler/replica{i}/tokens"] for i in range(replicas)) > 0, last
  assert sum(last[f"sampler/replica{i}/swaps"] for i in range(replicas)) >= 1, last
  # A float32 sampler (the tiny default) agrees with the learner within 1e-5 on the tokens of the current version.
  gaps = [m["sampler/logprob_gap"] for m in read_metrics(str(tmp_path))[1:] if m["sampler/logprob_gap_tokens"]]
  assert gaps and max(gaps) <= 1e-5, gaps


def test_a_colocated_run_generates_then_trains_on_every_device(tmp_path, caplog):
  """`mesh.colocated`: both roles on all 8 devices, η = 0; every trained answer is of the step's own version."""
  config = load_config(FAST, total_steps=3, **{"mesh.colocated": True, "rollout.max_head_offpolicyness": 0,
                                                "learner.use_decoupled_loss": False})
  with caplog.at_level("INFO"):
    rows = trainer.run(config, str(tmp_path))
  assert [r["step"] for r in rows] == [0, 1, 2, 3]
  assert "colocated: sampler {'data': 8, 'expert': 1, 'tensor': 1} and learner {'fsdp': 8, 'expert': 1, " \
         "'tensor': 1} time-share the 8 devices" in caplog.text
  for r in read_metrics(str(tmp_path))[1:]:
    assert r["staleness/max"] == 0 and r["version"] == r["step"], r
  assert_every_prompt_once(str(tmp_path), config, last_step=3)


@pytest.mark.parametrize("overrides", [
    {"learner.loss": "cispo"},
    {"learner.loss": "sapo", "learner.use_decoupled_loss": False},
    {"learner.loss": "gspo", "learner.m2_threshold": 0.04},
    {"rollout.workflow": "multi_turn_math", "sampler.max_seq_len": 160},  # room for a second try
], ids=["cispo", "sapo", "gspo+m2po", "multi_turn_math"])
def test_a_run_with_another_objective_or_workflow_trains(tmp_path, overrides):
  """Each objective (docs/objectives.md) and the bundled multi-turn workflow through a short run of the fast preset;
  no learning-curve target, only that the steps complete with finite losses and their own statistics. (The fast
  preset's policy solves almost nothing: rewards of 0 to 0.03, so a wrong first answer and a second try is the rule.)"""
  config = load_config(FAST, total_steps=2, **{"eval.every_steps": 100, "checkpoint.every_steps": 100, **overrides})
  rows = trainer.run(config, str(tmp_path))
  assert [r["step"] for r in rows] == [0, 1, 2]
  for m in read_metrics(str(tmp_path))[1:]:
    assert m["learner/loss"] == m["learner/loss"], m  # finite, not NaN
    if "learner.m2_threshold" in overrides:
      assert 0 <= m["learner/m2po_masked_fraction"] < 1, m
    if "rollout.workflow" in overrides:
      assert 1 < m["agent/turns_mean"] <= config.rollout.max_turns, m
  if "rollout.workflow" in overrides:
    trained = [r for r in rollouts(tmp_path) if not r["filtered"]]
    assert len(trained) == 2 * config.rollout.batch_size
