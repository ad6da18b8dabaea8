r"""Renders an sbatch script for a SLURM cluster from the config: one `launch/tpu_run.py` task per node, the learner's
nodes first, then one node per sampler (`config.mesh.sampler_processes` of them).

  python tools/render_slurm.py --config=configs/math.py:qwen2.5-1.5b --nodes=3 --gpus_per_node=8 \
      --workdir=/shared/runs/math --partition=gpu --time=24:00:00 --setup="source .venv/bin/activate" \
      --config.mesh.sampler_processes=2 --config.model.init_from=/ckpt/Qwen2.5-1.5B --out=math.sbatch
  sbatch math.sbatch

The script is `launch/slurm/job.sbatch` filled in: `#SBATCH --nodes --ntasks-per-node=1 --gpus-per-node`, the
authkey made once in the batch script and exported, and `srun` running the same command in every task. No task gets a
role flag: each is process $SLURM_PROCID of $SLURM_NTASKS and meets the others at the first host of
$SLURM_JOB_NODELIST (`areal_jax/distributed/roles.py`), as the job description (`distributed/job.py`) lays out.
Every `--config` and `--config.KEY=VALUE` flag given here is passed on to each task as given; run this from the
repository root (relative config paths are resolved from `--repo`, where the job starts). The workdir must be one that
every node reaches (a shared file system, or gs://).
"""

from __future__ import annotations

import datetime
import os
import shlex
import sys

from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from areal_jax import cli  # pylint: disable=g-import-not-at-top  # does not import JAX
from areal_jax.distributed.job import JobSpec, config_args  # pylint: disable=g-import-not-at-top
from areal_jax.distributed.roles import DEFAULT_PORT  # pylint: disable=g-import-not-at-top

TEMPLATE = os.path.join(ROOT, "launch", "slurm", "job.sbatch")


def render(*, nodes: int, gpus_per_node: int, sampler_processes: int, config: list[str], workdir: str,
           repo: str = ROOT, partition: str = "", account: str = "", time: str = "", job_name: str = "areal_jax",
           cpus_per_task: int = 0, setup: str = "", python: str = "python", port: int = DEFAULT_PORT,
           log: str = "%x-%j.out", stamp: str = "") -> str:
  """The sbatch script. A ValueError names the flag at fault and its value."""
  if nodes < 2:
    raise ValueError(f"--nodes={nodes}: a cluster job has at least 2 nodes (a learner and a sampler); one node is "
                     "launch/local.py (or launch/tpu_run.py) on it")
  if gpus_per_node < 0:
    raise ValueError(f"--gpus_per_node={gpus_per_node}: must be >= 0 (0: CPU nodes)")
  if cpus_per_task < 0:
    raise ValueError(f"--cpus_per_task={cpus_per_task}: must be >= 0 (0: whole nodes, --exclusive)")
  if not workdir:
    raise ValueError("--workdir='': every node writes to it: a shared file system path, or gs://")
  try:
    spec = JobSpec.create(num_processes=nodes, sampler_processes=sampler_processes,
                          accelerator="gpu" if gpus_per_node else "cpu", learner_devices=gpus_per_node,
                          sampler_devices=gpus_per_node, port=port)
  except ValueError as e:
    raise ValueError(f"--nodes={nodes} (one process per node): {e}") from None
  for flag, value in (("partition", partition), ("account", account), ("time", time), ("job_name", job_name),
                      ("log", log)):
    if any(c.isspace() for c in value) or "'" in value or '"' in value:
      raise ValueError(f"--{flag}={value!r}: no spaces or quotes in an #SBATCH value")

  sbatch = [f"--job-name={job_name}", f"--nodes={nodes}", "--ntasks-per-node=1"]
  if gpus_per_node:
    sbatch.append(f"--gpus-per-node={gpus_per_node}")
  sbatch += [f"--cpus-per-task={cpus_per_task}"] if cpus_per_task else ["--exclusive"]
  sbatch += [f"--partition={partition}"] * bool(partition) + [f"--account={account}"] * bool(account)
  sbatch += [f"--time={time}"] * bool(time) + [f"--chdir={repo}", f"--output={log}"]
  devices = f"{gpus_per_node} GPUs" if gpus_per_node else "its CPUs"
  roles = [f"# Rendered by tools/render_slurm.py{f' on {stamp}' if stamp else ''} from these flags (render it again "
           "rather than edit it):", *(f"#   {shlex.quote(a)}" for a in config),
           f"# {nodes} nodes, one process each over {devices}, in node-list order:"]
  for p in spec.processes:
    where = (f" (the leader: ports {spec.port} and {spec.port + 1}, and its transfer servers' ephemeral ports)"
             if p.process_id == 0 else "")
    roles.append(f"#   task {p.process_id}: {p.name}{where}")
  command = [python, "launch/tpu_run.py", *config, f"--workdir={workdir}"]  # no role flags: SLURM's variables
  fields = {
      "ROLES": "\n".join(roles), "SBATCH": "\n".join(f"#SBATCH {line}" for line in sbatch),
      "SETUP": setup or "# (no --setup: the python on the nodes' PATH has areal_jax's requirements)",
      "PYTHON": shlex.quote(python), "PORT": str(spec.port), "NODES": str(nodes),
      "SRUN_CPUS": f"--cpus-per-task={cpus_per_task}" if cpus_per_task else '--cpus-per-task="$SLURM_CPUS_ON_NODE"',
      "COMMAND": " \\\n    ".join([f"{shlex.quote(python)} launch/tpu_run.py", *map(shlex.quote, command[2:])]),
  }
  with open(TEMPLATE, encoding="utf-8") as f:
    text = f.read()
  for key, value in fields.items():
    text = text.replace("{{" + key + "}}", value)
  return text


def main(argv):
  del argv
  f = flags.FLAGS
  config = config_args(sys.argv[1:])
  try:
    text = render(nodes=f.nodes, gpus_per_node=f.gpus_per_node, sampler_processes=_CONFIG.value.mesh.sampler_processes,
                  config=config, workdir=f.workdir, repo=os.path.abspath(f.repo), partition=f.partition, account=f.account, time=f.time,
                  job_name=f.job_name, cpus_per_task=f.cpus_per_task, setup=f.setup, python=f.python, port=f.port,
                  log=f.log, stamp=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
  except ValueError as e:
    sys.exit(f"FATAL {e}")
  if f.out:
    with open(f.out, "w", encoding="utf-8") as out:
      out.write(text)
    os.chmod(f.out, 0o755)
    print(f"wrote {f.out}: sbatch {f.out}", file=sys.stderr)
  else:
    sys.stdout.write(text)


if __name__ == "__main__":
  _CONFIG = cli.define_config()
  flags.DEFINE_integer("nodes", 2, "Nodes, one process each: the learner's, then config.mesh.sampler_processes "
                       "samplers'.")
  flags.DEFINE_integer("gpus_per_node", 8, "GPUs per node (0: CPU nodes).")
  flags.DEFINE_string("workdir", "", "Run directory every node reaches (a shared file system, or gs://).")
  flags.DEFINE_string("repo", ROOT, "This repository's path on the nodes (where the job starts).")
  flags.DEFINE_string("partition", "", "#SBATCH --partition ('' = the cluster's default).")
  flags.DEFINE_string("account", "", "#SBATCH --account ('' = none).")
  flags.DEFINE_string("time", "", "#SBATCH --time, e.g. 24:00:00 ('' = the partition's limit).")
  flags.DEFINE_string("job_name", "areal_jax", "#SBATCH --job-name.")
  flags.DEFINE_integer("cpus_per_task", 0, "CPUs per task (0: whole nodes, --exclusive, every CPU to the task).")
  flags.DEFINE_string("setup", "", "A shell line run before srun, e.g. 'source .venv/bin/activate'.")
  flags.DEFINE_string("python", "python", "The nodes' Python.")
  flags.DEFINE_integer("port", DEFAULT_PORT, "The leader's control port (it also takes port + 1).")
  flags.DEFINE_string("log", "%x-%j.out", "#SBATCH --output (relative to --repo).")
  flags.DEFINE_string("out", "", "Write the script here ('' = stdout).")
  cli.run(main)
