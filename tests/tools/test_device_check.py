"""tools/device_check.py's dry run (tiny shapes, the Pallas GPU kernels interpreted on CPU): every section runs and
writes its rows, the kernels and the sampler's float32 logprobs agree with their references, greedy answers equal
`transformers`'."""

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_device_check_dry_run(tmp_path):
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "device_check.py"), "--dry_run",
                        f"--out={tmp_path}"], capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  rows = json.loads((tmp_path / "device_check.json").read_text())["rows"]
  assert {r["section"] for r in rows} == {"kernels", "logprobs", "sampler", "learner", "run"}, rows
  assert "| kernels | packed attention (Pallas GPU) vs dense" in (tmp_path / "device_check.md").read_text()
  by_check = {r["check"]: r for r in rows}

  def number(text):
    return float(re.search(r"[-+]?\d[\d,]*\.?\d*(?:e[-+]?\d+)?", text).group().replace(",", ""))

  kernels = [r for r in rows if r["section"] == "kernels"]
  assert len(kernels) == 2 and all(number(r["value"]) < 1e-4 for r in kernels), kernels
  assert number(kernels[0]["ratio"]) < 1e-4  # the gradients
  assert number(by_check["sampler (float32 weights) vs learner forward"]["value"]) < 1e-5
  assert by_check["greedy answers equal to transformers (cpu)"]["value"] == "8/8"
  assert any(r["section"] == "learner" and "faster" in r["ratio"] for r in rows)
  # Judged: each correctness row passed its threshold; the performance floors are shown but judged on the GPU only.
  data = json.loads((tmp_path / "device_check.json").read_text())
  assert data["dry_run"] and data["thresholds"]["learner_mfu"] > 0
  judged = [r for r in rows if r["ok"] is not None]
  assert len(judged) >= 6 and all(r["ok"] and r["verdict"] == "pass" for r in judged), judged
  mfu = next(r for r in rows if r["check"].startswith("packed step"))
  assert mfu["ok"] is None and "real check only" in mfu["threshold"]


def test_a_figure_past_its_threshold_fails_the_check(tmp_path, monkeypatch):
  import importlib.util  # pylint: disable=import-outside-toplevel

  spec = importlib.util.spec_from_file_location("device_check", os.path.join(ROOT, "tools", "device_check.py"))
  tool = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, "device_check", tool)  # its dataclasses look their module up
  spec.loader.exec_module(tool)
  monkeypatch.setitem(tool.THRESHOLDS, "kernel_max_abs", 0.0)  # no kernel is exact to the last bit
  monkeypatch.setattr(sys, "argv", ["device_check.py", "--dry_run", f"--out={tmp_path}",
                                    "--skip=logprobs,sampler,learner,run"])
  assert tool.main() == 1
  rows = json.loads((tmp_path / "device_check.json").read_text())["rows"]
  assert [r["verdict"] for r in rows] == ["FAIL", "FAIL"], rows
  # The planner refuses a dry run's figures as a device's calibration, naming the file.
  plan = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), "--device=h100", "--chips=16",
                         f"--calibration={tmp_path}/device_check.json", "--plot="], capture_output=True, text=True,
                        timeout=300, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert plan.returncode != 0 and "a dry run" in plan.stderr and "device_check.json" in plan.stderr, plan.stderr[-2000:]
