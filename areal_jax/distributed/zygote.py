"""A process that imports a script's modules once and forks each restarted copy of it from there.

A sampler process spends seconds of CPU importing JAX, Flax, Orbax and this package before it does anything, and a
restarted one spends them again, on the cores the learner and the other samplers are using. `Zygote` pays them once:
it starts a small process that imports `preload` and then waits; `spawn(argv, cores, env, out_fd)` makes it fork a
child that starts a session of its own, takes `out_fd` as its stdout and stderr, pins itself to `cores`, sets
`env` and runs the script `argv[0]` as `__main__` (as `python -u argv[0] argv[1:]` would). The zygote imports only:
no JAX backend, no thread is started before it forks, so each child starts JAX afresh (its device count and
thread pool from its own environment and affinity). Environment variables read at import time (`JAX_PLATFORMS`,
`JAX_COMPILATION_CACHE_DIR`) come from the zygote's own environment: start it with the children's.

The supervisor sees each child as a `Forked` handle (pid, `poll`, `wait`) whose exit status the zygote reports.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

_MAX_MESSAGE = 1 << 20
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# argv: the package's root, the socket's fd, the modules to import.
_START = ("import sys; sys.path.insert(0, sys.argv[1]); from areal_jax.distributed import zygote; "
          "zygote.main(sys.argv[2:])")


class Forked:
  """A child of the zygote, seen from the supervisor: `pid`, `poll()`, `wait()` and `returncode` as in `Popen`."""

  def __init__(self, pid: int, zygote_gone: threading.Event):
    self.pid, self.returncode = pid, None
    self._exited, self._zygote_gone = threading.Event(), zygote_gone

  def poll(self) -> int | None:
    if self.returncode is None and self._zygote_gone.is_set() and not _running(self.pid):
      self._exit(1)  # its zygote died before it, and its exit status with it
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    while self.poll() is None:
      left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
      if left <= 0:
        raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
      self._exited.wait(left)
    return self.returncode

  def _exit(self, code: int) -> None:
    self.returncode = code
    self._exited.set()


def _running(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except (OSError, IndexError):
    return False


class Zygote:
  """The zygote process and the supervisor's end of its socket. Not thread-safe: spawn from one thread."""

  def __init__(self, preload: Sequence[str], env: dict[str, str], python: str = sys.executable):
    ours, theirs = socket.socketpair()
    self.proc = subprocess.Popen([python, "-u", "-c", _START, _ROOT, str(theirs.fileno()), *preload], env=env,
                                 pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True)
    theirs.close()
    self.sock, self.children = ours, {}
    self._pids: list[int] = []
    self._gone = threading.Event()
    self._answer = threading.Condition()
    threading.Thread(target=self._read, daemon=True).start()

  def spawn(self, argv: Sequence[str], cores: Sequence[int], env: dict[str, str], out_fd: int,
            timeout_s: float = 60.0) -> Forked:
    """A forked child running `argv`; raises OSError if the zygote is gone or does not answer within `timeout_s`
    (it answers only once its imports are done)."""
    request = json.dumps({"argv": list(argv), "cores": list(cores), "env": env}).encode()
    try:
      socket.send_fds(self.sock, [request], [out_fd])
    except OSError as e:
      raise OSError(f"the zygote (pid {self.proc.pid}) is gone: {e}") from e
    deadline = time.monotonic() + timeout_s
    with self._answer:
      while not self._pids and not self._gone.is_set():
        if not self._answer.wait(max(0.0, deadline - time.monotonic())):
          self.proc.kill()  # one that does not answer is not asked again
          raise OSError(f"the zygote (pid {self.proc.pid}) did not answer within {timeout_s:.0f} s")
      if not self._pids:
        raise OSError(f"the zygote (pid {self.proc.pid}) is gone")
      return self.children[self._pids.pop(0)]

  def close(self) -> None:
    try:
      self.sock.shutdown(socket.SHUT_RDWR)  # the zygote exits when its end closes; its children run on
    except OSError:
      pass  # it is gone already
    self.sock.close()
    try:
      self.proc.wait(5)
    except subprocess.TimeoutExpired:
      self.proc.kill()

  def _read(self) -> None:
    try:
      self._take(self.sock.makefile("r"))
    except OSError:
      pass  # closed
    finally:
      with self._answer:
        self._gone.set()
        self._answer.notify_all()

  def _take(self, lines) -> None:
    for line in lines:
      msg = json.loads(line)
      with self._answer:
        if "forked" in msg:
          self.children[msg["forked"]] = Forked(msg["forked"], self._gone)
          self._pids.append(msg["forked"])
          self._answer.notify_all()
        else:
          self.children[msg["exited"]]._exit(msg["code"])  # pylint: disable=protected-access


def _child(request: dict, out_fd: int) -> None:
  """In the forked child: its own session, output, cores and environment, then the script as `__main__`."""
  import runpy  # pylint: disable=g-import-not-at-top

  os.setsid()
  for fd in (1, 2):
    os.dup2(out_fd, fd)
  os.close(out_fd)
  os.sched_setaffinity(0, request["cores"])
  os.environ.clear()
  os.environ.update(request["env"])
  sys.argv = list(request["argv"])
  code = 0
  try:
    runpy.run_path(sys.argv[0], run_name="__main__")
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if not isinstance(e.code, (int, type(None))):
      print(e.code, file=sys.stderr)
  except BaseException:  # pylint: disable=broad-except
    import traceback  # pylint: disable=g-import-not-at-top
    traceback.print_exc()
    code = 1
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access


def _serve(sock: socket.socket) -> None:
  """The zygote's loop: forks on each request, reports each child's exit; returns when the supervisor is gone."""
  import select  # pylint: disable=g-import-not-at-top

  live: set[int] = set()
  while True:
    if select.select([sock], [], [], 0.1)[0]:
      data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 1)
      if not data:
        return
      pid = os.fork()
      if pid == 0:
        sock.close()
        _child(json.loads(data), fds[0])
      os.close(fds[0])
      live.add(pid)
      sock.sendall(json.dumps({"forked": pid}).encode() + b"\n")
    for pid in list(live):
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        live.discard(pid)
        sock.sendall(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def main(argv: Sequence[str]) -> None:
  import importlib  # pylint: disable=g-import-not-at-top

  sock = socket.socket(fileno=int(argv[0]))
  for name in argv[1:]:
    importlib.import_module(name)
  sys.stdout.flush()
  sys.stderr.flush()
  _serve(sock)
