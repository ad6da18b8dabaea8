"""`tools/render_slurm.py`: the sbatch script it renders is valid bash, asks SLURM for what the job description says,
and every task it starts reads its role and the leader's address from SLURM's variables alone.

No cluster: the script runs under bash with a fake `srun` on the PATH that records the environment and command each
task would get; each task's view (`roles.from_flags_or_env`) is then computed from that environment plus the
variables SLURM gives a task of the step.
"""

import importlib.util
import os
import re
import stat
import subprocess
import sys

import pytest

from areal_jax.distributed import roles
from areal_jax.distributed.job import config_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = ["--config=configs/math.py:qwen2.5-1.5b", "--config.mesh.sampler_processes=2",
          "--config.model.init_from=/ckpt/Qwen 1.5B"]


def _tool():
  spec = importlib.util.spec_from_file_location("render_slurm", os.path.join(ROOT, "tools", "render_slurm.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _render(**kw):
  args = dict(nodes=3, gpus_per_node=8, sampler_processes=2, config=CONFIG, workdir="/shared/runs/math",
              partition="gpu", time="24:00:00", account="rl", python=sys.executable)
  return _tool().render(**(args | kw))


def test_the_script_is_bash_and_asks_slurm_for_one_task_per_gpu_node(tmp_path):
  text = _render()
  path = tmp_path / "job.sbatch"
  path.write_text(text)
  subprocess.run(["bash", "-n", str(path)], check=True)
  assert "{{" not in text and text.startswith("#!/bin/bash\n")
  lines = text.splitlines()
  sbatch = [line.removeprefix("#SBATCH ") for line in lines if line.startswith("#SBATCH")]
  assert sbatch == ["--job-name=areal_jax", "--nodes=3", "--ntasks-per-node=1", "--gpus-per-node=8", "--exclusive",
                    "--partition=gpu", "--account=rl", "--time=24:00:00", f"--chdir={ROOT}", "--output=%x-%j.out"]
  # sbatch reads directives only above the first command.
  first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
  assert all(i < first_command for i, line in enumerate(lines) if line.startswith("#SBATCH"))
  assert "#   task 0: learner 0 (the leader: ports 8476 and 8477" in text
  assert "#   task 1: sampler 0" in text and "#   task 2: sampler 1" in text
  # Whole nodes unless told; told, the tasks get that many CPUs.
  assert '--cpus-per-task="$SLURM_CPUS_ON_NODE"' in text
  text = _render(cpus_per_task=32, gpus_per_node=0, partition="", account="", time="")
  sbatch = [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH")]
  assert sbatch == ["--job-name=areal_jax", "--nodes=3", "--ntasks-per-node=1", "--cpus-per-task=32",
                    f"--chdir={ROOT}", "--output=%x-%j.out"]
  assert "--cpus-per-task=32 \\" in text


def test_every_task_gets_its_role_and_the_leader_from_slurms_variables_alone(tmp_path, monkeypatch):
  script = tmp_path / "job.sbatch"
  script.write_text(_render(setup="export FROM_SETUP=1"))
  fake = tmp_path / "bin"
  fake.mkdir()
  (fake / "srun").write_text('#!/bin/sh\nenv -0 > "$OUT/env"\nprintf "%s\\0" "$@" > "$OUT/argv"\n')
  (fake / "srun").chmod(stat.S_IRWXU)
  slurm = {"SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_NNODES": "3", "SLURM_NTASKS": "3", "SLURM_JOB_ID": "42",
           "SLURM_CPUS_ON_NODE": "64"}
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", roles.ENV_PREFIX))}
  proc = subprocess.run(["bash", str(script)], env=env | slurm | {"PATH": f"{fake}:{env['PATH']}", "OUT": tmp_path},
                        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
  task_env = dict(kv.split("=", 1) for kv in (tmp_path / "env").read_text().split("\0") if kv)
  argv = (tmp_path / "argv").read_text().split("\0")[:-1]
  key = task_env[roles.AUTHKEY_ENV]
  assert re.fullmatch(r"[0-9a-f]{32}", key) and key not in proc.stdout + proc.stderr  # made once, never printed
  assert task_env["FROM_SETUP"] == "1" and task_env[f"{roles.ENV_PREFIX}PORT"] == "8476"
  srun_options = argv[:argv.index(sys.executable)]
  assert srun_options == ["--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
                          "--cpus-per-task=64"]
  command = argv[len(srun_options):]
  assert command == [sys.executable, "launch/tpu_run.py", *CONFIG, "--workdir=/shared/runs/math"]
  assert not [a for a in command if a.startswith(("--num_processes", "--process_id", "--coordinator_address"))]

  expected = [("learner", "learner 0", True), ("sampler", "sampler 0", False), ("sampler", "sampler 1", False)]
  for procid, (role, name, leader) in enumerate(expected):
    monkeypatch.setattr(os, "environ", dict(task_env, SLURM_PROCID=str(procid)))  # what srun adds in each task
    layout = roles.from_flags_or_env(num_processes=None, process_id=None, coordinator_address=None,
                                     sampler_processes=2)
    assert (layout.num_processes, layout.process_id, layout.role, layout.name, layout.is_leader) == (
        3, procid, role, name, leader)
    assert layout.coordinator_address == "gpu07:8476" and layout.learner_coordinator == "gpu07:8477"
    assert roles.authkey() == key.encode()


def test_another_port_reaches_every_task(tmp_path, monkeypatch):
  text = _render(port=9000)
  assert "export AREAL_JAX_PORT=9000" in text and "ports 9000 and 9001" in text
  monkeypatch.setattr(os, "environ", {"SLURM_NTASKS": "3", "SLURM_PROCID": "2", "SLURM_JOB_NODELIST": "gpu[07-09]",
                                      "AREAL_JAX_PORT": "9000"})
  assert roles.from_flags_or_env(num_processes=None, process_id=None, coordinator_address=None,
                                 sampler_processes=2).coordinator_address == "gpu07:9000"


@pytest.mark.parametrize("kw,message", [
    (dict(nodes=1), "--nodes=1: a cluster job has at least 2 nodes"),
    (dict(nodes=2, sampler_processes=2), r"--nodes=2 \(one process per node\): config.mesh.sampler_processes=2: must "
     "leave at least one"),
    (dict(gpus_per_node=-1), "--gpus_per_node=-1"),
    (dict(cpus_per_task=-2), "--cpus_per_task=-2"),
    (dict(workdir=""), "--workdir='': every node writes to it"),
    (dict(partition="gpu large"), "--partition='gpu large': no spaces or quotes"),
    (dict(port=65535), "--port=65535"),
])
def test_a_job_that_cannot_run_is_refused_naming_the_flag(kw, message):
  with pytest.raises(ValueError, match=message):
    _render(**kw)


def test_config_flags_are_passed_on_as_given():
  assert config_args(["--nodes=3", "--config", "configs/math.py:tiny", "--config.learner.lr", "1e-5",
                           "--config.sampler.greedy", "--workdir=x", "--config.total_steps=3"]) == [
      "--config=configs/math.py:tiny", "--config.learner.lr=1e-5", "--config.sampler.greedy",
      "--config.total_steps=3"]
  assert config_args(["--config.total_steps=3"]) == ["--config=configs/math.py", "--config.total_steps=3"]
