"""Ahead-of-time lowering of the sampler's device functions from shapes alone (no parameter is materialised).

    mesh = Mesh(np.array(topology.devices).reshape(2, 2), ("data", "tensor"))  # e.g. a TPU topology description
    lowered = lower_sampler(ModelConfig.from_hf(...), SamplerConfig(...), mesh, free_bytes=16 << 30)
    compiled = lowered["decode"].compile(); print(compiled.memory_analysis())
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from areal_jax.models import ModelConfig, create
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.engine import MAX_EOS_IDS, pages_per_shard, param_bytes_per_device
from areal_jax.sampler.programs import Chunks, SlotUpdate, build_programs
from areal_jax.sampler.state import decode_state_shapes, decode_state_shardings, prefix_shardings
from areal_jax.sharding import SAMPLER_RULES, state_shardings
from areal_jax.models.weights import with_dtype


def abstract_params(model_cfg: ModelConfig, mesh: Mesh, dtype=None):
  """(graphdef, params as `jax.ShapeDtypeStruct`s carrying the sampler's shardings), floating ones in `dtype` (the
  sampler's `param_dtype`; None = the model's)."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: create(model_cfg)))
  shardings = state_shardings(state, mesh, SAMPLER_RULES)
  typed = state if dtype is None else with_dtype(state, dtype)
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), typed, shardings)
  return graphdef, params


def abstract_decode_state(model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Mesh, params, *,
                          free_bytes: int | None = None):
  """(decode state as sharded `jax.ShapeDtypeStruct`s, pages per data shard) for the pool size the config gives
  beside `params` (num_pages, or memory_fraction of `free_bytes` per device)."""
  per_shard = pages_per_shard(model_cfg, cfg, mesh, param_bytes_per_device=param_bytes_per_device(params, mesh),
                              free_bytes=free_bytes)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       decode_state_shapes(model_cfg, cfg, per_shard * mesh.shape["data"]),
                       decode_state_shardings(model_cfg, mesh))
  return state, per_shard


def _sds(shape, dtype, mesh, spec=P()):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def lower_sampler(model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Mesh, *, prefill_len: int | None = None,
                  free_bytes: int | None = None) -> dict[str, jax.stages.Lowered]:
  """Lowered `decode`, `prefill` (one row of `prefill_len` tokens per data shard, default max_seq_len, as the
  scheduler shards it), `prefill_after` (the same rows after pages of the prefix cache) and `insert` for the pool
  size the config gives (num_pages, or memory_fraction of `free_bytes` per device), with weights of the config's
  `param_dtype`."""
  graphdef, params = abstract_params(model_cfg, mesh, cfg.weight_dtype)
  state, _ = abstract_decode_state(model_cfg, cfg, mesh, params, free_bytes=free_bytes)
  programs = build_programs(graphdef, model_cfg, cfg, mesh)
  s, m = cfg.num_slots, cfg.pages_per_seq
  t = -(-(prefill_len or cfg.max_seq_len) // cfg.page_size) * cfg.page_size
  i32 = jnp.int32
  b = mesh.shape["data"]
  prefill_args = (_sds((b, t), i32, mesh, P("data")), _sds((b,), i32, mesh, P("data")), _sds((s,), i32, mesh))
  decode_args = (_sds((s,), i32, mesh, P("data")), _sds((s,), jnp.bool_, mesh, P("data")),
                 _sds((MAX_EOS_IDS,), i32, mesh), _sds((3, s * -(-cfg.decode_steps // cfg.page_size)), i32, mesh),
                 _sds((), i32, mesh))
  lowered = {
      "decode": programs.decode.lower(params, state, *decode_args),
      "prefill": programs.prefill.lower(params, *prefill_args, sharded=True),
      "prefill_after": programs.prefill_after.lower(
          params, state.k, state.v, _sds((b, m), i32, mesh, P("data")), _sds((b,), i32, mesh, P("data")),
          *prefill_args),
  }
  prefix = jax.eval_shape(functools.partial(programs.prefill, sharded=True), params, *prefill_args)[0]
  dense = prefix_shardings(model_cfg, mesh, sharded=True)
  prefix = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dense), prefix)
  chunks = Chunks(*(_sds((b * (t // cfg.page_size) + s,), i32, mesh) for _ in range(4)))
  vec = lambda dtype=i32: _sds((s,), dtype, mesh)
  upd = SlotUpdate(slot=vec(), rows=_sds((s, m), i32, mesh), src=vec(), override=vec(), lengths=vec(), index=vec(),
                   keys=_sds((s, 2), jnp.uint32, mesh), temperature=vec(jnp.float32), top_p=vec(jnp.float32),
                   top_k=vec())
  lowered["insert"] = programs.insert.lower(state, prefix, vec(), chunks, upd)
  if programs.speculate is not None:  # with sampler.speculation: the decode call that verifies drafts
    lowered["speculate"] = programs.speculate.lower(params, state, *decode_args,
                                                    _sds((s, cfg.draft_width), i32, mesh), vec(), vec())
  return lowered
