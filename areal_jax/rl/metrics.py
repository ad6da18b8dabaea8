"""One metrics path: `<workdir>/metrics.jsonl` (one JSON object per learner step), TensorBoard, and a progress line."""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import shutil
import struct
import tempfile
import time
from collections.abc import Mapping, Sequence

from etils import epath


# The metrics of the progress line and their labels there.
_PROGRESS = {"reward/mean": "mean reward", "eval/accuracy": "eval accuracy", "learner/loss": "loss",
             "staleness/max": "max staleness", "sampler/tokens_per_s": "sampler tokens/s"}


class MetricsWriter:
  """Writes one row per step to `<workdir>/metrics.jsonl` (and TensorBoard) and logs a progress line with an ETA."""

  def __init__(self, workdir: str, *, total_steps: int, tensorboard: bool = True):
    self.workdir = epath.Path(workdir)
    self.path = self.workdir / "metrics.jsonl"
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.total_steps = total_steps
    self._t0 = time.time()
    self._times: list[tuple[int, float]] = []  # (step, wall time) of each row this process wrote: the ETA's input
    self._tb = TensorBoard(self.workdir / "tensorboard") if tensorboard else None

  def write(self, step: int, metrics: dict[str, float]) -> None:
    record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
    append_lines(self.path, [json.dumps(record)])  # resumed runs keep their history
    if self._tb is not None:
      self._tb.write(step, {k: v for k, v in record.items() if k != "step"})
    self._times.append((step, time.time()))
    logging.info(self.progress_line(step, record))

  def progress_line(self, step: int, m: dict) -> str:
    """`step 12/120 [##------------------] 10% | mean reward 0.41 | ... | 0:31 elapsed, eta 4:12`."""
    frac = min(max(step / max(self.total_steps, 1), 0.0), 1.0)
    bar = "#" * round(frac * _BAR) + "-" * (_BAR - round(frac * _BAR))
    # reward/mean is NaN when no rollout finished since the last step (metrics.jsonl keeps it): left off the line.
    shown = [k for k in _PROGRESS if k in m and not (k == "reward/mean" and math.isnan(m[k]))]
    elapsed = m.get("time/elapsed_s", time.time() - self._t0)  # the run's time, resumed attempts included
    eta = eta_seconds(self._times, self.total_steps)
    parts = [f"{_PROGRESS[k]} {m[k]:.4g}" for k in shown]
    when = f"{_clock(elapsed)} elapsed, eta {'?' if eta is None else _clock(eta)}"
    return " | ".join([f"step {step}/{self.total_steps} [{bar}] {frac:.0%}", *parts, when])

  def summarize(self, minutes: float, *, eval_path: str = "") -> str:
    """Prints the end-of-run summary (`run_summary`) of everything in metrics.jsonl to stdout, once, as plain text
    (the progress lines are absl's log, on stderr); returns it."""
    text = run_summary(os.fspath(self.workdir), read_metrics(os.fspath(self.workdir)), minutes,
                       total_steps=self.total_steps, tensorboard=self._tb is not None, eval_path=eval_path)
    print(text, flush=True)
    return text

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


_BAR = 20  # characters of the progress bar


def eta_seconds(times: Sequence[tuple[int, float]], total_steps: int, *, window: int = 20) -> float | None:
  """Seconds left until `total_steps`, from the `(step, wall time)` of each step written so far (in order).

  The rate is the mean time per step over the last `window` steps. The first interval (the first step after the
  start, which carries the compiles: 30 s where later steps took 3-5 in the tiny run) and the time before the first
  row (warm-start, loading) never count, so the estimate is right from the second step on. None before three rows.
  """
  if len(times) < 3:
    return None
  first = max(1, len(times) - 1 - window)
  (s0, t0), (s1, t1) = times[first], times[-1]
  if s1 <= s0:
    return None
  return max(total_steps - s1, 0) * (t1 - t0) / (s1 - s0)


def _clock(seconds: float) -> str:
  """`4:05` (minutes:seconds), or `1:02:03` from an hour on."""
  s = int(seconds)
  return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def run_summary(workdir: str, records: Sequence[Mapping], minutes: float, *, total_steps: int | None = None,
                tensorboard: bool = True, eval_path: str = "") -> str:
  """The end-of-run text: held-out accuracy (`eval/accuracy`) at the first and last evaluation, the run's minutes,
  where its logs are, and the commands to evaluate, serve, open TensorBoard and plot it: each works after the
  README's `pip install -e .` (TensorBoard's installs it first).

  `records` are metrics.jsonl's rows (`read_metrics`); `eval_path` is the held-out JSONL the evaluate command scores
  (`evaluation.heldout_jsonl`); without one (code problems) the command asks for the reader's own benchmark.
  """
  q = shlex.quote
  last = max((r["step"] for r in records), default=0)
  evals = [(r["step"], r["eval/accuracy"]) for r in records
           if isinstance(r.get("eval/accuracy"), (int, float)) and math.isfinite(r["eval/accuracy"])]
  if not evals:
    accuracy = "no evaluation in metrics.jsonl"
  elif len(evals) == 1:
    accuracy = f"{evals[0][1]:.3f} at step {evals[0][0]}"
  else:
    accuracy = f"{evals[0][1]:.3f} at step {evals[0][0]} -> {evals[-1][1]:.3f} at step {evals[-1][0]}"
  tb = os.fspath(epath.Path(workdir) / "tensorboard")
  bench = f"heldout={q(eval_path)}" if eval_path else "NAME=PATH.jsonl"
  of = f"/{total_steps}" if total_steps else ""
  lines = [
      f"run finished: step {last}{of} in {minutes:.1f} minutes",
      f"held-out accuracy (eval/accuracy): {accuracy}",
      f"logs: {workdir}",
      f"  metrics:     {epath.Path(workdir) / 'metrics.jsonl'}",
      *([f"  tensorboard: {tb}"] if tensorboard else []),
      "next:",
      f"  evaluate:    python tools/evaluate.py --checkpoint_dir={q(workdir)} --benchmarks={bench}",
      f"  serve:       python tools/serve.py --checkpoint_dir={q(workdir)} --port=8000",
      # TensorBoard itself is no dependency (the run writes its events with tensorboardX): the command installs it.
      *([f"  tensorboard: pip install tensorboard && tensorboard --logdir {q(tb)}"] if tensorboard else []),
      f"  plot:        python tools/plot_run.py {q(workdir)}  (writes {epath.Path(workdir) / 'curves.png'})",
  ]
  return "\n".join(lines)


class TensorBoard:
  """Scalars into one TensorBoard event file in `logdir` (local or gs://), written and flushed on every `write`.

  Events are written synchronously (tensorboardX's `EventsWriter`, no background thread). For a remote logdir the file
  is written in a local temporary directory and uploaded whole after every `write` (objects cannot be appended to).
  tensorboardX's own gs:// writer is not used: every `SummaryWriter` stays referenced until exit (atexit) and its gs://
  writer uploads once more when it is finally deleted, at interpreter exit.
  """

  def __init__(self, logdir: str | os.PathLike):
    from tensorboardX.event_file_writer import EventsWriter  # pylint: disable=g-import-not-at-top

    self.logdir = epath.Path(logdir)
    self._remote = "://" in os.fspath(logdir)
    local = tempfile.mkdtemp(prefix="tensorboard-") if self._remote else os.fspath(logdir)
    os.makedirs(local, exist_ok=True)
    self._local_dir = local
    if self._remote:
      self.logdir.mkdir(parents=True, exist_ok=True)
    self._events = EventsWriter(os.path.join(local, "events"), filename_suffix=f".{os.getpid()}")

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    """Adds the finite numbers of `scalars` (non-numbers are skipped) at `step` and flushes."""
    from tensorboardX import summary  # pylint: disable=g-import-not-at-top
    from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top

    now = time.time()
    for k, v in scalars.items():
      v = _plain(v)
      if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        self._events.write_event(event_pb2.Event(wall_time=now, step=step, summary=summary.scalar(k, float(v))))
    self._events.flush()
    if self._remote:
      for name in os.listdir(self._local_dir):  # the one event file
        with open(os.path.join(self._local_dir, name), "rb") as f:
          (self.logdir / name).write_bytes(f.read())

  def close(self) -> None:
    self._events.close()
    if self._remote:
      shutil.rmtree(self._local_dir, ignore_errors=True)


def _plain(v):
  try:
    return v.item()
  except AttributeError:
    return v


def append_lines(path: epath.Path, lines: Sequence[str]) -> None:
  """Appends lines to a text file, local or on an object store.

  A local file is opened for appending. Objects (gs://, s3://) cannot be appended to (gcsfs would silently overwrite),
  so the object is rewritten with its old content plus the new lines: one read and one write per call.
  """
  if not lines:
    return
  text = "".join(line + "\n" for line in lines)
  if "://" not in os.fspath(path):
    with path.open("a") as f:
      f.write(text)
  else:
    path.write_text((path.read_text() if path.exists() else "") + text)


def read_metrics(workdir: str) -> list[dict]:
  """metrics.jsonl's rows ([] when there is none yet); a torn last line (a run still appending, or killed) is left
  out, a line that is not JSON before it raises a ValueError naming the file and line."""
  path = epath.Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  lines = [line for line in path.read_text().splitlines() if line.strip()]
  rows = []
  for i, line in enumerate(lines):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      if i < len(lines) - 1:
        raise ValueError(f"{path}: line {i + 1} is not JSON: {line[:80]!r}") from None
  return rows


def cut_logs(workdir: str | os.PathLike, step: int | None) -> None:
  """Cuts a resumed run's logs (metrics.jsonl, rollouts.jsonl, TensorBoard events) back to the restored `step`: the
  steps after it are redone. `None` (no checkpoint: the run starts again from nothing) removes every step, 0 too."""
  workdir = epath.Path(workdir)
  keep = -1 if step is None else step
  for name in ("metrics.jsonl", "rollouts.jsonl"):
    truncate_jsonl(workdir / name, keep)
  truncate_events(workdir / "tensorboard", keep)


def truncate_jsonl(path: epath.Path, step: int) -> None:
  """Drops the lines of a per-step JSONL log written after `step` (a resumed run redoes those steps), and a torn
  last line (the process was killed while appending). The file is replaced whole, never left half-written."""
  if not path.exists():
    return
  lines = [line for line in path.read_text().splitlines() if line.strip()]
  kept = []
  for i, line in enumerate(lines):
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      if i < len(lines) - 1:
        raise ValueError(f"{path}: line {i + 1} is not JSON and is not the last line: {line[:80]!r}") from None
      logging.warning("%s: dropping a torn last line (%d characters)", path, len(line))
      continue
    if record["step"] <= step:
      kept.append(line)
  _replace(path, "".join(line + "\n" for line in kept))


def _records(data: bytes) -> list[bytes]:
  """The records of a TFRecord file (8-byte length, 4-byte CRC, data, 4-byte CRC); a torn last record is dropped."""
  out, i = [], 0
  while i + 12 <= len(data):
    (n,) = struct.unpack("<Q", data[i:i + 8])
    if i + 12 + n + 4 > len(data):
      break
    out.append(data[i + 12:i + 12 + n])
    i += 12 + n + 4
  return out


def truncate_events(logdir: epath.Path, step: int) -> None:
  """Drops the TensorBoard events of steps after `step` from every event file in `logdir` (TensorBoard would plot a
  redone step twice); a file left with no scalars is removed. Each file is replaced whole."""
  if not logdir.exists():
    return  # before importing tensorboardX, which imports torch where it is installed (seconds at every start)
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  from tensorboardX.record_writer import masked_crc32c  # pylint: disable=g-import-not-at-top

  for path in logdir.iterdir():
    if not path.name.startswith("events"):
      continue
    old = path.read_bytes()
    kept = [r for r in _records(old) if event_pb2.Event.FromString(r).step <= step]
    if not any(event_pb2.Event.FromString(r).HasField("summary") for r in kept):
      path.unlink()
      continue
    data = b"".join(struct.pack("<Q", len(r)) + struct.pack("<I", masked_crc32c(struct.pack("<Q", len(r)))) + r
                    + struct.pack("<I", masked_crc32c(r)) for r in kept)
    if len(data) != len(old):  # steps dropped, or a torn last record
      _replace(path, data)


def _replace(path: epath.Path, data: bytes | str) -> None:
  """Writes a file whole: an object is replaced in one upload; a local file through a temporary file and a rename."""
  write = "write_text" if isinstance(data, str) else "write_bytes"
  if "://" in os.fspath(path):
    getattr(path, write)(data)
    return
  tmp = path.with_name(path.name + ".tmp")
  getattr(tmp, write)(data)
  os.replace(tmp, path)
