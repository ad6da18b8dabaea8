"""Speculative rollout priced in the simulator: the real scheduler drafts and calls `SimEngine.speculate`, which draws
the tokens a plain decode call would and prices the forwards they take under a measured acceptance."""

import numpy as np
import pytest

from areal_jax import config as config_lib
from areal_jax.hardware import Device, device
from areal_jax.sampler import Request, SamplerConfig, SamplingParams, Scheduler
from areal_jax.sim import plan
from areal_jax.sim.costs import Acceptance, CostModel, Efficiency
from areal_jax.sim.engine import SimEngine
from areal_jax.sim.lengths import Lengths
from helpers import TINY

CFG = SamplerConfig(num_slots=8, page_size=4, num_pages=0, max_seq_len=64, decode_steps=10, max_prefill_tokens=64)
MEMORY_BOUND = Device("memory", flops=1e30, hbm_bw=1e11, hbm=1e9, link=1e10)
COMPUTE_BOUND = Device("compute", flops=1e9, hbm_bw=1e30, hbm=1e9, link=1e10)
# The decode forwards alone: free prefills, no fixed costs per call or step, no host work (the drafter's neither).
FORWARDS_ONLY = Efficiency(prefill_flops=1e30, prefill_call_s=0.0, decode_call_s=0.0, decode_step_s=0.0,
                           host_call_s=0.0, host_slot_s=0.0, draft_slot_s=0.0)


def _run(device: Device, accept: str | None, *, length: int = 41, eff: Efficiency = FORWARDS_ONLY,
         overlap: bool = True) -> tuple[float, Scheduler]:
  """Device seconds of 24 answers of `length` tokens (the first from the prefill) through the real scheduler,
  plain or speculative."""
  cfg = CFG.replace(overlap=overlap, speculation="off" if accept is None else "suffix")
  costs = CostModel(model=TINY, device=device, sampler_chips=1, learner_chips=1, eff=eff,
                    acceptance=None if accept is None else Acceptance.parse(accept, cfg.spec_tokens))
  engine = SimEngine(model_cfg=TINY, cfg=cfg, num_shards=2, pages_per_shard=64, costs=costs,
                     lengths=lambda keys: np.full(np.asarray(keys).shape[:-1], length), eos_id=0)
  sched = Scheduler(engine=engine, params={}, eos_ids=[0])
  sp = SamplingParams(max_new_tokens=60, seed=3)
  for g in range(6):
    sched.submit(Request(group_id=g, prompt_ids=np.arange(2, 8, dtype=np.int32), num_answers=4, sampling=sp))
  spent = 0.0
  while not sched.idle:
    sched.step()
    spent += engine.take_spent()
  return spent, sched


def test_no_accepted_draft_costs_plain_decode_plus_the_compute_of_the_drafts():
  """Acceptance 0: a forward per token as plain decode; the same bytes (equal where memory decides), k + 1
  positions' compute (more where compute decides)."""
  plain, sched = _run(MEMORY_BOUND, None)
  spec, spec_sched = _run(MEMORY_BOUND, "0")
  assert spec_sched.counters["tokens"] == sched.counters["tokens"] == 24 * 41
  assert spec == pytest.approx(plain, rel=1e-9)
  plain, _ = _run(COMPUTE_BOUND, None)
  spec, _ = _run(COMPUTE_BOUND, "0")
  # spec_tokens + 1 = 5 positions' compute per forward of the calls that carry drafts (a call without any, as the
  # answers start, runs the plain decode program)
  assert 3 * plain < spec <= 5 * plain * (1 + 1e-9)


def test_every_draft_accepted_emits_spec_tokens_plus_one_per_forward_capped_by_the_call():
  _, sched = _run(MEMORY_BOUND, "1")
  c = sched.counters
  assert c["spec_tokens"] > 0  # the calls that carried drafts (the first of an answer may not: plain decode)
  assert c["spec_forwards"] == c["spec_tokens"] / 5  # calls of 10 tokens: 2 forwards of 5 each
  assert c["spec_accepted"] == c["spec_drafted"] > 0
  plain, _ = _run(MEMORY_BOUND, None)
  spec, _ = _run(MEMORY_BOUND, "1")
  assert spec < plain / 2  # 2 forwards a call where plain decode takes 10 (once drafts come)


def test_the_drafters_host_work_extends_a_short_call_and_hides_behind_a_long_one():
  """`Efficiency.draft_slot_s` per slot that draws, in every decode call with speculation (with drafts or without):
  it makes a call whose device part is tiny host-bound; with `sampler.overlap` a longer device part hides it, without
  overlap it adds to it."""
  slow = FORWARDS_ONLY.replace(draft_slot_s=1.0)
  assert _run(MEMORY_BOUND, None, eff=slow)[0] < 1  # no drafter without speculation
  assert _run(MEMORY_BOUND, "0.5")[0] < 1
  # Each answer draws its 40 tokens in calls of at most 10: the drafter works for it in 4 calls at least.
  assert _run(MEMORY_BOUND, "0.5", eff=slow)[0] >= 24 * 4 * 1.0
  some = FORWARDS_ONLY.replace(draft_slot_s=1e-4)  # a fifth of what one forward of a slot computes here
  device_s, _ = _run(COMPUTE_BOUND, "0.5")
  assert _run(COMPUTE_BOUND, "0.5", eff=some)[0] == pytest.approx(device_s, rel=1e-12)
  assert _run(COMPUTE_BOUND, "0.5", eff=some, overlap=False)[0] >= device_s + 24 * 4 * 1e-4


def test_forwards_follow_the_acceptance_and_the_tokens_a_call_has_left():
  a = Acceptance.parse("0.6", 4)
  assert a.accepted == pytest.approx((0.6, 0.36, 0.216, 0.1296))
  assert a.tokens_per_forward() == pytest.approx(1 + 0.6 + 0.36 + 0.216 + 0.1296)
  cdf = a.forwards_cdf(10)
  rng = np.random.default_rng(0)
  draws = []
  for _ in range(20000):  # a slot's forwards for 10 tokens, forward by forward
    left, f = 10, 0
    while left:
      accepted = 0
      while accepted < min(4, left - 1) and rng.random() < 0.6:
        accepted += 1
      left, f = left - 1 - accepted, f + 1
    draws.append(f)
  assert (1 - cdf[10]).sum() == pytest.approx(np.mean(draws), rel=0.02)  # E[F] = sum of P(F > f)
  assert np.all(np.diff(cdf, axis=1) >= -1e-12) and np.all(cdf[:, -1] == 1)
  assert Acceptance.parse("0.5,0.2,0.3,0", 4).leading().tolist() == [1, 0.5, 0.2, 0.2, 0]  # made non-increasing
  with pytest.raises(ValueError, match="3 draft positions, sampler.spec_tokens=4"):
    Acceptance.parse("0.5,0.2,0.1", 4)


def test_speculation_without_an_acceptance_is_refused_naming_the_flag():
  costs = CostModel(model=TINY, device=MEMORY_BOUND, sampler_chips=1, learner_chips=1)
  with pytest.raises(ValueError, match="--spec_accept"):
    SimEngine(model_cfg=TINY, cfg=CFG.replace(speculation="suffix"), num_shards=1, pages_per_shard=64, costs=costs,
              lengths=lambda keys: np.ones(np.asarray(keys).shape[:-1], int), eos_id=0)


def test_a_plan_with_speculation_runs_to_the_end_and_decodes_faster():
  settings = config_lib.validate(config_lib.load_config("configs/math.py:tiny"), data=False)
  setup = plan.Setup(model=settings.model, device=device("v5p"), chips=4, sampler=settings.sampler.replace(num_slots=16),
                     batch_prompts=4, answers=4, prompt_len=20, lengths=Lengths.parametric(mean=200, max=640),
                     steps=5, warmup=2)
  result = plan.plan(setup, etas=(1,), sampler_chips=[2])
  fast = plan.speculation(setup, result, Acceptance.parse("0.8", setup.sampler.spec_tokens))
  slow = plan.speculation(setup, result, Acceptance.parse("0", setup.sampler.spec_tokens))
  assert len(fast["rows"]) == len(result["rows"]) + 1  # colocated sync and the split's row
  for f, s in zip(fast["rows"], slow["rows"]):
    assert f["tokens_per_s"] > 0 and f["step_s"] > 0
    assert f["sampler_busy"] < s["sampler_busy"]
  assert "speculation" in plan.format_speculation(fast) and "-> " in plan.format_speculation(fast)


def test_the_evaluation_is_priced_with_the_acceptance_too():
  """`CostModel.evaluation` with speculation: where memory decides, every draft accepted takes a call's 8 tokens in 2
  forwards (5 and 3) instead of 8, none accepted costs what plain decode does; the prompts' prefill is the same."""
  def costs(accept: str | None) -> CostModel:
    return CostModel(model=TINY, device=MEMORY_BOUND, sampler_chips=1, learner_chips=1, eff=FORWARDS_ONLY,
                     acceptance=None if accept is None else Acceptance.parse(accept, 4),
                     eval_answers=64, eval_every=1, eval_len=400.0, eval_prompt=16, eval_slots=64,
                     eval_decode_steps=8)

  plain = costs(None).evaluation()
  prefill = costs(None).prefill(64, 16)  # one batch of the 64 prompts on the one chip (its weights read once)
  assert 0 < prefill < plain
  assert costs("0").evaluation() == pytest.approx(plain, rel=1e-9)
  assert costs("1").evaluation() == pytest.approx(prefill + (plain - prefill) * 2 / 8, rel=1e-9)
