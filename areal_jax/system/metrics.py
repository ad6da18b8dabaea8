"""One metrics path: `<workdir>/metrics.jsonl` (one JSON object per learner step), TensorBoard, and a progress line."""

from __future__ import annotations

import json
import logging
import math
import os
import time

from etils import epath


class MetricsWriter:

  def __init__(self, workdir: str, *, total_steps: int, tensorboard: bool = True, start_step: int = 0):
    self.path = epath.Path(workdir) / "metrics.jsonl"
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.total_steps, self.start_step = total_steps, start_step
    self._t0 = time.time()
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(os.fspath(epath.Path(workdir) / "tensorboard"))

  def write(self, step: int, metrics: dict[str, float]) -> None:
    record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
    # Append (resumed runs keep their history); a local file is flushed line by line.
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
          self._tb.add_scalar(k, v, step)
      self._tb.flush()
    logging.info(self.progress_line(step, record))

  def progress_line(self, step: int, m: dict) -> str:
    done = step - self.start_step
    elapsed = time.time() - self._t0
    eta = elapsed / max(done, 1) * (self.total_steps - step)
    keys = ("reward/mean", "eval/accuracy", "learner/loss", "staleness/max", "sampler/tokens_per_s")
    parts = [f"{k.split('/')[-1] if k != 'eval/accuracy' else 'eval'} {m[k]:.4g}" for k in keys if k in m]
    return f"step {step}/{self.total_steps} | " + " | ".join(parts) + f" | eta {_hms(eta)}"

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def _plain(v):
  try:
    return v.item()
  except AttributeError:
    return v


def _hms(seconds: float) -> str:
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def read_metrics(workdir: str) -> list[dict]:
  path = epath.Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_jsonl(path: epath.Path, step: int) -> None:
  """Drops the lines of a per-step JSONL log written after `step` (a resumed run redoes those steps)."""
  if not path.exists():
    return
  lines = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
  path.write_text("".join(line + "\n" for line in lines))
