"""What the code sandbox's jail costs: the time to score a correct answer, bubblewrap jail against the weaker
`rlimits` mode, interleaved in one run so that machine noise hits both alike.

Each sample is one `check_code` of a correct stdin answer (extraction, one sandboxed run, output comparison), as a
reward worker does it. Prints the median and p90 of each mode and the ratio of medians.

    python tools/bench_sandbox.py --samples 100
"""

from __future__ import annotations

import argparse
import statistics
import time

from areal_jax.reward import code as code_reward
from areal_jax.reward import sandbox

ANSWER = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TESTS = {"inputs": ["3 4\n"], "outputs": ["7\n"]}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--samples", type=int, default=100, help="scored answers per mode")
  args = p.parse_args()
  sandbox.check_isolation()
  times = {"bwrap": [], "rlimits": []}
  for i in range(args.samples + 5):
    for mode in times:
      limits = sandbox.Limits(isolation=mode)
      t0 = time.perf_counter()
      ok, why = code_reward.check_code(ANSWER, TESTS, limits=limits)
      elapsed = time.perf_counter() - t0
      assert ok, (mode, why)
      if i >= 5:  # the first few warm the page cache
        times[mode].append(elapsed)
  for mode, ts in times.items():
    ts.sort()
    print(f"{mode:8s} median {statistics.median(ts) * 1e3:6.1f} ms   p90 {ts[int(0.9 * len(ts))] * 1e3:6.1f} ms"
          f"   ({len(ts)} answers)")
  ratio = statistics.median(times["bwrap"]) / statistics.median(times["rlimits"])
  print(f"jail / rlimits: {ratio:.2f}x the time to score a correct answer")


if __name__ == "__main__":
  main()
