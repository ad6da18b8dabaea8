"""Finding checkpoints on a local disk: complete steps are listed, partial saves are reported; sources are classified."""

import json

import pytest

from areal_jax.checkpoint import sources


def _step(root, name, items=("params", "meta", "opt_state")):
  for item in items:
    (root / name / item).mkdir(parents=True)


def test_scan_lists_complete_steps_and_reports_partial_ones(tmp_path):
  _step(tmp_path, "1")
  _step(tmp_path, "10")
  _step(tmp_path, "2.orbax-checkpoint-tmp-1795340000")  # a local save in progress (renamed when done)
  _step(tmp_path, "3", items=("meta",))  # finalized name but no params item
  (tmp_path / "notes.txt").write_text("not a step")
  found = sources.scan(tmp_path)
  assert found.complete == [1, 10]
  assert set(found.incomplete) == {"2.orbax-checkpoint-tmp-1795340000", "3"}
  assert "temporary" in found.incomplete["2.orbax-checkpoint-tmp-1795340000"]
  assert "params" in found.incomplete["3"]


def test_scan_of_a_missing_directory_is_empty(tmp_path):
  found = sources.scan(tmp_path / "not_yet")
  assert found.complete == [] and found.incomplete == {}


def test_resolve_classifies_runs_checkpoint_dirs_policies_and_hf_dirs(tmp_path):
  run_config = {"model": {"tokenizer": "char"}, "sampler": {}, "total_steps": 3}
  run = tmp_path / "run"
  _step(run / "checkpoints", "1")
  (run / "config.json").write_text(json.dumps(run_config))
  src = sources.resolve(str(run))
  assert (src.kind, src.path, src.default_output) == ("run", run / "checkpoints", run / "eval")
  assert src.run_config["total_steps"] == 3
  src = sources.resolve(str(run / "checkpoints"))  # the checkpoint directory itself: results still beside it
  assert (src.kind, src.path, src.default_output, src.run_config) == ("run", run / "checkpoints", run / "eval",
                                                                     run_config)
  starting = tmp_path / "starting"  # a run that has written its config but no checkpoint yet (--watch)
  starting.mkdir()
  (starting / "config.json").write_text(json.dumps(run_config))
  assert sources.resolve(str(starting)).path == starting / "checkpoints"
  policy = run / "warmstart"
  policy.mkdir()
  (policy / "model_config.json").write_text("{}")
  src = sources.resolve(str(policy))
  assert src.kind == "policy" and src.run_config == run_config
  hf = tmp_path / "hf"
  hf.mkdir()
  (hf / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
  assert sources.resolve(str(hf)).kind == "hf"


def test_resolve_names_a_broken_run_config(tmp_path):
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match="config.json is not valid JSON"):
    sources.resolve(str(tmp_path))
