r"""A run's saved `config.json` as a config: re-run (or benchmark) exactly what a run ran.

    python launch/tpu_run.py --config=configs/from_json.py:/path/to/run/config.json --workdir=DIR [--config.x=y]

The saved values sit on top of `configs/math.py`'s defaults, so a config saved before a field existed still loads,
with that field's default.
"""

import importlib.util
import json
import os

import ml_collections


def _defaults() -> ml_collections.ConfigDict:
  spec = importlib.util.spec_from_file_location("_math_config", os.path.join(os.path.dirname(__file__), "math.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def get_config(path: str | None = None) -> ml_collections.ConfigDict:
  if not path:
    raise ValueError("configs/from_json.py needs a path: --config=configs/from_json.py:/path/to/config.json")
  with open(path) as f:
    saved = json.load(f)
  config = _defaults()
  config.update(saved)
  return config
