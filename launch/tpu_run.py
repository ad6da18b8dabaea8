r"""Starts an asynchronous RL run: one controller process, a sampler slice and a learner slice.

  python launch/tpu_run.py --config=configs/math.py[:PRESET] --workdir=DIR [--config.learner.lr=1e-5 ...]

A workdir that already holds checkpoints is resumed. On CPU the device count comes from `config.mesh.cpu_devices`.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from areal_jax.devices import emulate_cpu_devices  # pylint: disable=g-import-not-at-top  # does not import JAX

_CONFIG = config_flags.DEFINE_config_file("config", "configs/math.py", "Config file[:preset].", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/areal_jax", "Run directory, local or gs://.")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() (multi-host without Pathways).")


def main(argv):
  del argv
  config = _CONFIG.value
  emulate_cpu_devices(config.mesh.cpu_devices)  # before JAX starts
  import jax  # pylint: disable=g-import-not-at-top

  if os.environ.get("JAX_PLATFORMS", "").startswith("proxy"):
    try:
      import pathwaysutils  # pylint: disable=g-import-not-at-top
      pathwaysutils.initialize()
    except ImportError:
      logging.warning("JAX_PLATFORMS=proxy but pathwaysutils is not installed")
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  from areal_jax.system import trainer  # pylint: disable=g-import-not-at-top

  trainer.run(config, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
