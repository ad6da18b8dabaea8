r"""SIGKILLs a short training run again and again, then checks from the run's own records that nothing was lost,
repeated or corrupted.

    python tools/chaos.py --workdir=/tmp/chaos --kills=20 --seed=0 [--steps=150] [--phases=checkpoint_write,...]
    python tools/chaos.py --workdir=/tmp/chaos --kills=10 --processes=2   # a learner and a sampler process

The job is `launch/tpu_run.py` on a fast variant of the tiny default (a 2-layer model, 4 groups of 4 answers per step,
a checkpoint every 2 steps, an evaluation every 4). Each attempt but the last is killed, with its whole process group
as a preempted machine is, either after a random delay or at the n-th time it reaches a phase
(`areal_jax/faults.py`: during generation, a learner step, a weight update, a checkpoint write or an evaluation);
the next attempt resumes the same workdir. With `--processes=N` the job is `launch/local.py` (one sampler process,
the rest learners) and a kill takes down one process, as a lost host does: a random one after the delay, or the one
that reaches the phase; the launcher must then stop the others and exit. The last attempt runs to the end. Then,
from metrics.jsonl, rollouts.jsonl and the checkpoints:

* logs: every line parses (none torn), metrics has steps 0..N once each and its time/elapsed_s never goes back;
* prompts: no prompt is trained on (or filtered) twice, and the prompts done plus those the last checkpoint holds as
  pending are exactly a prefix of the epoch's order (none lost);
* versions: the policy version equals the step and strictly increases; restarts resume at non-decreasing steps;
* staleness: every trained answer started at most eta versions before the step that trained it, including the first
  batches after each restart;
* checkpoint: the latest one restores (parameters, optimizer state, meta) onto the run's learner.

Prints a table of attempts and one of checks; exits 1 on any violation, on an attempt that crashed or hung, and when
the run completed before all kills were made. Logs of each attempt: <workdir>/chaos/.

    python tools/chaos.py --workdir=/tmp/chaos --processes=3 --target=sampler --kills=20 --seed=0
    python tools/chaos.py ... --set=sync.delta=True --set=sampler.param_dtype=bfloat16   # any config override

`--target=sampler` is the other kind of fault: samplers that come and go while the learner runs on. The job (a learner
and processes - 1 sampler processes, `launch/local.py --restart_samplers`, a short heartbeat) runs once, start to end;
about every `--interval` seconds until it ends (at least `--kills` times) a random sampler process is killed
(SIGKILL: lost) or preempted (SIGTERM), and the launcher restarts it, or stopped (SIGSTOP: hung; it is let go after
the heartbeat limit, finds itself dropped and connects again). The same checks, plus: the learner never restarted,
and the run's trained answers per second (from its step 0 row to its last) against a fault-free run of the same job
run first (`<workdir>/fault_free`), which must be at least `--min-ratio`.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from areal_jax.faults import ENV, PHASES  # pylint: disable=g-import-not-at-top

CONFIG = os.path.join(ROOT, "configs", "math.py:fast")  # fast steps with every mechanism on
# How far into an attempt a phase kill may come: the n-th occurrence, n drawn from 1..this.
MAX_OCCURRENCE = {"generation": 300, "learner_step": 3, "weight_update": 3, "checkpoint_write": 2, "evaluation": 2}


@dataclasses.dataclass
class Attempt:
  kill: str  # "after 12.3 s", "learner_step #2" or "none"
  outcome: str = ""  # "killed", "completed", "timeout", "crashed (rc N)"
  seconds: float = 0.0
  resumed_at: int | None = None  # the step it resumed from (None: a fresh start)
  last_step: int | None = None  # the last step in metrics.jsonl after it ended


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True, help="run directory (emptied first)")
  p.add_argument("--kills", type=int, default=20)
  p.add_argument("--seed", type=int, default=0, help="draws the kills; also the run's config.seed")
  p.add_argument("--steps", type=int, default=None,
                 help="learner steps of the run (enough that it does not finish before the last kill); default 150, "
                      "1200 with --target=sampler")
  p.add_argument("--phases", default="time," + ",".join(PHASES),
                 help=f"kill kinds to draw from: 'time' (a random delay) and phases of {PHASES}")
  p.add_argument("--max-delay", type=float, default=40.0, help="longest random delay of a 'time' kill, seconds")
  p.add_argument("--attempt-timeout", type=float, default=600.0, help="seconds before an attempt counts as hung")
  p.add_argument("--processes", type=int, default=0,
                 help="0: one process (launch/tpu_run.py); N >= 2: a multi-process job (launch/local.py, one sampler "
                      "process), where a kill takes down one process and the launcher must stop the rest")
  p.add_argument("--target", choices=("job", "sampler"), default="job",
                 help="job: kill the job (or one of its processes) and resume it; sampler: kill, preempt and stop "
                      "sampler processes of a running job (--processes >= 3: a learner and the rest samplers)")
  p.add_argument("--interval", type=float, default=20.0, help="--target=sampler: mean seconds between faults")
  p.add_argument("--heartbeat", type=float, default=5.0, help="--target=sampler: mesh.sampler_heartbeat_s")
  p.add_argument("--min-ratio", type=float, default=0.8,
                 help="--target=sampler: trained answers/s under faults over the fault-free run's, at least")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="a config override for the job (and the fault-free run), e.g. --set=sync.delta=True; repeatable")
  args = p.parse_args()
  for item in args.set:
    if "=" not in item:
      p.error(f"--set={item!r}: expected KEY=VALUE (a config field, e.g. sync.delta=True)")
  if args.processes == 1 or args.processes < 0:
    p.error(f"--processes={args.processes}: 0 (one process) or at least 2")
  if args.target == "sampler" and args.processes < 3:
    p.error(f"--processes={args.processes}: --target=sampler needs a learner and at least two sampler processes (3)")
  if args.steps is None:
    args.steps = 1200 if args.target == "sampler" else 150
  return args


def _literal(text: str):
  """A --set value as the config field takes it: a Python literal (True, 1e-5), else the string."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _overrides(args) -> dict:
  extra = {}
  if getattr(args, "processes", 0):
    extra = {"mesh.cpu_devices": 1, "mesh.sampler_processes": 1}
  if getattr(args, "target", "job") == "sampler":
    # Enough prompts that the run stays in its first epoch (the prompt check reads the epoch's order once).
    extra |= {"mesh.sampler_processes": args.processes - 1, "mesh.sampler_heartbeat_s": args.heartbeat,
              "data.synthetic_size": 8 * args.steps}
  extra |= {k: _literal(v) for k, v in (item.split("=", 1) for item in getattr(args, "set", []))}
  return {"total_steps": args.steps, "seed": args.seed, "eval.every_steps": 4, **extra}


_CHILD = re.compile(r"local: (.+?) is process \d+ \(pid (\d+)\)")
_DIED = re.compile(r"local: (.+?) \(pid \d+\) exited with signal SIGKILL")


def _children(log_path: str) -> dict[str, int]:
  """The job's processes (name -> pid) as launch/local.py announced them."""
  return {name: int(pid) for name, pid in _CHILD.findall(open(log_path).read())}


def _kill_groups(pids) -> None:
  for pid in pids:
    try:
      os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def _last_step(workdir: str) -> int | None:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return None
  steps = []
  for line in open(path).read().splitlines():
    try:
      steps.append(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError):
      pass
  return max(steps, default=None)


def run_attempt(args, index: int, kill: str, rng) -> Attempt:
  """One launch of the job; `kill` is "time", a phase, or "none" (run to the end)."""
  workdir = args.workdir
  launcher = "local.py" if args.processes else "tpu_run.py"
  cmd = [sys.executable, os.path.join(ROOT, "launch", launcher), f"--config={CONFIG}", f"--workdir={workdir}"]
  cmd += [f"--num_processes={args.processes}"] if args.processes else []
  cmd += [f"--config.{k}={v}" for k, v in _overrides(args).items()]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop(ENV, None)
  delay = None
  if kill == "time":
    delay = float(rng.uniform(2.0, args.max_delay))
    attempt = Attempt(kill=f"after {delay:.1f} s")
  elif kill == "none":
    attempt = Attempt(kill="none")
  else:
    n = int(rng.integers(1, MAX_OCCURRENCE[kill] + 1))
    env[ENV] = f"{kill}:{n}"
    attempt = Attempt(kill=f"{kill} #{n}")
  log_path = os.path.join(workdir, "chaos", f"attempt_{index:02d}.log")
  start = time.time()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    limit = delay if delay is not None else args.attempt_timeout
    try:
      rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
      rc = None
      if args.processes and delay is not None:  # one process dies; the launcher must stop the others
        name, pid = list(_children(log_path).items())[int(rng.integers(args.processes))]
        attempt.kill = f"{name} after {delay:.1f} s"
        _kill_groups([pid])
        try:
          rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
          pass
      if rc is None:
        _kill_groups([proc.pid, *_children(log_path).values()])
        proc.wait()
  attempt.seconds = time.time() - start
  text = open(log_path).read()
  died = _DIED.search(text)
  if args.processes and died and ENV in env:
    attempt.kill = f"{died.group(1)}: {attempt.kill}"
  if rc is None:
    attempt.outcome = "killed" if delay is not None and not args.processes else "timeout"
  elif rc == 0:
    attempt.outcome = "completed"
  elif (rc == -signal.SIGKILL and ENV in env) or (args.processes and rc == 1 and died):
    attempt.outcome = "killed"
  else:
    attempt.outcome = f"crashed (rc {rc})"
  resumed = re.search(r"resumed .* at step (\d+)", text)
  attempt.resumed_at = int(resumed.group(1)) if resumed else None
  attempt.last_step = _last_step(workdir)
  return attempt


def _read_jsonl(path: str, violations: list[str]) -> list[dict]:
  rows = []
  for i, line in enumerate(open(path).read().splitlines()):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      violations.append(f"{os.path.basename(path)} line {i + 1} is torn: {line[:60]!r}")
  return rows


def check_run(args, attempts: list[Attempt]) -> list[tuple[str, list[str]]]:
  """(check, violations) for each check."""
  from areal_jax.config import load_config
  from areal_jax.data import DataConfig, build_dataset
  from areal_jax.learner.config import LearnerConfig
  from areal_jax.learner.step import build_step, make_learner_mesh
  from areal_jax.models import ModelConfig
  from areal_jax.checkpoint.store import Checkpointer
  from areal_jax.tokenizer import load_tokenizer
  import jax

  config = load_config(CONFIG, **_overrides(args))
  workdir, eta = args.workdir, config.rollout.max_head_offpolicyness
  results = []

  logs: list[str] = []
  metrics = _read_jsonl(os.path.join(workdir, "metrics.jsonl"), logs)
  rollouts = _read_jsonl(os.path.join(workdir, "rollouts.jsonl"), logs)
  steps = [m["step"] for m in metrics]
  if steps != list(range(args.steps + 1)):
    logs.append(f"metrics.jsonl steps are {steps}, expected 0..{args.steps} once each")
  elapsed = [m.get("time/elapsed_s", 0.0) for m in metrics]
  if any(b < a for a, b in zip(elapsed, elapsed[1:])):
    logs.append(f"time/elapsed_s goes back (restarts from zero on resume?): {[round(t) for t in elapsed]}")
  results.append(("logs: no torn or duplicated lines", logs))

  prompts: list[str] = []
  uids = [r["uid"] for r in rollouts]
  repeated = sorted(u for u, n in collections.Counter(uids).items() if n > 1)
  if repeated:
    prompts.append(f"{len(repeated)} prompts logged more than once, e.g. {repeated[:3]}")
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=config.checkpoint.every_steps)
  latest = ckpt.latest_step()
  undone = ckpt.read_meta(latest).controller["undone"] if latest is not None else []
  if latest != args.steps:
    prompts.append(f"the latest checkpoint is step {latest}, expected {args.steps}")
  if set(undone) & set(uids):
    prompts.append(f"prompts both done and pending: {sorted(set(undone) & set(uids))[:3]}")
  dataset = build_dataset(DataConfig.from_config(config.data), load_tokenizer(config.model.tokenizer), split="train")
  order = [next(dataset).uid for _ in range(len(uids) + len(undone))]
  if sorted(uids + undone) != sorted(order):
    missing = sorted(set(order) - set(uids) - set(undone))
    prompts.append(f"done + pending prompts are not the epoch's first {len(order)}; missing e.g. {missing[:3]}")
  results.append(("prompts: each trained once, none lost", prompts))

  versions: list[str] = []
  if any(m["version"] != m["step"] for m in metrics):
    versions.append("a metrics row's version differs from its step")
  if any(b["version"] <= a["version"] for a, b in zip(metrics, metrics[1:])):
    versions.append("versions do not strictly increase")
  resumes = [a.resumed_at for a in attempts if a.resumed_at is not None]
  if any(b < a for a, b in zip(resumes, resumes[1:])):
    versions.append(f"a restart resumed at an earlier step than the one before: {resumes}")
  results.append(("versions: strictly increasing across restarts", versions))

  stale: list[str] = []
  for r in rollouts:
    if not r["filtered"] and any((r["step"] - 1) - v > eta for v in r["version_start"]):
      stale.append(f"step {r['step']}: prompt {r['uid']} has answers started at versions {r['version_start']}")
  results.append((f"staleness: <= eta = {eta} in every trained batch", stale[:5]))

  restore: list[str] = []
  try:
    model_cfg = ModelConfig.from_config(config.model)
    learner_cfg = LearnerConfig.from_config(config.learner, max_new_tokens=config.sampler.max_new_tokens)
    params, opt_state = build_step(model_cfg, learner_cfg, make_learner_mesh(jax.devices()[:1])).abstract_state()
    _, _, meta = ckpt.restore(latest, params=params, opt_state=opt_state)
    if meta.step != latest or meta.version != latest:
      restore.append(f"checkpoint {latest} holds step {meta.step}, version {meta.version}")
  except Exception as e:  # pylint: disable=broad-except  # reported as a violation
    restore.append(f"checkpoint {latest} does not restore: {type(e).__name__}: {e}")
  ckpt.close()
  results.append(("checkpoint: the latest restores", restore))
  return results


# --- --target=sampler: samplers come and go, the learner runs on ---------------------------------------------------

_SAMPLER = re.compile(r"local: (sampler \d+) is (?:process \d+|restarted) \(pid (\d+)\)")


@dataclasses.dataclass
class Fault:
  at_s: float  # since the job started
  sampler: str
  kind: str  # "kill", "preempt", "stop"
  pid: int


def _job(args, workdir: str, log_path: str) -> subprocess.Popen:
  cmd = [sys.executable, os.path.join(ROOT, "launch", "local.py"), f"--config={CONFIG}", f"--workdir={workdir}",
         f"--num_processes={args.processes}", "--restart_samplers"]
  cmd += [f"--config.{k}={v}" for k, v in _overrides(args).items()]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop(ENV, None)
  with open(log_path, "w") as log:
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)


def _answers_per_s(workdir: str, config) -> float:
  """Trained answers per second from the step 0 row (warm-start and first evaluation done) to the last."""
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  seconds = rows[-1]["time/elapsed_s"] - rows[0]["time/elapsed_s"]
  return rows[-1]["step"] * config.rollout.batch_size * config.rollout.group_size / seconds


def _fault(args, log_path: str, rng, start: float) -> Fault:
  """One fault on a random sampler process: SIGKILL, SIGTERM, or SIGSTOP let go after the heartbeat limit."""
  pids = dict(_SAMPLER.findall(open(log_path).read()))  # the latest pid of each
  name = str(rng.choice(sorted(pids)))
  pid, kind = int(pids[name]), str(rng.choice(["kill", "preempt", "stop"]))
  fault = Fault(at_s=time.time() - start, sampler=name, kind=kind, pid=pid)
  try:
    if kind == "stop":
      os.kill(pid, signal.SIGSTOP)
      time.sleep(args.heartbeat + 2.0)
      os.kill(pid, signal.SIGCONT)
    else:
      os.killpg(pid, signal.SIGKILL if kind == "kill" else signal.SIGTERM)
  except ProcessLookupError:
    fault.kind += " (it had exited)"
  return fault


def sampler_chaos(args, rng) -> tuple[list[Fault], list[str], dict]:
  """The fault-free run, then the run under faults; (faults, failures, {"fault_free": a/s, "faults": a/s})."""
  from areal_jax.config import load_config  # pylint: disable=g-import-not-at-top

  config = load_config(CONFIG, **_overrides(args))
  clean, workdir = os.path.join(args.workdir, "fault_free"), args.workdir
  rates, failures, faults = {}, [], []
  proc = _job(args, clean, os.path.join(workdir, "chaos", "fault_free.log"))
  try:
    if proc.wait(timeout=args.attempt_timeout * 4) != 0:
      failures.append(f"the fault-free run exited with {proc.returncode}; see {workdir}/chaos/fault_free.log")
      return faults, failures, rates
  except subprocess.TimeoutExpired:
    _kill_groups([proc.pid])
    failures.append("the fault-free run hung")
    return faults, failures, rates
  rates["fault_free"] = _answers_per_s(clean, config)
  print(f"fault-free run: {rates['fault_free']:.1f} trained answers/s", flush=True)

  log_path = os.path.join(workdir, "chaos", "faults.log")
  start = time.time()
  proc = _job(args, os.path.join(workdir, "run"), log_path)
  try:
    while _last_step(os.path.join(workdir, "run")) is None and proc.poll() is None:  # training begun
      time.sleep(0.5)
    while proc.poll() is None:  # faults until the run ends, so all of it runs under them
      time.sleep(rng.uniform(0.5, 1.5) * args.interval)
      if proc.poll() is None:
        faults.append(_fault(args, log_path, rng, start))
        print(f"fault {len(faults)}: {faults[-1].sampler} {faults[-1].kind} at {faults[-1].at_s:.0f} s", flush=True)
    rc = proc.wait(timeout=args.attempt_timeout * 4)
  except subprocess.TimeoutExpired:
    rc = None
  finally:
    if proc.poll() is None:
      _kill_groups([proc.pid, *_children(log_path).values()])
      proc.wait()
  text = open(log_path).read()
  if rc != 0:
    failures.append(f"the run under faults {'hung' if rc is None else f'exited with {rc}'}; see {log_path}")
  elif len(faults) < args.kills:
    failures.append(f"only {len(faults)} faults, fewer than --kills={args.kills}: the run was too short "
                    "(raise --steps)")
  if text.count("learner 0 is process 0") != 1 or "resumed" in text or "learner 0 (pid" in text:
    failures.append("the learner process restarted")
  if rc == 0:
    rates["faults"] = _answers_per_s(os.path.join(workdir, "run"), config)
  return faults, failures, rates


def _report(checks: list[tuple[str, list[str]]], failures: list[str]) -> None:
  """Prints the checks and failures; exits 1 if any."""
  print(f"{'check':<48}result")
  for name, problems in checks:
    print(f"{name:<48}{'ok' if not problems else 'VIOLATED: ' + '; '.join(problems)}")
  for f in failures:
    print(f"FAILED: {f}")
  sys.exit(1 if failures or any(p for _, p in checks) else 0)


def _fresh(workdir: str) -> None:
  if os.path.exists(workdir):
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.rmtree(workdir)
  os.makedirs(os.path.join(workdir, "chaos"))


def main_samplers(args) -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top

  _fresh(args.workdir)
  start = time.time()
  faults, failures, rates = sampler_chaos(args, np.random.default_rng(args.seed))
  print(f"\n{'#':>3}  {'at s':>6}  {'sampler':<12}{'fault':<24}")
  for i, f in enumerate(faults):
    print(f"{i:>3}  {f.at_s:>6.0f}  {f.sampler:<12}{f.kind:<24}")
  checks = []
  if "faults" in rates:
    run_args = argparse.Namespace(**{**vars(args), "workdir": os.path.join(args.workdir, "run")})
    checks = check_run(run_args, [Attempt(kill="none", outcome="completed")])
    ratio = rates["faults"] / rates["fault_free"]
    print(f"\ntrained answers/s: fault-free {rates['fault_free']:.1f}, under {len(faults)} faults "
          f"{rates['faults']:.1f}: effective-time ratio {ratio:.3f}")
    checks.append((f"throughput: >= {args.min_ratio:g} of the fault-free run's",
                   [] if ratio >= args.min_ratio else [f"ratio {ratio:.3f}"]))
  checks.append(("learner: never restarted", [f for f in failures if "learner" in f]))
  print(f"\n{len(faults)} faults, {time.time() - start:.0f} s")
  _report(checks, failures)


def main():
  args = parse_args()
  if args.target == "sampler":
    return main_samplers(args)
  import numpy as np

  kinds = args.phases.split(",")
  unknown = sorted(set(kinds) - {"time", *PHASES})
  if unknown:
    sys.exit(f"--phases: unknown {unknown}; choose from time,{','.join(PHASES)}")
  _fresh(args.workdir)
  rng = np.random.default_rng(args.seed)
  attempts: list[Attempt] = []
  start = time.time()
  while sum(a.outcome == "killed" for a in attempts) < args.kills:
    attempt = run_attempt(args, len(attempts), str(rng.choice(kinds)), rng)
    attempts.append(attempt)
    print(f"attempt {len(attempts) - 1}: {attempt.kill} -> {attempt.outcome} after {attempt.seconds:.0f} s "
          f"(resumed at {attempt.resumed_at}, last step {attempt.last_step})", flush=True)
    if attempt.outcome != "killed":
      break  # completed, crashed or hung: no more kills to make
  if not attempts or attempts[-1].outcome == "killed":
    attempts.append(run_attempt(args, len(attempts), "none", rng))

  print(f"\n{'#':>3}  {'kill':<32}{'outcome':<18}{'seconds':>8}{'resumed at':>12}{'last step':>11}")
  for i, a in enumerate(attempts):
    print(f"{i:>3}  {a.kill:<32}{a.outcome:<18}{a.seconds:>8.0f}{str(a.resumed_at):>12}{str(a.last_step):>11}")
  kills = sum(a.outcome == "killed" for a in attempts)
  failures = [f"attempt {i} ({a.kill}): {a.outcome}; see {args.workdir}/chaos/attempt_{i:02d}.log"
              for i, a in enumerate(attempts) if a.outcome not in ("killed", "completed")]
  if attempts[-1].outcome != "completed":
    failures.append("the last attempt did not complete the run")
  elif kills < args.kills:
    failures.append(f"only {kills} of {args.kills} kills: the run completed first (raise --steps)")
  checks = check_run(args, attempts) if attempts[-1].outcome == "completed" else []
  print(f"\n{kills} kills, {len(attempts)} attempts, {time.time() - start:.0f} s")
  _report(checks, failures)


if __name__ == "__main__":
  main()
