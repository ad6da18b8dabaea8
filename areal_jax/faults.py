"""Fault injection for `tools/chaos.py`: with `AREAL_KILL_AT=phase:n` set, the n-th time this process reaches
`phase` it SIGKILLs its whole process group (reward workers included), as a preempted machine dies mid-operation;
start the job in its own session, as `tools/chaos.py` does. Unset, `reach` is a no-op.

Phases, each reached once per occurrence: `generation` (a sampler scheduler step), `learner_step` (after the step's
proximal passes are dispatched, before its updates), `weight_update` (new weights on the sampler's devices, not yet
handed to it), `checkpoint_write` (an asynchronous checkpoint save in flight), `evaluation` (requests submitted,
answers not yet drawn).
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import threading

PHASES = ("generation", "learner_step", "weight_update", "checkpoint_write", "evaluation")
ENV = "AREAL_KILL_AT"

_counts: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()


def parse(spec: str) -> tuple[str, int]:
  """"checkpoint_write:2" -> ("checkpoint_write", 2); raises ValueError naming the variable."""
  phase, _, n = spec.partition(":")
  if phase not in PHASES or not n.isdigit() or int(n) < 1:
    raise ValueError(f"{ENV}={spec!r}: expected PHASE:N with PHASE in {PHASES} and N >= 1")
  return phase, int(n)


def reach(phase: str) -> None:
  spec = os.environ.get(ENV)
  if not spec:
    return
  target, n = parse(spec)
  if phase != target:
    return
  with _lock:
    _counts[phase] += 1
    if _counts[phase] != n:
      return
  sys.stderr.write(f"\n{ENV}: SIGKILL at {phase} #{n}\n")
  sys.stderr.flush()
  os.killpg(os.getpgrp(), signal.SIGKILL)
