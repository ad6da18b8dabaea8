"""`plot_run(workdir)`: a run's curves from `<workdir>/metrics.jsonl` in one PNG (`tools/plot_run.py`).

One panel per quantity, x = learner step; a panel whose metrics the run did not write is left out:

    held-out accuracy   eval/accuracy
    reward              reward/mean (every answer scored since the last step), reward/trained_mean (the batch)
    staleness           staleness/mean, staleness/max (policy versions behind, over the trained tokens)
    throughput          sampler/tokens_per_s, learner/tokens_per_s
"""

from __future__ import annotations

import math
import os

from etils import epath

from areal_jax.rl.metrics import read_metrics

PANELS = (("held-out accuracy", ("eval/accuracy",)),
          ("reward", ("reward/mean", "reward/trained_mean")),
          ("staleness (versions)", ("staleness/mean", "staleness/max")),
          ("throughput (tokens/s)", ("sampler/tokens_per_s", "learner/tokens_per_s")))


class NoMetrics(ValueError):
  """metrics.jsonl is missing, empty, or holds none of the plotted metrics (the message names the file)."""


def read_rows(workdir: str | os.PathLike) -> list[dict]:
  """metrics.jsonl's rows (`metrics.read_metrics`); raises `NoMetrics` when it is missing, empty or unreadable."""
  path = epath.Path(workdir) / "metrics.jsonl"
  if not path.exists():
    raise NoMetrics(f"{path}: no such file (is this a run's workdir?)")
  try:
    rows = read_metrics(os.fspath(workdir))
  except ValueError as e:
    raise NoMetrics(str(e)) from None
  if not rows:
    raise NoMetrics(f"{path}: empty (no step written yet)")
  return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of `key`'s finite numbers (`reward/mean` is NaN at steps where no answer finished)."""
  points = [(r["step"], float(r[key])) for r in rows
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
  return [s for s, _ in points], [v for _, v in points]


def plot_run(workdir: str | os.PathLike, out: str | os.PathLike | None = None) -> epath.Path:
  """Writes the run's curves as a PNG (default `<workdir>/curves.png`, local or gs://) and returns its path."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  path = epath.Path(workdir) / "metrics.jsonl"
  rows = read_rows(workdir)
  panels = [(title, [(k, *series(rows, k)) for k in keys]) for title, keys in PANELS]
  panels = [(title, [c for c in curves if c[1]]) for title, curves in panels]
  panels = [(title, curves) for title, curves in panels if curves]
  if not panels:
    wanted = ", ".join(k for _, keys in PANELS for k in keys)
    raise NoMetrics(f"{path}: none of the plotted metrics ({wanted}) in its {len(rows)} rows")
  fig = Figure(figsize=(7, 2.4 * len(panels)), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
  for ax, (title, curves) in zip(axes, panels):
    for key, steps, values in curves:
      ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
  axes[-1].set_xlabel("step")
  fig.suptitle(os.fspath(workdir), fontsize=9)
  out = epath.Path(out) if out else epath.Path(workdir) / "curves.png"
  with out.open("wb") as f:
    fig.savefig(f, format="png", dpi=120)
  return out
