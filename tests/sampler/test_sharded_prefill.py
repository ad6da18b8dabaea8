"""Prefill sharded over the data axis: each shard computes and keeps only its own rows' keys and values (read from the
compiled programs), rows go only to slots of their shard, and a weight swap recomputes every shard's answers in the
same calls."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.sampler import Engine, Placement, Request, SamplerConfig, SamplingParams, Scheduler
from areal_jax.sampler.aot import _sds, abstract_params, lower_sampler
from areal_jax.sampler.engine import Draws
from areal_jax.sampler.programs import build_programs
from areal_jax.sharding import make_mesh
from helpers import TINY, tiny_model

T = 48  # the prefill's padded length: a dimension no weight or other activation of TINY has
_COLLECTIVE = re.compile(r"= (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def _big_collectives(compiled) -> list[tuple[str, str]]:
  """(shape, kind) of the compiled program's collectives over anything as large as one row's keys of one layer."""
  one_row = T * TINY.num_kv_heads * TINY.head_dim
  out = []
  for shape, kind in _COLLECTIVE.findall(compiled.as_text()):
    dims = [int(d) for d in re.findall(r"\d+", shape.split("{")[0].split("[", 1)[-1])]
    if np.prod(dims, dtype=np.int64) >= one_row:
      out.append((shape, kind))
  return out


def test_a_two_row_prefill_on_two_data_shards_gathers_no_keys_or_values():
  mesh = make_mesh(jax.devices()[:2], {"data": 2, "tensor": 1})
  cfg = SamplerConfig(num_slots=8, page_size=4, num_pages=64, max_seq_len=64, prefix_cache=True)
  lowered = lower_sampler(TINY, cfg, mesh, prefill_len=T)  # one row per data shard, as the scheduler shards them
  for name in ("prefill", "prefill_after", "insert"):
    assert _big_collectives(lowered[name].compile()) == [], name
  # The layout rows take when their slot is not known yet (JetStream's prefill): every shard computes both rows and
  # the keys and values are gathered over `data`. The check above would see it.
  graphdef, params = abstract_params(TINY, mesh, cfg.weight_dtype)
  programs = build_programs(graphdef, TINY, cfg, mesh)
  args = (_sds((2, T), jnp.int32, mesh), _sds((2,), jnp.int32, mesh), _sds((8,), jnp.int32, mesh))
  replicated = _big_collectives(programs.prefill.lower(params, *args, sharded=False).compile())
  assert [kind for _, kind in replicated] == ["all-gather", "all-gather"], replicated  # keys and values


@pytest.fixture(scope="module")
def model():
  return tiny_model(TINY, seed=11)


def _engine(model, **kw):
  cfg = SamplerConfig(num_slots=8, page_size=4, num_pages=2 * 40, max_seq_len=64, **kw)
  return Engine(model=model, config=cfg, mesh=make_mesh(jax.devices()[:2], {"data": 2, "tensor": 1}))


def test_rows_are_laid_out_by_shard_and_placed_only_on_their_shard(model):
  engine = _engine(model)
  params, state = engine.load_params(model), engine.init_decode_state()
  prompts = [np.arange(2, 2 + n, dtype=np.int32) for n in (5, 9, 3)]
  draws = [Draws(keys=np.zeros((1, 2), np.uint32))] * 3
  prefix, _ = engine.prefill_batch(params, prompts, draws, shards=[1, 0, 1], decode_state=state)
  assert prefix.arrays.rows_per_shard == 2 and prefix.arrays.k.shape[1] == 4  # shard 0: rows 0-1, shard 1: 2-3
  assert prefix.array_row.tolist() == [2, 0, 3]
  assert prefix.arrays.k.sharding.spec[1] == "data"
  with pytest.raises(ValueError, match=r"prefix row 0 was prefilled on data shard 1; slot 0 is on shard 0"):
    engine.insert_many(prefix, state, [Placement.new(0, [0])])
  state = engine.insert_many(prefix, state, [Placement.new(0, [4]), Placement.new(1, [0]), Placement.new(2, [5])])
  assert engine.slots.active[[0, 4, 5]].all()
  with pytest.raises(ValueError, match=r"shards \[0, 2\] for 2 rows; each must be a data shard in \[0, 2\)"):
    engine.prefill_batch(params, prompts[:2], draws[:2], shards=[0, 2])


def _prefill_calls(engine) -> list[int]:
  """Wraps `engine.prefill_batch` to record the rows of each call."""
  calls, inner = [], engine.prefill_batch

  def counted(params, sequences, draws, **kw):
    calls.append(len(sequences))
    return inner(params, sequences, draws, **kw)

  engine.prefill_batch = counted
  return calls


def test_a_weight_swap_recomputes_each_shard_s_answers_in_the_same_call(model):
  """With a budget of one row per shard (contexts of 33-38 tokens: the 64 bucket), 4 running answers (2 per shard)
  are recomputed in 2 calls of 2 rows, not in 4 calls of one; the tokens after the swap are the ones a run without it
  draws (same weights)."""
  def run(swap):
    engine = _engine(model, max_prefill_tokens=64, decode_steps=2, overlap=False)
    params = engine.load_params(model)
    sched = Scheduler(engine=engine, params=params)
    for g in range(4):
      sched.submit(Request(group_id=g, prompt_ids=np.arange(3, 36 + g, dtype=np.int32) % 60 + 2,
                           sampling=SamplingParams(max_new_tokens=12, ignore_eos=True)))
    sched.step()
    assert sorted(engine.slots.shard_of(s) for s in sched.running) == [0, 0, 1, 1]
    calls = _prefill_calls(engine)
    if swap:
      sched.update_params(params, version=1)
    out = {}
    while not sched.idle:
      out.update({s.request.group_id: s.tokens for s in sched.step()})
    return sched, calls, out

  sched, calls, swapped = run(swap=True)
  assert sched.counters["recomputed"] == 4 and calls == [2, 2]
  _, _, plain = run(swap=False)
  assert swapped == plain
