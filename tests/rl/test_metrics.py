"""The progress line's ETA (`eta_seconds`) and the end-of-run summary (`run_summary`, `MetricsWriter.summarize`)."""

import json
import os
import shlex
import shutil

import pytest

from areal_jax.rl import metrics
from areal_jax.rl.metrics import MetricsWriter, eta_seconds, read_metrics, run_summary


def _times(first_s, steady_s, n, *, start_step=0, t0=1000.0):
  """(step, wall time) of rows start_step..start_step+n: a slow first step, then steady ones."""
  out, t = [(start_step, t0)], t0
  for i in range(1, n + 1):
    t += first_s if i == 1 else steady_s
    out.append((start_step + i, t))
  return out


@pytest.mark.parametrize("done", [2, 3, 5, 30])
def test_eta_is_remaining_steps_times_steady_step_after_a_slow_first_step(done):
  times = _times(first_s=300.0, steady_s=6.0, n=done)
  assert eta_seconds(times, 120) == pytest.approx((120 - done) * 6.0, rel=1e-6)


def test_eta_uses_recent_steps_and_its_edges():
  assert eta_seconds([], 10) is None and eta_seconds([(0, 5.0)], 10) is None
  assert eta_seconds([(0, 0.0), (1, 10.0)], 11) is None  # one interval, the first step's compiles: no estimate yet
  # The run got slower: the last `window` steps decide.
  times = _times(first_s=50.0, steady_s=2.0, n=40) + [(41 + i, 1000 + 50 + 39 * 2 + 10.0 * (i + 1)) for i in range(5)]
  assert eta_seconds(times, 100, window=5) == pytest.approx((100 - 45) * 10.0)
  assert eta_seconds(_times(10.0, 3.0, 4, start_step=60), 64) == 0.0  # resumed at 60, finished
  assert eta_seconds([(3, 1.0), (3, 2.0), (3, 3.0)], 10) is None  # no step advanced


def test_progress_line_bar_labels_and_eta(tmp_path, monkeypatch):
  now = [1000.0]
  monkeypatch.setattr(metrics, "time", type("Clock", (), {"time": staticmethod(lambda: now[0])}))
  w = MetricsWriter(str(tmp_path), total_steps=100, tensorboard=False)
  for step, t in ((0, 1300.0), (1, 1306.0)):  # 300 s of compiles (initial evaluation) before the first row
    now[0] = t
    w.write(step, {"reward/mean": 0.5})
  assert w.progress_line(1, {}).endswith("| 5:06 elapsed, eta ?")  # no time/elapsed_s: since the writer was made
  now[0] = 1312.0
  w._times.append((2, now[0]))  # what write(2, ...) records
  line = w.progress_line(2, {"reward/mean": 0.41, "learner/loss": 0.25, "time/elapsed_s": 331.0,
                             "staleness/max": 2, "sampler/tokens_per_s": 1234.5})
  assert line == ("step 2/100 [--------------------] 2% | mean reward 0.41 | loss 0.25 | max staleness 2 | "
                  "sampler tokens/s 1234 | 5:31 elapsed, eta 9:48")  # 98 steps x 6 s
  assert "[##########----------] 50%" in w.progress_line(50, {})


def test_summary_from_a_synthetic_metrics_jsonl(tmp_path):
  rows = [{"step": 0, "eval/accuracy": 0.6125, "time/elapsed_s": 40.0}]
  rows += [{"step": s, "reward/mean": 0.5, "staleness/max": 1} for s in range(1, 5)]
  rows += [{"step": 5, "reward/mean": float("nan"), "eval/accuracy": 0.875}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  text = run_summary(str(tmp_path), read_metrics(str(tmp_path)), 12.34, total_steps=5, tensorboard=True)
  print(text)
  assert "step 5/5 in 12.3 minutes" in text
  assert "held-out accuracy (eval/accuracy): 0.613 at step 0 -> 0.875 at step 5" in text
  assert f"metrics:     {tmp_path}/metrics.jsonl" in text
  assert f"python tools/evaluate.py --checkpoint_dir={tmp_path} --benchmarks=NAME=PATH.jsonl" in text
  assert f"python tools/serve.py --checkpoint_dir={tmp_path} --port=8000" in text
  assert f"pip install tensorboard && tensorboard --logdir {tmp_path}/tensorboard" in text
  assert f"python tools/plot_run.py {tmp_path}" in text
  # Every next command works after the README's `pip install -e .`: its scripts exist, and a program the package
  # does not install is installed by the command itself.
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  for line in text.split("next:\n", 1)[1].splitlines():
    command = line.split(":", 1)[1].split("  (")[0].strip()
    for part in command.split(" && "):
      words = shlex.split(part)
      if words[0] == "python":
        assert os.path.exists(os.path.join(root, words[1])), line
      elif words[0] != "pip":
        assert shutil.which(words[0]) or f"pip install {words[0]}" in command, line
  quiet = run_summary(str(tmp_path), rows[1:5], 1.0, tensorboard=False, eval_path="/data/held out.jsonl")
  assert "no evaluation in metrics.jsonl" in quiet and "tensorboard" not in quiet
  assert "--benchmarks=heldout='/data/held out.jsonl'" in quiet


def test_writer_summarize_prints_what_it_wrote(tmp_path, capsys):
  w = MetricsWriter(str(tmp_path), total_steps=2, tensorboard=False)
  w.write(0, {"eval/accuracy": 0.5})
  w.write(1, {"reward/mean": 0.25})
  w.write(2, {"reward/mean": 0.5, "eval/accuracy": 0.75})
  w.close()
  text = w.summarize(3.0)
  assert "0.500 at step 0 -> 0.750 at step 2" in text and "tensorboard" not in text
  assert text in capsys.readouterr().out


def test_read_metrics_leaves_out_a_torn_last_line_and_names_a_bad_one_before_it(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "rew')
  assert read_metrics(str(tmp_path)) == [{"step": 0}, {"step": 1}]
  (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 2}\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not JSON: 'not json'"):
    read_metrics(str(tmp_path))
  assert read_metrics(str(tmp_path / "nowhere")) == []
