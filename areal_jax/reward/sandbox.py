"""Runs untrusted Python in a contained subprocess (Linux).

Each run gets: its own session and process group; a fresh temporary working directory (also HOME and TMPDIR) that
is deleted afterwards; a minimal environment; stdin, stdout and stderr as files in that directory; rlimits on CPU
time, address space (RLIMIT_AS), processes (RLIMIT_NPROC), file size (which also caps output) and open files, set by
a small trusted harness before the program starts; a wall-clock timeout. After every run, finished or not,
everything left in its process group is killed. No Python runs between fork and exec, so callers may have threads.

When the caller is root, the program runs under a per-run unprivileged uid: root ignores RLIMIT_NPROC, and another
uid can neither signal our processes nor write our files. The harness drops the uid itself after start-up, reaching
the interpreter's library directories through descriptors opened before the drop (`/proc/self/fd/N`), so an
interpreter installed where other users cannot read (under /root, say) still works; every process of that uid is
killed after the run. Inside, an audit hook (`_HARNESS`) also refuses process creation, signals to other processes,
writes outside the working directory, sockets and ctypes. Audit hooks are a tripwire for ordinary code, not a
security boundary; the boundaries are the rlimits, the process group and the uid.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
  """Per-run limits. `site_packages=False` runs `python -S` (stdlib only; ~3x faster start-up)."""

  wall_s: float = 4.0
  cpu_s: float = 3.0
  memory_mb: int = 1024
  max_procs: int = 16  # processes and threads (of the per-run uid; else on top of this user's current count)
  max_output_mb: float = 16.0  # any file the program writes, stdout and stderr included
  max_open_files: int = 64
  site_packages: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
  status: str  # "ok" | "exit N" | "signal SIGxxx" | "timeout"
  stdout: str
  stderr: str
  wall_s: float

  @property
  def ok(self) -> bool:
    return self.status == "ok"


# The program runs under this harness, started as `python -I [-S] harness.py` in the working directory, which holds
# run.json ({"rlimits": {name: [soft, hard]}, "uid": int or null, "call": null or {"fn_name", "args"}}) and
# program.py. The harness, still trusted, sets the rlimits, drops to the uid and installs the audit hook; then it runs
# the program as __main__, or (with "call") defines it as a module, calls the function and prints the JSON result
# as the last line of stdout.
_HARNESS = r'''
import json, os, resource, sys
_WORKDIR = os.path.realpath(os.getcwd())
with open("run.json") as _f:
  _RUN = json.load(_f)
with open("program.py") as _f:
  _SOURCE = _f.read()
for _name, _limit in _RUN["rlimits"].items():
  resource.setrlimit(getattr(resource, _name), tuple(_limit))

if _RUN["uid"] is not None:  # drop root; the library directories stay reachable through descriptors opened now
  _moved = {}
  for _i, _p in enumerate(sys.path):
    if os.path.isdir(_p):
      _moved[_p] = sys.path[_i] = "/proc/self/fd/%d" % os.open(_p, os.O_RDONLY | os.O_DIRECTORY)
  for _m in list(sys.modules.values()):
    _path = getattr(_m, "__path__", None)
    if isinstance(_path, list):
      _path[:] = [next((n + p[len(o):] for o, n in _moved.items() if p == o or p.startswith(o + os.sep)), p)
                  for p in _path]
  sys.path_importer_cache.clear()
  os.setgroups([])
  os.setgid(_RUN["uid"])
  os.setuid(_RUN["uid"])
_PID, _PGID = os.getpid(), os.getpgid(0)
_realpath, _join, _getcwd = os.path.realpath, os.path.join, os.getcwd
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {"os.remove": (0,), "os.rename": (0, 1), "os.rmdir": (0,), "os.mkdir": (0,), "os.symlink": (1,),
                "os.link": (1,), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
                "shutil.copyfile": (1,)}
_DENY = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.system", "subprocess.Popen", "socket.__new__")
_busy = []

def _inside(path):
  if isinstance(path, int):
    return True
  p = _realpath(_join(_getcwd(), os.fsdecode(path)))
  return p == _WORKDIR or p.startswith(_WORKDIR + os.sep) or p == os.devnull

def _hook(event, args):
  if _busy:
    return
  _busy.append(1)
  try:
    if event in _DENY or event.startswith("ctypes."):
      raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0].partition(".")[0] in ("ctypes", "_ctypes", "cffi"):
      raise ImportError(f"sandbox: importing {args[0]} is not allowed")
    if event in ("os.kill", "os.killpg"):
      target = args[0]
      if not (target in (0, _PID) or (event == "os.killpg" and target == _PGID) or target == -_PGID):
        raise PermissionError(f"sandbox: {event}({target}) is not allowed")
    elif event == "open":
      path, mode, flags = args
      writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & _WRITE
      if path is not None and writes and not _inside(path):
        raise PermissionError(f"sandbox: writing {path!r} outside the working directory is not allowed")
    elif event in _PATH_EVENTS:
      for i in _PATH_EVENTS[event]:
        if i < len(args) and args[i] is not None and not _inside(args[i]):
          raise PermissionError(f"sandbox: {event}({args[i]!r}) outside the working directory is not allowed")
  finally:
    _busy.pop()

import _posixsubprocess
def _no_fork_exec(*a, **k):
  raise PermissionError("sandbox: subprocesses are not allowed")
_posixsubprocess.fork_exec = _no_fork_exec
sys.addaudithook(_hook)

_code = compile(_SOURCE, "program.py", "exec")
sys.argv = ["program.py"]
if _RUN["call"] is None:
  exec(_code, {"__name__": "__main__", "__file__": "program.py", "__builtins__": __builtins__})
else:
  import types
  _out, sys.stdout = sys.stdout, open(os.devnull, "w")
  _module = types.ModuleType("solution")
  _module.__file__ = "program.py"
  sys.modules["solution"] = _module
  exec(_code, _module.__dict__)
  _name = _RUN["call"]["fn_name"]
  _fn = getattr(_module, _name, None)
  if not callable(_fn) and isinstance(getattr(_module, "Solution", None), type):
    _fn = getattr(_module.Solution(), _name, None)
  if not callable(_fn):
    raise SystemExit(f"sandbox: the program defines no function or Solution method {_name!r}")
  _result = _fn(*_RUN["call"]["args"])
  sys.stdout.flush()
  _out.write("\n" + json.dumps(_result, default=repr) + "\n")
  _out.flush()
'''

_RUN_COUNTER = itertools.count()
_UID_BASE = 1 << 30  # per-run uids: far above any real account


def _run_uid() -> int:
  """A uid no other live run uses: this process's pid and a counter (unique over 256 consecutive runs)."""
  return _UID_BASE + ((os.getpid() & 0x3FFFFF) << 8) + (next(_RUN_COUNTER) & 0xFF)


def _pids_of_uid(uid: int) -> list[int]:
  """Processes whose real uid is `uid` (from /proc/PID/status: /proc/PID itself shows root after a uid change)."""
  pids, prefix = [], f"Uid:\t{uid}\t".encode()
  for d in os.listdir("/proc"):
    if d.isdigit():
      try:
        with open(f"/proc/{d}/status", "rb") as f:
          if prefix in f.read():
            pids.append(int(d))
      except OSError:
        pass
  return pids


def descendants(pid: int) -> list[int]:
  """All live descendants of `pid` (from /proc), each after its parent."""
  children: dict[int, list[int]] = {}
  for d in os.listdir("/proc"):
    if not d.isdigit():
      continue
    try:
      with open(f"/proc/{d}/stat", "rb") as f:
        stat = f.read()
    except OSError:
      continue
    ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
    children.setdefault(ppid, []).append(int(d))
  out, todo = [], [pid]
  while todo:
    for c in children.get(todo.pop(), ()):
      out.append(c)
      todo.append(c)
  return out


def _gone(pid: int) -> bool:
  """True once `pid` has exited (a zombie counts: it runs nothing and holds no resources but its pid)."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      return f.read().rsplit(b") ", 1)[1][:1] in (b"Z", b"X")
  except (FileNotFoundError, ProcessLookupError):
    return True


def _await_exit(pids: list[int], timeout_s: float = 2.0) -> None:
  """SIGKILL is asynchronous: wait (briefly) until the killed processes are really gone."""
  deadline = time.monotonic() + timeout_s
  while pids and time.monotonic() < deadline:
    pids = [p for p in pids if not _gone(p)]
    if pids:
      time.sleep(0.005)


def kill_tree(pid: int) -> None:
  """SIGKILLs `pid`, its descendants and the process groups they lead (never the caller's own group); returns once
  they have exited."""
  own = os.getpgid(0)
  victims = [pid] + descendants(pid)
  for p in victims:
    try:
      g = os.getpgid(p)
      if g != own and g == p:
        os.killpg(g, signal.SIGKILL)
      os.kill(p, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
  _await_exit(victims)


def _rlimits(limits: Limits, uid: int | None) -> dict[str, list[int]]:
  """The rlimits the harness sets on itself before running the program."""
  cpu = max(1, math.ceil(limits.cpu_s))
  out = int(limits.max_output_mb * 2**20)
  mem = int(limits.memory_mb * 2**20)
  nproc = limits.max_procs
  if uid is None and os.geteuid() != 0:  # RLIMIT_NPROC counts all of this user's processes
    nproc += len(_pids_of_uid(os.getuid()))
  return {"RLIMIT_CPU": [cpu, cpu + 1], "RLIMIT_AS": [mem, mem], "RLIMIT_FSIZE": [out, out],
          "RLIMIT_NOFILE": [limits.max_open_files] * 2, "RLIMIT_CORE": [0, 0], "RLIMIT_NPROC": [nproc, nproc]}


def _status(returncode: int | None, timed_out: bool) -> str:
  if timed_out:
    return "timeout"
  if returncode == 0:
    return "ok"
  if returncode is not None and returncode < 0:
    try:
      return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
      return f"signal {-returncode}"
  return f"exit {returncode}"


def _rmtree(path: str) -> None:
  def unlock(func, p, exc_info):
    try:
      os.chmod(os.path.dirname(p), 0o700)
      os.chmod(p, 0o700)
      func(p)
    except OSError:
      pass

  shutil.rmtree(path, onerror=unlock)


def run_python(source: str, *, stdin: str = "", call: dict | None = None, limits: Limits = Limits(),
               python: str | None = None) -> RunResult:
  """Runs `source` as a script fed `stdin`, or, with `call={"fn_name": ..., "args": [...]}`, calls its function and
  returns the JSON result as the last line of stdout. Never raises for anything the program does."""
  python = python or sys.executable
  uid = _run_uid() if os.geteuid() == 0 else None
  work = tempfile.mkdtemp(prefix="areal_sandbox_")
  t0 = time.monotonic()
  proc = None
  timed_out = False
  try:
    run = {"rlimits": _rlimits(limits, uid), "uid": uid, "call": call}
    files = {"harness.py": _HARNESS, "program.py": source, "stdin.txt": stdin, "run.json": json.dumps(run)}
    for name, text in files.items():
      with open(os.path.join(work, name), "w", encoding="utf-8") as f:
        f.write(text)
    if uid is not None:
      os.chown(work, uid, uid)
    os.chmod(work, 0o700)
    env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
           "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    argv = [python, "-I", *([] if limits.site_packages else ["-S"]), "harness.py"]
    with open(os.path.join(work, "stdin.txt"), "rb") as fin, \
         open(os.path.join(work, "stdout.txt"), "wb") as fout, \
         open(os.path.join(work, "stderr.txt"), "wb") as ferr:
      proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=ferr, cwd=work, env=env, close_fds=True,
                              start_new_session=True)
    try:
      proc.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
      timed_out = True
    wall = time.monotonic() - t0
    _kill_run(proc, uid)
    proc.wait()
    cap = int(limits.max_output_mb * 2**20)
    with open(os.path.join(work, "stdout.txt"), "rb") as f:
      out = f.read(cap).decode("utf-8", "replace")
    with open(os.path.join(work, "stderr.txt"), "rb") as f:
      err = f.read(65536).decode("utf-8", "replace")
    return RunResult(status=_status(proc.returncode, timed_out), stdout=out, stderr=err, wall_s=wall)
  except OSError as e:  # e.g. the interpreter cannot start
    return RunResult(status=f"error {type(e).__name__}: {e}", stdout="", stderr="", wall_s=time.monotonic() - t0)
  finally:
    if proc is not None and proc.returncode is None:
      _kill_run(proc, uid)
      proc.wait()
    _rmtree(work)


def _kill_run(proc: subprocess.Popen, uid: int | None) -> None:
  """Kills the run's process group, and with a per-run uid every process of that uid (escapees of the group)."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  if uid is not None:
    for _ in range(3):  # a process forking while we scan is caught by the next pass (RLIMIT_NPROC bounds it)
      pids = [p for p in _pids_of_uid(uid) if not _gone(p)]
      if not pids:
        break
      for p in pids:
        try:
          os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
          pass
      _await_exit(pids)
