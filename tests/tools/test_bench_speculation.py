"""tools/bench_sampler.py --speculation end to end at a small size: speculation off vs suffix on the revisited-prompts
workload (a briefly warm-started tiny model). Its lines parse, acceptance lies in [0, 1], and drafts from the earlier
epoch's answers are accepted. The long-tail workload prints the same lines through the same code; it is left out to
save its compiles (exact budgets and EOS with drafts: tests/sampler/test_speculation.py)."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_LINE = re.compile(r"^(revisit|longtail) speculation=(off|suffix): tokens (\d+), seconds ([\d.]+), tokens/s (\d+), "
                   r"decode calls (\d+), host s ([\d.]+) \(drafter ([\d.]+)\), device wait s ([\d.]+), "
                   r"tokens per slot-forward ([\d.]+)(.*)$", re.M)
_SPEC = re.compile(r"^, slot-forwards (\d+) \(drafted share ([\d.]+)\), drafted (\d+), accepted (\d+), "
                   r"acceptance ([\d.]+), by position ((?:[\d.]+ ?)+), accepted per slot-forward by position "
                   r"((?:[\d.]+ ?)+)$")


def test_bench_speculation_lines_and_acceptance(tmp_path):
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_sampler.py"), "--speculation",
                        "--spec_workload=revisit", "--prompts=4", "--group=4", "--epochs=2", "--slots=8", "--warm_steps=40",
                        f"--warm_cache={tmp_path}", "--repeats=1"],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  out = out.stdout
  rows = {(w, v): m for w, v, *m in _LINE.findall(out)}
  assert set(rows) == {("revisit", "off"), ("revisit", "suffix")}, out
  spec = {}
  for (w, v), (tokens, seconds, rate, _, host, drafter, wait, per_forward, rest) in rows.items():
    assert int(tokens) > 0 and int(rate) > 0, out
    assert float(drafter) <= float(host) <= float(seconds) + 0.01 and float(wait) <= float(seconds) + 0.01, out
    if v == "off":
      assert per_forward == "1.00" and not rest and float(drafter) == 0, out
      continue
    m = _SPEC.match(rest)
    assert m, rest
    forwards, share, drafted, accepted, acceptance = int(m[1]), float(m[2]), int(m[3]), int(m[4]), float(m[5])
    by_position = [float(x) for x in m[6].split()]
    assert 0 <= accepted <= drafted <= 4 * forwards and 0 <= share <= 1 and 0 <= acceptance <= 1, out
    assert len(by_position) == 4 and all(0 <= a <= 1 for a in by_position), out
    leading = [float(x) for x in m[7].split()]  # P(L >= j): at most the drafted share, non-increasing
    assert len(leading) == 4 and share >= leading[0] and leading == sorted(leading, reverse=True), out
    assert float(per_forward) == pytest.approx(1 + sum(leading), abs=0.01), out  # a forward emits 1 + L tokens
    spec[w] = accepted
  assert spec["revisit"] > 0, out  # the earlier epoch's answers draft the later one's
  assert re.search(r"^revisit speculation=suffix: acceptance by epoch [\d.]+ of \d+, [\d.]+ of \d+$", out, re.M), out
  assert re.search(r"^revisit ratio suffix / off tokens/s: [\d.]+x$", out, re.M), out
