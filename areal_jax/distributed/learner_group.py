"""The learner processes as one learner: the leader's loop is the same for 1 or N of them.

    group = LearnerGroup(learner, followers)   # followers: {} in one process
    stats = group.train_step(step, trajectories)
    local = group.publish()                     # the new weights on this process's devices (for the samplers)
    group.save(checkpointer, step, meta=...)    # every process saves its shards
    group.stop()

Every call that runs a program over the learner mesh is SPMD across the learner processes: the leader sends each one
to the followers (a typed record over the control connection) before making it itself, and each follower
(`follow`) makes the same calls in the same order on its shards. A follower whose connection ends before `stop` is a
dead learner process the leader may be waiting for inside a collective it cannot leave: the leader's watcher exits
the process (a restart resumes from the last checkpoint).
"""

from __future__ import annotations

import logging
import os
import threading

from areal_jax.checkpoint.store import CheckpointMeta, Checkpointer
from areal_jax.distributed.control import Peer
from areal_jax.distributed.messages import LEARNER, Save, Start, Stop, TrainStep
from areal_jax.distributed.weight_transfer import local_copy
from areal_jax.learner.learner import Learner
from areal_jax.types import Trajectory


class LearnerGroup:
  """The leader's side; see the module docstring."""

  def __init__(self, learner: Learner, followers: dict[int, Peer]):
    self.learner, self.followers = learner, followers
    self._done = threading.Event()
    for peer in followers.values():
      threading.Thread(target=self._watch, args=(peer,), name=f"watch-{peer.name}", daemon=True).start()

  def _send(self, record) -> None:
    for peer in self.followers.values():
      peer.send(LEARNER, record)

  def train_step(self, step: int, trajectories: list[Trajectory]) -> dict[str, float]:
    """Learner step `step` (one PPO update of every learner process); publish its weights next."""
    self._send(TrainStep(step=step, trajectories=tuple(trajectories)))
    return self.learner.train_step(trajectories)

  def publish(self):
    """The learner's weights (version `learner.version`) copied onto this process's learner devices, what the
    samplers take; a collective across learner processes (each follower copies after its step)."""
    return local_copy(self.learner.params, self.learner.mesh)

  def save(self, ckpt: Checkpointer, step: int, *, meta: CheckpointMeta, force: bool = False) -> bool:
    """Step `step`'s checkpoint on its schedule (or `force`d), every process its shards; the leader's `meta`."""
    self._send(Save(step=step, force=force))
    return self.learner.save(ckpt, step, meta=meta, force=force)

  def stop(self) -> None:
    """Best effort: a follower whose connection is gone is skipped."""
    self._done.set()
    for peer in self.followers.values():
      try:
        peer.send(LEARNER, Stop())
      except OSError:
        pass

  def _watch(self, peer: Peer) -> None:
    """Followers send nothing: a message here means the connection ended."""
    try:
      peer.recv()
    except ConnectionError as e:
      if not self._done.is_set():
        logging.error("%s; stopping (a restart resumes from the last checkpoint)", e)
        for handler in logging.getLogger().handlers:
          handler.flush()
        os._exit(1)  # pylint: disable=protected-access


def agree_on_start(latest: int | None, *, followers: dict[int, Peer] | None = None, leader: Peer | None = None,
                   where: str = "") -> None:
  """Learner processes check that they resume the same checkpoint (a workdir on a disk they do not share would have
  them run different programs and hang in a collective): the leader tells its `followers`, a follower compares."""
  if leader is not None:
    _, start = leader.recv()
    if not isinstance(start, Start) or start.checkpoint != latest:
      raise RuntimeError(f"{leader.name}: the leader starts from checkpoint {getattr(start, 'checkpoint', start)}, "
                         f"this process found {latest} in {where}; every learner process must see the same workdir")
  for peer in (followers or {}).values():
    peer.send(LEARNER, Start(checkpoint=latest))


def follow(leader: Peer, learner: Learner, ckpt: Checkpointer) -> None:
  """A learner process other than the leader: the leader's train steps, publications and saves, on its shards."""
  local_copy(learner.params, learner.mesh)  # the initial publication
  while True:
    _, record = leader.recv()
    match record:
      case Stop():
        return
      case TrainStep():
        learner.train_step(list(record.trajectories))
        local_copy(learner.params, learner.mesh)
        step, force = record.step, False
      case Save():
        step, force = record.step, record.force
      case _:
        raise RuntimeError(f"learner follower: unknown message {record!r}")
    learner.save(ckpt, step, meta=CheckpointMeta(step=step), force=force)  # only the primary process writes it
