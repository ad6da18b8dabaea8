"""The cost model's regimes: decode reads every weight per step, training is compute-bound, transfers ride links."""

import numpy as np
import pytest

from areal_jax import config as config_lib
from areal_jax.sim.costs import HOST_MEASURED, PUBLISHED, CostModel, Efficiency, published
from areal_jax.hardware import DEVICES, device


def _model():
  return config_lib.validate(config_lib.load_config("configs/math.py:qwen2.5-1.5b"), data=False).model


def test_a_decode_step_of_one_short_answer_costs_one_read_of_the_weights():
  m = _model()
  eff = Efficiency(decode_bw=1.0, decode_step_s=0.0)
  c = CostModel(model=m, device=device("h100"), sampler_chips=1, learner_chips=1, eff=eff)
  weights_s = m.num_params() * 2 / device("h100").hbm_bw
  assert c.decode_step(np.array([1]), np.array([16])) == pytest.approx(weights_s, rel=0.01)
  # Long contexts add their keys and values; the slowest data shard decides.
  assert c.decode_step(np.array([1, 64]), np.array([16, 64 * 8000])) > 5 * weights_s


def test_training_is_compute_bound_and_scales_with_chips_and_tokens():
  m = _model()
  small = CostModel(model=m, device=device("v5p"), sampler_chips=8, learner_chips=8)
  big = CostModel(model=m, device=device("v5p"), sampler_chips=8, learner_chips=16)
  lengths = np.full(1024, 4096)
  assert small.train_step(lengths) == pytest.approx(2 * big.train_step(lengths), rel=0.1)
  assert small.train_step(np.full(2048, 4096)) == pytest.approx(2 * small.train_step(lengths), rel=0.1)


def test_colocated_weights_move_in_hbm_and_split_ones_over_links():
  m = _model()
  split = CostModel(model=m, device=device("h800"), sampler_chips=4, learner_chips=4)
  colocated = CostModel(model=m, device=device("h800"), sampler_chips=8, learner_chips=8, colocated=True)
  assert colocated.transfer() < split.transfer()


def test_a_checkpoint_waits_for_the_copy_of_what_the_learner_saves_over_pcie():
  """Orbax's asynchronous save blocks for each chip's copy of its shards to the host, at the datasheet's PCIe rate;
  what is copied is what `Learner.save` writes, its float32 parameters and Adam moments (counted from the learner's
  own state). Where no datasheet gives the host link (TPUs) the checkpoint is unpriced."""
  import jax

  from areal_jax.learner.step import build_step, make_learner_mesh

  m = _model()
  c = CostModel(model=m, device=device("h100"), sampler_chips=8, learner_chips=16, checkpoint_every=50)
  settings = config_lib.validate(config_lib.load_config("configs/math.py:qwen2.5-1.5b"), data=False)
  fns = build_step(settings.model, settings.learner, make_learner_mesh(jax.devices()))
  params, opt = fns.abstract_state()
  saved = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((fns.split(params)[0], opt)))
  assert c.checkpoint() == pytest.approx(saved / 16 / 64e9, rel=1e-6)
  assert c.after_step() == pytest.approx(c.checkpoint() / 50) and c.checkpoint() > 0
  assert CostModel(model=m, device=device("v5p"), sampler_chips=8, learner_chips=16,
                   checkpoint_every=50).after_step() == 0.0


def test_a_colocated_pool_leaves_the_learners_state_and_scratch_free():
  m = _model()
  kw = dict(model=m, device=device("v5p"), sampler_chips=8, learner_chips=8, sampler_shards=8, colocated=True)
  state_only, with_scratch = CostModel(**kw), CostModel(**kw, learner_scratch=40 * 2**30)
  page = 64 * with_scratch.kv_per_token
  assert state_only.pages_per_shard(64) - with_scratch.pages_per_shard(64) == pytest.approx(40 * 2**30 / page, abs=1)
  split = CostModel(**kw | {"colocated": False}, learner_scratch=40 * 2**30)
  assert split.pages_per_shard(64) > state_only.pages_per_shard(64)  # a split's sampler holds no learner state


def test_every_device_has_positive_peaks_and_an_unknown_one_is_named():
  assert sorted(DEVICES) == ["a100", "b200", "h100", "h200", "h800", "v4", "v5e", "v5p", "v6e"]
  assert all(d.flops > 0 and d.hbm_bw > 0 and d.hbm > 0 and d.link > 0 for d in DEVICES.values())
  with pytest.raises(ValueError, match="--device='tpu9'"):
    device("tpu9")


def test_a_mixture_of_experts_decodes_with_its_active_flops_and_reads_the_experts_its_tokens_use():
  m = config_lib.validate(config_lib.load_config("configs/math.py:tiny-moe"), data=False).model
  assert m.num_experts > m.num_experts_per_tok > 0
  d = device("h100")
  c = CostModel(model=m, device=d, sampler_chips=1, learner_chips=1,
                eff=Efficiency(decode_bw=1.0, decode_flops=1.0, decode_step_s=0.0))
  head = 0 if m.tie_word_embeddings else 2 * m.vocab_size * m.hidden_size
  experts = sum(m.sparse_layers()) * m.num_experts * 3 * m.hidden_size * m.moe_intermediate_size
  shared = m.num_params() - experts
  # One token: the shared weights and k of E experts per sparse layer; compute on its active weights only.
  one = (shared + experts * m.num_experts_per_tok / m.num_experts) * 2
  assert c.decode_weight_bytes(np.array([1]))[0] == pytest.approx(one)
  assert shared + experts * m.num_experts_per_tok / m.num_experts == pytest.approx(m.num_params(active=True))
  # A large batch reads every expert: the whole model.
  assert c.decode_weight_bytes(np.array([4096]))[0] == pytest.approx(m.num_params() * 2)
  batch, context = np.array([256]), np.array([0])
  flops_s = 256 * (2 * m.num_params(active=True) - head) / d.flops
  bytes_s = m.num_params() * 2 / d.hbm_bw
  assert c.decode_step(batch, context) == pytest.approx(max(flops_s, bytes_s))
  # A dense model of the same weights reads them all at any batch.
  dense = CostModel(model=_model(), device=d, sampler_chips=1, learner_chips=1)
  assert dense.decode_weight_bytes(np.array([1]))[0] == dense.params * 2


def test_the_schedulers_host_work_per_call_hides_behind_the_device_only_with_overlap():
  """`sampler.overlap`: the longer of host and device decides a decode call; without it they add. The host part
  grows with the engine's slots (the bench's 0.6 / 4.3 / 12.4 ms at 256 / 2048 / 8192 slots)."""
  c = CostModel(model=_model(), device=device("h100"), sampler_chips=1, learner_chips=1)
  e = c.eff
  for slots, measured in ((256, 0.6e-3), (2048, 4.3e-3), (8192, 12.4e-3)):
    assert c.decode_call(0.0, slots, overlap=True) - e.decode_call_s == pytest.approx(measured, rel=0.2)
  host = e.host_call_s + e.host_slot_s * 2048
  assert c.decode_call(0.05, 2048, overlap=True) == pytest.approx(0.05 + e.decode_call_s)
  assert c.decode_call(0.05, 2048, overlap=False) == pytest.approx(0.05 + host + e.decode_call_s)
  assert c.decode_call(0.001, 2048, overlap=True) == pytest.approx(host + e.decode_call_s)
  # With speculation the drafter's work per slot that draws joins it: 256 drawing slots ~20 ms a call (the drafter's
  # own bench, areal_jax/sampler/drafts.py: 16-19 ms for 256 answers), hidden only behind a longer device part.
  drafter = e.draft_slot_s * 256
  assert drafter == pytest.approx(17.5e-3, rel=0.2)
  assert c.decode_call(0.05, 2048, overlap=True, drafting=256) == pytest.approx(0.05 + e.decode_call_s)
  assert c.decode_call(0.001, 2048, overlap=True, drafting=256) == pytest.approx(host + drafter + e.decode_call_s)
  assert c.decode_call(0.05, 2048, overlap=False, drafting=256) == pytest.approx(
      0.05 + host + drafter + e.decode_call_s)


def test_published_figures_replace_the_defaults_with_their_sources_and_only_those():
  """Each family's published figures (MaxText's MFUs on TPUs) replace the default, each naming its source; the
  host's own costs are measured with the run's code and named on every family; a family with no published figure
  keeps the defaults and names only the host's."""
  for name, figures in PUBLISHED.items():
    eff, sources = published(device(name))
    assert set(sources) == set(figures) | set(HOST_MEASURED) and all(sources.values())
    assert all(getattr(eff, k) == v for k, (v, _) in figures.items())
    assert all(0 < v < 1 for v, _ in figures.values())
  eff, sources = published(device("b200"))
  assert eff == Efficiency() and sources == HOST_MEASURED


def test_tpu_slices_are_named_as_google_names_them():
  assert device("v5p").describe(4) == "4 x v5p (v5p-8)" and device("v4").describe(64) == "64 x v4 (v4-128)"
  assert device("v5e").describe(8) == "8 x v5e (v5e-8)" and device("v6e").describe(8) == "8 x v6e (v6e-8)"
  assert device("h100").describe(64) == "64 x h100"
