"""AReaL's own loss functions, from the released `areal` package (installed with --no-deps, as the README says).

Importing `areal.utils.functional` runs `areal/__init__.py`, which starts AReaL's infrastructure and needs its whole
dependency tree (hydra, omegaconf, uvloop, torchdata, a torch below the one pinned here). So this loads the named
top-level definitions verbatim from the installed package's source files into one namespace, with the names they
use at definition time: the code that runs is AReaL's, unchanged.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import pathlib
import types
import typing

import numpy as np
import pytest

torch = pytest.importorskip("torch")

# (file inside the package, top-level definitions to take from it), in dependency order.
SOURCES = (
    ("api/cli_args.py", ("RejectionSamplingConfig",)),
    ("utils/data.py", ("KLEstimator",)),
    ("utils/functional/functional.py", ("_compute_sequence_level_ratio_and_advantages", "RejectionSamplingResult",
                                        "_check_bounds", "apply_rejection_sampling", "ppo_actor_loss_fn",
                                        "sapo_loss_fn")),
    ("trainer/ppo/actor.py", ("_apply_m2po_masking", "_get_m2po_loss_mask")),
)


def _package_dir() -> pathlib.Path:
  spec = importlib.util.find_spec("areal")  # locates the package without importing it
  if spec is None or not spec.submodule_search_locations:
    pytest.skip("AReaL is not installed (pip install --no-deps areal==1.0.4)")
  return pathlib.Path(list(spec.submodule_search_locations)[0])


@functools.cache
def load() -> types.SimpleNamespace:
  root = _package_dir()
  namespace = {"torch": torch, "np": np, "dataclass": dataclasses.dataclass, "field": dataclasses.field,
               "functools": functools, "Any": typing.Any, "dist": None, "__name__": "areal_functions"}
  for rel, names in SOURCES:
    source = (root / rel).read_text()
    nodes = {n.name: n for n in ast.parse(source).body
             if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names}
    missing = sorted(set(names) - set(nodes))
    if missing:
      raise RuntimeError(f"AReaL's {rel} has no {missing}: not the release these tests were written against")
    module = ast.Module(body=[nodes[n] for n in names], type_ignores=[])
    exec(compile(module, str(root / rel), "exec"), namespace)
  return types.SimpleNamespace(**{n: namespace[n] for _, names in SOURCES for n in names})
