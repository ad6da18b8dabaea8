"""Typed control messages between the leader and the other processes: records `wire.py` sends field by field.

Each side sends them under one kind (`LEARNER`, `SAMPLER`) and matches them by type; anything else it receives is an
error naming it.

    leader                                          learner process k > 0 (a follower; learner_group.py)
      Start(checkpoint)               ──────►       checks it resumes the same checkpoint
      TrainStep(step, trajectories)   ──────►       the same train step on its shards (SPMD), then the weight copy
      Save(step, force)               ──────►       its shards of the checkpoint
      Stop()                          ──────►       returns

    leader (sampler_hub.py)                         sampler process i (sampler_process.py)
      Weights(version, uuid, ...)     ──────►       pulls, checks the fingerprint, swaps between two decode steps
      Generate(request)               ──────►       generates the group's answers
      Stop()                          ──────►       finishes a pull in flight, says Bye, exits
      Dropped(why)                    ──────►       (its last word to one silent too long) connects again
                                      ◄──────       Answer(index, trajectory)   one finished answer
                                      ◄──────       Pulled(version, seconds)
                                      ◄──────       Stats(counters)             once a second: its heartbeat
                                      ◄──────       Failed(traceback)           it stops; the leader drops it
                                      ◄──────       Leaving(signum)             preempted: the leader drops it
                                      ◄──────       Bye()                       the answer to Stop

A sampler process may connect at any time (a restart, or one more): the leader's first message to it is the current
`Weights`. One that leaves, dies or falls silent is dropped, and its groups in flight are generated again elsewhere
(`sampler_hub.py`); one dropped for silence that was only slow or stopped reads `Dropped` when it resumes, and
connects again with its engine as it is.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from areal_jax.sampler.requests import Request
from areal_jax.types import Trajectory

LEARNER = "learner"  # the kind the learner processes' records travel under
SAMPLER = "sampler"  # the kind the sampler processes' records travel under

# --- learner processes ---------------------------------------------------------------------------------------------


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
  """To a learner follower or a sampler process: finish and return."""


# --- sampler processes: leader to sampler --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Weights:
  """A published version to pull: `uuid` from the transfer server at `address`, checked against `fingerprint`."""

  version: int
  uuid: int
  address: str
  fingerprint: np.ndarray  # per leaf, as `weight_transfer.fingerprint`, of the whole version
  part: str = "all"  # "all", or under LoRA (after the first) "adapters"
  base: int = -1  # >= 0: a delta against this version of `part` (the sampler's latest), with `codes`; -1: whole
  codes: tuple[int, ...] = ()  # per leaf, as `weight_delta.plan`


@dataclasses.dataclass(frozen=True)
class Dropped:
  """To a sampler that sent nothing for the heartbeat limit: its groups went elsewhere; it may connect again."""

  why: str


@dataclasses.dataclass(frozen=True)
class Generate:
  request: Request  # generated from request.min_version or newer


# --- sampler processes: sampler to leader --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Answer:
  index: int  # which answer of the group (the trajectory names the group)
  trajectory: Trajectory


@dataclasses.dataclass(frozen=True)
class Pulled:
  version: int
  seconds: float
  nbytes: int = 0  # what the pull moved


@dataclasses.dataclass(frozen=True)
class Stats:
  counters: dict[str, float]  # `Sampler.stats()`


@dataclasses.dataclass(frozen=True)
class Failed:
  traceback: str


@dataclasses.dataclass(frozen=True)
class Leaving:
  signum: int  # the signal that stopped the sampler process (a preemption): it leaves, the job goes on


@dataclasses.dataclass(frozen=True)
class Bye:
  pass


RECORDS = (Start, TrainStep, Save, Stop, Weights, Dropped, Generate, Answer, Pulled, Stats, Failed, Leaving, Bye)
