"""tools/bench_sampler.py, bench_learner.py, bench_agents.py (its calculator modes too), bench_sandbox.py,
bench_lora.py, bench_prefix_cache.py and bench_delta_sync.py end to end on small workloads, peers included."""

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tool, *args):
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), *args], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def test_bench_sampler_with_hf_peer():
  out = _run("bench_sampler.py", "--peer=hf", "--requests=12", "--slots=4", "--mean-len=6", "--decode-steps=1,4",
             "--repeats=1")
  rows = dict(re.findall(r"^(engine \(paged, decode_steps=\d\)|static batches \(dense JAX\)|hf transformers generate"
                         r" \(torch, \d+ threads\))\s+(\d+)", out, re.M))
  assert len(rows) == 4 and len(set(rows.values())) == 1, out  # every variant generated the same tokens
  assert len(re.findall(r"^ratio engine \(paged, decode_steps=4\) / ", out, re.M)) == 3, out
  assert out.count("where a step's time goes") == 2, out


def test_bench_sampler_host_work_and_replicas_lines():
  out = _run("bench_sampler.py", "--host_slots=256,512", "--host_calls=4")
  lines = re.findall(r"^host per decode call at (\d+) slots: ([\d.]+) ms, hidden (\d+)%$", out, re.M)
  assert [n for n, _, _ in lines] == ["256", "512"] and all(0 <= int(h) <= 100 for _, _, h in lines), out
  out = _run("bench_sampler.py", "--replicas=2", "--requests=8", "--mean-len=6", "--slots=8", "--repeats=1",
             "--swap_every=2")
  lines = re.findall(r"^replicas=(\d+): tokens/s (\d+), stall per swap ([\d.]+) s, "
                     r"learner's wait per publish [\d.]+ s$", out, re.M)
  assert [n for n, _, _ in lines] == ["2"] and all(int(t) > 0 for _, t, _ in lines), out


def test_bench_learner_with_torch_peer():
  out = _run("bench_learner.py", "--peer=torch", "--sequences=8", "--max-len=96", "--max-tokens=192", "--steps=1",
             "--short-rows=96")
  for line in ("packed (Alg. 1)", "padded (fixed)", "packed, loglinear", "packed, dense attn", "packed, 96 rows",
               "packed / padded: tokens/s", "loglinear proximal logprobs", "flash / dense attention: step time",
               "rows of 192 / rows of 96 tokens: step time", "packed / torch: tokens/s"):
    assert line in out, (line, out)


def test_bench_learner_host_work_lines():
  """One line per answer count with its micro-batches (more answers, more micro-batches), then the fitted line."""
  out = _run("bench_learner.py", "--host_answers=64,256", "--max-len=512", "--median-len=64", "--max-tokens=1024",
             "--steps=1")
  lines = re.findall(r"^learner host work per step at (\d+) answers \((\d+) tokens, (\d+) micro-batches\): "
                     r"([\d.]+) s$", out, re.M)
  assert [n for n, *_ in lines] == ["64", "256"] and int(lines[0][2]) < int(lines[1][2]), out
  assert re.search(r"^fit: step_s=\S+ \+ micro_batch_s=\S+ x micro-batches \(of 1024 tokens\)$", out, re.M), out


def test_bench_agents_replays_the_recorded_completions():
  out = _run("bench_agents.py", "--episodes=4", "--turns=2", "--max-tokens=4", "--repeats=1")
  rows = re.findall(r"^  (episodes \(recorded\)|same agent, unrecorded|plain requests)\s+(\d+) completions, "
                    r"(\d+) tokens", out, re.M)
  assert [r[0] for r in rows] == ["episodes (recorded)", "same agent, unrecorded", "plain requests"], out
  assert {r[1:] for r in rows} == {("8", "32")}, out  # 4 episodes x 2 turns x 4 tokens
  drawn = re.findall(r"prefill rows, (\d+) tokens drawn$", out, re.M)
  assert len(drawn) == 3 and len(set(drawn)) == 1, out  # the sampler did the same work in each
  assert re.search(r"^recording overhead: [+-]\d+\.\d% time", out, re.M), out
  assert re.search(r"^agents' overhead \(client, routes and recording\): [+-]\d+\.\d% time", out, re.M), out


@pytest.fixture(scope="module")
def calculator_policy_dir(tmp_path_factory):
  """Where the calculator tests keep their warm-started policy: the first to run warm-starts it, the other loads it."""
  return tmp_path_factory.mktemp("calculator_policy")


def test_bench_agents_calculator_keeps_each_episode_on_one_replica(calculator_policy_dir):
  """The calculator agent on 2 replicas, its policy warm-started to call the tool: its episodes are 2 turns or more
  with tool calls in both variants, and tagged, every episode's turns land on one replica."""
  out = _run("bench_agents.py", "--agent=calculator", "--replicas=2", "--episodes=4", "--warm-steps=150",
             f"--policy-dir={calculator_policy_dir}")
  hits = re.findall(r"^  (scattered \(no episode\)|kept \(Request\.episode\))\s+prefix hits ([\d.]+) \(per replica "
                    r"([\d.]+), ([\d.]+)\); (\d+) tokens cached, (\d+) prefilled$", out, re.M)
  assert [h[0] for h in hits] == ["scattered (no episode)", "kept (Request.episode)"], out
  assert all(0 < float(h[1]) < 1 and 0 <= float(h[2]) <= 1 and 0 <= float(h[3]) <= 1 for h in hits), out
  counts = [tuple(map(int, m)) for m in re.findall(
      r"^ +(\d+) episodes: (\d+) turns, (\d+) episodes of 2 or more, (\d+) tool calls, (\d+) solved, (\d+) failed; "
      r"(\d+) episodes' turns all on one replica$", out, re.M)]
  assert len(counts) == 2, out
  for episodes, turns, multi, calls, _, failed, _ in counts:
    assert episodes == 4 and failed == 0 and multi >= 1 and calls >= 1 and turns >= episodes + multi, out
  assert counts[1][6] == 4, out  # tagged: every episode's turns on one replica
  assert re.search(r"^answers drawn alike by both: \d+ of \d+$", out, re.M), out
  assert len(os.listdir(calculator_policy_dir)) == 1, out  # the warm-started policy, kept


def test_bench_agents_calculator_speculation_lines(calculator_policy_dir):
  """The calculator's episodes with speculation off and suffix (1 replica, 2 epochs: the second re-asks the first's
  problems): the lines parse, acceptance lies in [0, 1], a forward emits >= 1 token per slot (exactly 1 off), and
  drafts are accepted."""
  out = _run("bench_agents.py", "--agent=calculator", "--speculation", "--replicas=1", "--episodes=4",
             "--warm-steps=150", "--group=2", "--epochs=2", "--repeats=1", f"--policy-dir={calculator_policy_dir}")
  rows = {v: m for v, *m in re.findall(
      r"^calculator speculation=(off|suffix): tokens (\d+), seconds ([\d.]+), tokens/s (\d+), decode calls (\d+), "
      r"tokens per slot-forward ([\d.]+)(.*)$", out, re.M)}
  assert set(rows) == {"off", "suffix"}, out
  assert all(int(m[0]) > 0 and int(m[2]) > 0 and int(m[3]) > 0 for m in rows.values()), out
  assert rows["off"][4:] == ["1.00", ""], out
  assert float(rows["suffix"][4]) >= 1.0, out  # a forward emits its accepted drafts + 1
  m = re.fullmatch(r", slot-forwards (\d+) \(drafted share ([\d.]+)\), drafted (\d+), accepted (\d+), acceptance "
                   r"([\d.]+), by position ((?:[\d.]+ ?){4}), accepted per slot-forward by position ((?:[\d.]+ ?){4})",
                   rows["suffix"][5])
  assert m, out
  assert 0 < int(m[4]) <= int(m[3]) and 0 <= float(m[5]) <= 1, out  # drafts from the history were accepted
  assert 0 < float(m[2]) <= 1 and all(0 <= float(a) <= 1 for a in m[6].split() + m[7].split()), out
  assert len(re.findall(r"^calculator speculation=(?:off|suffix): 16 episodes: \d+ turns, .* 0 failed$", out,
                        re.M)) == 2, out
  assert re.search(r"^calculator speculation=suffix: acceptance by epoch [\d.]+ of \d+, [\d.]+ of \d+$", out,
                   re.M), out
  assert re.search(r"^calculator ratio suffix / off tokens/s: [\d.]+x$", out, re.M), out


def test_bench_sandbox_times_both_modes():
  out = _run("bench_sandbox.py", "--samples=3")
  assert "bwrap    median" in out and "rlimits  median" in out and "jail / rlimits:" in out


def test_bench_lora_compares_unmerged_merged_and_update_sizes():
  out = _run("bench_lora.py", "--slots=4", "--new-tokens=6", "--repeats=1", "--rank=4")
  rows = dict(re.findall(r"^(unmerged|merged)\s+[\d.]+\s+(\d+)$", out, re.M))
  assert set(rows) == {"unmerged", "merged"}, out
  moved = dict(re.findall(r"^(whole model|adapters \(unmerged sampler\)|adapters, merged on the device)\s+(\d+)", out,
                          re.M))
  assert len(moved) == 3 and int(moved["whole model"]) > 10 * int(moved["adapters (unmerged sampler)"]), out
  assert re.search(r"^ratio whole-model / adapter bytes: [\d.]+x", out, re.M), out


def test_bench_prefix_cache_draws_the_same_answers_with_fewer_tokens_prefilled():
  out = _run("bench_prefix_cache.py", "--episodes=4", "--turns=2", "--system=16", "--question=4", "--answer=12",
             "--tool=4", "--repeats=1")
  assert "answers drawn alike by both: 8 of 8" in out, out
  rows = {m[0]: tuple(map(int, m[1:])) for m in re.findall(
      r"^(prefix cache o(?:ff|n))\s+[\d.]+s\s+[\d.]+s\s+(\d+)\s+(\d+)\s+(\d+)$", out, re.M)}
  off, on = rows["prefix cache off"], rows["prefix cache on"]
  # Turn 2's prompts: 20 + 12 + 4 tokens; turn 1 cached 31 of them (the last answer token is never cached): one
  # full page of 16 for each episode.
  assert off == (8, 4 * 20 + 4 * 36, 0) and on == (8, off[1] - 4 * 16, 4 * 16), out
  assert "ratio off / on (best rounds)" in out, out


def test_bench_prefix_cache_replicas_keeps_episodes_where_their_pages_are():
  """--replicas: both variants' lines parse, per replica; kept on its replica, each episode's second turn finds at
  least the full page of its first turn's prompt (16 + 4 tokens) in the cache."""
  out = _run("bench_prefix_cache.py", "--replicas=2", "--episodes=4", "--turns=2", "--system=16", "--question=4",
             "--answer=12", "--tool=4")
  rows = {m[0]: (float(m[1]), int(m[2]), int(m[3])) for m in re.findall(
      r"^  (scattered \(no episode\)|kept \(Request\.episode\))\s+prefix hits ([\d.]+) \(per replica [\d.]+, [\d.]+\); "
      r"(\d+) tokens cached, (\d+) prefilled; [\d.]+ s$", out, re.M)}
  assert set(rows) == {"scattered (no episode)", "kept (Request.episode)"}, out
  hits, cached, prefilled = rows["kept (Request.episode)"]
  assert cached >= 4 * 16 and hits == pytest.approx(cached / (cached + prefilled), abs=1e-3), out


def test_bench_delta_sync_pulls_whole_and_delta_copies_that_match(tmp_path):
  """The tiny preset in one version after another, pulled by a second process whole and as a delta; the tool fails
  unless both rebuild the published fingerprint. A float32 copy under Adam changes nearly everywhere: its delta goes
  whole."""
  out = _run("bench_delta_sync.py", "--preset=tiny", "--layers=0", "--lrs=1e-3", "--steps=2",
             f"--json={tmp_path}/rows.json")
  rows = json.load(open(tmp_path / "rows.json"))
  assert [r["step"] for r in rows] == [1, 2], out
  for r in rows:
    assert 0.99 < r["changed_fraction"] <= 1 and r["delta_bytes"] <= r["full_bytes"], r
    assert r["full_pull_s"] > 0 and r["delta_pull_s"] > 0
  assert "delta 1.000x the full copy's bytes" in out, out
