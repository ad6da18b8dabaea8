r"""Plots a run's curves from `<workdir>/metrics.jsonl` into a PNG: held-out accuracy, reward, staleness,
throughput, against the learner step (the metrics a run wrote; see `areal_jax.rl.plot`).

  python tools/plot_run.py /tmp/areal_tiny                      # writes /tmp/areal_tiny/curves.png
  python tools/plot_run.py gs://bucket/run --out=/tmp/run.png

A missing or empty metrics.jsonl is one error line and exit status 1.
"""

import sys

from absl import app, flags, logging

from areal_jax.rl.plot import NoMetrics, plot_run

_OUT = flags.DEFINE_string("out", None, "PNG to write (default: WORKDIR/curves.png).")


def main(argv):
  if len(argv) != 2:
    raise app.UsageError(f"one argument, the run's workdir; got {argv[1:]}")
  try:
    out = plot_run(argv[1], _OUT.value)
  except NoMetrics as e:
    print(f"plot_run: {e}", file=sys.stderr)
    return 1
  logging.info("wrote %s", out)
  return 0


if __name__ == "__main__":
  app.run(main)
