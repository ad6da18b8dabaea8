"""The control plane of a multi-process run: authenticated connections between the leader and the other processes.

Every process but the leader (learner process 0) connects to the leader's `multiprocessing.connection` listener and
says who it is; after that each side sends `(kind, payload)` tuples of host data (requests, trajectories, notices,
learner batches). Arrays never travel here: weights go over `jax.experimental.transfer` (`weight_transfer.py`).

    leader                                         sampler process i
      ("weights", {version, uuid, fp})  ──────►      pulls, checks fp, swaps between two decode steps
      ("request", Request)              ──────►      generates the group's answers
      ("stop", None)                    ──────►      exits
                                        ◄──────      ("trajectory", (answer, Trajectory))   one finished answer
                                        ◄──────      ("pulled", {version, seconds})
                                        ◄──────      ("stats", {tokens, busy_s, ...})
                                        ◄──────      ("error", traceback)
                                        ◄──────      ("stopped", signum)   signalled: the leader stops too

    leader                                         learner process k > 0 (a follower)
      ("step", {step, trajectories})    ──────►      the same train step on its shards (SPMD)
      ("save", {step}) / ("stop", None) ──────►
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from multiprocessing.connection import Client, Connection, Listener

from areal_jax.distributed.roles import ProcessLayout

CONNECT_TIMEOUT_S = 600.0  # how long a process waits for the others to connect (compilation may come first)


class Peer:
  """One connection, safe to send on from several threads."""

  def __init__(self, conn: Connection, *, name: str, process_id: int):
    self.conn, self.name, self.process_id = conn, name, process_id
    self._lock = threading.Lock()

  def send(self, kind: str, payload=None) -> None:
    with self._lock:
      self.conn.send((kind, payload))

  def poll(self, timeout: float) -> bool:
    """Whether a message (or the end of the connection) is waiting, after at most `timeout` seconds."""
    try:
      return self.conn.poll(timeout)
    except (EOFError, OSError):
      return True  # recv() will say the peer is gone

  def recv(self):
    """The next (kind, payload); ConnectionError naming the peer when the other side is gone."""
    try:
      return self.conn.recv()
    except (EOFError, OSError) as e:
      raise ConnectionError(f"{self.name} (process {self.process_id}) is gone: its control connection closed") from e

  def close(self) -> None:
    try:
      self.conn.close()
    except OSError:
      pass


class ControlServer:
  """The leader's listener: accepts the other processes of the job in the background, from the very start."""

  def __init__(self, layout: ProcessLayout, authkey: bytes):
    self.layout = layout
    self._listener = Listener(layout.control_address, authkey=authkey)
    self._peers: dict[int, Peer] = {}
    self._cond = threading.Condition()
    threading.Thread(target=self._accept, name="control-accept", daemon=True).start()

  def _accept(self) -> None:
    expected = self.layout.num_processes - 1
    while len(self._peers) < expected:
      conn = None
      try:
        conn = self._listener.accept()
        hello, info = conn.recv()
        pid = int(info["process_id"])
      except Exception as e:  # pylint: disable=broad-except  # a stranger or a wrong key: log it, keep listening
        logging.warning("control: rejected a connection: %s", e)
        if conn is not None:
          conn.close()
        continue
      peer = Peer(conn, name=dataclasses.replace(self.layout, process_id=pid).name, process_id=pid)
      if hello != "hello" or not 0 < pid < self.layout.num_processes or pid in self._peers:
        logging.warning("control: rejected %r from process %s", hello, pid)
        peer.close()
        continue
      with self._cond:
        self._peers[pid] = peer
        self._cond.notify_all()
      logging.info("control: %s connected", peer.name)

  def wait(self, process_ids, *, timeout_s: float) -> dict[int, Peer]:
    """The peers of `process_ids`, waiting up to `timeout_s` for them to connect."""
    ids = list(process_ids)
    with self._cond:
      if not self._cond.wait_for(lambda: all(i in self._peers for i in ids), timeout_s):
        missing = [dataclasses.replace(self.layout, process_id=i).name
                   for i in ids if i not in self._peers]
        raise TimeoutError(f"control: {', '.join(missing)} did not connect to {self.layout.coordinator_address} "
                           f"within {timeout_s:.0f} s")
      return {i: self._peers[i] for i in ids}

  def close(self) -> None:
    for peer in list(self._peers.values()):
      peer.close()
    self._listener.close()


def connect(layout: ProcessLayout, authkey: bytes, *, timeout_s: float, **info) -> Peer:
  """Connects this (non-leader) process to the leader, retrying until it listens; says hello with `info`."""
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      conn = Client(layout.control_address, authkey=authkey)
      break
    except OSError as e:  # not listening yet
      if time.monotonic() > deadline:
        raise TimeoutError(f"{layout.name}: the leader at {layout.coordinator_address} did not accept a control "
                           f"connection within {timeout_s:.0f} s ({e})") from e
      time.sleep(0.2)
  conn.send(("hello", {"process_id": layout.process_id, **info}))
  return Peer(conn, name="the leader (learner 0)", process_id=0)
