"""The leader's view of the sampler processes: a `Rollout` (rollout.py) over samplers that come and go.

The rollout controller submits prompt groups to it exactly as to an in-process loop, so admission (paper Eq. 3) is
decided in one place for all sampler processes. A group goes whole to the live sampler with the fewest answers
outstanding (with none live it waits here for one); `submit` returns one future per answer, completed when the
answer arrives (on the reader thread of its sampler). `publish` offers a version with `jax.experimental.transfer` and
tells every live sampler to pull it; the notice carries the published fingerprint, and the sampler checks its pull
against it before the swap. The messages each way are the typed records of `messages.py` (its diagram).

Samplers are elastic; learners are not:

- **leave**: a sampler whose connection ends (it died), that reports a failure, that is preempted (a signal: it says
  `Leaving`), or that sends nothing for `heartbeat_s` (hung, or cut off: it sends `Stats` every second; it is told
  `Dropped`, and if it resumes it connects again as a joiner, without restarting) is dropped.
  The answers it still owed fail with `SamplerLost`, and the controller generates their groups again, admitted anew
  (so no prompt is lost, none is trained twice, and staleness counts from the new admission). Versions it had still
  to pull are released.
- **join**: a sampler process that connects while the job runs (a restart, or one more: `ControlServer.on_sampler`)
  is sent the current weights (the whole model) and takes work from then on; groups that waited for a sampler go to
  it. Once its loop runs (its first `Stats` with counters) it is sent the newest version published since, and every
  publish after that: the learner never waits for a sampler that is still starting.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from concurrent.futures import Future

import numpy as np

from areal_jax import faults
from areal_jax.distributed.control import Peer
from areal_jax.distributed.messages import (SAMPLER, Answer, Bye, Dropped, Failed, Generate, Leaving, Pulled, Stats,
                                            Stop, Weights)
from areal_jax.distributed.weight_transfer import WeightPublisher
from areal_jax.errors import SamplerLost
from areal_jax.sampler.loop import end_futures
from areal_jax.sampler.requests import Request

MAX_LIVE_VERSIONS = 2
# Counters that only grow: a sampler that leaves keeps its share in the sums (`stats`), so rates never go back.
CUMULATIVE = ("tokens", "decode_steps", "prefill_rows", "prefill_tokens", "cached_tokens", "recomputed", "busy_s")
WAIT_WARNING_S = 60.0  # with no sampler live: how often to say so


@dataclasses.dataclass(eq=False)
class _Sampler:
  """A live sampler process, as the hub tracks it."""

  peer: Peer
  heard: float  # time.monotonic() of its latest message
  groups: dict[int, int] = dataclasses.field(default_factory=dict)  # group id -> answers still to come
  stats: dict = dataclasses.field(default_factory=dict)
  pull: Pulled | None = None  # the latest pull it reported
  # Joined while the job ran: the version it was sent then, until its loop runs (`_catch_up`). Until then it is not
  # offered new versions, so a sampler still starting (process start, first pull, loop) never holds the learner back.
  catching_up: int | None = None

  @property
  def key(self) -> str:  # "sampler0": the metrics' name for it
    return self.peer.name.replace(" ", "")


class SamplerHub:
  """See the module docstring. `peers`: the sampler processes connected at the start (process id -> peer)."""

  def __init__(self, *, peers: dict[int, Peer], publisher: WeightPublisher | None, heartbeat_s: float = 30.0):
    self.publisher, self.heartbeat_s = publisher, heartbeat_s
    now = time.monotonic()
    self._live = {pid: _Sampler(peer, now) for pid, peer in peers.items()}
    self._futures: dict[tuple[int, int], Future] = {}  # (group id, answer) -> its future, until the answer arrives
    self._waiting: list[Request] = []  # submitted while no sampler was live
    self.error: BaseException | None = None
    self.version = -1
    # For samplers that join: the latest published copy of each part (version, staged): the whole model, and under
    # LoRA the latest adapters (the learner's own arrays cannot be kept: its train step donates them).
    self._kept: dict[str, tuple[int, object]] = {}
    self._publish_s = 0.0  # the latest publish: staged and offered
    self._part = "all"  # what the latest publish held: "all", or under LoRA (after the first) "adapters"
    self.joined = self.lost = 0
    self._retired = dict.fromkeys(CUMULATIVE, 0.0)  # the counters of samplers that left
    self._none_since: float | None = None  # since when no sampler has been live
    self._none_s = 0.0  # seconds without a live sampler before that
    self._lock = threading.Lock()  # membership, futures, counters
    self._publishing = threading.RLock()  # one publish or join offer at a time: each sampler sees versions in order
    self._stopping = threading.Event()
    self._threads = [threading.Thread(target=self._watch, name="hub-heartbeat", daemon=True)]

  def start(self) -> SamplerHub:
    self._threads[0].start()
    for pid, s in self._live.items():
      self._read_in_background(pid, s)
    return self

  # --- the Rollout protocol -----------------------------------------------------------------------------------------

  def submit(self, request: Request) -> list[Future]:
    self.check()
    futures = [Future() for _ in range(request.num_answers)]
    with self._lock:
      self._futures.update({(request.group_id, a): f for a, f in enumerate(futures)})
      target = self._assign(request)
    if target is not None:
      self._send_work(*target, request)
    return futures

  def publish(self, params, version: int) -> None:
    """Offers the learner's local copy `params` as `version`; samplers pull it and swap it in between two decode
    steps."""
    start = time.perf_counter()
    with self._publishing:
      part = "adapters" if self.version >= 0 and "adapters" in self.publisher.parts else "all"
      staged = self.publisher.stage(params, part)
      faults.reach("weight_update")
      self._offer(staged, version, part)
      self._kept[part] = (version, staged)
    self._publish_s, self._part = time.perf_counter() - start, part

  def check(self) -> None:
    if self.error is not None:
      raise RuntimeError(f"sampler hub failed: {self.error}") from self.error

  def stats(self) -> dict[str, float]:
    """Counters summed over the sampler processes (tokens, busy_s, ..., those that left included; running, waiting:
    the live ones'; `version`: the oldest live one's), as `SamplerLoop.stats`."""
    with self._lock:
      out: dict[str, float] = {k: v for k, v in self._retired.items() if v}
      for s in self._live.values():
        for k, v in s.stats.items():
          out[k] = min(out.get(k, v), v) if k == "version" else out.get(k, 0) + v
      return out

  def sampler_metrics(self) -> dict[str, float]:
    """`samplers/live` now; `samplers/joined` and `samplers/lost` since the start; `samplers/wait_s`: seconds in all
    with no sampler live (the learner waits for samplers then)."""
    with self._lock:
      none_s = self._none_s + (time.monotonic() - self._none_since if self._none_since is not None else 0.0)
      return {"samplers/live": float(len(self._live)), "samplers/joined": float(self.joined),
              "samplers/lost": float(self.lost), "samplers/wait_s": none_s}

  def sync_metrics(self) -> dict[str, float]:
    """`sync/publish_seconds` of the latest publish; `sync/seconds` (slowest pull) and `sync/mb_per_s` (mean) of the
    live samplers' latest pulls, and the same per sampler."""
    with self._lock:
      pulls = {s.key: s.pull for s in self._live.values() if s.pull is not None}
    nbytes = self.publisher.nbytes(self._part)
    out = {"sync/publish_seconds": self._publish_s, "sync/bytes": float(nbytes)}
    if not pulls:
      return out
    mb = nbytes / 1e6
    out |= {"sync/seconds": max(p.seconds for p in pulls.values()),
            "sync/mb_per_s": float(np.mean([mb / max(p.seconds, 1e-9) for p in pulls.values()])),
            "sync/version_lag": float(self.version - min(p.version for p in pulls.values()))}
    for key, p in pulls.items():
      out[f"sync/{key}/seconds"] = p.seconds
      out[f"sync/{key}/mb_per_s"] = mb / max(p.seconds, 1e-9)
    return out

  def stop(self, timeout_s: float = 120.0) -> None:
    """Tells every sampler to stop and waits for its goodbye (it first finishes a pull in flight, which needs this
    process's transfer server alive)."""
    self._stopping.set()
    with self._lock:
      live = list(self._live.values())
    for s in live:
      try:
        s.peer.send(SAMPLER, Stop())
      except OSError:
        pass
    deadline = time.monotonic() + timeout_s
    for t in self._threads:
      if t.is_alive():
        t.join(max(0.0, deadline - time.monotonic()))
    with self._lock:
      futures, self._futures, self._waiting = list(self._futures.values()), {}, []
    end_futures(futures, None)

  # --- membership ---------------------------------------------------------------------------------------------------

  def join(self, peer: Peer) -> None:
    """A sampler process connected while the job runs (`ControlServer.on_sampler`): it gets the current weights,
    then work, with the groups that waited for a sampler."""
    if self._stopping.is_set():
      peer.close()
      return
    pid = peer.process_id
    with self._lock:
      old = self._live.get(pid)
    if old is not None:
      self._drop(pid, old, f"{peer.name} reconnected (its previous process is gone)")
    s = _Sampler(peer, time.monotonic())
    try:
      with self._publishing:
        for part in [p for p in ("all", "adapters") if p in self._kept]:  # none yet: the first publish reaches it
          s.catching_up = self._offer_kept(pid, s, part)
        with self._lock:
          self._live[pid] = s
          self.joined += 1
          self._some_live()
          waiting, self._waiting = self._waiting, []
          for request in waiting:
            s.groups[request.group_id] = request.num_answers
    except OSError as e:
      logging.warning("%s connected and went at once: %s", peer.name, e)
      self._drop(pid, s, f"{peer.name} went during its join")
      return
    logging.info("%s joined at version %d (%d samplers live; %d waiting groups go to it)", peer.name, self.version,
                 len(self._live), len(waiting))
    self._read_in_background(pid, s)
    for request in waiting:
      self._send_work(pid, s, request)

  def _offer_kept(self, pid: int, s: _Sampler, part: str) -> int:
    """Offers sampler `s` the kept copy of `part` (under `_publishing`); returns its version."""
    version, staged = self._kept[part]
    uuids, fp = self.publisher.offer(staged, version, [pid])
    s.peer.send(SAMPLER, Weights(version=version, uuid=uuids[pid], address=self.publisher.address, fingerprint=fp,
                                 part=part))
    return version

  def _catch_up(self, pid: int, s: _Sampler) -> None:
    """A sampler that joined has its loop running: it is sent the newest version published since its join, and from
    now on every publish. (On its reader thread: while a publish holds the lock, which may wait for this thread to
    read a `Pulled`, it tries again at its next `Stats`.)"""
    if not self._publishing.acquire(blocking=False):
      return
    try:
      version, part = max((v, p) for p, (v, _) in self._kept.items())
      if version > s.catching_up:
        self._offer_kept(pid, s, part)
      s.catching_up = None
    except OSError as e:
      self._drop(pid, s, f"{s.peer.name} cannot be reached ({e})")
    finally:
      self._publishing.release()

  def _drop(self, pid: int, s: _Sampler, why: str, tell: bool = False) -> None:
    """Sampler `s` (process `pid`) is gone (`why`: what happened, a sentence naming it): the answers it owed fail
    with `SamplerLost` (their groups are generated again), what it had to pull is released. With `tell`, its last
    message is `Dropped`: one that was only stopped or slow connects again when it resumes."""
    with self._lock:
      if self._live.get(pid) is not s:
        return  # dropped already, or replaced by a restart
      del self._live[pid]
      self.lost += 1
      for k in CUMULATIVE:
        self._retired[k] += s.stats.get(k, 0.0)
      owed = [k for k in self._futures if k[0] in s.groups]
      futures = [self._futures.pop(k) for k in owed]
      if not self._live and self._none_since is None:
        self._none_since = time.monotonic()
      live = len(self._live)
    if tell:
      s.peer.send_last(SAMPLER, Dropped(why))
    s.peer.close()
    if self.publisher is not None:
      self.publisher.forget(pid)
    logging.warning("%s: dropped; its %d groups in flight are generated again (%d samplers live)", why,
                    len(s.groups), live)
    end_futures(futures, SamplerLost(why))

  def _some_live(self) -> None:
    if self._none_since is not None:
      self._none_s += time.monotonic() - self._none_since
      self._none_since = None

  def _assign(self, request: Request) -> tuple[int, _Sampler] | None:
    """The live sampler with the fewest answers outstanding takes the group (under the lock); None: it waits."""
    if not self._live:
      self._waiting.append(request)
      return None
    pid, s = min(self._live.items(), key=lambda kv: (sum(kv[1].groups.values()), kv[0]))
    s.groups[request.group_id] = request.num_answers
    return pid, s

  def _send_work(self, pid: int, s: _Sampler, request: Request) -> None:
    try:
      s.peer.send(SAMPLER, Generate(request))  # held there until it generates from request.min_version
    except OSError as e:
      self._drop(pid, s, f"{s.peer.name} cannot be reached ({e})")

  def _offer(self, staged, version: int, part: str) -> None:
    """Offers `staged` (from `publisher.stage`) as `version` to the live samplers.

    Waits while `MAX_LIVE_VERSIONS` earlier copies are still being pulled: each holds a copy of the weights on the
    learner's device, so a sampler that pulls slower than the learner steps must not pile them up (one that hangs is
    dropped by the heartbeat, and its pulls released).
    """
    self.check()
    while not self.publisher.wait_live_below(MAX_LIVE_VERSIONS, timeout=1.0):
      self.check()
    with self._lock:
      live = {pid: s for pid, s in self._live.items() if s.catching_up is None}
    uuids, fp = self.publisher.offer(staged, version, list(live))
    for pid, s in live.items():
      try:
        s.peer.send(SAMPLER, Weights(version=version, uuid=uuids[pid], address=self.publisher.address,
                                     fingerprint=fp, part=part))
      except OSError as e:
        self._drop(pid, s, f"{s.peer.name} cannot be reached ({e})")
    self.version = version

  # --- one reader thread per sampler process, one heartbeat watcher -------------------------------------------------

  def _read_in_background(self, pid: int, s: _Sampler) -> None:
    t = threading.Thread(target=self._read, args=(pid, s), name=f"hub-{s.key}", daemon=True)
    self._threads.append(t)
    t.start()

  def _read(self, pid: int, s: _Sampler) -> None:
    peer = s.peer
    try:
      while True:
        kind, msg = peer.recv()
        s.heard = time.monotonic()
        match msg:
          case Answer(index=answer, trajectory=traj):
            self._answered(s, answer, traj)
          case Stats(counters=counters):
            s.stats = counters
            if s.catching_up is not None and counters:
              self._catch_up(pid, s)
          case Pulled():
            self.publisher.pulled(msg.version, pid)
            s.pull = msg
          case Failed(traceback=tb):
            return self._drop(pid, s, f"{peer.name} failed:\n{tb}")
          case Leaving(signum=signum):
            return self._drop(pid, s, f"{peer.name} left ({signal.Signals(signum).name}: preempted or stopped)")
          case Bye():
            return
          case _:
            return self._drop(pid, s, f"{peer.name} sent an unknown message {kind!r}: {msg!r:.300}")
    except ConnectionError as e:
      if not self._stopping.is_set():
        self._drop(pid, s, str(e))

  def _answered(self, s: _Sampler, answer: int, traj) -> None:
    with self._lock:
      gid = traj.group_id
      left = s.groups.get(gid, 0) - 1
      if left > 0:
        s.groups[gid] = left
      else:
        s.groups.pop(gid, None)
      future = self._futures.pop((gid, answer), None)
    if future is not None:  # None: cancelled by stop()
      future.set_result(traj)

  def _watch(self) -> None:
    try:
      self._watch_heartbeats()
    except BaseException as e:  # pylint: disable=broad-except  # raised to the learner by check()
      logging.exception("sampler hub: the heartbeat watcher failed")
      self.error = e

  def _watch_heartbeats(self) -> None:
    """Drops samplers silent for `heartbeat_s`; with none live, says every minute that it waits for one."""
    warned = time.monotonic()
    while not self._stopping.wait(min(1.0, self.heartbeat_s / 4)):
      now = time.monotonic()
      with self._lock:
        silent = [(pid, s) for pid, s in self._live.items() if now - s.heard > self.heartbeat_s]
        none_since = self._none_since
      for pid, s in silent:
        self._drop(pid, s, f"{s.peer.name} sent nothing for {now - s.heard:.0f} s "
                           f"(mesh.sampler_heartbeat_s={self.heartbeat_s:g}): hung or cut off", tell=True)
      if none_since is not None and now - max(none_since, warned) > WAIT_WARNING_S:
        warned = now
        logging.warning("waiting for samplers: none live for %.0f s (%d groups wait); a sampler process that starts "
                        "against this job joins it", now - none_since, len(self._waiting))
