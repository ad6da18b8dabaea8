r"""Starts an asynchronous RL run: one controller process, or one process of a multi-process job.

  python launch/tpu_run.py --config=configs/math.py[:PRESET] --workdir=DIR [--config.learner.lr=1e-5 ...]

One process (the default) splits its devices into a sampler slice and a learner slice. With `--num_processes=N`
(and `--process_id`, `--coordinator_address=HOST:PORT` of process 0), this is one of N processes:
`config.mesh.sampler_processes` of them are samplers, the rest form the learner (`areal_jax/distributed/roles.py`).
`launch/local.py` starts all N on one machine. A workdir that already holds checkpoints is resumed. On CPU each
process emulates `config.mesh.cpu_devices` devices; on a GPU or TPU host `--devices=0,1` gives this process only those
GPUs or TPU chips of its host (several processes per host, each with its own).
"""

import os
import sys

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from areal_jax import cli  # pylint: disable=g-import-not-at-top  # does not import JAX
from areal_jax.devices import (device_subset_env, emulate_cpu_devices,  # pylint: disable=g-import-not-at-top
                               local_accelerators)  # does not import JAX
from areal_jax.distributed import roles  # pylint: disable=g-import-not-at-top  # does not import JAX

_CONFIG = cli.define_config()
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/areal_jax", "Run directory, local or gs://.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job (default: environment, else 1).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id in [0, num_processes).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0 (it also uses PORT + 1).")
_DEVICES = flags.DEFINE_list("devices", None, "This process's GPUs or TPU chips of its host, by index (default: all).")


def main(argv):
  del argv
  config = _CONFIG.value
  layout = roles.from_flags_or_env(num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value,
                                   coordinator_address=_COORDINATOR.value,
                                   sampler_processes=config.mesh.sampler_processes)
  emulate_cpu_devices(config.mesh.cpu_devices)  # before JAX starts
  if _DEVICES.value:
    kind, _ = local_accelerators()
    from areal_jax.distributed.local_job import free_port_pair  # pylint: disable=g-import-not-at-top  # no JAX
    try:
      os.environ.update(device_subset_env(kind, [int(d) for d in _DEVICES.value], port=free_port_pair()))
    except ValueError as e:
      sys.exit(f"FATAL --devices={','.join(_DEVICES.value)}: {e}")
  if os.environ.get("JAX_PLATFORMS", "").startswith("proxy"):
    try:
      import pathwaysutils  # pylint: disable=g-import-not-at-top
      pathwaysutils.initialize()
    except ImportError:
      logging.warning("JAX_PLATFORMS=proxy but pathwaysutils is not installed")
  roles.start_jax(layout)
  import jax  # pylint: disable=g-import-not-at-top

  from areal_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from areal_jax.run import trainer  # pylint: disable=g-import-not-at-top

  jax.devices()  # the backend first: libtpu installs a SIGTERM handler of its own, replaced here
  cli.stop_on_signals()
  try:
    trainer.entry_point(layout)(config, _WORKDIR.value, layout)  # lead, follow or sample
  except ConfigError as e:
    sys.exit(f"FATAL config error: {e}")
  except cli.Stopped as e:
    logging.warning("%s: stopped (the run's threads and workers are shut down and the checkpoint write in flight "
                    "finished); the same command resumes from the last checkpoint", e)
    status = 128 + e.signum
  except Exception:  # pylint: disable=broad-except
    if layout.role != "sampler":
      raise
    logging.exception("%s failed (the job goes on without it; started again, it rejoins)", layout.name)
    status = 1
  else:
    status = 0
  if layout.role == "sampler" or status or (layout.multi_process and layout.num_learners == 1):
    # Done and said goodbye (or stopped and shut down). Skip interpreter teardown: destroying a transfer client or
    # server while a pull is still blocked in it (the leader's takes back what a lost sampler never pulled) can abort
    # in C++ and turn a clean stop into a crash. Learners of a multi-learner job keep it: `jax.distributed` shuts
    # down together there.
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # pylint: disable=protected-access


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
