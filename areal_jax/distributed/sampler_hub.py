"""The leader's view of the sampler processes: a `Rollout` (rollout.py).

The rollout controller submits prompt groups to it exactly as to an in-process loop, so admission (paper Eq. 3) is
decided in one place for all sampler processes. A group goes whole to the sampler process with the fewest answers
outstanding; `submit` returns one future per answer, completed when the answer arrives (on the reader thread of its
sampler process). `publish` offers a version with `jax.experimental.transfer` and tells every sampler to
pull it; the notice carries the published fingerprint, and the sampler checks its pull against it before the swap.
The messages each way are the typed records of `messages.py` (its diagram), sent under the kind `SAMPLER`.

A sampler process that dies, or reports an error, makes `check()` raise with its name: the run stops and is resumed
from its last checkpoint (prompts in flight are generated again).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent.futures import Future

import numpy as np

from areal_jax import cli, faults
from areal_jax.distributed.control import Peer
from areal_jax.distributed.messages import (SAMPLER, Answer, Bye, Failed, Generate, Pulled, Signalled, Stats, Stop,
                                            Weights)
from areal_jax.distributed.weight_transfer import WeightPublisher
from areal_jax.sampler.loop import end_futures
from areal_jax.sampler.requests import Request

MAX_LIVE_VERSIONS = 2


class SamplerHub:

  def __init__(self, *, peers: dict[int, Peer], publisher: WeightPublisher):
    self.peers = dict(enumerate(peers[k] for k in sorted(peers)))  # sampler index -> peer
    self.publisher = publisher
    self._futures: dict[tuple[int, int], Future] = {}  # (group id, answer) -> its future, until the answer arrives
    self.error: BaseException | None = None
    self.version = -1
    self._outstanding = dict.fromkeys(self.peers, 0)
    self._stats = {i: {} for i in self.peers}
    self._pulls: dict[int, Pulled | None] = dict.fromkeys(self.peers)  # the latest pull each sampler reported
    self._publish_s = 0.0  # the latest publish: staged and offered
    self._part = "all"  # what the latest publish held: "all", or under LoRA (after the first) "adapters"
    self._lock = threading.Lock()
    self._stopping = False
    self._threads = [threading.Thread(target=self._read, args=(i,), name=f"hub-{i}", daemon=True) for i in self.peers]

  def start(self) -> SamplerHub:
    for t in self._threads:
      t.start()
    return self

  def submit(self, request: Request) -> list[Future]:
    self.check()
    futures = [Future() for _ in range(request.num_answers)]
    with self._lock:
      i = min(self._outstanding, key=lambda k: (self._outstanding[k], k))
      self._outstanding[i] += request.num_answers
      self._futures.update({(request.group_id, a): f for a, f in enumerate(futures)})
    self.peers[i].send(SAMPLER, Generate(request))  # held there until it generates from request.min_version
    return futures

  def publish(self, params, version: int) -> None:
    """Offers the learner's local copy `params` as `version`; samplers pull it and swap it in between two decode
    steps."""
    start = time.perf_counter()
    part = "adapters" if self.version >= 0 and "adapters" in self.publisher.parts else "all"
    staged = self.publisher.stage(params, part)
    faults.reach("weight_update")
    self._offer(staged, version, part)
    self._publish_s, self._part = time.perf_counter() - start, part

  def _offer(self, staged, version: int, part: str) -> None:
    """Offers `staged` (from `publisher.stage`) as `version`.

    Waits while `MAX_LIVE_VERSIONS` earlier versions are still being pulled: each holds a copy of the weights on the
    learner's device, so a sampler that pulls slower than the learner steps must not pile them up.
    """
    self.check()
    while not self.publisher.wait_live_below(MAX_LIVE_VERSIONS, timeout=1.0):
      self.check()  # a sampler that died never pulls
    uuids, fp = self.publisher.offer(staged, version, list(self.peers))
    for i, peer in self.peers.items():
      peer.send(SAMPLER, Weights(version=version, uuid=uuids[i], address=self.publisher.address, fingerprint=fp,
                                 part=part))
    self.version = version

  def check(self) -> None:
    if isinstance(self.error, cli.Stopped):
      raise self.error
    if self.error is not None:
      raise RuntimeError(f"sampler process failed: {self.error}") from self.error

  def stats(self) -> dict[str, float]:
    """Counters summed over the sampler processes (tokens, busy_s, running, ...; `version`: the oldest), as
    `SamplerLoop.stats`."""
    with self._lock:
      out: dict[str, float] = {}
      for s in self._stats.values():
        for k, v in s.items():
          out[k] = min(out.get(k, v), v) if k == "version" else out.get(k, 0) + v
      return out

  def sync_metrics(self) -> dict[str, float]:
    """`sync/publish_seconds` of the latest publish; `sync/seconds` (slowest pull) and `sync/mb_per_s` (mean) of the
    latest pulls, and the same per sampler."""
    with self._lock:
      pulls = {i: p for i, p in self._pulls.items() if p is not None}
    nbytes = self.publisher.nbytes(self._part)
    if not pulls:
      return {"sync/publish_seconds": self._publish_s, "sync/bytes": float(nbytes)}
    mb = nbytes / 1e6
    out = {"sync/publish_seconds": self._publish_s, "sync/bytes": float(nbytes),
           "sync/seconds": max(p.seconds for p in pulls.values()),
           "sync/mb_per_s": float(np.mean([mb / max(p.seconds, 1e-9) for p in pulls.values()])),
           "sync/version_lag": float(self.version - min(p.version for p in pulls.values()))}
    for i, p in pulls.items():
      out[f"sync/sampler{i}/seconds"] = p.seconds
      out[f"sync/sampler{i}/mb_per_s"] = mb / max(p.seconds, 1e-9)
    return out

  def stop(self, timeout_s: float = 120.0) -> None:
    """Tells every sampler to stop and waits for its goodbye (it first finishes a pull in flight, which needs this
    process's transfer server alive)."""
    self._stopping = True
    for peer in self.peers.values():
      try:
        peer.send(SAMPLER, Stop())
      except OSError:
        pass
    for t in self._threads:
      if t.is_alive():
        t.join(timeout_s)
    self._end_futures(None)

  # --- one reader thread per sampler process ----------------------------------------------------------------------

  def _read(self, i: int) -> None:
    peer = self.peers[i]
    try:
      while True:
        kind, msg = peer.recv()
        match msg:
          case Answer(index=answer, trajectory=traj):
            with self._lock:
              self._outstanding[i] -= 1
              future = self._futures.pop((traj.group_id, answer), None)
            if future is not None:  # None: cancelled by stop()
              future.set_result(traj)
          case Stats(counters=counters):
            with self._lock:
              self._stats[i] = counters
          case Pulled():
            self._pulled(i, msg)
          case Failed(traceback=tb):
            raise RuntimeError(f"{peer.name} (process {peer.process_id}) failed:\n{tb}")
          case Bye():
            return
          case Signalled(signum=signum):  # so is the whole job: stop as if this process got it (no traceback)
            logging.warning("%s (process %d) stopped by %s", peer.name, peer.process_id, signal.Signals(signum).name)
            self.error = cli.peer_stopped(signum)
            self._end_futures(self.error)
            return
          case _:
            raise RuntimeError(f"{peer.name} sent an unknown message {kind!r}: {msg!r:.300}")
    except BaseException as e:  # pylint: disable=broad-except  # surfaced by check() and the open futures
      if not self._stopping:
        logging.error("%s", e)
        self.error = e
        self._end_futures(e)

  def _end_futures(self, error: BaseException | None) -> None:
    with self._lock:
      futures, self._futures = list(self._futures.values()), {}
    end_futures(futures, error)

  def _pulled(self, i: int, report: Pulled) -> None:
    """Sampler `i` has pulled (and checked) a version: its published copy can go once every sampler has it."""
    self.publisher.pulled(report.version, i)
    with self._lock:
      self._pulls[i] = report
