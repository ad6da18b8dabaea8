"""The control plane of a multi-process run: authenticated connections between the leader and the other processes.

Every process but the leader (learner process 0) connects to the leader's `multiprocessing.connection` listener,
both sides prove they hold the job's key ($AREAL_JAX_AUTHKEY, HMAC challenges both ways; `roles.authkey`), and the
process says who it is; after that each side sends `(kind, payload)` messages of host data as typed msgpack
(`wire.py`: data, never pickles): the payload is one of the typed records of `messages.py` (its diagram: weight
notices, requests, answers, counters, learner steps), the kind names the role (`messages.SAMPLER`, `LEARNER`). A
connection that has not finished its handshake within `HANDSHAKE_TIMEOUT_S` is dropped without holding up the others.
Weights never travel here: they go over `jax.experimental.transfer` (`weight_transfer.py`).

    process i                                      leader
      answer_challenge, deliver_challenge  ◄─────►   deliver_challenge, answer_challenge   (HMAC with the job's key)
      ("hello", {process_id, ...})         ──────►   names the peer; then the records of `messages.py`
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import struct
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, answer_challenge, deliver_challenge

from areal_jax.distributed import wire
from areal_jax.distributed.roles import ProcessLayout

CONNECT_TIMEOUT_S = 600.0  # how long a process waits for the others to connect (compilation may come first)
HANDSHAKE_TIMEOUT_S = 10.0  # from accept to hello: a silent or slow stranger is dropped after this


def _io_timeout(conn: Connection, seconds: float) -> None:
  """Bounds each blocking read and write on `conn` by `seconds` (0: no bound); past it they raise OSError."""
  tv = struct.pack("@ll", int(seconds), int((seconds % 1) * 1e6))
  sock = socket.socket(fileno=os.dup(conn.fileno()))  # a second handle on the same socket, for its options
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
  finally:
    sock.close()


class Peer:
  """One connection, safe to send on from several threads."""

  def __init__(self, conn: Connection, *, name: str, process_id: int):
    self.conn, self.name, self.process_id = conn, name, process_id
    self._lock = threading.Lock()

  def send(self, kind: str, payload=None) -> None:
    data = wire.encode((kind, payload))
    with self._lock:
      self.conn.send_bytes(data)

  def send_last(self, kind: str, payload=None, timeout_s: float = 1.0) -> None:
    """Best effort, before `close`: gives up after `timeout_s` (a peer that stopped reading) instead of blocking."""
    if not self._lock.acquire(timeout=timeout_s):
      return
    try:
      _io_timeout(self.conn, timeout_s)
      self.conn.send_bytes(wire.encode((kind, payload)))
    except OSError:
      pass
    finally:
      self._lock.release()

  def poll(self, timeout: float) -> bool:
    """Whether a message (or the end of the connection) is waiting, after at most `timeout` seconds."""
    try:
      return self.conn.poll(timeout)
    except (EOFError, OSError):
      return True  # recv() will say the peer is gone

  def recv(self):
    """The next (kind, payload); ConnectionError naming the peer when the other side is gone or sent garbage."""
    try:
      kind, payload = wire.decode(self.conn.recv_bytes())
    except (EOFError, OSError) as e:
      raise ConnectionError(f"{self.name} (process {self.process_id}) is gone: its control connection closed") from e
    except ValueError as e:
      raise ConnectionError(f"{self.name} (process {self.process_id}) sent a malformed message: {e}") from e
    return kind, payload

  def close(self) -> None:
    """Shuts the connection down (a thread blocked reading it wakes, and the other side sees it end), then closes
    it."""
    try:
      sock = socket.socket(fileno=os.dup(self.conn.fileno()))
      try:
        sock.shutdown(socket.SHUT_RDWR)
      finally:
        sock.close()
    except OSError:
      pass
    try:
      self.conn.close()
    except OSError:
      pass


class ControlServer:
  """The leader's listener: accepts the other processes of the job in the background, from the very start. Each
  connection gets its own handshake thread, so one that stays silent cannot keep the others out."""

  def __init__(self, layout: ProcessLayout, authkey: bytes):
    self.layout, self._authkey = layout, authkey
    self._listener = Listener(layout.control_address)
    self._peers: dict[int, Peer] = {}
    self._given: dict[int, Peer] = {}  # what `wait` returned
    self._on_sampler = None
    self._cond = threading.Condition()
    self._closed = False
    self._thread = threading.Thread(target=self._accept, name="control-accept", daemon=True)
    self._thread.start()

  def _accept(self) -> None:
    while True:
      try:
        conn = self._listener.accept()
      except OSError as e:
        if self._closed:
          return
        logging.warning("control: accept failed: %s", e)
        time.sleep(0.1)
        continue
      if self._closed:
        conn.close()
        return
      threading.Thread(target=self._handshake, args=(conn,), name="control-handshake", daemon=True).start()

  def _handshake(self, conn: Connection) -> None:
    try:
      _io_timeout(conn, HANDSHAKE_TIMEOUT_S)
      deliver_challenge(conn, self._authkey)
      answer_challenge(conn, self._authkey)
      hello, info = wire.decode(conn.recv_bytes(1 << 16))
      pid = int(info["process_id"])
      _io_timeout(conn, 0)
    except Exception as e:  # pylint: disable=broad-except  # a stranger, a wrong key, silence: drop it, keep listening
      logging.warning("control: rejected a connection: %s", f"{type(e).__name__}: {e}"[:300])
      conn.close()
      return
    peer = Peer(conn, name=dataclasses.replace(self.layout, process_id=pid).name, process_id=pid)
    sampler = pid >= self.layout.num_learners  # samplers may (re)connect at any time, with ids beyond the job's too
    with self._cond:
      if hello != "hello" or pid <= 0 or self._closed or not sampler and (pid in self._peers or
                                                                            pid >= self.layout.num_processes):
        logging.warning("control: rejected %r from process %s", hello, pid)
        peer.close()
        return
      handler = self._on_sampler if sampler else None
      if handler is None:
        self._peers[pid] = peer
        self._cond.notify_all()
    logging.info("control: %s connected", peer.name)
    if handler is not None:
      handler(peer)

  def on_sampler(self, handler) -> None:
    """From now on a sampler process's connection goes to `handler(peer)` (on its handshake thread), a restarted
    one's too; those that connected since `wait` returned go to it now."""
    with self._cond:
      self._on_sampler = handler
      late = [p for i, p in self._peers.items() if i >= self.layout.num_learners and p is not self._given.get(i)]
    for peer in late:
      handler(peer)

  def wait(self, process_ids, *, timeout_s: float) -> dict[int, Peer]:
    """The peers of `process_ids`, waiting up to `timeout_s` for them to connect."""
    ids = list(process_ids)
    with self._cond:
      if not self._cond.wait_for(lambda: all(i in self._peers for i in ids), timeout_s):
        missing = [dataclasses.replace(self.layout, process_id=i).name
                   for i in ids if i not in self._peers]
        raise TimeoutError(f"control: {', '.join(missing)} did not connect to {self.layout.coordinator_address} "
                           f"within {timeout_s:.0f} s")
      given = {i: self._peers[i] for i in ids}
      self._given.update(given)
      return given

  def close(self) -> None:
    """Stops accepting (the accept thread is woken by a connection of our own and exits) and closes every peer."""
    with self._cond:
      self._closed = True
      peers = list(self._peers.values())
    try:
      socket.create_connection(self.layout.control_address, timeout=1.0).close()
    except OSError:
      pass
    self._thread.join(timeout=5.0)
    self._listener.close()
    for peer in peers:
      peer.close()


def connect(layout: ProcessLayout, authkey: bytes, *, timeout_s: float, **info) -> Peer:
  """Connects this (non-leader) process to the leader, retrying until it listens; both sides prove the key, then it
  says hello with `info`."""
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      conn = Client(layout.control_address)
      break
    except OSError as e:  # not listening yet
      if time.monotonic() > deadline:
        raise TimeoutError(f"{layout.name}: the leader at {layout.coordinator_address} did not accept a control "
                           f"connection within {timeout_s:.0f} s ({e})") from e
      time.sleep(0.2)
  peer = Peer(conn, name="the leader (learner 0)", process_id=0)
  try:
    _io_timeout(conn, HANDSHAKE_TIMEOUT_S)
    answer_challenge(conn, authkey)
    deliver_challenge(conn, authkey)
    _io_timeout(conn, 0)
  except (OSError, EOFError, AuthenticationError) as e:
    peer.close()
    raise ConnectionError(f"{layout.name}: the control handshake with {layout.coordinator_address} failed "
                          f"({type(e).__name__}: {e}); do all processes have the same $AREAL_JAX_AUTHKEY?") from e
  peer.send("hello", {"process_id": layout.process_id, **info})
  return peer
