"""`run_sampler(settings, layout)`: a sampler process of a multi-process run.

It owns its local devices (data x expert x tensor meshes of its own, `mesh.sampler_replicas` of them; it never joins
the learner's collectives), connects to the leader, and then, until told to stop:
- generates the prompt groups the leader sends (a `LocalRollout`: a `Sampler` per replica, continuous batching, paged
  KV cache; a group goes whole to one replica), each from the policy version it names or newer;
- sends every finished answer back as its future completes (detokenised here, scored by the leader's reward workers);
- pulls each new policy version in a background thread, beside decoding, and swaps it in between two decode steps
  (answers in flight are re-prefilled under it);
- reports its counters once a second, from the moment it connects: its heartbeat (`mesh.sampler_heartbeat_s`).

The messages each way are the typed records of `messages.py` (its diagram), sent under the kind `SAMPLER`.

Any failure (the leader gone, a pull that hangs or arrives corrupted, a device error) is reported to the leader when
possible and ends the process with a non-zero status; SIGTERM or SIGINT (a preemption) says `Leaving` first. Either
way the leader generates its answers in flight again elsewhere and the job goes on; the same command started again
(or `launch/local.py --restart_samplers`) rejoins it; a replica that fails fails the process so. One the leader
dropped for silence (stopped, or too slow) reads `Dropped` when it runs again and connects again as it is: its meshes
and compiled programs, no restart.
"""

from __future__ import annotations

import functools
import gc
import logging
import queue
import threading
import time
import traceback

import jax
from flax import nnx

from areal_jax import cli
from areal_jax.distributed.control import CONNECT_TIMEOUT_S, Peer, connect
from areal_jax.distributed.messages import (SAMPLER, Answer, Bye, Dropped, Failed, Generate, Leaving, Pulled, Stats,
                                            Stop, Weights)
from areal_jax.distributed.replicas import LocalRollout
from areal_jax.distributed.roles import ProcessLayout, authkey
from areal_jax.distributed.slices import MeshConfig, replica_meshes
from areal_jax.distributed.weight_transfer import WeightPuller, check_fingerprint, local_ip_towards
from areal_jax.models import create
from areal_jax.models.weights import with_dtype
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sharding import make_mesh
from areal_jax.tokenizer import load_tokenizer

PULL_TIMEOUT_S = 600.0
REJOIN_TIMEOUT_S = 60.0  # a dropped sampler that resumes tries this long to connect again, then exits


def run_sampler(settings, layout: ProcessLayout) -> None:
  """A sampler process: `settings` are the run's typed settings (`config.validate`)."""
  tokenizer = load_tokenizer(settings.model_source.tokenizer)
  mesh = make_mesh(jax.local_devices(), settings.mesh.sampler_axes())
  meshes = replica_meshes(mesh, settings.mesh)
  abstract_model = nnx.eval_shape(lambda: create(settings.model, 0))
  config = settings.sampler.for_tokenizer(tokenizer.vocab_size)
  abstract_params = with_dtype(nnx.split(abstract_model)[1], config.weight_dtype)  # what the learner publishes
  logging.info("%s: %d engine replica(s) of %s on %d local devices", layout.name, len(meshes),
               dict(meshes[0].shape), mesh.devices.size)
  puller, timeout_s = None, CONNECT_TIMEOUT_S
  while True:
    leader = connect(layout, authkey(), timeout_s=timeout_s, devices=mesh.devices.size)
    sampler = SamplerWorker(leader, abstract_model, config, meshes, abstract_params, layout=layout,
                            mesh=settings.mesh, eos_ids=[tokenizer.eos_id], detokenize=tokenizer.decode,
                            puller=puller, delta=settings.sync.delta)
    try:
      sampler.run()
      return
    except _Dropped as e:  # it was stopped or too slow, and runs again: the same engine joins again
      logging.warning("%s: the leader dropped it (%s); connecting again", layout.name, e)
    puller, timeout_s = (sampler.puller if sampler.idle_puller() else None), REJOIN_TIMEOUT_S
    del sampler
    gc.collect()  # the dropped samplers' KV caches go before the next ones are allocated


class _Dropped(Exception):
  pass


class SamplerWorker:
  """One connection's worth of a sampler process: its replicas, its pulls, its heartbeat. Only the main thread reads the
  connection; the other threads only send, and a send that fails (the leader closed it) ends their work quietly: the
  main thread reads why (`Dropped`, or the connection's end) in order."""

  def __init__(self, leader: Peer, abstract_model, config: SamplerConfig, meshes, abstract_params, *,
               layout: ProcessLayout, mesh: MeshConfig, eos_ids, detokenize, puller: WeightPuller | None = None,
               delta: bool = False):
    """`delta`: the leader sends deltas (`sync.delta`): the puller keeps the latest version to apply them to."""
    self.leader, self.layout, self.delta = leader, layout, delta
    self.abstract_model, self.config, self.meshes = abstract_model, config, meshes
    self.abstract_params, self.mesh = abstract_params, mesh
    self.eos_ids, self.detokenize = eos_ids, detokenize
    self.rollout: LocalRollout | None = None
    self.version = -1  # the newest version handed to the replicas
    self.puller = puller  # kept across a rejoin
    self.held: dict[str, int] = {}  # part -> the version pulled last (a delta's base)
    self.threads: dict[str, threading.Thread] = {}
    self.notices: queue.Queue = queue.Queue()  # weight notices, pulled in order by the pull thread
    self.error: BaseException | None = None
    self.stop = threading.Event()
    self.answers = 0  # sent to the leader
    self._answers_lock = threading.Lock()  # answers are sent from every replica's detokeniser

  def run(self) -> None:
    try:
      self._serve()
    except cli.Stopped as e:
      self._send(Leaving(e.signum))  # preempted: the leader drops it at once (not after the heartbeat limit)
      raise
    except _Dropped:
      raise
    except BaseException as e:
      self._report(e)
      raise
    finally:
      self.stop.set()
      if self.rollout is not None:
        self.rollout.stop()
        self.rollout = None
      self.leader.close()

  def idle_puller(self) -> bool:
    """Whether its puller is free for the next connection. A pull the stop cut off may never finish (the leader
    takes a dropped sampler's offers itself): then the next connection gets a puller of its own."""
    pull = self.threads.get("_pull_loop")
    if pull is not None and pull.ident is not None:
      pull.join(1.0)
    return self.puller is not None and not (pull is not None and pull.is_alive())

  def _report(self, e: BaseException) -> None:
    self._send(Failed("".join(traceback.format_exception(e))))

  def _send(self, msg) -> bool:
    """Best effort: the leader may be gone (or have dropped it: the main thread reads why). Whether it went."""
    try:
      self.leader.send(SAMPLER, msg)
      return True
    except OSError:
      return False

  def _serve(self) -> None:
    threads = self.threads = {f.__name__: threading.Thread(target=self._guard(f), name=f.__name__, daemon=True)
                              for f in (self._report_stats, self._pull_loop)}
    threads["_report_stats"].start()  # the heartbeat, through the first pull and the warm-up compile too
    # The first message is the current weights: pull them before generating anything.
    kind, notice = self.leader.recv()
    if isinstance(notice, Stop):
      return
    if not isinstance(notice, Weights):
      raise RuntimeError(f"{self.layout.name}: expected the initial weights, got {kind!r}: {notice!r:.300}")
    if self.puller is None or self.puller.address != notice.address:
      self.puller = WeightPuller(address=notice.address, abstract_params=self.abstract_params,
                                 tensor=self.mesh.sampler_tensor, expert=self.mesh.sampler_expert,
                                 devices=jax.local_devices(), host=local_ip_towards(self.layout.host),
                                 keep=self.delta)
    params = self._pull(notice)
    self.rollout = LocalRollout(abstract_model=self.abstract_model, config=self.config, meshes=self.meshes,
                                params=params, version=notice.version, eos_ids=self.eos_ids,
                                detokenize=self.detokenize)
    self.version = notice.version
    del params  # each replica holds its own copy
    threads["_pull_loop"].start()
    while not self.stop.is_set():
      if self.error is not None:
        raise self.error
      self._check_replicas()
      if not self.leader.poll(0.2):
        continue
      kind, msg = self.leader.recv()
      match msg:
        case Generate(request=request):
          for answer, future in enumerate(self.rollout.submit(request)):
            future.add_done_callback(functools.partial(self._send_answer, answer))
        case Weights():
          self.notices.put(msg)
        case Dropped(why=why):
          raise _Dropped(why)
        case Stop():
          logging.info("%s: stopping after %d answers", self.layout.name, self.answers)
          self.stop.set()
          # A pull in flight finishes first: the leader keeps its transfer server up until it hears Bye.
          threads["_pull_loop"].join(PULL_TIMEOUT_S)
          threads["_report_stats"].join(10)
          self.leader.send(SAMPLER, Bye())
        case _:
          raise RuntimeError(f"{self.layout.name}: unknown message {kind!r}: {msg!r:.300}")

  def _guard(self, fn):
    def run():
      try:
        fn()
      except BaseException as e:  # pylint: disable=broad-except  # ends the process through the main thread
        if self.stop.is_set():
          return  # shutting down: the connection may already be closed
        logging.exception("%s: %s failed", self.layout.name, fn.__name__)
        self.error = e  # the main thread raises it within 0.2 s
        self._report(e)

    return run

  def _check_replicas(self) -> None:
    """Raises the error of a replica that failed: the process ends, and the leader generates its groups again
    elsewhere (a replica's groups are the process's to the leader)."""
    self.rollout.check()
    failed = [r for r in self.rollout.replicas if r.failed is not None]
    if failed:
      raise RuntimeError(f"{self.layout.name}: sampler replica {failed[0].index} failed") from failed[0].failed

  def _pull(self, notice: Weights):
    """Pulls one version, checks it against the published fingerprint (a layout mismatch would copy the wrong bytes),
    reports it and returns it (on the puller's devices: `LocalRollout` moves it onto each other replica; under LoRA,
    after the first version, the adapters only, which each replica joins to its copy of the base)."""
    start = time.perf_counter()
    part, delta = notice.part, notice.base >= 0
    if delta and self.held.get(part) != notice.base:
      raise RuntimeError(f"{self.layout.name}: version {notice.version} of {part!r} came as a delta against version "
                         f"{notice.base}, but the latest it pulled is {self.held.get(part)}")
    pulled, fp = self.puller.pull(notice.uuid, part=part, timeout_s=PULL_TIMEOUT_S,
                                  codes=notice.codes if delta else None)
    seconds = time.perf_counter() - start
    check_fingerprint(fp, notice.fingerprint, paths=self.puller.paths[part],
                      what=f"weights of version {notice.version} on {self.layout.name}")
    self.held[part] = notice.version
    self._send(Pulled(version=notice.version, seconds=seconds, nbytes=self.puller.last_nbytes))
    return pulled

  def _pull_loop(self) -> None:
    while not self.stop.is_set():
      try:
        notice = self.notices.get(timeout=0.2)
      except queue.Empty:
        continue
      # Every published version is pulled (the learner holds each until then); the replicas swap in the newest.
      params = self._pull(notice)
      if notice.version > self.version:  # never back: a sampler that joins may hear of a version twice
        self.rollout.publish(params, notice.version, owned=True)  # a replica on the pull's layout takes it as it is
        self.version = notice.version

  def _send_answer(self, answer: int, future) -> None:
    """On the sampler's detokenising thread: one finished answer to the leader (a failed future: the sampler's error,
    which the main thread raises)."""
    if future.cancelled() or future.exception() is not None:
      return
    if self._send(Answer(index=answer, trajectory=future.result())):
      with self._answers_lock:
        self.answers += 1

  def _report_stats(self) -> None:
    while not self.stop.wait(1.0):
      if not self._send(Stats(self.rollout.stats() if self.rollout is not None else {})):
        return  # the connection ended: the main thread reads why
