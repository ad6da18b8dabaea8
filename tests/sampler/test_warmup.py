"""`sampler.warmup`: every program the scheduler calls is compiled before generating, so nothing compiles mid-run,
not even at a weight swap that recomputes running answers."""

import numpy as np

from areal_jax.sampler import Engine, Request, SamplerConfig, SamplingParams, Scheduler
from areal_jax.sampler.sampler import Sampler
from helpers import TINY, tiny_model

CFG = SamplerConfig(num_slots=4, page_size=4, num_pages=24, max_seq_len=24, max_prefill_tokens=32, warmup=True)


def _compiled(engine: Engine) -> dict[str, int]:
  p = engine.programs
  return {name: getattr(p, name)._cache_size() for name in ("prefill", "sample", "insert", "decode")}


def test_a_warmed_up_sampler_compiles_nothing_while_it_generates_and_swaps_weights():
  model = tiny_model(TINY, seed=2)
  engine = Engine(model=model, config=CFG)
  params = engine.load_params(model)
  before = _compiled(engine)
  sampler = Sampler(engine=engine, params=params, eos_ids=[5, 9])  # warms up: sampler.warmup=True
  warm = _compiled(engine)
  assert all(warm[k] > before[k] for k in ("prefill", "insert")), (before, warm)
  sched = sampler.scheduler
  sp = SamplingParams(max_new_tokens=12, seed=1)
  for g in range(3):
    sched.submit(Request(group_id=g, prompt_ids=np.arange(2, 4 + 3 * g, dtype=np.int32), num_answers=2, sampling=sp))
  finished = sched.step()
  sched.update_params(params, 1)  # answers running: their keys and values are recomputed
  while not sched.idle or sched.has_update:
    finished += sched.step()
  assert sched.counters["recomputed"] > 0 and len(finished) == 6
  assert _compiled(engine) == warm
