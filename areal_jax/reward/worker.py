"""A reward worker process: `python -m areal_jax.reward.worker FD MEMORY_MB` serves one RewardService over socket FD.

Protocol (pickled objects, `multiprocessing.connection` framing): the worker caps its address space at MEMORY_MB
(0: no cap), imports math-verify and sympy and warms them up (about a second), and sends `("ready",)`; then, for each
`(seq, kind, completion, reference, budget_s, code_limits)` it receives, it answers `(seq, reward, reason, run_s)`.
`None` or a closed socket ends it.
"""

from __future__ import annotations

import importlib
import multiprocessing.connection
import resource
import signal
import sys
import time
from typing import Any

from areal_jax import faults

KINDS = ("math", "code")


def score(kind: str, completion: str, reference: Any, *, budget_s: float | None = None,
          code_limits=None) -> tuple[float, str]:
  """Scores one item in this process: (reward, reason)."""
  from areal_jax.reward import code as code_reward  # pylint: disable=g-import-not-at-top
  from areal_jax.reward import math as math_reward  # pylint: disable=g-import-not-at-top
  from areal_jax.reward import sandbox  # pylint: disable=g-import-not-at-top

  if kind == "math":
    ok, why = math_reward.check_math(completion, reference, timeout_s=budget_s)
  elif kind == "code":
    ok, why = code_reward.check_code(completion, reference, limits=code_limits or sandbox.Limits(),
                                     time_budget_s=budget_s)
  else:
    return 0.0, f"unknown reward kind {kind!r}; choose one of {KINDS}"
  return float(ok), why


def serve(conn: multiprocessing.connection.Connection) -> None:
  for module in ("math_verify", "areal_jax.reward.math", "areal_jax.reward.code"):
    importlib.import_module(module)
  score("math", r"\boxed{\frac{x^2-1}{x-1}}", "x+1")  # sympy's first simplify is slow: pay it before "ready"
  conn.send(("ready",))
  while True:
    try:
      msg = conn.recv()
    except (EOFError, OSError):
      return
    if msg is None:
      return
    seq, kind, completion, reference, budget_s, code_limits = msg
    faults.reward_worker_item(seq)
    t0 = time.perf_counter()
    try:
      reward, reason = score(kind, completion, reference, budget_s=budget_s, code_limits=code_limits)
    except Exception as e:  # pylint: disable=broad-except  (a bad item must not take the worker down)
      reward, reason = 0.0, f"{type(e).__name__}: {e}"[:300]
    conn.send((seq, reward, reason, time.perf_counter() - t0))


def main(argv: list[str]) -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service decides when workers stop
  fd, memory_mb = int(argv[1]), int(argv[2])
  if memory_mb:
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
  serve(multiprocessing.connection.Connection(fd))


if __name__ == "__main__":
  main(sys.argv)
