"""RewardService: non-blocking scoring in worker processes that survives hung, crashed and hostile work."""

import os
import random
import time
from concurrent.futures import wait

import pytest

from areal_jax.config import load_config
from areal_jax.reward import sandbox
from areal_jax.reward.config import RewardConfig
from areal_jax.reward.service import Failure, RewardService, score_all
from helpers import SLOW_MATH
from hostile_code import jailed_processes
from waiting import wait_until

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "math.py")


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(") ", 1)[1][0] != "Z"
  except FileNotFoundError:
    return False


def _results(futures, timeout=60.0):
  """item id -> result, waiting at most `timeout` seconds in all."""
  done, not_done = wait(futures, timeout=timeout)
  assert not not_done, f"{len(not_done)} of {len(futures)} items not scored within {timeout} s"
  return {f.result().item_id: f.result() for f in done}


def test_scores_math_and_code_without_blocking():
  with RewardService(num_workers=2, timeout_s=5.0) as service:
    t0 = time.monotonic()
    futures = [service.submit(("m", i), "math", rf"\boxed{{{i}}}", str(i if i % 2 else i + 1)) for i in range(40)]
    futures.append(service.submit("code", "code", "```python\nprint(sum(map(int, input().split())))\n```",
                                  {"inputs": ["2 3\n"], "outputs": ["5\n"]}))
    futures.append(service.submit("kind", "poetry", "roses", "red"))
    assert time.monotonic() - t0 < 0.5  # submit never waits for a worker
    assert not all(f.done() for f in futures) and service.pending > 0
    results = _results(futures)
    assert all(results[("m", i)].reward == float(i % 2 == 1) for i in range(40))
    assert results["code"].reward == 1.0 and results["code"].reason == "all 1 tests passed"
    assert results["kind"].reward == 0.0 and "unknown reward kind 'poetry'" in results["kind"].reason
    assert all(r.latency_s >= r.run_s >= 0 for r in results.values())
    assert service.stats() == {"submitted": 42, "finished": 42, "timeouts": 0, "crashes": 0, "restarts": 0}
    assert service.pending == 0 and service.healthy
    pids = service.worker_pids()
  assert not any(_alive(p) for p in pids)


def adversarial_completions(n: int, seed: int = 0) -> list[tuple[str, str]]:
  """Power towers, thousands of nested braces, megabyte strings, unbalanced LaTeX, then random LaTeX soup."""
  mb = 1 << 20
  fixed = [
      r"\boxed{9^{9^{9^{9}}}}", r"\boxed{2^{2^{2^{2^{2^{2}}}}}}", r"\boxed{10^{10^{10}}}", r"\boxed{(10^{10})^{10^{10}}}",
      r"\boxed{9^9^9^9}", r"\boxed{10^{100000000}}", r"\boxed{999999999!}", r"\boxed{x^{x^{x^{x}}}}",
      r"\boxed{(10^{99999})^{99999}}", r"\boxed{(9999!)!}", r"\boxed{\binom{100000}{50000}}", r"\boxed{1e999999}",
      "\\boxed{" + "{" * 4000 + "1" + "}" * 4000 + "}", "\\boxed{" + "\\frac{" * 2000 + "1" + "}{2}" * 2000 + "}",
      "\\boxed{" + "(" * 4000 + "1" + ")" * 4000 + "}", "\\boxed{" + "\\sqrt{" * 3000 + "2" + "}" * 3000 + "}",
      "{" * 4000 + r"\boxed{1}", "\\boxed{" * 4000 + "1",
      "7" * mb + r"\boxed{7}", "\\boxed{" + "1" * mb + "}", "x" * mb, "The final answer is " + "9" * mb,
      "\\boxed{" + "a+" * (mb // 2) + "}", r"\boxed{1}" * (mb // 9),
      r"\boxed{\frac{1}{2", r"\boxed{\left( 1, 2 }", r"$\boxed{1}", "\\\\" * 1000, r"\boxed{\begin{pmatrix} 1 & 2}",
      r"\boxed{\sqrt[}", r"\boxed{^^^^^}", r"\boxed{\frac{}{}}", r"\boxed{}}}}}{{{{}", r"\boxed{\left(\right]}",
      "\\boxed{" + "1&" * 400 + "}", r"\boxed{\sum_{n=1}^{10^{9}} n}", r"\boxed{\int_0^1 x^{1000} dx}",
      "\\boxed{" + "9" * 900 + "}", r"\boxed{\infty^{\infty}}", r"\boxed{\lim_{x\to 0} \frac{\sin x}{x}}",
  ]
  rng = random.Random(seed)
  alphabet = list("0123456789+-*/^_{}()[]=,.\\ $xyz!") + [
      r"\frac", r"\sqrt", r"\left(", r"\right)", r"\cdot", r"\pi", r"\infty", r"\text{", r"\begin{matrix}", "&", "^{"]
  items = []
  for i in range(n):
    if i < len(fixed):
      completion = fixed[i]
    else:
      body = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 120)))
      completion = "\\boxed{" + body + rng.choice(["}", "}}", "", "}" * body.count("{")])
    items.append((completion, rng.choice(["5", r"\frac{1}{2}", "#### 72", "x=3", "(1,2]"])))
  return items


def test_1000_adversarial_completions_finish_in_time_and_service_stays_healthy():
  items = adversarial_completions(1000)
  timeout_s = 5.0  # the default; workers' soft budget is 3 s
  t0 = time.monotonic()
  with RewardService(num_workers=2, timeout_s=timeout_s) as service:
    futures = [service.submit(i, "math", completion, reference) for i, (completion, reference) in enumerate(items)]
    results = _results(futures, timeout=120)
    wall = time.monotonic() - t0
    assert service.healthy
    stats = service.stats()  # no item needed a kill: the screen or the workers' soft timeout ended each one
    assert stats == {"submitted": 1000, "finished": 1000, "timeouts": 0, "crashes": 0, "restarts": 0}, stats
    worst = max(results.values(), key=lambda r: r.run_s)
    assert worst.run_s < timeout_s, worst
    wrongly_rewarded = [(r.item_id, items[r.item_id][0][:60], items[r.item_id][1], r.reward, r.run_s)
                        for r in results.values() if r.item_id < 40 and r.reward != 0.0]
    assert not wrongly_rewarded, wrongly_rewarded  # (item, completion head, reference, reward, seconds)
    # still scoring correctly afterwards
    assert service.submit("after", "math", r"The answer is \boxed{\frac{3}{4}}.", "0.75").result(10).reward == 1.0
  assert wall < 90, f"1000 adversarial items took {wall:.1f} s"


def test_hung_item_times_out_and_worker_is_replaced():
  hang = "```python\nimport time\ntime.sleep(600)\n```"
  limits = sandbox.Limits(wall_s=60, cpu_s=60)
  with RewardService(num_workers=2, timeout_s=1.0, soft_timeout_s=60, code_limits=limits) as service:
    service.wait_ready()
    pids = set(service.worker_pids())
    futures = [service.submit("slow-math", "math", SLOW_MATH, "5"),
               service.submit("hung-code", "code", hang, {"inputs": [""], "outputs": ["1"]})]
    wait_until(jailed_processes, timeout_s=30, what="the hung program running in its sandbox")
    t0 = time.monotonic()
    results = _results(futures, timeout=10)
    assert time.monotonic() - t0 < 3.0
    for r in results.values():
      assert r.reward == 0.0 and r.reason == "timed out after 1.0 s" and r.failure is Failure.TIMED_OUT, r
      assert 1.0 <= r.run_s < 2.0
    assert service.stats()["timeouts"] == 2 and service.stats()["restarts"] == 2
    assert not pids & set(service.worker_pids())
    assert not any(_alive(p) for p in pids)
    assert jailed_processes() == []  # the sandboxed program died with its worker
    assert service.submit("next", "math", r"\boxed{2}", "2").result(30).reward == 1.0
    assert service.healthy


def test_crashed_worker_scores_zero_and_pool_recovers():
  with RewardService(num_workers=1, timeout_s=30.0, soft_timeout_s=30) as service:
    service.wait_ready()
    futures = [service.submit("victim", "math", SLOW_MATH, "5"), service.submit("queued", "math", r"\boxed{4}", "4")]
    wait_until(lambda: service.in_flight() == ["victim"], what="the victim on the worker")
    os.kill(service.worker_pids()[0], 9)
    results = _results(futures, timeout=30)
    assert results["victim"].reward == 0.0 and results["victim"].reason == "worker crashed (exit code -9)"
    assert results["victim"].failure is Failure.CRASHED and results["queued"].failure is None
    assert results["queued"].reward == 1.0  # waited in the queue, then went to the replacement
    assert service.stats()["crashes"] == 1 and service.healthy


def test_futures_callbacks_and_close_finishes_pending():
  seen = []
  service = RewardService(num_workers=1, timeout_s=30.0, soft_timeout_s=30)
  service.submit("fast", "math", r"\boxed{1}", "1").add_done_callback(lambda f: seen.append(f.result()))
  assert score_all(service, [("math", r"\boxed{2}", "2"), ("math", "no", "3")]) == [1.0, 0.0]
  assert [r.item_id for r in seen] == ["fast"]  # on the dispatcher thread, before the later items
  futures = [service.submit("slow", "math", SLOW_MATH, "5"), service.submit("waiting", "math", r"\boxed{1}", "1")]
  wait_until(lambda: service.in_flight() == ["slow"], what="the slow item on the worker")
  assert service.pending == 2
  pid = service.worker_pids()[0]
  service.close()
  assert {f.result(0).item_id: f.result(0).reason for f in futures} == {"slow": "service closed",
                                                                         "waiting": "service closed"}
  assert all(f.result(0).failure is Failure.CLOSED and not Failure.CLOSED.of_worker for f in futures)
  assert not _alive(pid)
  with pytest.raises(RuntimeError, match="after close"):
    service.submit("late", "math", "1", "1")


def test_workers_that_cannot_start_break_the_service_loudly():
  service = RewardService(num_workers=1, timeout_s=5.0, memory_mb=32)  # too little to import sympy
  r = service.submit("doomed", "math", r"\boxed{1}", "1").result(60)
  assert r.reward == 0.0 and "died while starting" in r.reason
  assert not service.healthy
  with pytest.raises(RuntimeError, match="broken"):
    service.submit("again", "math", r"\boxed{1}", "1")
  service.close()


def test_from_config():
  reward = RewardConfig.from_config(load_config(CONFIG).reward)
  with RewardService.from_config(reward) as service:
    assert service.num_workers == reward.num_workers and service.timeout_s == reward.timeout_s
    assert service.submit(0, "math", r"\boxed{3}", "3").result(30).reward == 1.0
