r"""A run's saved `config.json` as a config: re-run (or benchmark) exactly what a run ran.

    python launch/tpu_run.py --config=configs/from_json.py:/path/to/run/config.json --workdir=DIR [--config.x=y]
"""

import json

import ml_collections


def get_config(path: str | None = None) -> ml_collections.ConfigDict:
  if not path:
    raise ValueError("configs/from_json.py needs a path: --config=configs/from_json.py:/path/to/config.json")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))
