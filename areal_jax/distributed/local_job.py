"""Runs the N processes of a multi-process job on one machine, each pinned to its own cores.

Each process is `launch/tpu_run.py` with `--num_processes/--process_id/--coordinator_address` added, started with
its CPU affinity already set (XLA sizes its CPU thread pool from the affinity mask when JAX starts, so the pinning
reaches XLA too), a shared authkey for the control connections ($AREAL_JAX_AUTHKEY if set, else a random one), and
its output prefixed with its role.
SIGINT/SIGTERM are forwarded: each process shuts down cleanly and the job exits with 128 + the signal's number.

Samplers come and go: a sampler process that exits is restarted with the same command (`restart_samplers`; after a
second, or after a pause that doubles while it keeps failing within `QUICK_EXIT_S` of its start, up to
`MAX_RESTART_PAUSE_S`) and joins the running job, or else the job goes on without it. Every process shares the job's
persistent compilation cache (`cache_dir`, unless $JAX_COMPILATION_CACHE_DIR names one), so a restarted one loads its
programs instead of compiling them; a restarted one is forked from a process that has already imported the script's
modules (`zygote.py`), so it does not spend seconds of the other processes' CPU importing them again.

On a GPU or TPU host each process can own a subset of its accelerators (`learner_devices`, `sampler_devices` per
process; `device_blocks`): consecutive blocks in process order, given through the environment JAX reads at start
(`devices.device_subset_env`), so 8 GPUs can be a 4-GPU learner and 4 one-GPU sampler processes. A restarted sampler
gets its own block again. If a learner
process dies, the others are stopped within seconds and the job exits non-zero naming it; starting it again with the
same workdir resumes from the last checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from areal_jax.devices import device_subset_env, local_accelerators
from areal_jax.distributed import zygote
from areal_jax.distributed.job import JobSpec
from areal_jax.distributed.roles import AUTHKEY_ENV

STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long
FINISH_GRACE_S = 60.0  # after the leader finished: how long the others get to exit on their own
SAMPLER_FINISH_S = 10.0  # after the leader finished: a sampler still running then (one still starting, say) is stopped
QUICK_EXIT_S = 10.0  # a sampler that exits this soon after its start failed at once (a bad host or config)
MAX_RESTART_PAUSE_S = 60.0  # a sampler that keeps failing at once is restarted at most this often


def free_port_pair(host: str = "127.0.0.1") -> int:
  """A port p with p and p + 1 free (control connections and the learners' jax.distributed coordinator)."""
  for _ in range(100):
    with socket.socket() as a:
      a.bind((host, 0))
      port = a.getsockname()[1]
      with socket.socket() as b:
        try:
          b.bind((host, port + 1))
        except OSError:
          continue
    return port
  raise RuntimeError(f"no two consecutive free ports on {host}")


def core_sets(num_processes: int, cpus_per_process: int | None) -> list[list[int]]:
  """Cores for each process: consecutive blocks of the cores this process may use (wrapping when there are too few)."""
  cores = sorted(os.sched_getaffinity(0))
  k = cpus_per_process or max(1, len(cores) // num_processes)
  return [[cores[(i * k + j) % len(cores)] for j in range(k)] for i in range(num_processes)]


def device_blocks(roles: Sequence[str], *, learner_devices: int, sampler_devices: int,
                  available: int) -> list[list[int]]:
  """Accelerator indices per process (`roles` in process order, each "learner" or "sampler"): consecutive blocks of
  `learner_devices` or `sampler_devices` each; a role given 0 splits what the other leaves evenly. [] when both are 0
  (every process sees every device). A ValueError names the flags when the blocks do not fit `available`."""
  if not learner_devices and not sampler_devices:
    return []
  if learner_devices < 0 or sampler_devices < 0:
    raise ValueError(f"--learner_devices={learner_devices} --sampler_devices={sampler_devices}: must be >= 0")
  count = {r: sum(x == r for x in roles) for r in ("learner", "sampler")}
  per = {"learner": learner_devices, "sampler": sampler_devices}
  left = available - sum(per[r] * count[r] for r in per)
  for r in per:  # the role given 0 shares what is left
    if not per[r] and count[r]:
      per[r] = max(0, left) // count[r]
  need = sum(max(per[r], 1) * count[r] for r in per)
  if need > available:
    raise ValueError(f"--learner_devices={learner_devices} --sampler_devices={sampler_devices}: "
                     f"{count['learner']} learner and {count['sampler']} sampler processes need at least {need} "
                     f"devices; this host has {available}")
  blocks, start = [], 0
  for r in roles:
    blocks.append(list(range(start, start + per[r])))
    start += per[r]
  return blocks


def _signal_name(code: int) -> str:
  if code < 0:
    try:
      return f"signal {signal.Signals(-code).name}"
    except ValueError:
      return f"signal {-code}"
  return f"status {code}"


@dataclasses.dataclass
class _Child:
  name: str
  args: list[str]  # the script and its arguments
  cores: list[int]
  env: dict[str, str]
  python: str = sys.executable
  proc: subprocess.Popen | zygote.Forked | None = None
  sampler: bool = False
  started: float = 0.0
  pause_s: float = 1.0  # before the next restart
  restart_at: float | None = None  # when a sampler that exited is started again
  gone: bool = False  # a sampler that exited and is not restarted

  def start(self, forker: zygote.Zygote | None = None) -> None:
    """Starts the process: forked by `forker` if given (falling back to a new interpreter if that fails)."""
    self.started = time.monotonic()
    if forker is not None:
      read, write = os.pipe()
      try:
        self.proc = forker.spawn(self.args, self.cores, self.env, write)
      except OSError as e:
        print(f"local: {e}; starting {self.name} in a new interpreter", flush=True)
        os.close(read)
      else:
        threading.Thread(target=_prefix, args=(os.fdopen(read), self.name), daemon=True).start()
        return
      finally:
        os.close(write)
    self.proc = subprocess.Popen(pinned(self.cores, ["-u", *self.args], self.python), env=self.env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    threading.Thread(target=_prefix, args=(self.proc.stdout, self.name), daemon=True).start()

  # What `supervise` asks of a process (launch/ray_run.py's actors answer the same).
  def poll(self) -> int | None:
    return self.proc.poll()

  def wait(self, timeout: float) -> int:
    """The exit status; subprocess.TimeoutExpired if it is still running after `timeout` seconds."""
    return self.proc.wait(timeout)

  def signal(self, signum: int) -> None:
    _signal_group(self.proc, signum)

  @property
  def label(self) -> str:
    return f"{self.name} (pid {self.proc.pid})"


# argv: cores, then the python arguments to exec with that affinity (set before JAX starts, so XLA's pool follows it).
_PIN = ("import os, sys; os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(',')]); "
        "os.execv(sys.executable, [sys.executable] + sys.argv[2:])")


def pinned(cores: Sequence[int], args: Sequence[str], python: str = sys.executable) -> list[str]:
  """The command that runs `python *args` on `cores` only (pinned by a small exec wrapper rather than preexec_fn,
  which is unsafe once threads run in this process)."""
  return [python, "-c", _PIN, ",".join(map(str, cores)), *args]


def run_local(*, script: str, args: Sequence[str], num_processes: int, sampler_processes: int,
              cpus_per_process: int | None = None, python: str = sys.executable, restart_samplers: bool = False,
              cache_dir: str | None = None, preload: Sequence[str] = (), learner_devices: int = 0,
              sampler_devices: int = 0, accelerators: tuple[str, int] | None = None) -> int:
  """Starts the job, waits for it, returns 0 if every learner process finished cleanly (else 1). With
  `restart_samplers`, restarted samplers are forked from a zygote that imported `preload` (the script's modules).
  `learner_devices`/`sampler_devices`: accelerators per process (`device_blocks`) of `accelerators` (kind, count;
  default: this host's, `devices.local_accelerators`)."""
  kind, available = accelerators or local_accelerators()
  spec = JobSpec.create(num_processes=num_processes, sampler_processes=sampler_processes, accelerator=kind,
                        learner_devices=learner_devices, sampler_devices=sampler_devices, port=free_port_pair())
  host = "127.0.0.1"
  # The environment's key if it has one, so that more samplers can be started by hand against the running job.
  env = dict(os.environ, **{AUTHKEY_ENV: os.environ.get(AUTHKEY_ENV) or secrets.token_hex(16)})
  if cache_dir and "JAX_COMPILATION_CACHE_DIR" not in env:
    env.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.1")
  blocks = device_blocks([p.role for p in spec.processes], learner_devices=learner_devices,
                         sampler_devices=sampler_devices, available=available)
  print(f"local: the job's control address is {spec.coordinator_address(host)}", flush=True)
  children: list[_Child] = []
  for p, cores in zip(spec.processes, core_sets(num_processes, cpus_per_process)):
    child_env = dict(env, OMP_NUM_THREADS=str(len(cores)), OPENBLAS_NUM_THREADS=str(len(cores)),
                     MKL_NUM_THREADS=str(len(cores)))
    where = ""
    if blocks:
      child_env.update(device_subset_env(kind, blocks[p.process_id], port=free_port_pair()))
      where = f", {kind.upper()}s {','.join(map(str, blocks[p.process_id]))}"
    child = _Child(p.name, [script, *args, *spec.argv(p.process_id, host)], cores, child_env, python,
                   sampler=p.role == "sampler")
    child.start()
    children.append(child)
    print(f"local: {p.name} is process {p.process_id} (pid {child.proc.pid}) on cores {cores}{where}", flush=True)

  samplers = [c for c in children if c.sampler]
  forker = zygote.Zygote(preload, samplers[0].env, python) if restart_samplers and preload and samplers else None
  try:
    return supervise(children, restart=(lambda c: c.start(forker)) if restart_samplers else None,
                     no_restart_hint="--restart_samplers starts it again")
  finally:
    if forker is not None:
      forker.close()


def supervise(children: Sequence, *, restart=None, no_restart_hint: str = "", tag: str = "local") -> int:
  """Waits for the job's processes (in process order, the leader first; each with `name`, `sampler`, `label`,
  `poll()`, `wait(timeout)`, `signal(signum)`, `started`, `pause_s`, `restart_at`, `gone`), forwarding SIGINT and
  SIGTERM to them. `restart(child)` starts a sampler that exited again (None: the job goes on without it). Returns
  0 when every learner process finished cleanly, 1 when one died, 128 + N after forwarding signal N. Its lines start
  with `tag`."""
  stopped: list[int] = []

  def forward(signum, _frame):
    stopped.append(signum)
    for c in children:
      c.signal(signum)

  old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    return _supervise(children, stopped, restart, no_restart_hint, tag)
  finally:
    for s, handler in old.items():
      signal.signal(s, handler)


def _prefix(stream, name: str) -> None:
  for line in stream:
    sys.stdout.write(f"[{name}] {line}")
    sys.stdout.flush()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
  try:
    os.killpg(proc.pid, signum)  # the process and what it started (reward workers)
  except ProcessLookupError:
    pass


def _wait_or_kill(children: Sequence[_Child], grace_s: float) -> None:
  """Waits up to `grace_s` in all for the processes to exit; kills those still running then."""
  deadline = time.monotonic() + grace_s
  for c in children:
    try:
      c.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      c.signal(signal.SIGKILL)
      c.wait(None)


def _stop(children: Sequence[_Child]) -> None:
  for c in children:
    if c.poll() is None:
      c.signal(signal.SIGTERM)
  _wait_or_kill(children, STOP_GRACE_S)


def _supervise(children: Sequence, stopped: list[int], restart, hint: str, tag: str = "local") -> int:
  """0 when every learner process finished cleanly; 1 when one died; 128 + N after forwarding signal N (then each
  process gets FINISH_GRACE_S to shut down cleanly; a second signal ends them at once)."""
  leader_done_at = None
  learners = [c for c in children if not c.sampler]
  while True:
    if stopped:
      _wait_or_kill(children, FINISH_GRACE_S)
      print(f"{tag}: stopped by {signal.Signals(stopped[0]).name}; run the same command again to resume from the "
            "last checkpoint", flush=True)
      return 128 + stopped[0]
    for c in learners:
      code = c.poll()
      if code is not None and code != 0:
        print(f"{tag}: {c.label} exited with {_signal_name(code)}; stopping the other processes. "
              "Run the same command again to resume from the last checkpoint.", flush=True)
        _stop(children)
        return 1
    if leader_done_at is None and not stopped:
      _tend_samplers(children, restart, hint, tag)
    if all(c.poll() is not None for c in children):
      return 0 if all(c.poll() == 0 for c in learners) else 1
    if children[0].poll() == 0:  # the leader finished: the others are told to stop and should exit soon
      leader_done_at = leader_done_at or time.monotonic()
      if time.monotonic() - leader_done_at > SAMPLER_FINISH_S:
        # A sampler the leader could not tell (one still starting or rejoining) has no learner left to serve.
        late = [c for c in children if c.sampler and c.poll() is None]
        if late:
          print(f"{tag}: {', '.join(c.name for c in late)} still running {SAMPLER_FINISH_S:.0f} s after the leader "
                "finished; stopping them", flush=True)
          _stop(late)
      if time.monotonic() - leader_done_at > FINISH_GRACE_S:
        late = [c for c in children if c.poll() is None]
        print(f"{tag}: {', '.join(c.name for c in late)} still running {FINISH_GRACE_S:.0f} s after the leader "
              "finished; stopping them", flush=True)
        _stop(children)
        return 1 if any(not c.sampler for c in late) else 0
    time.sleep(0.2)


def _tend_samplers(children: Sequence, restart, hint: str, tag: str = "local") -> None:
  """A sampler process that exited (while the leader runs) is restarted when its pause is over, or left gone."""
  now = time.monotonic()
  for c in children:
    code = c.poll()
    if not c.sampler or code is None or code == 0:  # 0: the leader told it to stop
      continue
    if c.restart_at is None:
      if restart is None:
        if not c.gone:
          c.gone = True
          print(f"{tag}: {c.label} exited with {_signal_name(code)}; the job goes on without it"
                + (f" ({hint})" if hint else ""), flush=True)
        continue
      # One that fails at once waits longer each time before the next (a broken host, a bad config).
      c.pause_s = 1.0 if now - c.started > QUICK_EXIT_S else min(2 * c.pause_s, MAX_RESTART_PAUSE_S)
      c.restart_at = now + c.pause_s
      print(f"{tag}: {c.label} exited with {_signal_name(code)}; restarting it in {c.pause_s:.0f} s", flush=True)
    elif now >= c.restart_at:
      c.restart_at = None
      restart(c)
      print(f"{tag}: {c.name} is restarted (pid {c.proc.pid})", flush=True)
