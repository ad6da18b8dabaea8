"""A run's recorded timings, as the replay reads them from its metrics.jsonl."""

import json

import pytest

from areal_jax.sim import replay


def _row(step, elapsed, wait, busy, sync, sampler_busy, decode_steps):
  return {"step": step, "time/elapsed_s": elapsed, "learner/wait_s": wait, "learner/busy_s": busy,
          "sync/seconds": sync, "sampler/step_busy_s": sampler_busy, "sampler/decode_steps": decode_steps}


def test_each_step_trains_publishes_and_works_on_the_host_for_what_it_took(tmp_path):
  rows = [{"step": 0, "eval/accuracy": 0.5, "time/elapsed_s": 3.0},
          _row(1, 10.0, 1.0, 2.0, 0.5, 1.5, 30),  # waited 1, trained 1.5, published 0.5
          _row(2, 13.0, 0.2, 4.5, 0.1, 0.6, 0)]  # 13 - 10 = 0.3 on the host + 0.2 waiting + 2.5 busy
  (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
  first, second = replay.step_timings(str(tmp_path))
  assert first == replay.StepTimings(train_s=1.5, publish_s=0.5, after_s=pytest.approx(0.3), decode_step_s=0.05)
  assert second == replay.StepTimings(train_s=2.4, publish_s=0.1, after_s=0.0, decode_step_s=0.0)
  (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "learner/busy_s": 1.0}))
  with pytest.raises(ValueError, match="metrics.jsonl: no step rows with learner/wait_s"):
    replay.step_timings(str(tmp_path))
