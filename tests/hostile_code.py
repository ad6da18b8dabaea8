"""Hostile answers for the code sandbox, shared by the tests that run them as root and as an unprivileged user.

Every program is scored against one stdin test whose expected output is "7". An attack that gets through prints 7
(it read the answer or the secret, or its side effect happened), so "every attack scores 0" is the first check; the
tests then look for the side effects themselves. `Setup` holds what the attacks aim at, made by the test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile

SECRET = "AREAL_JAX_TEST_SECRET_7"  # in the environment and the memory of every process of the test


def jailed_processes() -> list[int]:
  """Live processes in a PID namespace other than ours: whatever a jail left running."""
  ours, out = os.readlink("/proc/self/ns/pid"), []
  for d in os.listdir("/proc"):
    if d.isdigit():
      try:
        if os.readlink(f"/proc/{d}/ns/pid") != ours:
          with open(f"/proc/{d}/stat", "rb") as f:
            if f.read().rsplit(b") ", 1)[1][:1] not in (b"Z", b"X"):
              out.append(int(d))
      except OSError:
        pass
  return out


@dataclasses.dataclass
class Setup:
  """What the attacks aim at: files of the "training user", a listening port, a decoy process whose command line
  names the dataset, and a victim process of the same user."""

  root: str
  dataset: str
  victim_file: str
  outside: str
  port: int
  listener: socket.socket
  decoy: subprocess.Popen
  victim: subprocess.Popen

  @classmethod
  def make(cls) -> Setup:
    root = tempfile.mkdtemp(prefix="hostile_")
    os.chmod(root, 0o755)  # world-readable, as a dataset usually is
    dataset = os.path.join(root, "train.jsonl")
    with open(dataset, "w") as f:
      f.write("7\n")
    victim_file = os.path.join(root, "checkpoint.txt")
    with open(victim_file, "w") as f:
      f.write("weights\n")
    os.chmod(victim_file, 0o666)
    outside = os.path.join(root, "outside")
    os.mkdir(outside)
    os.chmod(outside, 0o777)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    decoy = subprocess.Popen(sleeper + [f"--config.data.path={dataset}"], env=dict(os.environ, SECRET=SECRET))
    victim = subprocess.Popen(sleeper)
    return cls(root=root, dataset=dataset, victim_file=victim_file, outside=outside,
               port=listener.getsockname()[1], listener=listener, decoy=decoy, victim=victim)

  def programs(self) -> dict[str, str]:
    return {name: src.format(dataset=self.dataset, victim_file=self.victim_file, outside=self.outside,
                             port=self.port, victim=self.victim.pid, secret=SECRET)
            for name, src in ATTACKS.items()}

  def breaches(self) -> list[str]:
    """The side effects that show an attack got through."""
    out = []
    if os.listdir(self.outside):
      out.append(f"files written outside: {os.listdir(self.outside)}")
    with open(self.victim_file) as f:
      if f.read() != "weights\n":
        out.append("the user's file was overwritten")
    if self.victim.poll() is not None or self.decoy.poll() is not None:
      out.append("a process of the user was killed")
    try:
      conn, _ = self.listener.accept()
      conn.close()
      out.append("a TCP connection reached 127.0.0.1")
    except BlockingIOError:
      pass
    return out

  def close(self) -> None:
    for p in (self.decoy, self.victim):
      p.kill()
      p.wait()
    self.listener.close()
    subprocess.run(["rm", "-rf", self.root], check=False)


# {dataset}, {victim_file}, {outside}, {port}, {victim}, {secret}: filled by Setup.programs.
ATTACKS = {
    # Reward without solving: find the answer instead of computing it.
    "dataset named in /proc/*/cmdline": r"""
import os
for pid in os.listdir("/proc"):
  try:
    args = open(f"/proc/{{pid}}/cmdline", "rb").read().split(b"\0")
  except OSError:
    continue
  for a in args:
    if a.startswith(b"--config.data.path="):
      print(open(a.split(b"=", 1)[1]).read().strip())
      raise SystemExit
""",
    "dataset read by path": "print(open({dataset!r}).read().strip())",
    "secrets in other processes' environment and memory": r"""
import os, re
for pid in os.listdir("/proc"):
  if not pid.isdigit() or int(pid) == os.getpid():
    continue
  try:
    if b"{secret}" in open(f"/proc/{{pid}}/environ", "rb").read():
      print(7); raise SystemExit
    mem = open(f"/proc/{{pid}}/mem", "rb")
    for line in open(f"/proc/{{pid}}/maps"):
      lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
      if "r" in line.split()[1] and hi - lo < 1 << 26:
        try:
          mem.seek(lo)
          if b"{secret}" in mem.read(hi - lo):
            print(7); raise SystemExit
        except OSError:
          pass
  except OSError:
    pass
""",
    # Writes and kills outside the answer.
    "write outside": "open({outside!r} + '/pwned', 'w').write('x')\nprint(7)",
    "write outside through dir_fd": (
        "import os\nd = os.open({outside!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.close(os.open('pwned', os.O_WRONLY | os.O_CREAT, dir_fd=d))\nprint(7)"),
    "overwrite the user's file": "open({victim_file!r}, 'w').write('pwned')\nprint(7)",
    "kill a process of the user": "import os\nos.kill({victim}, 9)\nprint(7)",
    "kill every process it can": "import os\nos.kill(-1, 9)",
    "kill the parent and its group": (
        "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)\nos.kill(os.getppid(), 9)"),
    # The network.
    "TCP to localhost": (
        "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'leak')\nprint(7)"),
    "raw socket syscall": (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nif libc.syscall(41, 2, 1, 0) >= 0:\n  print(7)"),
    # Processes that outlive the answer, or hide from its limits.
    "setsid daemon": r"""
import os, time
if os.fork() == 0:
  os.setsid()
  while True:
    open({outside!r} + "/daemon", "a").write("x")
    time.sleep(0.1)
print(7)
""",
    "fork through a raw syscall": (
        "import ctypes, time\nlibc = ctypes.CDLL(None)\npid = libc.syscall(57)\n"
        "if pid == 0:\n  time.sleep(60)\nelif pid > 0:\n  print(7)"),
    "subprocess": "import subprocess\nsubprocess.Popen(['sleep', '600'], start_new_session=True)\nprint(7)",
    "fork bomb": "import os\nwhile True:\n  os.fork()",
    "new user namespace": (
        "import ctypes\nlibc = ctypes.CDLL(None)\nif libc.unshare(0x10000000) == 0:\n  print(7)"),
    "ptrace the parent": "import ctypes, os\nif ctypes.CDLL(None).ptrace(16, os.getppid(), 0, 0) == 0:\n  print(7)",
    # Resources.
    "memory across threads": r"""
import threading
got = []
def grab():
  try:
    got.append(bytearray(400 << 20))
  except MemoryError:
    pass
ts = [threading.Thread(target=grab) for _ in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]
if len(got) == 4:
  print(7)
""",
    "10 GB allocation": "x = bytearray(10 << 30)\nprint(7)",
    "fill the disk": r"""
import os
with open("/tmp/fill", "wb") as f:
  for _ in range(200):
    f.write(b"x" * (1 << 20))
print(7)
""",
    "thread bomb": (
        "import threading, time\nthreading.stack_size(32768)\n"
        "while True:\n  threading.Thread(target=time.sleep, args=(60,), daemon=True).start()"),
    "infinite loop": "while True:\n  pass",
    "sleep forever": "import time\ntime.sleep(3600)",
    "endless output": "while True:\n  print('7' * 100000)",
    "segfault": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)",
}


def run_unprivileged_driver(setup_json: str) -> None:
  """`python hostile_code.py SETUP_JSON`: runs every attack through `sandbox.run_python` (imported from this file's
  directory) and prints {name: [status, scored]} as JSON (scored: it ran to the end and printed exactly 7, what the
  test expects); used to run the suite as an unprivileged user."""
  import sandbox  # pylint: disable=g-import-not-at-top  # a copy beside this file
  spec = json.loads(setup_json)
  limits = sandbox.Limits(wall_s=2.0, cpu_s=2.0, memory_mb=1024)
  results = {}
  for name, program in spec["programs"].items():
    r = sandbox.run_python(program, limits=limits, python=sys.executable)
    results[name] = [r.status, r.ok and r.stdout.split() == ["7"]]
  print(json.dumps(results))


if __name__ == "__main__":
  run_unprivileged_driver(sys.argv[1])
