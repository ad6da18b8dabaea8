"""Fault injection for `tools/chaos.py` and the fault tests. Unset, every hook here is a no-op.

`AREAL_KILL_AT=phase:n`: the n-th time this process reaches `phase` it SIGKILLs its whole process group (reward
workers included), as a preempted machine dies mid-operation; start the job in its own session, as `tools/chaos.py`
does. Phases, each reached once per occurrence: `generation` (a sampler scheduler step), `learner_step` (after the
step's proximal passes are dispatched, before its updates), `weight_update` (new weights on the sampler's devices, not
yet handed to it), `checkpoint_write` (an asynchronous checkpoint save in flight), `evaluation` (requests submitted,
answers not yet drawn).

`AREAL_FAULT=kind:n[,kind:n...]`: faults the run must survive or stop on cleanly:
- `nan_grads:n`: the gradients of the n-th learner step of this process are NaN;
- `reward_crash:n`: the reward worker given every n-th answer the reward service dispatches exits instead of answering;
- `reward_hang:n`: the reward worker given every n-th answer never answers it (the service's timeout ends it).
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import threading
import time

PHASES = ("generation", "learner_step", "weight_update", "checkpoint_write", "evaluation")
ENV = "AREAL_KILL_AT"
FAULT_ENV = "AREAL_FAULT"
FAULTS = {"nan_grads": "once", "reward_crash": "every", "reward_hang": "every"}  # kind -> fires at n, or every n

_counts: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()


def parse(spec: str) -> tuple[str, int]:
  """"checkpoint_write:2" -> ("checkpoint_write", 2); raises ValueError naming the variable."""
  phase, _, n = spec.partition(":")
  if phase not in PHASES or not n.isdigit() or int(n) < 1:
    raise ValueError(f"{ENV}={spec!r}: expected PHASE:N with PHASE in {PHASES} and N >= 1")
  return phase, int(n)


def parse_faults(spec: str) -> dict[str, int]:
  """"nan_grads:3,reward_hang:10" -> {"nan_grads": 3, "reward_hang": 10}; raises ValueError naming the variable."""
  out = {}
  for part in filter(None, spec.split(",")):
    kind, _, n = part.partition(":")
    if kind not in FAULTS or not n.isdigit() or int(n) < 1:
      raise ValueError(f"{FAULT_ENV}={spec!r}: expected KIND:N[,KIND:N...] with KIND in {tuple(FAULTS)} and N >= 1")
    out[kind] = int(n)
  return out


def _count(key: str) -> int:
  with _lock:
    _counts[key] += 1
    return _counts[key]


def reach(phase: str) -> None:
  spec = os.environ.get(ENV)
  if not spec:
    return
  target, n = parse(spec)
  if phase != target or _count(phase) != n:
    return
  sys.stderr.write(f"\n{ENV}: SIGKILL at {phase} #{n}\n")
  sys.stderr.flush()
  os.killpg(os.getpgrp(), signal.SIGKILL)


def hit(kind: str, count: int | None = None) -> bool:
  """True when `AREAL_FAULT` says this occurrence of `kind` fails: the `count`-th (1-based), or else the next one
  counted in this process."""
  spec = os.environ.get(FAULT_ENV)
  if not spec:
    return False
  n = parse_faults(spec).get(kind)
  if n is None:
    return False
  count = _count(kind) if count is None else count
  return count == n if FAULTS[kind] == "once" else count % n == 0


def reward_worker_item(seq: int) -> None:
  """In a reward worker, before it scores the service's answer number `seq` (0-based, counted across workers):
  crashes or hangs as `AREAL_FAULT` says."""
  crash, hang = hit("reward_crash", seq + 1), hit("reward_hang", seq + 1)
  if crash:
    sys.stderr.write(f"\n{FAULT_ENV}: reward worker {os.getpid()} crashes\n")
    os._exit(3)  # pylint: disable=protected-access
  if hang:
    while True:
      time.sleep(60)
