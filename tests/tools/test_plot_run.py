"""`tools/plot_run.py` and `areal_jax.rl.plot`: a PNG of a run's curves; a clear error without metrics."""

import json
import math
import os
import subprocess
import sys

import pytest

from areal_jax.rl.plot import NoMetrics, plot_run

_TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "plot_run.py")


def _write_run(workdir, steps=12):
  rows = []
  for s in range(steps + 1):
    row = {"step": s}
    if s % 4 == 0:
      row["eval/accuracy"] = 0.5 + 0.03 * s
    if s:
      row |= {"reward/mean": float("nan") if s == 3 else 0.4 + 0.02 * s, "reward/trained_mean": 0.45 + 0.02 * s,
              "staleness/mean": 0.5 + (s % 3) / 2, "staleness/max": s % 3 + 1,
              "sampler/tokens_per_s": 900 + 10 * s, "learner/tokens_per_s": 3000 + 40 * math.sin(s)}
    rows.append(row)
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 13, "rew')  # torn
  return workdir


def _is_png(path):
  data = open(path, "rb").read()
  return len(data) > 100 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_run_writes_a_png(tmp_path):
  run = _write_run(tmp_path / "run")
  out = plot_run(str(run))
  assert os.fspath(out) == str(run / "curves.png") and _is_png(out)
  assert _is_png(plot_run(str(run), str(tmp_path / "other.png")))


def test_plot_run_errors_name_the_file(tmp_path):
  with pytest.raises(NoMetrics, match=f"{tmp_path}/metrics.jsonl: no such file"):
    plot_run(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_text("\n")
  with pytest.raises(NoMetrics, match="metrics.jsonl: empty"):
    plot_run(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "learner/loss": 1.0}\n')
  with pytest.raises(NoMetrics, match="none of the plotted metrics"):
    plot_run(str(tmp_path))


def test_tool_exit_status(tmp_path):
  run = _write_run(tmp_path / "run")
  ok = subprocess.run([sys.executable, _TOOL, str(run), f"--out={tmp_path / 'c.png'}"], capture_output=True,
                      text=True, timeout=120)
  assert ok.returncode == 0, ok.stderr
  assert _is_png(tmp_path / "c.png")
  bad = subprocess.run([sys.executable, _TOOL, str(tmp_path / "nothing")], capture_output=True, text=True, timeout=120)
  assert bad.returncode == 1
  assert bad.stderr.strip() == f"plot_run: {tmp_path}/nothing/metrics.jsonl: no such file (is this a run's workdir?)"
  assert "Traceback" not in bad.stderr
