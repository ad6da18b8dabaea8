"""The leader's view of the sampler processes: a `Rollout` (rollout.py) over samplers that come and go.

The rollout controller submits prompt groups to it exactly as to an in-process loop, so admission (paper Eq. 3) is
decided in one place for all sampler processes. A group goes whole to the live sampler that served its episode's last
turn, else the one with the fewest tokens of work outstanding (`dispatch.Dispatcher`; with none live it waits here for
one); `submit` returns one future per answer, completed when the answer arrives. `publish` offers a version with
`jax.experimental.transfer` and tells every live sampler to pull it; the notice carries the published fingerprint, and
the sampler checks its pull against it before the swap. With `delta` a sampler that holds the version before is offered
only what changed (`weight_delta.py`; one that joined or restarted gets the full copy). With `overlap` the learner only
dispatches the copy: the rest (the copy itself, the delta, the offer) runs on the `hub-publish` thread while the learner
trains, one version at a time (the next publish waits for it), under the same bound on versions live as before. The
messages each way are the typed records of `messages.py` (its diagram).

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

One actor owns the samplers' state: a reader thread per sampler process only puts what it reads in the hub's inbox;
`submit`, `publish`, `join`, the metrics and `stop` put calls there too; one loop (the `hub` thread) takes them in
order, keeps the heartbeat and is the only code that reads or changes membership, futures and counters. So there is
no lock to take and nothing to try again later: a publish, a join and a catch-up offer never interleave, and each
sampler sees versions in order.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import jax
import numpy as np

from areal_jax import faults
from areal_jax.distributed.control import Peer
from areal_jax.distributed.messages import (SAMPLER, Answer, Bye, Dropped, Failed, Generate, Leaving, Pulled, Stats,
                                            Stop, Weights)
from areal_jax.distributed.weight_transfer import Delta, WeightPublisher
from areal_jax.errors import SamplerLost
from areal_jax.sampler.sampler import end_futures
from areal_jax.sampler import dispatch
from areal_jax.sampler.dispatch import Outstanding
from areal_jax.sampler.requests import Request

MAX_LIVE_VERSIONS = 2
# Counters that only grow: a sampler that leaves keeps its share in the sums (`stats`), so rates never go back.
CUMULATIVE = ("tokens", "decode_steps", "prefill_rows", "prefill_tokens", "cached_tokens", "recomputed", "busy_s")
WAIT_WARNING_S = 60.0  # with no sampler live: how often to say so
CALL_TIMEOUT_S = 600.0  # a call on the hub's loop (a publish's offer, a metrics read) waits at most this long


@dataclasses.dataclass(eq=False)
class RemoteSampler:
  """A live sampler process, as the hub's loop tracks it."""

  peer: Peer
  heard: float  # time.monotonic() of its latest message
  groups: Outstanding = dataclasses.field(default_factory=Outstanding)  # its groups with answers still to come
  stats: dict = dataclasses.field(default_factory=dict)
  pull: Pulled | None = None  # the latest pull it reported
  # Joined while the job ran: the version it was sent then, until its loop runs (`_catch_up`). Until then it is not
  # offered new versions, so a sampler still starting (process start, first pull, loop) never holds the learner back.
  catching_up: int | None = None
  held: dict[str, int] = dataclasses.field(default_factory=dict)  # part -> the latest version offered to it

  @property
  def key(self) -> str:  # "sampler0": the metrics' name for it
    return self.peer.name.replace(" ", "")


class SamplerHub:
  """See the module docstring. `peers`: the sampler processes connected at the start (process id -> peer)."""

  def __init__(self, *, peers: dict[int, Peer], publisher: WeightPublisher | None, heartbeat_s: float = 30.0,
               delta: bool = False, overlap: bool = False):
    self.publisher, self.heartbeat_s, self.delta, self.overlap = publisher, heartbeat_s, delta, overlap
    now = time.monotonic()
    # The loop's state: nothing else reads or writes it.
    self._live = {pid: RemoteSampler(peer, now) for pid, peer in peers.items()}
    self._dispatcher = dispatch.Dispatcher()  # on the loop
    self._futures: dict[tuple[int, int], Future] = {}  # (group id, answer) -> its future, until the answer arrives
    self._waiting: list[Request] = []  # submitted while no sampler was live
    # For samplers that join: the latest published copy of each part (version, staged): the whole model, and under
    # LoRA the latest adapters (the learner's own arrays cannot be kept: its train step donates them).
    self._kept: dict[str, tuple[int, object]] = {}
    # The latest offer's `sync/publish_seconds` (staged and offered), `sync/bytes` (what a pull of it moves: its
    # delta's, where one was sent) and `sync/changed_fraction` (the delta's share of changed elements); the metrics
    # report a copy taken on the learner's thread once that offer is complete (`_reported`).
    self._offered: dict[str, float] = {}
    self._reported: dict[str, float] = {}
    self._learner_s = 0.0  # the latest publish: what the learner waited for (all of it, without `overlap`)
    self._retired = dict.fromkeys(CUMULATIVE, 0.0)  # the counters of samplers that left
    self._none_since: float | None = None  # since when no sampler has been live
    self._none_s = 0.0  # seconds without a live sampler before that
    self._warned = now  # the latest "waiting for samplers"
    self.joined = self.lost = 0
    self.version = -1
    self.error: BaseException | None = None
    # Everything else: the inbox, and the threads that fill it.
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (function, args, Future or None), run in order
    self._stopping = threading.Event()
    self._loop = threading.Thread(target=self._run, name="hub", daemon=True)
    self._readers: list[threading.Thread] = []
    self._publishing: threading.Thread | None = None  # the version in flight (`overlap`)
    self._base: dict[str, tuple[int, object]] = {}  # the publishing side's latest staged copy of each part

  def start(self) -> SamplerHub:
    self._loop.start()
    for pid, s in self._live.items():
      self._read_in_background(pid, s)
    return self

  # --- the Rollout protocol: calls put in the inbox -----------------------------------------------------------------

  def submit(self, request: Request) -> list[Future]:
    self.check()
    futures = [Future() for _ in range(request.num_answers)]
    self._post(self._submit, request, futures)
    return futures

  def publish(self, params, version: int) -> None:
    """Offers the learner's local copy `params` as `version`; samplers pull it and swap it in between two decode
    steps. Staged here; offered by the hub's loop once fewer than `MAX_LIVE_VERSIONS` earlier versions are still
    being pulled (each holds a copy of the weights on the learner's device, so a sampler that pulls slower than the
    learner steps must not pile them up; one that hangs is dropped by the heartbeat, and its pulls released). With
    `overlap` this returns once the copy is dispatched, after the previous version was offered."""
    start = time.perf_counter()
    self._wait_published()
    self._reported = dict(self._offered)  # under `overlap`, the version before's (this one is not offered yet)
    part = "adapters" if self.version >= 0 and "adapters" in self.publisher.parts else "all"
    staged = self.publisher.stage(params, part, block=not self.overlap)
    faults.reach("weight_update")
    self.check()
    if self.overlap:
      self._publishing = threading.Thread(target=self._publish_in_background, args=(staged, version, part, start),
                                          name="hub-publish", daemon=True)
      self._publishing.start()
    else:
      self._finish_publish(staged, version, part, start)
      self._reported = dict(self._offered)
    self._learner_s = time.perf_counter() - start

  def _wait_published(self) -> None:
    """Waits for the version in flight to be offered (or to fail: `check` raises its error)."""
    if self._publishing is not None:
      self._publishing.join()
      self._publishing = None
    self.check()

  def _publish_in_background(self, staged, version: int, part: str, start: float) -> None:
    try:
      self._finish_publish(staged, version, part, start)
    except BaseException as e:  # pylint: disable=broad-except  # the learner's next call raises it (check)
      logging.exception("sampler hub: publishing version %d failed", version)
      self.error = e

  def _finish_publish(self, staged, version: int, part: str, start: float) -> None:
    """The copy in the pull layout (and under `delta` the change since the previous one), offered once fewer than
    `MAX_LIVE_VERSIONS` versions are live."""
    jax.block_until_ready(staged)
    delta = None
    if self.delta and part in self._base:
      base_version, base = self._base[part]
      delta = (base_version, self.publisher.delta(staged, base))
    if self.delta:
      self._base[part] = (version, staged)  # the same copy as `_kept`'s once offered: nothing more is held
    while not self.publisher.wait_live_below(MAX_LIVE_VERSIONS, timeout=1.0):
      self.check()
    self._call(self._offer, staged, version, part, start, delta)

  def check(self) -> None:
    if self.error is not None:
      raise RuntimeError(f"sampler hub failed: {self.error}") from self.error

  def stats(self) -> dict[str, float]:
    """Counters summed over the sampler processes (tokens, busy_s, ..., those that left included; running, waiting:
    the live ones'; `version`: the oldest live one's), as `Sampler.stats`."""
    return self._call(self._stats)

  def sampler_metrics(self) -> dict[str, float]:
    """`samplers/live` now; `samplers/joined` and `samplers/lost` since the start; `samplers/wait_s`: seconds in all
    with no sampler live (the learner waits for samplers then)."""
    return self._call(self._sampler_metrics)

  def sync_metrics(self) -> dict[str, float]:
    """Of the latest publish: `sync/learner_seconds` (what the learner waited for). Of the latest offer complete when
    it was published (that version's own without `overlap`; with it, the version before's, as the new one may still be
    in flight): `sync/publish_seconds` (staged and offered), `sync/bytes` (what a pull of it moves: its delta's where
    samplers were sent one) and under `delta` `sync/changed_fraction`. `sync/seconds` (slowest pull) and
    `sync/mb_per_s` (mean) of the live samplers' latest pulls, and the same per sampler."""
    return self._call(self._sync_metrics)

  def stop(self, timeout_s: float = 120.0) -> None:
    """Tells every sampler to stop and waits for its goodbye (it first finishes a pull in flight, which needs this
    process's transfer server alive); answers still owed are cancelled."""
    deadline = time.monotonic() + timeout_s
    if self._publishing is not None:  # the version in flight is offered first (the samplers finish its pull)
      self._publishing.join(timeout_s)
    if self._loop.is_alive():
      self._call(self._tell_stop)
    for t in list(self._readers):
      if t.is_alive():
        t.join(max(0.0, deadline - time.monotonic()))
    if self._loop.is_alive():
      self._post(None)  # the loop's last call: it ends the futures still owed
      self._loop.join(max(0.0, deadline - time.monotonic()))
    else:
      self._end()

  def join(self, peer: Peer) -> None:
    """A sampler process connected while the job runs (`ControlServer.on_sampler`): it gets the current weights,
    then work, with the groups that waited for a sampler."""
    if self._stopping.is_set():
      return peer.close()
    return self._post(self._join, peer)

  # --- the inbox ----------------------------------------------------------------------------------------------------

  def _post(self, fn: Callable | None, *args, result: Future | None = None) -> None:
    self._inbox.put((fn, args, result))

  def _call(self, fn: Callable, *args):
    """Runs `fn(*args)` on the hub's loop and returns what it returns (or raises what it raised). Before `start` and
    after `stop` no loop runs, and nothing else touches its state: then the caller runs it; so does the loop itself
    (a future's callback, run where the future completes, that asks the hub for its metrics)."""
    if not self._loop.is_alive() or threading.current_thread() is self._loop:
      return fn(*args)
    result = Future()
    self._post(fn, *args, result=result)
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while True:
      try:
        return result.result(timeout=1.0)
      except TimeoutError:
        if not self._loop.is_alive() and not result.done():  # the loop ended before it took this call
          return fn(*args)
        if time.monotonic() > deadline:
          raise TimeoutError(f"sampler hub: {fn.__name__} not run within {CALL_TIMEOUT_S:.0f} s") from None

  def _run(self) -> None:
    """The hub's loop: runs the inbox's calls in order, and every `heartbeat_s / 4` (at most 1 s) drops the samplers
    silent for `heartbeat_s`."""
    tick = min(1.0, self.heartbeat_s / 4)
    next_beat = time.monotonic() + tick
    while True:
      try:
        fn, args, result = self._inbox.get(timeout=max(0.0, next_beat - time.monotonic()))
      except queue.Empty:
        fn, args, result = self._heartbeat, (), None
        next_beat = time.monotonic() + tick
      if fn is None:
        return self._end()
      try:
        value = fn(*args)
      except BaseException as e:  # pylint: disable=broad-except  # the caller's, or the learner's through check()
        if result is not None:
          result.set_exception(e)
        else:
          logging.exception("sampler hub: %s failed", getattr(fn, "__name__", fn))
          self.error = e
      else:
        if result is not None:
          result.set_result(value)

  def _end(self) -> None:
    futures, self._futures, self._waiting = list(self._futures.values()), {}, []
    end_futures(futures, None)

  # --- on the loop: work --------------------------------------------------------------------------------------------

  def _submit(self, request: Request, futures: list[Future]) -> None:
    if self._stopping.is_set():
      return end_futures(futures, None)
    self._futures.update({(request.group_id, a): f for a, f in enumerate(futures)})
    if not self._live:
      self._waiting.append(request)
      return None
    pid = self._dispatcher.choose(request, {pid: s.groups.load() for pid, s in self._live.items()})
    s = self._live[pid]
    s.groups.add(request)
    return self._send_work(pid, s, request)

  def _send_work(self, pid: int, s: RemoteSampler, request: Request) -> None:
    try:
      s.peer.send(SAMPLER, Generate(request))  # held there until it generates from request.min_version
    except OSError as e:
      self._drop(pid, s, f"{s.peer.name} cannot be reached ({e})")

  def _answered(self, s: RemoteSampler, answer: int, traj) -> None:
    gid = traj.group_id
    if gid in s.groups:
      s.groups.answered(gid)
    future = self._futures.pop((gid, answer), None)
    if future is not None:  # None: its sampler was dropped meanwhile, or the hub stopped
      future.set_result(traj)

  # --- on the loop: weights -----------------------------------------------------------------------------------------

  def _offer(self, staged, version: int, part: str, start: float, delta: tuple[int, Delta] | None = None) -> None:
    """Offers `staged` (from `publisher.stage`) as `version` to the live samplers that run: `delta` (base version,
    its delta) to those that hold that base, the full copy to the others."""
    live = {pid: s for pid, s in self._live.items() if s.catching_up is None}
    if delta is not None:
      base, change = delta
      small = {pid: s for pid, s in live.items() if s.held.get(part) == base}
      if small:
        uuids, fp = self.publisher.offer(staged, version, list(small), delta=change)
        for pid, s in small.items():
          self._send_weights(pid, s, version, uuids[pid], fp, part, delta=delta)
      live = {pid: s for pid, s in live.items() if pid not in small}
      offered = {"sync/changed_fraction": change.changed_fraction,
                 "sync/bytes": float(change.nbytes if small else self.publisher.nbytes(part))}
    else:
      offered = {"sync/bytes": float(self.publisher.nbytes(part))}
    if live or delta is None:
      uuids, fp = self.publisher.offer(staged, version, list(live))
      for pid, s in live.items():
        self._send_weights(pid, s, version, uuids[pid], fp, part)
    self.version = version
    self._kept[part] = (version, staged)
    self._offered = {"sync/publish_seconds": time.perf_counter() - start, **offered}

  def _offer_kept(self, pid: int, s: RemoteSampler, part: str) -> int:
    """Offers sampler `s` the kept copy of `part` (whole); returns its version."""
    version, staged = self._kept[part]
    uuids, fp = self.publisher.offer(staged, version, [pid])
    self._send_weights(pid, s, version, uuids[pid], fp, part)
    return version

  def _send_weights(self, pid: int, s: RemoteSampler, version: int, uuid, fingerprint, part: str,
                    delta: tuple[int, Delta] | None = None) -> None:
    base, codes = (delta[0], delta[1].codes) if delta is not None else (-1, ())
    s.held[part] = version
    try:
      s.peer.send(SAMPLER, Weights(version=version, uuid=uuid, address=self.publisher.address,
                                   fingerprint=fingerprint, part=part, base=base, codes=codes))
    except OSError as e:
      self._drop(pid, s, f"{s.peer.name} cannot be reached ({e})")

  def _catch_up(self, pid: int, s: RemoteSampler) -> None:
    """A sampler that joined has its loop running: it is sent the newest version published since its join, and from
    now on every publish."""
    version, part = max((v, p) for p, (v, _) in self._kept.items())
    if version > s.catching_up:
      self._offer_kept(pid, s, part)
    s.catching_up = None

  # --- on the loop: membership --------------------------------------------------------------------------------------

  def _join(self, peer: Peer) -> None:
    if self._stopping.is_set():
      return peer.close()
    pid = peer.process_id
    if (old := self._live.get(pid)) is not None:
      self._drop(pid, old, f"{peer.name} reconnected (its previous process is gone)")
    s = RemoteSampler(peer, time.monotonic())
    self._live[pid] = s
    self.joined += 1
    if self._none_since is not None:
      self._none_s += time.monotonic() - self._none_since
      self._none_since = None
    for part in [p for p in ("all", "adapters") if p in self._kept]:  # none yet: the first publish reaches it
      s.catching_up = self._offer_kept(pid, s, part)
    if self._live.get(pid) is not s:
      logging.warning("%s connected and went at once", peer.name)
      return None
    waiting, self._waiting = self._waiting, []
    logging.info("%s joined at version %d (%d samplers live; %d waiting groups go to it)", peer.name, self.version,
                 len(self._live), len(waiting))
    self._read_in_background(pid, s)
    for request in waiting:
      s.groups.add(request)
      self._send_work(pid, s, request)
    return None

  def _drop(self, pid: int, s: RemoteSampler, why: str, tell: bool = False) -> None:
    """Sampler `s` (process `pid`) is gone (`why`: what happened, a sentence naming it): the answers it owed fail
    with `SamplerLost` (their groups are generated again), what it had to pull is released. With `tell`, its last
    message is `Dropped`: one that was only stopped or slow connects again when it resumes."""
    if self._live.get(pid) is not s:
      return  # dropped already, or replaced by a restart
    del self._live[pid]
    self.lost += 1
    for k in CUMULATIVE:
      self._retired[k] += s.stats.get(k, 0.0)
    futures = [self._futures.pop(k) for k in [k for k in self._futures if k[0] in s.groups]]
    if not self._live and self._none_since is None:
      self._none_since = time.monotonic()
    if tell:
      s.peer.send_last(SAMPLER, Dropped(why))
    s.peer.close()  # its reader wakes, and its last word finds it gone
    if self.publisher is not None:
      self.publisher.forget(pid)
    logging.warning("%s: dropped; its %d groups in flight are generated again (%d samplers live)", why,
                    len(s.groups), len(self._live))
    end_futures(futures, SamplerLost(why))

  def _heard(self, pid: int, s: RemoteSampler, kind: str, msg) -> None:
    """A message from sampler `s`, as its reader took it off the connection."""
    if self._live.get(pid) is not s:
      return  # from a connection dropped meanwhile
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
        self._drop(pid, s, f"{s.peer.name} failed:\n{tb}")
      case Leaving(signum=signum):
        self._drop(pid, s, f"{s.peer.name} left ({signal.Signals(signum).name}: preempted or stopped)")
      case Bye():
        pass
      case _:
        self._drop(pid, s, f"{s.peer.name} sent an unknown message {kind!r}: {msg!r:.300}")

  def _lost(self, pid: int, s: RemoteSampler, why: str) -> None:
    if not self._stopping.is_set():
      self._drop(pid, s, why)

  def _heartbeat(self) -> None:
    """Drops samplers silent for `heartbeat_s`; with none live, says every minute that it waits for one."""
    now = time.monotonic()
    for pid, s in [(pid, s) for pid, s in self._live.items() if now - s.heard > self.heartbeat_s]:
      self._drop(pid, s, f"{s.peer.name} sent nothing for {now - s.heard:.0f} s "
                         f"(mesh.sampler_heartbeat_s={self.heartbeat_s:g}): hung or cut off", tell=True)
    if self._none_since is not None and now - max(self._none_since, self._warned) > WAIT_WARNING_S:
      self._warned = now
      logging.warning("waiting for samplers: none live for %.0f s (%d groups wait); a sampler process that starts "
                      "against this job joins it", now - self._none_since, len(self._waiting))

  def _tell_stop(self) -> None:
    self._stopping.set()
    for s in self._live.values():
      try:
        s.peer.send(SAMPLER, Stop())
      except OSError:
        pass

  # --- on the loop: metrics -----------------------------------------------------------------------------------------

  def _stats(self) -> dict[str, float]:
    out: dict[str, float] = {k: v for k, v in self._retired.items() if v}
    for s in self._live.values():
      for k, v in s.stats.items():
        out[k] = min(out.get(k, v), v) if k == "version" else out.get(k, 0) + v
    return out

  def _sampler_metrics(self) -> dict[str, float]:
    none_s = self._none_s + (time.monotonic() - self._none_since if self._none_since is not None else 0.0)
    return {"samplers/live": float(len(self._live)), "samplers/joined": float(self.joined),
            "samplers/lost": float(self.lost), "samplers/wait_s": none_s}

  def _sync_metrics(self) -> dict[str, float]:
    pulls = {s.key: s.pull for s in self._live.values() if s.pull is not None}
    out = {"sync/publish_seconds": 0.0, "sync/bytes": float(self.publisher.nbytes()), **self._reported,
           "sync/learner_seconds": self._learner_s}
    if not pulls:
      return out
    out |= {"sync/seconds": max(p.seconds for p in pulls.values()),
            "sync/mb_per_s": float(np.mean([p.nbytes / 1e6 / max(p.seconds, 1e-9) for p in pulls.values()])),
            "sync/version_lag": float(self.version - min(p.version for p in pulls.values()))}
    for key, p in pulls.items():
      out[f"sync/{key}/seconds"] = p.seconds
      out[f"sync/{key}/mb_per_s"] = p.nbytes / 1e6 / max(p.seconds, 1e-9)
    return out

  # --- one reader thread per sampler process: it only fills the inbox -----------------------------------------------

  def _read_in_background(self, pid: int, s: RemoteSampler) -> None:
    t = threading.Thread(target=self._read, args=(pid, s), name=f"hub-{s.key}", daemon=True)
    self._readers.append(t)
    t.start()

  def _read(self, pid: int, s: RemoteSampler) -> None:
    try:
      while True:
        kind, msg = s.peer.recv()
        self._post(self._heard, pid, s, kind, msg)
        if not isinstance(msg, (Answer, Stats, Pulled)):  # its last word (Failed, Leaving, Bye) or a wrong one
          return
    except ConnectionError as e:
      self._post(self._lost, pid, s, str(e))
