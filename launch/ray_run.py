r"""Runs a multi-process job on a Ray cluster: one Ray actor per process (learners one per host, samplers each over
their own slice, host or GPUs), Ray restarting samplers that die (`areal_jax/distributed/ray_job.py`).

  python launch/ray_run.py --config=configs/math.py[:PRESET] --workdir=DIR --num_processes=3 \
      [--address=auto] [--config.mesh.sampler_processes=2 ...]
  # TPU: a v5p-32 learner (4 hosts) and 4 single-host v5e-8 samplers
  python launch/ray_run.py --config=configs/math.py:qwen2.5-1.5b --workdir=gs://bucket/run --address=auto \
      --accelerator=tpu --learner_slice=v5p-32 --sampler_slice=v5e-8 --num_processes=8 \
      --config.mesh.sampler_processes=4 ...
  # GPU: one 8-GPU learner node and two 8-GPU sampler nodes
  python launch/ray_run.py ... --address=auto --accelerator=gpu --learner_devices=8 --sampler_devices=8 \
      --num_processes=3 --config.mesh.sampler_processes=2

Without --address it starts a Ray instance on this machine. Every node needs this repository at the same path (or the
package installed) and a workdir every process reaches (`gs://`, or a shared file system). Every other flag is
passed to each `launch/tpu_run.py` process. A learner process that dies stops the job, naming it; the same command
resumes from the last checkpoint.
"""

import os
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from areal_jax import cli  # pylint: disable=g-import-not-at-top  # does not import JAX
from areal_jax.distributed.job import ACCELERATORS, JobSpec  # pylint: disable=g-import-not-at-top
from areal_jax.distributed.roles import AUTHKEY_ENV  # pylint: disable=g-import-not-at-top

_CONFIG = cli.define_config()
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/areal_jax", "Run directory (passed on): gs:// or a path every node "
                               "shares.")
_ADDRESS = flags.DEFINE_string("address", None, "The Ray cluster (`auto`, HOST:PORT, ray://...); unset: start one "
                               "here.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Processes in the job (learners + "
                                      "config.mesh.sampler_processes samplers).")
_ACCELERATOR = flags.DEFINE_enum("accelerator", "cpu", ACCELERATORS, "What each process computes on.")
_LEARNER_DEVICES = flags.DEFINE_integer("learner_devices", 0, "GPUs per learner process (--accelerator=gpu).")
_SAMPLER_DEVICES = flags.DEFINE_integer("sampler_devices", 0, "GPUs per sampler process (--accelerator=gpu).")
_LEARNER_SLICE = flags.DEFINE_string("learner_slice", "", "TPU: the learner's slice, e.g. v5p-32 (one process per "
                                     "host).")
_SAMPLER_SLICE = flags.DEFINE_string("sampler_slice", "", "TPU: each sampler's single-host slice, e.g. v5e-8.")
_HOST_RESOURCE = flags.DEFINE_string("host_resource", "", "A custom resource each node offers once: one process per "
                                     "node (CPU clusters, tests).")
_CPUS = flags.DEFINE_float("cpus_per_process", 1.0, "Ray CPUs each process's actor takes.")
_RESTARTS = flags.DEFINE_integer("max_sampler_restarts", -1, "How often Ray restarts a sampler actor (-1: always).")
_EXTRA = flags.DEFINE_integer("extra_samplers", 0, "Samplers beyond the job's, placed when room appears (nodes an "
                              "autoscaler adds); they join the running job.")
_PORT = flags.DEFINE_integer("port", None, "The leader's control port (and port + 1); default: a free one.")
_LOCAL_CPUS = flags.DEFINE_integer("local_cpus", None, "CPUs of the Ray instance started here (no --address).")
_OWN = tuple(f"--{f.name}" for f in (_ADDRESS, _NUM_PROCESSES, _ACCELERATOR, _LEARNER_DEVICES, _SAMPLER_DEVICES,
                                     _LEARNER_SLICE, _SAMPLER_SLICE, _HOST_RESOURCE, _CPUS, _RESTARTS, _EXTRA, _PORT,
                                     _LOCAL_CPUS))
# What the processes' JAX and Python need from this environment (a remote node's workers do not inherit it); the
# authkey goes through the actors' runtime environment instead.
_PASSED_ENV = ("JAX_", "XLA_", "TPU_", "PYTHONPATH", "AREAL_JAX_")


def main(argv):
  del argv
  from areal_jax.distributed import ray_job  # pylint: disable=g-import-not-at-top  # imports ray, not JAX
  passed = [a for a in sys.argv[1:] if not a.startswith(_OWN)]
  env = {k: v for k, v in os.environ.items() if k.startswith(_PASSED_ENV) and k != AUTHKEY_ENV}
  try:
    spec = JobSpec.create(num_processes=_NUM_PROCESSES.value, sampler_processes=_CONFIG.value.mesh.sampler_processes,
                          accelerator=_ACCELERATOR.value, learner_devices=_LEARNER_DEVICES.value,
                          sampler_devices=_SAMPLER_DEVICES.value)
    placement = ray_job.Placement(learner_slice=_LEARNER_SLICE.value, sampler_slice=_SAMPLER_SLICE.value,
                                  host_resource=_HOST_RESOURCE.value, cpus_per_process=_CPUS.value,
                                  max_sampler_restarts=_RESTARTS.value, extra_samplers=_EXTRA.value)
    placement.check(spec)
  except ValueError as e:  # a layout that cannot run, named
    sys.exit(f"ray: {e}")
  sys.exit(ray_job.run_ray(script=os.path.join(ROOT, "launch", "tpu_run.py"), args=passed, spec=spec,
                           placement=placement, address=_ADDRESS.value, port=_PORT.value, env=env,
                           local_cpus=_LOCAL_CPUS.value))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
