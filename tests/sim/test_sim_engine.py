"""The simulated engine steps exactly as the real one: the same requests through the real `Scheduler`, once over the
tiny model's programs and once over `SimEngine` told each answer's length (by its PRNG key), finish the same answers
at the same lengths in the same scheduler steps, with the same preemptions and weight-swap recomputes."""

import numpy as np
import pytest

from areal_jax.sampler import Engine, Request, SamplerConfig, SamplingParams, Scheduler
from areal_jax.sampler.sampling import request_key
from areal_jax.sim.costs import CostModel
from areal_jax.hardware import Device
from areal_jax.sim.engine import SimEngine
from helpers import TINY, tiny_model

EOS_IDS = (5, 9, 17, 33)  # a random model draws one of them about every 16 tokens


def _requests():
  sp = SamplingParams(max_new_tokens=24, seed=7)
  return [Request(group_id=g, prompt_ids=np.arange(2, 6 + g % 5, dtype=np.int32), num_answers=4, sampling=sp)
          for g in range(10)]


def _run(sched: Scheduler) -> list:
  """Each scheduler step's answers in flight, decode steps and finished (group, answer, length); the weights are
  swapped after the fourth step."""
  for r in _requests():
    sched.submit(r)
  log = []
  while not sched.idle or sched.has_update:
    if len(log) == 4:
      sched.update_params(sched.params, 1)
    steps = sched.counters["decode_steps"]
    finished = sched.step()
    log.append((len(sched.running), sched.counters["decode_steps"] - steps,
                sorted((s.request.group_id, s.answer, len(s.tokens)) for s in finished)))
  return log


def test_the_simulated_engine_steps_as_the_real_one():
  cfg = SamplerConfig(num_slots=12, page_size=4, num_pages=28, max_seq_len=40, decode_steps=4, max_prefill_tokens=48)
  model = tiny_model(TINY, seed=1)
  engine = Engine(model=model, config=cfg)
  real = Scheduler(engine=engine, params=engine.load_params(model), eos_ids=EOS_IDS)
  real_log = _run(real)
  drawn = {(g, i, n) for _, _, done in real_log for g, i, n in done}
  by_key = {tuple(int(x) for x in request_key(7, g, i)): n for g, i, n in drawn}

  def replay(keys):
    keys = np.asarray(keys)
    return np.array([by_key.get(tuple(int(x) for x in k), 1) for k in keys.reshape(-1, 2)]).reshape(keys.shape[:-1])

  costs = CostModel(model=TINY, device=Device("any", flops=1e12, hbm_bw=1e11, hbm=1e9, link=1e10), sampler_chips=1,
                    learner_chips=1)
  sim_engine = SimEngine(model_cfg=TINY, cfg=cfg, num_shards=1, pages_per_shard=engine.slots.pool.pages_per_shard,
                         costs=costs, lengths=replay, eos_id=0)
  sim = Scheduler(engine=sim_engine, params={}, eos_ids=[0])
  assert _run(sim) == real_log
  assert len(drawn) == 40 and len({n for _, _, n in drawn}) > 5  # every answer, of many lengths
  for key in ("preemptions", "recomputed", "decode_calls", "prefill_rows", "tokens"):
    assert sim.counters[key] == real.counters[key], key
  assert real.counters["preemptions"] > 0 and real.counters["recomputed"] > 0


def test_a_prefill_costs_the_rows_each_data_shard_computes_as_the_code_compiles_it():
  """Two rows on a 4-way data axis: sharded (the scheduler names their shards), each shard computes and keeps one
  row, so the prefill costs one row's; replicated (JetStream's prefill, no shard), every shard computes both. What
  each device holds is read from the real engine's output; the simulated engine is priced the same."""
  import jax  # pylint: disable=g-import-not-at-top

  from areal_jax.sampler.engine import Draws  # pylint: disable=g-import-not-at-top
  from areal_jax.sharding import make_mesh  # pylint: disable=g-import-not-at-top

  cfg = SamplerConfig(num_slots=8, page_size=4, num_pages=64, max_seq_len=40, decode_steps=4)
  mesh = make_mesh(jax.devices()[:4], {"data": 4, "tensor": 1})
  engine = Engine(model=tiny_model(TINY, seed=1), config=cfg, mesh=mesh)
  params = engine.load_params(tiny_model(TINY, seed=1))
  device = Device("any", flops=1e12, hbm_bw=1e11, hbm=1e9, link=1e10)
  costs = CostModel(model=TINY, device=device, sampler_chips=4, learner_chips=1, sampler_shards=4)
  one_chip = CostModel(model=TINY, device=device, sampler_chips=1, learner_chips=1)
  sim = SimEngine(model_cfg=TINY, cfg=cfg, num_shards=4, pages_per_shard=16, costs=costs,
                  lengths=lambda keys: np.full(np.shape(keys)[:-1], 4), eos_id=0)
  rows = [np.arange(2, 12, dtype=np.int32)] * 2
  draws = [Draws(keys=np.zeros((1, 2), np.uint32))] * 2
  for shards, per_device in (([0, 1], 1), (None, 2)):
    prefix, _ = engine.prefill_batch(params, rows, draws, shards=shards)
    held = {s.data.shape[1] for s in prefix.arrays.k.addressable_shards}  # rows each device computed and keeps
    assert held == {per_device}, shards
    sim.prefill_batch({}, rows, draws, shards=shards)
    bucket = engine.bucket(len(rows[0]))
    assert sim.take_spent() == pytest.approx(one_chip.prefill(per_device, bucket)), shards


def test_an_evaluations_price_is_what_the_simulated_engine_takes_to_answer_it():
  """`CostModel.evaluation`: the held-out answers through the real `Scheduler` over `SimEngine` (one engine on the
  leader host's learner chips, every answer 64 tokens) take what the closed form says, and the learner pays it
  spread over `eval.every_steps`."""
  device = Device("any", flops=1e12, hbm_bw=1e11, hbm=1e9, link=1e10, chips_per_host=2)
  costs = CostModel(model=TINY, device=device, sampler_chips=2, learner_chips=4, eval_answers=64, eval_every=10,
                    eval_len=64, eval_prompt=8, eval_slots=16, eval_decode_steps=8)
  cfg = SamplerConfig(num_slots=16, page_size=8, num_pages=2 * 16 * 10, max_seq_len=80, max_new_tokens=64,
                      decode_steps=8, max_prefill_tokens=16 * 8)
  engine_costs = CostModel(model=TINY, device=device, sampler_chips=2, learner_chips=4, sampler_shards=2)
  sim = SimEngine(model_cfg=TINY, cfg=cfg, num_shards=2, pages_per_shard=16 * 10, costs=engine_costs,
                  lengths=lambda keys: np.full(np.shape(keys)[:-1], 64), eos_id=0)
  sched = Scheduler(engine=sim, params={}, eos_ids=[0])
  sp = SamplingParams(max_new_tokens=64, temperature=0.0, seed=1)
  for g in range(64):
    sched.submit(Request(group_id=g, prompt_ids=np.arange(2, 10, dtype=np.int32), num_answers=1, sampling=sp))
  seconds = 0.0
  while not sched.idle:
    sched.step()
    seconds += sim.take_spent()
  assert costs.evaluation() == pytest.approx(seconds, rel=0.15)
  assert costs.after_step() == pytest.approx(costs.evaluation() / 10)
  assert CostModel(model=TINY, device=device, sampler_chips=2, learner_chips=4).after_step() == 0.0
