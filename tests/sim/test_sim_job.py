"""A run in virtual time: the real buffer, controller, sampler loop and scheduler, with simulated device calls."""

import dataclasses
import json

import numpy as np
import pytest

from areal_jax import config as config_lib
from areal_jax.rl import rollout_buffer
from areal_jax.rl.controller import Stalled
from areal_jax.sim import plan
from areal_jax.sim.costs import CostModel
from areal_jax.sim.job import Job, simulate
from areal_jax.hardware import Device, device
from areal_jax.sim.lengths import Lengths, RecordedGroups


def _setup(**kw) -> plan.Setup:
  settings = config_lib.validate(config_lib.load_config("configs/math.py:tiny"), data=False)
  base = dict(model=settings.model, device=device("v5p"), chips=4, sampler=settings.sampler.replace(num_slots=16),
              batch_prompts=4, answers=4, prompt_len=20, lengths=Lengths.parametric(mean=20, max=64), steps=8,
              warmup=2)
  return plan.Setup(**(base | kw))


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_staleness_stays_within_eta_and_grows_with_it(eta):
  r = plan.simulate_split(_setup(), sampler_chips=2, eta=eta)
  stale = np.concatenate([np.array(s) for s in r.staleness])
  assert len(r.step_end) == 8 and np.all(np.diff(r.step_end) > 0)
  assert stale.max() <= eta
  if eta == 0:
    assert stale.max() == 0
  else:
    assert stale.mean() > 0.5


def test_target_staleness_holds_the_mean_down():
  loose = plan.simulate_split(_setup(), sampler_chips=2, eta=4).staleness_of(2).mean()
  held = plan.simulate_split(_setup(target_staleness=1.0), sampler_chips=2, eta=4).staleness_of(2).mean()
  assert held <= 1.25 < loose


def test_the_simulation_runs_the_runs_own_buffer(monkeypatch):
  """A change to the shared admission rule changes the prediction: a buffer that never looks ahead makes η=2
  synchronous."""
  def capacity_without_lookahead(self, version):
    return max(0, (version + 1) * self.batch_size - (self.accepted + len(self._out)))

  monkeypatch.setattr(rollout_buffer.RolloutBuffer, "_capacity", capacity_without_lookahead)
  r = plan.simulate_split(_setup(), sampler_chips=2, eta=2)
  assert max(max(s) for s in r.staleness) == 0


def test_answers_run_to_their_lengths_through_preemption():
  """With a pool too small for every slot, the real scheduler preempts and re-prefills; each answer still ends at
  the length its key drew, and every answer of every step is trained on."""
  setup = _setup(lengths=Lengths([30], source="thirty"), steps=4)
  m = setup.model
  page_bytes = setup.sampler.page_size * 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4
  hbm = (setup.model.num_params() * 4 + 12 * page_bytes) / 0.8  # 12 pages per shard: 8 answers need 32
  setup = dataclasses.replace(setup, device=Device("tiny", flops=1e12, hbm_bw=1e11, hbm=hbm, link=1e10))
  r = plan.simulate_split(setup, sampler_chips=2, eta=1)
  assert r.sampler_stats["preemptions"] > 0
  assert r.tokens == [4 * 4 * 30] * 4  # batch x answers x the length
  assert r.answers == [16] * 4


def test_the_same_job_gives_the_same_timeline():
  a = plan.simulate_split(_setup(), sampler_chips=2, eta=2)
  b = plan.simulate_split(_setup(), sampler_chips=2, eta=2)
  assert a.step_end == b.step_end and a.staleness == b.staleness


def test_a_plan_names_a_recommended_row_with_every_field():
  setup = dataclasses.replace(_setup(), steps=5)
  result = plan.plan(setup, etas=(0, 2), sampler_chips=[1, 2])
  assert {(r["sampler_chips"], r["eta"]) for r in result["rows"]} == {(1, 0), (1, 2), (2, 0), (2, 2)}
  fields = {"sampler_chips", "learner_chips", "eta", "tokens_per_s", "step_s", "sampler_busy", "learner_busy",
            "staleness_mean", "speedup_vs_colocated_sync", "speedup_vs_split_sync"}
  assert all(fields <= set(r) for r in result["rows"])
  assert {"tokens_per_s", "step_s"} <= set(result["sync"])
  assert result["recommended"] in result["rows"]
  assert all(0 <= r["sampler_busy"] <= 1.0001 and 0 <= r["learner_busy"] <= 1.0001 for r in result["rows"])
  assert "tokens/s" in plan.format_table(result)


def test_a_job_whose_groups_are_all_dropped_stalls_as_the_run_would():
  setup = _setup(success=1.0, steps=2)
  job = Job(model=setup.model, sampler=setup.sampler, num_shards=1, batch_prompts=2, answers=4, prompt_len=10,
                 eta=1, steps=2, success=1.0, filter_uniform=True)
  costs = CostModel(model=setup.model, device=setup.device, sampler_chips=1, learner_chips=1)
  with pytest.raises(Stalled, match="scored uniformly"):
    simulate(job, costs, setup.lengths)


def test_recorded_groups_are_replayed_whole_lengths_with_their_rewards():
  """A uniform recorded group is dropped and a mixed one trained, each answer as long as it was recorded."""
  setup = _setup()
  recorded = RecordedGroups([((3, 3, 3, 3), (1, 1, 1, 1)), ((5, 7, 9, 11), (1, 0, 1, 0))], source="two groups")
  job = Job(model=setup.model, sampler=setup.sampler, num_shards=1, batch_prompts=2, answers=4, prompt_len=10,
            eta=1, steps=3, recorded=recorded, filter_uniform=True)
  costs = CostModel(model=setup.model, device=setup.device, sampler_chips=1, learner_chips=1)
  r = simulate(job, costs)
  assert r.tokens == [2 * (5 + 7 + 9 + 11)] * 3 and r.answers == [8] * 3
  with pytest.raises(ValueError, match="not both"):
    simulate(job, costs, setup.lengths)


def test_a_plan_from_a_runs_rollouts_replays_its_groups_whole(tmp_path):
  """`--lengths=rollouts.jsonl`: every simulated group is one of the run's, its answers all 8 or all 40 tokens long,
  so a step's 4 groups x 4 answers hold 128 tokens plus 128 for each long group (drawn one by one, any 32)."""
  rollouts = tmp_path / "rollouts.jsonl"
  rollouts.write_text("".join(json.dumps({"lengths": [n] * 4, "rewards": [1, 0, 1, 0]}) + "\n" for n in (8, 40)))
  recorded = RecordedGroups.from_rollouts([str(rollouts)])
  setup = _setup(lengths=recorded.lengths(), recorded=recorded, steps=6, scale=1)
  r = plan.simulate_split(setup, sampler_chips=2, eta=1)
  assert len(r.tokens) == 6 and all((t - 128) % 128 == 0 for t in r.tokens), r.tokens
  assert len(set(r.tokens)) > 1


def test_independent_engines_share_the_groups_and_train_each_once():
  """`--layout=replicas`: each data shard an engine of its own behind the run's dispatch rule; every group trained
  once, every engine given work, staleness within η."""
  r = plan.simulate_split(_setup(), sampler_chips=2, eta=2)
  assert plan.layout(_setup(), 2) == plan.Layout("replicas", engines=2, engine_shards=1, processes=0)
  ids = [g for step in r.group_ids for g in step]
  assert len(set(ids)) * 4 == len(ids)  # 4 answers per group, no group twice
  assert len(r.engine_tokens) == 2 and min(r.engine_tokens) > 0
  assert max(max(s) for s in r.staleness) <= 2


def test_layouts_are_the_ones_the_code_runs():
  gpus = _setup(device=device("h100"), chips=32)  # 4 hosts of 8
  assert plan.layout(gpus, 16) == plan.Layout("replicas", engines=16, engine_shards=1, processes=2)
  assert plan.layout(dataclasses.replace(gpus, layout="host"), 16) == plan.Layout("host", 2, 8, 2)
  with pytest.raises(ValueError, match="one controller over several GPU hosts"):
    plan.layout(dataclasses.replace(gpus, layout="pathways"), 16)
  with pytest.raises(ValueError, match="colocated sync on 32 h100 chips"):
    plan.layout(gpus, 32, colocated=True)
  tpus = _setup(device=device("v5p"), chips=64)  # a slice under Pathways may span its hosts
  assert plan.layout(dataclasses.replace(tpus, layout="pathways"), 32) == plan.Layout("pathways", 1, 32, 0)
  # Colocated: every chip does both, in the learner's process, its sampler split as the layout says.
  assert plan.layout(tpus, 64, colocated=True) == plan.Layout("colocated", 64, 1, 0)
  assert plan.layout(dataclasses.replace(tpus, layout="pathways"), 64, colocated=True) == plan.Layout(
      "colocated", 1, 64, 0)
  one_host = _setup(device=device("h800"), chips=8)
  assert plan.layout(one_host, 4).processes == 0
  assert plan.layout(dataclasses.replace(one_host, layout="host"), 8, colocated=True) == plan.Layout(
      "colocated", 1, 8, 0)


def test_num_slots_counts_one_engines_slots_as_in_a_run():
  """`sampler.num_slots` is one engine's (one replica's) in the engine, the config and the planner: an engine of 4
  data shards holds num_slots in all; `slots_per_shard` sets every shard's instead; slots that do not divide an
  engine's shards are refused, as the run's config check refuses them."""
  from areal_jax.distributed.slices import MeshConfig, build_slices  # the run's own meshes

  s = _setup(chips=8)
  host = dataclasses.replace(s, layout="pathways")
  for setup, engines, per_engine in ((s, 4, 16), (host, 1, 16), (dataclasses.replace(host, slots_per_shard=16), 1, 64)):
    lay = plan.layout(setup, 4)
    assert (lay.engines, plan.slots_per_engine(setup, lay)) == (engines, per_engine)
    r = plan.simulate_split(setup, sampler_chips=4, eta=1)
    assert r.job.sampler.num_slots == per_engine and r.job.num_shards == 4 // engines
  # The run: 4 sampler devices as 4 replicas or as 1, sampler.num_slots=16 per replica mesh either way.
  import jax  # pylint: disable=g-import-not-at-top
  for replicas, data in ((4, 1), (1, 4)):
    meshes = build_slices(MeshConfig(sampler_devices=4, sampler_replicas=replicas), jax.devices()[:8]).replicas
    assert [m.shape["data"] for m in meshes] == [data] * replicas
  with pytest.raises(ValueError, match=r"sampler.num_slots=6 \(one engine's\).*4 data shards.*--slots_per_shard"):
    plan.simulate_split(dataclasses.replace(host, sampler=s.sampler.replace(num_slots=6)), sampler_chips=4, eta=1)


def test_weights_to_sampler_processes_cross_the_leaders_host_network():
  """Each sampler process pulls every version from the leader: N copies through its host's NIC."""
  model = _setup().model
  kw = dict(model=model, device=device("h100"), sampler_chips=16, learner_chips=16, sampler_shards=16, engines=16)
  one = CostModel(**kw, sampler_processes=1, host_network=400e9)
  two = CostModel(**kw, sampler_processes=2, host_network=400e9)
  size = model.num_params() * 2
  assert one.transfer() == pytest.approx(size / (400e9 * one.eff.link) + one.eff.transfer_s)
  assert two.transfer() - two.eff.transfer_s == pytest.approx(2 * (one.transfer() - one.eff.transfer_s))
  with pytest.raises(ValueError, match="host_network_gbps"):
    CostModel(**kw, sampler_processes=2).transfer()


def test_delta_sync_prices_what_changed_and_overlap_takes_the_pull_off_the_learners_path():
  """`sync.delta`: a pull moves each changed element's int32 index and bf16 value (3x its share), and the diff reads
  both copies in HBM; `sync.overlap`: the learner waits only for the version before, so its sync share drops."""
  model = _setup().model
  kw = dict(model=model, device=device("h100"), sampler_chips=16, learner_chips=16, sampler_shards=16, engines=16,
            sampler_processes=2, host_network=50e9)
  full, delta = CostModel(**kw), CostModel(**kw, sync_delta=0.02)
  size, d = model.num_params() * 2, device("h100")
  assert delta.delta_share == pytest.approx(0.06) and CostModel(**kw, sync_delta=0.5).delta_share == 1.0
  assert delta.transfer() == pytest.approx(2 * 0.06 * size / (50e9 * delta.eff.link) + 3 * size / (
      d.hbm_bw * delta.eff.learner_bw) + delta.eff.transfer_s)
  assert delta.transfer() < full.transfer()
  assert not full.transfer_overlaps and CostModel(**kw, sync_overlap=True).transfer_overlaps
  assert not CostModel(**(kw | {"sampler_processes": 0}), sync_overlap=True).transfer_overlaps  # in-process: as is

  slow = dataclasses.replace(_setup(), eff=_setup().eff.replace(transfer_s=2.0), chips=16, device=device("h100"),
                             host_network=50e9)
  # 16 chips on 8-chip hosts: sampler processes behind the hub.
  waits, shares = {}, {}
  for overlap in (False, True):
    r = plan.simulate_split(dataclasses.replace(slow, sync_overlap=overlap), sampler_chips=8, eta=2)
    waits[overlap], shares[overlap] = r.sync_s, r.sync_share()
    ids = [g for step in r.group_ids for g in step]
    assert len(set(ids)) * 4 == len(ids) and max(max(s) for s in r.staleness) <= 2
  assert min(waits[False]) >= 2.0 and shares[True] < shares[False]


def test_a_device_checks_figures_replace_the_devices_default_efficiencies():
  """`tools/plan.py --calibration=device_check.json`: the measured decode share of the datasheet roofline (at the
  most slots) and learner MFU replace the defaults; a dry run or another device's report is refused."""
  from areal_jax.sim import costs

  report = {"header": "# device check: 1 x NVIDIA H100", "device": "h100", "dry_run": False, "thresholds": {},
            "calibration": {"decode_of_spec_roofline_64": 0.41, "decode_of_spec_roofline_256": 0.55,
                            "hbm_bw": 2.9e12, "learner_mfu": 0.31}, "rows": []}
  h100 = device("h100")
  eff = costs.from_device_check(report, h100)
  assert (eff.decode_bw, eff.learner_mfu, eff.decode_call_s, eff.decode_step_s) == (0.55, 0.31, 0.0, 0.0)
  assert eff.prefill_flops == costs.Efficiency().prefill_flops  # what it did not measure stays
  model = _setup().model
  kw = dict(model=model, device=h100, sampler_chips=1, learner_chips=1)
  batch, context = np.array([64]), np.array([4096 * 64])
  slow = CostModel(**kw, eff=costs.Efficiency().replace(decode_call_s=0.0, decode_step_s=0.0, decode_bw=0.7))
  assert CostModel(**kw, eff=eff).decode_step(batch, context) == pytest.approx(
      slow.decode_step(batch, context) * 0.7 / 0.55)
  with pytest.raises(ValueError, match="a dry run"):
    costs.from_device_check(report | {"dry_run": True}, h100)
  with pytest.raises(ValueError, match="measured on 'h100', not on 'h200'"):
    costs.from_device_check(report, device("h200"))


def test_colocated_sync_evaluates_on_the_sampler_chips_before_generating_again():
  """Colocated, the held-out evaluation runs on the chips the sampler uses: each step takes its share of it on top;
  on a split it runs on the learner's chips beside the sampler."""
  base = _setup(chips=8, device=device("h800"))
  evals = dataclasses.replace(base, eval_answers=64, eval_every=2)
  share = plan.cost_model(evals, 8, 0, colocated=True).after_step()
  assert share > 0
  plain, with_eval = (plan.simulate_split(s, 8, 0, colocated=True) for s in (base, evals))
  assert with_eval.step_s() == pytest.approx(plain.step_s() + share, rel=0.02)


def test_a_layout_whose_pool_holds_no_sequence_is_refused_as_the_engine_refuses_it():
  """Colocated, the learner's state and scratch can leave the pool less than one sequence: the engine refuses that
  pool, so the plan has no colocated row and says why; the splits, whose samplers hold no learner, still plan."""
  small = Device("small", flops=1e12, hbm_bw=1e11, hbm=2e8, link=1e10, kinds=("TPU small",))
  setup = _setup(device=small, chips=4, steps=4, learner_scratch=1.4e8)
  result = plan.plan(setup, etas=(0, 1), sampler_chips=[2])
  assert result["sync"] is None and result["rows"]
  assert "colocated sync: a KV pool of 0 pages per data shard cannot hold one sequence" in result["sync_refused"]
  with pytest.raises(ValueError, match="cannot hold one sequence"):
    plan.simulate_split(_setup(device=small, learner_scratch=1.4e8), 4, 0, colocated=True)
