r"""Runs a multi-process job on this machine: learner and sampler processes, each pinned to its own cores.

  python launch/local.py --config=configs/math.py[:PRESET] --workdir=DIR --num_processes=2 [--cpus_per_process=1] \
      [--config.mesh.sampler_processes=1 --config.mesh.cpu_devices=1 ...]
  python launch/local.py --config=configs/math.py:qwen2.5-1.5b --num_processes=5 --learner_devices=4 \
      --sampler_devices=1 --config.mesh.sampler_processes=4 ...  # 8 GPUs: a 4-GPU learner, 4 one-GPU samplers

Every other flag is passed to each `launch/tpu_run.py` process. A sampler process that dies is restarted and rejoins
the running job with `--restart_samplers` (else the job goes on without it). If a learner process dies the others are
stopped and the job exits non-zero naming it; the same command resumes from the last checkpoint.
"""

import os
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from areal_jax import cli  # pylint: disable=g-import-not-at-top  # does not import JAX
from areal_jax.distributed import local_job  # pylint: disable=g-import-not-at-top  # does not import JAX

_CONFIG = cli.define_config()
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/areal_jax", "Run directory (passed on); its compilation_cache/ is "
                                "the processes' persistent compilation cache.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Processes to start.")
_CPUS = flags.DEFINE_integer("cpus_per_process", None, "Cores pinned to each process (default: cores / processes).")
_RESTART = flags.DEFINE_bool("restart_samplers", False, "Restart sampler processes that exit; they rejoin the job.")
_LEARNER_DEVICES = flags.DEFINE_integer("learner_devices", 0, "GPUs or TPU chips of this host per learner process "
                                        "(0: what --sampler_devices leaves, shared; both 0: each process sees all).")
_SAMPLER_DEVICES = flags.DEFINE_integer("sampler_devices", 0, "GPUs or TPU chips of this host per sampler process "
                                        "(0: what --learner_devices leaves, shared).")
_PRELOAD = ("absl.app", "areal_jax.run.trainer")  # what tpu_run.py imports: a restarted sampler is forked after them
_OWN = ("--num_processes", "--cpus_per_process", "--restart_samplers", "--norestart_samplers", "--learner_devices",
        "--sampler_devices")


def main(argv):
  passed = [a for a in sys.argv[1:] if not a.startswith(_OWN)]
  del argv
  cache = None if "://" in _WORKDIR.value else os.path.join(_WORKDIR.value, "compilation_cache")
  try:
    status = local_job.run_local(script=os.path.join(ROOT, "launch", "tpu_run.py"), args=passed,
                                 num_processes=_NUM_PROCESSES.value,
                                 sampler_processes=_CONFIG.value.mesh.sampler_processes,
                                 cpus_per_process=_CPUS.value, restart_samplers=_RESTART.value, cache_dir=cache,
                                 preload=_PRELOAD, learner_devices=_LEARNER_DEVICES.value,
                                 sampler_devices=_SAMPLER_DEVICES.value)
  except ValueError as e:  # a layout or device split that cannot run, named
    sys.exit(f"local: {e}")
  sys.exit(status)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
