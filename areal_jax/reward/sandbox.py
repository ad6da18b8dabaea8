"""Runs untrusted Python in a jail the kernel enforces (Linux): one process per run, nothing left after it.

`isolation="bwrap"` (the default) starts the program under bubblewrap (`bwrap`, Debian's `bubblewrap` package) in
new user, mount, PID, network, IPC, UTS and cgroup namespaces, as uid 65534 without capabilities:

* files: a read-only root holding only /usr (with the /bin, /lib... links) and the interpreter's installation; a
  private /tmp (its working directory and HOME) of `disk_mb`; its own /proc, which shows only its own processes; a
  read-only minimal /dev. No dataset, project tree, home directory, /etc or other process is reachable.
* network: a namespace with nothing but its own loopback, and no sockets at all (seccomp).
* seccomp (libseccomp through `pyseccomp`): no new processes (fork, vfork, clone without CLONE_THREAD; clone3 says
  ENOSYS so libc falls back to clone), no sockets, ptrace, process_vm_*, namespaces, mounts, keyrings, bpf,
  perf_event_open, userfaultfd or io_uring. Threads are allowed (recursion-depth tricks need them).
* rlimits, set by the harness before the program's first line: CPU seconds, address space (one process, so this
  caps the whole answer), threads (RLIMIT_NPROC; exempt when the service runs as root, where the address-space cap
  and the clock bound them), file size, open files, no core dumps.
* data: the program and its arguments arrive on an inherited descriptor the harness reads and closes; stdin, stdout
  and stderr are pipes this process owns (stdout is capped at `max_output_mb`). Nothing is read back from a path.
* the end: when the program returns, times out or writes too much, bwrap is SIGKILLed; `--die-with-parent` and the
  PID namespace take everything in the jail with it.

The same boundary holds whether the service runs as root or not. Where the host cannot build it (no `bwrap`, user
namespaces refused, no libseccomp), `check_isolation()` and every run raise `SandboxUnavailable` naming what is
missing. `isolation="rlimits"` is a weaker mode a user must choose by name: the same harness, rlimits, session and
wall clock, with no namespaces and no seccomp, so the program can read and write what this user can and open sockets.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ISOLATIONS = ("bwrap", "rlimits")


class SandboxUnavailable(RuntimeError):
  """The host cannot build the requested isolation; the message names what is missing."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
  """Per-run limits. `site_packages=False` runs `python -S` (stdlib only; ~3x faster start-up)."""

  wall_s: float = 4.0
  cpu_s: float = 3.0
  memory_mb: int = 1024  # address space of the one process (threads share it)
  max_threads: int = 16  # RLIMIT_NPROC (not enforced for a root service: see the module docstring)
  max_output_mb: float = 16.0  # stdout, and any one file the program writes
  disk_mb: int = 64  # the private /tmp ("bwrap")
  max_open_files: int = 64
  site_packages: bool = False
  isolation: str = "bwrap"  # or "rlimits", the weaker mode (module docstring)

  def __post_init__(self):
    if self.isolation not in ISOLATIONS:
      raise ValueError(f"sandbox isolation {self.isolation!r}: choose one of {ISOLATIONS}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
  status: str  # "ok" | "exit N" | "signal SIGxxx" | "timeout" | "output limit"
  stdout: str
  stderr: str
  wall_s: float

  @property
  def ok(self) -> bool:
    return self.status == "ok"


# Started as `python -I [-S] -c _HARNESS FD`. FD holds {"source", "rlimits": {name: [soft, hard]}, "call"}; the
# harness reads and closes it, sets the rlimits, then runs the program as __main__, or (with "call": {"fn_name",
# "args"}) defines it as a module, calls the function and prints the JSON result as the last line of stdout.
_HARNESS = r'''
import json, os, resource, sys
with os.fdopen(int(sys.argv[1]), "rb") as _f:
  _RUN = json.loads(_f.read())
for _name, _limit in _RUN["rlimits"].items():
  resource.setrlimit(getattr(resource, _name), tuple(_limit))
_code = compile(_RUN["source"], "program.py", "exec")
sys.argv = ["program.py"]
if _RUN["call"] is None:
  del _RUN
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

_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_DENIED_SYSCALLS = (
    "fork", "vfork", "socket", "socketpair", "ptrace", "process_vm_readv", "process_vm_writev", "unshare", "setns",
    "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount", "fspick", "move_mount", "open_tree", "keyctl",
    "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "kcmp", "pidfd_getfd",
    "open_by_handle_at", "name_to_handle_at", "personality", "syslog", "acct", "quotactl", "swapon", "swapoff",
    "reboot", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load")
_CLONE_THREAD = 0x00010000


@functools.cache
def _seccomp_filter() -> bytes:
  """The jail's seccomp program (classic BPF for bwrap's `--seccomp FD`), built once per process."""
  try:
    import pyseccomp as sc  # pylint: disable=g-import-not-at-top
    f = sc.SyscallFilter(sc.ALLOW)
  except (ImportError, OSError, RuntimeError) as e:
    raise SandboxUnavailable(f"code sandbox: no seccomp filter ({type(e).__name__}: {e}); it needs the pyseccomp "
                             "package and libseccomp.so.2 (Debian: libseccomp2)") from None
  for name in _DENIED_SYSCALLS:
    try:
      f.add_rule(sc.ERRNO(errno.EPERM), name)
    except (ValueError, OSError):  # not a syscall on this architecture
      pass
  f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
  f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
  with tempfile.TemporaryFile() as out:
    f.export_bpf(out)
    out.seek(0)
    return out.read()


def _memfd(name: str, data: bytes) -> int:
  fd = os.memfd_create(name, 0)  # no CLOEXEC: the jail inherits it
  os.write(fd, data)
  os.lseek(fd, 0, os.SEEK_SET)
  return fd


def _bwrap_argv(python: str, limits: Limits, seccomp_fd: int, info_fd: int) -> list[str]:
  """bwrap's command line up to the interpreter (see the module docstring)."""
  bwrap = shutil.which("bwrap")
  if bwrap is None:
    raise SandboxUnavailable("code sandbox: `bwrap` is not on PATH; install bubblewrap (Debian/Ubuntu: apt-get "
                             "install bubblewrap), or choose the weaker isolation='rlimits' by name")
  argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--uid", "65534", "--gid", "65534",
          "--ro-bind", "/usr", "/usr"]
  for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
    if os.path.islink(top):
      argv += ["--symlink", os.readlink(top), top]
    elif os.path.isdir(top):
      argv += ["--ro-bind", top, top]
  roots = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.realpath(python))}
  if limits.site_packages:
    roots.add(os.path.realpath(sys.prefix))
  for root in sorted(roots):
    if not (root == "/usr" or root.startswith("/usr/")):
      argv += ["--ro-bind", root, root]
  return argv + ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.disk_mb << 20), "--tmpfs", "/tmp",
                 "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--clearenv",
                 *[a for k, v in dict(_ENV, HOME="/tmp", TMPDIR="/tmp").items() for a in ("--setenv", k, v)],
                 "--seccomp", str(seccomp_fd), "--info-fd", str(info_fd), "--"]


@functools.cache
def check_isolation() -> None:
  """Raises SandboxUnavailable, naming what is missing, unless this host can run `isolation="bwrap"` jails (checked
  once per process by running one)."""
  probe = "import os\ntry:\n  os.fork()\nexcept PermissionError:\n  print(os.getuid(), 'cannot fork')"
  r = run_python(probe, limits=Limits(wall_s=30.0, cpu_s=10.0), _checked=True)
  if r.status != "ok" or r.stdout.split() != ["65534", "cannot", "fork"]:
    raise SandboxUnavailable(f"code sandbox: bwrap could not start a jail on this host ({r.status}): "
                             f"{r.stderr.strip()[-500:] or r.stdout.strip()[-200:]}; user namespaces may be "
                             "disabled (sysctl kernel.unprivileged_userns_clone / user.max_user_namespaces). "
                             "Choose the weaker isolation='rlimits' by name to score code anyway")


def _rlimits(limits: Limits) -> dict[str, list[int]]:
  cpu = max(1, math.ceil(limits.cpu_s))
  out = int(limits.max_output_mb * 2**20)
  mem = int(limits.memory_mb * 2**20)
  nproc = limits.max_threads
  if limits.isolation == "rlimits" and os.geteuid() != 0:  # here RLIMIT_NPROC counts all of this user's processes
    nproc += sum(_user_tasks(os.getuid()))
  return {"RLIMIT_CPU": [cpu, cpu + 1], "RLIMIT_AS": [mem, mem], "RLIMIT_FSIZE": [out, out],
          "RLIMIT_NOFILE": [limits.max_open_files] * 2, "RLIMIT_CORE": [0, 0], "RLIMIT_NPROC": [nproc, nproc]}


def _user_tasks(uid: int):
  """The thread count of each process of `uid` (RLIMIT_NPROC counts threads)."""
  prefix = f"Uid:\t{uid}\t".encode()
  for d in os.listdir("/proc"):
    if d.isdigit():
      try:
        with open(f"/proc/{d}/status", "rb") as f:
          status = f.read()
      except OSError:
        continue
      if prefix in status:
        yield int(status.split(b"Threads:\t")[1].split()[0]) if b"Threads:\t" in status else 1


def _status(returncode: int | None, ended: str | None) -> str:
  if ended:
    return ended
  if returncode == 0:
    return "ok"
  if returncode is not None and returncode < 0:
    try:
      return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
      return f"signal {-returncode}"
  return f"exit {returncode}"


def _exchange(proc: subprocess.Popen, stdin: bytes, limits: Limits) -> tuple[bytes, bytes, str | None]:
  """Feeds stdin and reads stdout/stderr until the program exits; (stdout, stderr, "timeout" | "output limit" |
  None). stderr keeps its first 64 KiB."""
  deadline = time.monotonic() + limits.wall_s
  cap = int(limits.max_output_mb * 2**20)
  out, err = bytearray(), bytearray()
  sel = selectors.DefaultSelector()
  pending = memoryview(stdin)
  if pending:
    os.set_blocking(proc.stdin.fileno(), False)
    sel.register(proc.stdin, selectors.EVENT_WRITE)
  else:
    proc.stdin.close()
  sel.register(proc.stdout, selectors.EVENT_READ, out)
  sel.register(proc.stderr, selectors.EVENT_READ, err)
  try:
    while sel.get_map():
      left = deadline - time.monotonic()
      if left <= 0:
        return bytes(out), bytes(err), "timeout"
      for key, _ in sel.select(left):
        if key.fileobj is proc.stdin:
          try:
            pending = pending[os.write(key.fd, pending[:65536]):]
          except (BrokenPipeError, BlockingIOError) as e:
            pending = pending if isinstance(e, BlockingIOError) else pending[:0]
          if not pending:
            sel.unregister(proc.stdin)
            proc.stdin.close()
          continue
        chunk = os.read(key.fd, 1 << 16)
        if not chunk:
          sel.unregister(key.fileobj)
        elif key.data is err:
          err += chunk[:max(0, 65536 - len(err))]
        else:
          out += chunk
          if len(out) > cap:
            return bytes(out[:cap]), bytes(err), "output limit"
    try:
      proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      return bytes(out), bytes(err), "timeout"
    return bytes(out), bytes(err), None
  finally:
    sel.close()


def run_python(source: str, *, stdin: str = "", call: dict | None = None, limits: Limits = Limits(),
               python: str | None = None, _checked: bool = False) -> RunResult:
  """Runs `source` as a script fed `stdin`, or, with `call={"fn_name": ..., "args": [...]}`, calls its function and
  returns the JSON result as the last line of stdout. Never raises for anything the program does; raises
  SandboxUnavailable when the host cannot build the jail `limits.isolation` names."""
  python = python or sys.executable
  jailed = limits.isolation == "bwrap"
  if jailed and not limits.site_packages:
    python = os.path.realpath(python)  # a venv's bin/python links to the base interpreter, which is all -S needs
  if jailed and not _checked:
    check_isolation()
  t0 = time.monotonic()
  fds, work, proc, info = [], None, None, None
  try:
    payload = json.dumps({"source": source, "rlimits": _rlimits(limits), "call": call}).encode()
    fds.append(_memfd("program", payload))
    argv = [python, "-I", *([] if limits.site_packages else ["-S"]), "-c", _HARNESS, str(fds[0])]
    if jailed:
      info, info_w = os.pipe()
      fds += [_memfd("seccomp", _seccomp_filter()), info_w]
      argv = _bwrap_argv(python, limits, fds[1], info_w) + argv
      env, cwd = {}, None
    else:
      work = tempfile.mkdtemp(prefix="areal_sandbox_")
      env, cwd = dict(_ENV, HOME=work, TMPDIR=work), work
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                            env=env, pass_fds=fds, start_new_session=True)
    for fd in fds:
      os.close(fd)
    fds = []
    out, err, ended = _exchange(proc, stdin.encode(), limits)
    wall = time.monotonic() - t0
    _kill(proc, info)
    return RunResult(status=_status(proc.returncode, ended), stdout=out.decode("utf-8", "replace"),
                     stderr=err.decode("utf-8", "replace"), wall_s=wall)
  except OSError as e:  # e.g. the interpreter or bwrap cannot start
    return RunResult(status=f"error {type(e).__name__}: {e}", stdout="", stderr="", wall_s=time.monotonic() - t0)
  finally:
    for fd in fds:
      os.close(fd)
    if proc is not None:
      _kill(proc, info)
      for f in (proc.stdin, proc.stdout, proc.stderr):
        if not f.closed:
          f.close()
    if info is not None:
      os.close(info)
    if work is not None:
      shutil.rmtree(work, ignore_errors=True)


def _kill(proc: subprocess.Popen, info: int | None) -> None:
  """Ends the run: SIGKILLs its process group if it is still going, and reaps it. bwrap may exit a moment before its
  jail's init (which takes everything else in the PID namespace with it when it exits), so with bwrap's `info` pipe
  (the init's pid and namespace) wait for that init too."""
  if proc.poll() is None:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    proc.wait()
  if info is None:
    return
  os.set_blocking(info, False)
  try:
    jail = json.loads(os.read(info, 1 << 16))
    init, pidns = int(jail["child-pid"]), f"pid:[{jail['pid-namespace']}]"
  except (OSError, ValueError, KeyError):
    return  # bwrap died before it made the jail
  deadline = time.monotonic() + 5.0
  while not _gone(init):
    try:
      if os.readlink(f"/proc/{init}/ns/pid") != pidns:
        return  # the pid is another process's now: the init is long gone
      os.kill(init, signal.SIGKILL)  # it dies with bwrap anyway (--die-with-parent); do not wait for the signal
    except OSError:
      return
    if time.monotonic() > deadline:
      raise RuntimeError(f"code sandbox: the jail of pid {init} did not end within 5 s of its run")
    time.sleep(0.001)


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
  deadline = time.monotonic() + 2.0  # SIGKILL is asynchronous: wait (briefly) until they are really gone
  while victims and time.monotonic() < deadline:
    victims = [p for p in victims if not _gone(p)]
    if victims:
      time.sleep(0.005)
