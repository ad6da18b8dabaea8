"""`sampler.overlap`: reading a decode call after the next one is dispatched changes no answer. The same requests
through the real engine with and without overlap give the same tokens, logprobs, versions, finish reasons and
routes, answer by answer (logprobs to float rounding where an answer was preempted, and so resumed from a
re-prefilled cache, in either run, or with the prefix cache, whose prefills the two runs batch differently): with EOS ids, stop sequences and per-request lengths, a pool tight enough to preempt, two
data shards, the prefix cache, and a mixture of experts recording its routing."""

import jax
import numpy as np
import pytest

from areal_jax.models import ModelConfig
from areal_jax.sampler import Engine, Request, SamplerConfig, SamplingParams, Scheduler
from areal_jax.sharding import make_mesh
from helpers import TINY, tiny_model

MOE = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, max_position_embeddings=256)
EOS_IDS = (5, 9, 17)


def _requests(seed: int) -> list[Request]:
  rng = np.random.default_rng(seed)
  out = []
  for g in range(14):
    stop = ((int(rng.integers(2, 64)),),) if g % 3 == 0 else ()  # a one-token stop sequence now and then
    sp = SamplingParams(temperature=1.0, max_new_tokens=int(rng.integers(1, 30)), stop=stop, seed=seed,
                        ignore_eos=g % 5 == 0)
    out.append(Request(group_id=g, prompt_ids=rng.integers(2, 64, size=int(rng.integers(2, 20))),
                       num_answers=int(rng.integers(1, 4)), sampling=sp))
  return out


def _answers(model, cfg: SamplerConfig, mesh, requests) -> tuple[dict, Scheduler, int]:
  engine = Engine(model=model, config=cfg, mesh=mesh)
  sched = Scheduler(engine=engine, params=engine.load_params(model), eos_ids=EOS_IDS)
  for r in requests:
    sched.submit(r)
  out, in_flight = {}, 0
  while not sched.idle:
    for seq in sched.step():
      out[seq.request.group_id, seq.answer] = (seq.trajectory(), seq.preemptions)
    in_flight += bool(sched._inflight)  # pylint: disable=protected-access  # steps that left a call in flight
  engine.slots.check()
  assert not engine.slots.active.any()
  return out, sched, in_flight


@pytest.mark.parametrize("case", ["tight_pool", "two_shards", "prefix_cache", "moe_routes"])
def test_overlap_changes_no_answer(case):
  model_cfg = MOE if case == "moe_routes" else TINY
  model = tiny_model(model_cfg, seed=3)
  data = 2 if case == "two_shards" else 1
  pages = 30 if case == "tight_pool" else 8 * 12 + 1  # else every slot at full length: nothing preempted
  cfg = SamplerConfig(num_slots=8, page_size=4, num_pages=pages * data, max_seq_len=48, max_prefill_tokens=64,
                      decode_steps=4, prefix_cache=case == "prefix_cache", record_routes=case == "moe_routes")
  mesh = make_mesh(jax.devices()[:data], {"data": data, "tensor": 1})
  requests = _requests(seed=len(case))
  if case == "prefix_cache":  # second turns: each earlier prompt again with a few more tokens
    requests += [Request(group_id=100 + r.group_id, prompt_ids=np.concatenate([r.prompt_ids, [7, 8, 9, 10, 11]]),
                         num_answers=1, sampling=r.sampling) for r in requests[:6]]
  serial, plain, _ = _answers(model, cfg.replace(overlap=False), mesh, requests)
  overlapped, sched, in_flight = _answers(model, cfg, mesh, requests)
  assert in_flight > 5  # the host really read calls after dispatching the next
  assert (plain.counters["preemptions"] > 0) == (sched.counters["preemptions"] > 0) == (case == "tight_pool")
  assert serial.keys() == overlapped.keys() == {(r.group_id, i) for r in requests for i in range(r.num_answers)}
  reasons, exact = set(), 0
  for key, (a, preempted_a) in serial.items():
    b, preempted_b = overlapped[key]
    np.testing.assert_array_equal(a.response_ids, b.response_ids, err_msg=str(key))
    # Resumed by a re-prefill (at different tokens), or with the prefix cache (every prefill then runs the program
    # that reads cached pages, and the two runs batch the prompts differently: another row count and bucket, so
    # the CPU's matmuls may round differently): float rounding.
    if preempted_a or preempted_b or case == "prefix_cache":
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, err_msg=str(key))
    else:
      np.testing.assert_array_equal(a.logprobs, b.logprobs, err_msg=str(key))
      exact += 1
    np.testing.assert_array_equal(a.versions, b.versions, err_msg=str(key))
    assert a.finish_reason == b.finish_reason, key
    if case == "moe_routes":
      np.testing.assert_array_equal(a.routes, b.routes, err_msg=str(key))
    reasons.add(a.finish_reason)
  assert reasons == {"eos", "stop", "length"} and (exact > 0) == (case != "prefix_cache")
  assert sched.counters["tokens"] == plain.counters["tokens"] == sum(len(t.response_ids) for t, _ in serial.values())
