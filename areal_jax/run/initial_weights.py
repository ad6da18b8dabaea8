"""A run's initial weights: the base model from `model.init_from` (HF or Orbax), or the random init warm-started on
worked solutions (or an agent's demonstrations; `model.init_from`'s weights too with `warmstart.on_init_from`), cached
in `<workdir>/warmstart`; under LoRA, the learner's fresh adapters on that base. With `warmstart.cache_dir` runs share
warm-starts: one trained by a run with the same model (and `model.init_from`), data, tokenizer, warm-start settings,
seed and learner mesh is copied into the workdir instead of trained again."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import uuid

import jax
from etils import epath
from flax import nnx

from areal_jax import agents
from areal_jax import config as config_lib
from areal_jax.data import warmstart_pairs
from areal_jax.learner.learner import Learner
from areal_jax.learner.step import build_step
from areal_jax.models import hf_io, lora, orbax_io, weights
from areal_jax.rl import warmstart
from areal_jax.rl.workflows import problem


def place(tree, shardings):
  """Host-loaded weights onto the learner's shardings (through the host when the mesh spans processes)."""
  if all(s.is_fully_addressable for s in jax.tree.leaves(shardings)):
    return jax.device_put(tree, shardings)
  return jax.device_put(jax.device_get(tree), shardings)


def initial_params(settings: config_lib.Settings, learner: Learner, train, tokenizer, workdir: epath.Path):
  """The initial weights: the base model (`initial_base`), with the learner's fresh adapters under LoRA."""
  if not learner.model_cfg.lora_rank:
    return initial_base(settings, learner.fns, learner.params, train, tokenizer, workdir)
  if not settings.model_source.init_from and not settings.warmstart.steps:
    return learner.params  # the random init, as `checkpoint.sources.load_base` rebuilds it
  adapters, base = lora.split(learner.params)
  # The base is loaded or warm-started in model.param_dtype, then stored as learner.lora.quantize_base says.
  base_cfg = learner.model_cfg.without_lora().replace(param_dtype=settings.model_source.param_dtype)
  base_fns = build_step(base_cfg, learner.config, learner.mesh, temperature=learner.temperature)
  start = weights.cast(lora.dequantize_base(base), base_cfg.weight_dtype)
  base = initial_base(settings, base_fns, start, train, tokenizer, workdir)
  base = lora.quantized_onto(weights.cast(base, learner.model_cfg.weight_dtype), learner.model_cfg,
                             lora.split(learner.fns.param_shardings)[1])
  return nnx.merge_state(base, adapters)


def _warm_started(settings: config_lib.Settings) -> bool:
  """Whether the run's base is warm-started: the random init when there are warm-start steps, `model.init_from`'s
  weights only with `warmstart.on_init_from`."""
  w = settings.warmstart
  return bool(w.steps) and (not settings.model_source.init_from or w.on_init_from)


def base_source(settings: config_lib.Settings, workdir: epath.Path) -> dict:
  """Where a run's base weights come from, for its LoRA checkpoints' `meta` (`initial_base`'s order)."""
  if settings.model_source.init_from and not _warm_started(settings):
    return {"init_from": settings.model_source.init_from}
  if settings.warmstart.steps:
    return {"warmstart": str(workdir / "warmstart")}
  return {"random_seed": settings.seed}


def initial_base(settings: config_lib.Settings, fns, params, train, tokenizer, workdir: epath.Path):
  """HF or Orbax weights from `model.init_from`, else the random init `params`; warm-started on worked solutions
  (cached) by `fns` (every weight trains, adapters or not) when `_warm_started`."""
  init, dtype = settings.model_source.init_from, settings.model.dtype
  shardings = fns.param_shardings
  if init:
    if epath.Path(init, "config.json").exists():
      model = hf_io.load_hf(init, dtype=dtype, param_dtype=settings.model_source.param_dtype)
    else:
      model = orbax_io.load_orbax(init, dtype=dtype)
    params = place(nnx.state(model, nnx.Param), shardings)
  if not _warm_started(settings):
    return params
  cache = workdir / "warmstart"
  shared = _shared_cache(settings, fns)
  if not (cache / "model_config.json").exists() and shared is not None and (shared / "model_config.json").exists():
    logging.info("warm-start: the one in %s (warmstart.cache_dir) is this run's", shared)
    _copy_tree(shared, cache)
  if (cache / "model_config.json").exists():
    logging.info("warm-start: loading cached %s", cache)
    return place(nnx.state(orbax_io.load_orbax(str(cache)), nnx.Param), shardings)
  agent = settings.agent.load()
  demonstration = agents.demonstrator(agent) if agent else None
  max_response_len = settings.sampler.max_new_tokens
  if demonstration is not None:  # the agent's transcripts, turns merged as in its recorded episodes
    examples = agents.demonstration_episodes([demonstration(problem(r)) for r in train.records], tokenizer,
                                             max_response_len=max_response_len)
  else:
    examples = warmstart_pairs(train.records, tokenizer, max_response_len=max_response_len)
  w = settings.warmstart
  heldout = []
  if w.target_match > 0:  # the last `heldout` examples are not trained on: they measure the match
    if not 0 < w.heldout < len(examples):
      raise config_lib.ConfigError(f"config.warmstart.heldout={w.heldout}: must be in [1, {len(examples) - 1}] "
                                   f"({len(examples)} warm-start examples) when warmstart.target_match > 0")
    examples, heldout = examples[:-w.heldout], examples[-w.heldout:]
  logging.info("warm-start: up to %d steps on %d %s", w.steps, len(examples),
               "demonstrated episodes" if demonstration else "worked solutions")
  params, loss, taken = warmstart.sft(fns, params, examples, steps=w.steps, batch_size=w.batch_size,
                                      lr=w.lr, max_tokens=settings.learner.max_tokens_per_mb, seed=settings.seed,
                                      target_loss=w.target_loss, accumulate=w.accumulate, heldout=heldout,
                                      target_match=w.target_match)
  orbax_io.save_orbax(nnx.merge(fns.graphdef, params), str(cache))
  logging.info("warm-start: done after %d steps, loss %.4f, cached in %s", taken, loss, cache)
  if shared is not None:
    _share(cache, shared)
  return params


def _shared_cache(settings: config_lib.Settings, fns) -> epath.Path | None:
  """This run's entry in `warmstart.cache_dir`: a key of everything that decides the warm-started weights."""
  if not settings.warmstart.cache_dir:
    return None
  warmstart = dataclasses.replace(settings.warmstart, cache_dir="")
  params = [(jax.tree_util.keystr(k), x.shape, str(x.dtype))
            for k, x in jax.tree_util.tree_flatten_with_path(fns.abstract_params)[0]]
  decides = (settings.model, settings.model_source, settings.data, warmstart, settings.agent, settings.seed,
             settings.sampler.max_new_tokens, settings.learner.max_tokens_per_mb, dict(fns.mesh.shape), params)
  key = hashlib.sha256(repr(decides).encode()).hexdigest()[:20]
  return epath.Path(settings.warmstart.cache_dir) / key


def _copy_tree(src: epath.Path, dst: epath.Path) -> None:
  """A directory's files, byte for byte (across file systems: local, gs://)."""
  dst.mkdir(parents=True, exist_ok=True)
  for path in src.iterdir():
    if path.is_dir():
      _copy_tree(path, dst / path.name)
    else:
      (dst / path.name).write_bytes(path.read_bytes())


def _share(cache: epath.Path, shared: epath.Path) -> None:
  """Copies this run's warm-start into the shared cache: staged beside it, then renamed, so a run never reads one
  half-written; when another run shared the same one meanwhile, its copy stays."""
  staging = shared.parent / f"{shared.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  _copy_tree(cache, staging)
  try:
    staging.rename(shared)
  except OSError:
    staging.rmtree()
  else:
    logging.info("warm-start: shared in %s (warmstart.cache_dir)", shared)
