"""The simulated engine steps exactly as the real one: the same requests through the real `Scheduler`, once over the
tiny model's programs and once over `SimEngine` told each answer's length (by its PRNG key), finish the same answers
at the same lengths in the same scheduler steps, with the same preemptions and weight-swap recomputes."""

import numpy as np

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
