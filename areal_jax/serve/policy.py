"""What `--checkpoint_dir` names, read for serving: a step of a run's checkpoints (local or gs://), an Orbax policy
directory, or a local HF model directory (resolved as `tools/evaluate.py` does, by `areal_jax.checkpoint.sources`).

    source = describe("gs://bucket/run", step="latest")  # metadata only: model config, version, tokenizer
    engine = Engine(model=abstract_model(source.model_cfg), config=..., mesh=mesh)
    params = load_params(source, engine)  # read straight onto the engine's shardings
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from etils import epath
from flax import nnx

from areal_jax.checkpoint import sources
from areal_jax.models import hf_io, orbax_io
from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import Transformer
from areal_jax.sampler.engine import Engine
from areal_jax.sharding import SAMPLER_RULES


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicySource:
  """A resolved checkpoint: where its weights are and what serving them needs.

  `tokenizer` is the run's tokenizer spec (a HF directory's own), None if neither says; `run_sampler` is the run's
  `sampler` settings (empty for a model directory); `eos_ids` are extra end-of-answer ids a HF directory's
  `generation_config.json` names (the tokenizer's own EOS always ends answers).
  """

  kind: str  # "run" | "policy" | "hf"
  path: epath.Path
  step: int | None
  model_cfg: ModelConfig
  version: int
  tokenizer: str | None
  run_sampler: dict[str, Any]
  eos_ids: tuple[int, ...]
  name: str


def _name(path: epath.Path, step: int | None) -> str:
  parts = [p for p in os.fspath(path).rstrip("/").split("/") if p]
  base = parts[-2] if len(parts) > 1 and parts[-1] == "checkpoints" else parts[-1] if parts else "policy"
  return base if step is None else f"{base}@{step}"


def _generation_eos(path: epath.Path) -> tuple[int, ...]:
  gen = path / "generation_config.json"
  if not gen.exists():
    return ()
  e = json.loads(gen.read_text()).get("eos_token_id")
  return tuple(int(x) for x in (e if isinstance(e, list) else [] if e is None else [e]))


def describe(checkpoint_dir: str, *, step: str = "latest", dtype: str = "") -> PolicySource:
  """Resolves `checkpoint_dir`; `step` ("latest" or a number) picks a run's checkpoint; `dtype` is the compute dtype
  of a model directory (a run's checkpoints keep their own)."""
  src = sources.resolve(checkpoint_dir)
  run = src.run_config or {}
  overrides = {"dtype": dtype} if dtype else {}
  tokenizer = run.get("model", {}).get("tokenizer")
  if src.kind == "hf":
    return PolicySource(kind="hf", path=src.path, step=None, model_cfg=hf_io.read_config(str(src.path), **overrides),
                        version=0, tokenizer=str(src.path), run_sampler={}, eos_ids=_generation_eos(src.path),
                        name=_name(src.path, None))
  if src.kind == "policy":
    cfg = orbax_io.config_from_json(json.loads((src.path / "model_config.json").read_text()), **overrides)
    return PolicySource(kind="policy", path=src.path, step=None, model_cfg=cfg, version=0, tokenizer=tokenizer,
                        run_sampler=run.get("sampler", {}), eos_ids=(), name=_name(src.path, None))
  found = sources.scan(src.path)
  if step == "latest":
    if not found.complete:
      raise ValueError(f"{src.path} holds no complete checkpoint (passed over: {found.incomplete or 'nothing'})")
    chosen = found.complete[-1]
  elif step.isdigit() and int(step) in found.complete:
    chosen = int(step)
  else:
    raise ValueError(f"step={step!r}: not a complete checkpoint of {src.path} (complete: {found.complete})")
  meta = sources.read_meta(src.path, chosen)
  return PolicySource(kind="run", path=src.path, step=chosen, model_cfg=meta.model_cfg, version=meta.version,
                      tokenizer=tokenizer, run_sampler=run.get("sampler", {}), eos_ids=(), name=_name(src.path, chosen))


def abstract_model(cfg: ModelConfig) -> Transformer:
  """The model's graph and parameter shapes, nothing allocated (what `Engine` takes)."""
  return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def load_params(source: PolicySource, engine: Engine) -> nnx.State:
  """The parameters of `source`, on `engine`'s shardings."""
  if source.kind == "run":
    return sources.load_params(source.path, source.step, source.model_cfg, shardings=engine.param_shardings)
  if source.kind == "hf":
    model = hf_io.load_hf(str(source.path), dtype=source.model_cfg.dtype, mesh=engine.mesh, rules=SAMPLER_RULES)
  else:
    model = orbax_io.load_orbax(str(source.path), dtype=source.model_cfg.dtype, shardings=engine.param_shardings)
  return engine.load_params(nnx.state(model, nnx.Param))
