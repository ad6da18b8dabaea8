"""A sampler mesh of 4 of the 8 CPU devices (data 2 x tensor 2) gives the outputs of one device."""

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from areal_jax.sampler import Engine, Request, SamplerConfig, SamplingParams, Scheduler
from areal_jax.sharding import make_mesh
from helpers import TINY, tiny_model

CFG = TINY



def run(model, mesh, num_pages):
  cfg = SamplerConfig(num_slots=8, page_size=4, num_pages=num_pages, max_seq_len=32, max_prefill_tokens=64)
  engine = Engine(model=model, config=cfg, mesh=mesh)
  sched = Scheduler(engine=engine, params=engine.load_params(model))
  rng = np.random.default_rng(0)
  for g in range(7):
    temperature = 0.0 if g % 2 else 0.9
    sched.submit(Request(group_id=g, prompt_ids=rng.integers(2, 64, size=rng.integers(1, 13)),
                         num_answers=int(rng.integers(1, 4)),
                         sampling=SamplingParams(temperature=temperature, top_p=0.95, max_new_tokens=16, seed=4)))
  out = {}
  while not sched.idle:
    out.update({(s.request.group_id, s.answer): s for s in sched.step()})
  return engine, sched, out


def test_data2_tensor2_mesh_equals_one_device():
  model = tiny_model(CFG, seed=5)
  mesh = make_mesh(jax.devices()[4:], {"data": 2, "tensor": 2})
  one_engine, _, one = run(model, None, num_pages=2 * 33)
  engine, sched, four = run(model, mesh, num_pages=2 * 12)  # tight per-shard pools: preemption on each shard
  # Pages over data, KV heads over tensor; parameters split over tensor.
  assert sched.state.k[0].sharding.spec == P("tensor", "data", None, None)
  assert sched.params["layers"]["mlp"]["up"][...].sharding.spec == P(None, None, "tensor")
  assert {d.id for d in sched.state.k[0].sharding.device_set} == {d.id for d in jax.devices()[4:]}
  assert sched.counters["preemptions"] > 0
  assert sorted(one) == sorted(four)
  for key in one:
    assert four[key].tokens == one[key].tokens, key
    np.testing.assert_allclose(four[key].logprobs, one[key].logprobs, atol=1e-5)
  for shard in range(2):
    assert engine.slots.pool.num_free(shard) == engine.slots.pool.capacity
