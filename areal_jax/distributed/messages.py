"""Typed control messages of the learner processes (`learner_group.py`): records `wire.py` sends field by field.

    leader                                          learner process k > 0 (a follower)
      Start(checkpoint)               ──────►       checks it resumes the same checkpoint
      TrainStep(step, trajectories)   ──────►       the same train step on its shards (SPMD), then the weight copy
      Save(step, force)               ──────►       its shards of the checkpoint
      Stop()                          ──────►       returns
"""

from __future__ import annotations

import dataclasses

from areal_jax.types import Trajectory


@dataclasses.dataclass(frozen=True)
class Start:
  checkpoint: int | None  # the step the leader resumes, or None


@dataclasses.dataclass(frozen=True)
class TrainStep:
  step: int  # the step it makes
  trajectories: tuple[Trajectory, ...] = ()


@dataclasses.dataclass(frozen=True)
class Save:
  step: int
  force: bool = False


@dataclasses.dataclass(frozen=True)
class Stop:
  pass


RECORDS = (Start, TrainStep, Save, Stop)
