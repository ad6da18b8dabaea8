"""Controller parts: the rollout buffer (admission rule, batches), weight sync, slices, checkpoints, metrics."""

import dataclasses
import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from areal_jax import sharding as shd
from areal_jax.checkpoint.store import CheckpointMeta, Checkpointer
from areal_jax.config import load_config, validate
from areal_jax.errors import ConfigError
from areal_jax.distributed import weight_transfer
from areal_jax.distributed.slices import MeshConfig, build_slices
from areal_jax.models import ModelConfig, create, weights
from areal_jax.rl.metrics import MetricsWriter, read_metrics
from areal_jax.rl.rollout_buffer import RolloutBuffer
from areal_jax.types import Trajectory
from flax import nnx


def _capacity_reference(max_concurrent, eta, v, b, accepted, running):
  return max(0, min(max_concurrent - running, (eta + v + 1) * b - (accepted + running)))


def test_admission_matches_eq3_under_random_events():
  rng = np.random.default_rng(0)
  for eta in (0, 1, 4):
    buf = RolloutBuffer(batch_size=4, max_offpolicyness=eta, max_concurrent=10)
    accepted = running = v = 0
    gids = iter(range(10**6))
    out = []
    for _ in range(500):
      assert buf.capacity(v) == _capacity_reference(10, eta, v, 4, accepted, running)
      event = rng.integers(3)
      if event == 0 and buf.capacity(v) > 0:
        out.append(next(gids))
        buf.admit(out[-1], v)
        running += 1
      elif event == 1 and running:
        kept = bool(rng.integers(2))
        buf.finish(out.pop(rng.integers(len(out))), [_traj(v)] if kept else None, version=v)
        running, accepted = running - 1, accepted + kept
      elif event == 2 and accepted >= (v + 1) * 4:
        v += 1
      # Never more generated (kept or in flight) than the staleness bound allows.
      assert accepted + running <= (eta + v + 1) * 4
    if buf.capacity(v) == 0:
      with pytest.raises(RuntimeError, match="beyond the staleness bound"):
        buf.admit(-1, v)


def test_eta_zero_is_synchronous():
  buf = RolloutBuffer(batch_size=3, max_offpolicyness=0, max_concurrent=100)
  assert buf.capacity(0) == 3
  for g in range(3):
    buf.admit(g, 0)
  for g in range(3):
    buf.finish(g, [_traj(0, g)], version=0)
  assert buf.capacity(0) == 0  # the whole batch is done: nothing more until the learner steps
  assert buf.capacity(1) == 3


def test_target_staleness_paces_admission_below_the_bound():
  """A target t < eta admits up to ⌊(t + v + 1)·B⌋ generated groups (fractional t: part of a batch ahead), while
  take_batch still waits only for groups at the bound eta."""
  for target, want in ((0.0, 4), (0.5, 6), (1.0, 8), (4.0, 20)):
    assert RolloutBuffer(batch_size=4, max_offpolicyness=4, max_concurrent=100,
                         target_staleness=target).capacity(0) == want
  buf = RolloutBuffer(batch_size=4, max_offpolicyness=4, max_concurrent=100, target_staleness=0.5)
  assert buf.capacity(3) == 18  # 4.5 batches at version 3, none generated yet
  for g in range(6):
    buf.admit(g, 0)
  assert buf.capacity(0) == 0
  for g in range(1, 6):
    buf.finish(g, [_traj(0, g)], version=0)
  assert len(buf.take_batch(4, version=0, timeout=1)) == 4  # group 0, still out, is within the bound: no wait
  assert buf.capacity(1) == 4  # 10 allowed at version 1: 6 generated so far (one kept and waiting, one out)
  with pytest.raises(ValueError, match="target_staleness=5"):
    RolloutBuffer(batch_size=4, max_offpolicyness=4, max_concurrent=100, target_staleness=5)


def _traj(version, group=0):
  return Trajectory(prompt_ids=np.zeros(2, np.int32), response_ids=np.ones(3, np.int32),
                    logprobs=np.zeros(3, np.float32), versions=np.full(3, version, np.int32), finish_reason="eos",
                    group_id=group)


def _wait_in_thread(fn):
  out = []
  t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
  t.start()
  return t, out


def test_buffer_hands_out_the_oldest_first():
  buf = RolloutBuffer(batch_size=1, max_offpolicyness=10, max_concurrent=100)
  for g, v in enumerate([2, 0, 1, 0]):
    buf.admit(g, 0)
    buf.finish(g, [_traj(v, g)], version=v)
  batch = buf.take_batch(3, version=0)
  assert [(g[0].version_start, g[0].group_id) for g in batch] == [(0, 1), (0, 3), (1, 2)]  # ties: arrival order
  assert len(buf) == 1 and buf.take_batch(2, version=0, timeout=0.2) is None


def test_take_batch_waits_for_groups_at_the_staleness_bound():
  """A group admitted under v - eta is trained in the step after v or never within the bound: the batch waits for it,
  and a group finishing faster does not take its place."""
  buf = RolloutBuffer(batch_size=2, max_offpolicyness=1, max_concurrent=100)
  buf.admit(0, 0)  # slow, admitted under version 0
  buf.admit(1, 1)
  buf.admit(2, 1)
  buf.finish(1, ["g1"], version=1)
  buf.finish(2, ["g2"], version=1)
  assert buf.take_batch(2, version=0, timeout=0.1) == [["g1"], ["g2"]]  # step 1 (v=0): 0 - eta < 0 waits for none
  buf.admit(3, 1)
  buf.admit(4, 1)
  buf.finish(3, ["g3"], version=1)
  buf.finish(4, ["g4"], version=1)
  waiter, got = _wait_in_thread(lambda: buf.take_batch(2, version=1))  # step 2 (v=1) must wait for group 0
  waiter.join(0.3)
  assert waiter.is_alive()
  buf.finish(0, ["g0"], version=0)  # wakes the learner at once: no polling
  waiter.join(2)
  assert got == [[["g0"], ["g3"]]]
  buf.close()
  assert buf.take_batch(1, version=5) is None


def test_weight_sync_is_device_to_device_and_exact():
  cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8)
  slices = build_slices(MeshConfig(sampler_devices=3, learner_tensor=1))
  model = create(cfg, seed=1)
  state = nnx.state(model, nnx.Param)
  learner_shardings = shd.state_shardings(state, slices.learner, shd.LEARNER_RULES)
  sampler_shardings = shd.state_shardings(state, slices.sampler, shd.SAMPLER_RULES)
  on_learner = jax.device_put(state, learner_shardings)
  moved = weight_transfer.transfer(on_learner, sampler_shardings)
  for a, b, s in zip(jax.tree.leaves(state), jax.tree.leaves(moved), jax.tree.leaves(sampler_shardings)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert b.sharding.device_set == set(slices.sampler.devices.flat) and b.sharding.is_equivalent_to(s, a.ndim)
  # A host array cannot sneak through the guard.
  with pytest.raises(Exception, match="[Dd]isallowed host-to-device"):
    weight_transfer.transfer(np.ones(4, np.float32), NamedSharding(slices.sampler, P()))


def test_check_compatible_names_the_leaf():
  ref = {"a": {"w": jnp.zeros((2, 3))}, "b": jnp.zeros(4)}
  weights.check_compatible({"a": {"w": jnp.ones((2, 3))}, "b": jnp.ones(4)}, ref)
  with pytest.raises(ValueError, match=r"\['a'\]\['w'\].*float32\[3, 2\]"):
    weights.check_compatible({"a": {"w": jnp.ones((3, 2))}, "b": jnp.ones(4)}, ref)
  with pytest.raises(ValueError, match=r"\['b'\].*bfloat16"):
    weights.check_compatible({"a": {"w": jnp.ones((2, 3))}, "b": jnp.ones(4, jnp.bfloat16)}, ref)
  with pytest.raises(ValueError, match=r"\['b'\] is missing"):
    weights.check_compatible({"a": {"w": jnp.ones((2, 3))}}, ref)


def test_slices_split_devices():
  mesh = MeshConfig.from_config(load_config("configs/math.py", **{"mesh.sampler_devices": 0.25,
                                                                  "mesh.learner_tensor": 2}).mesh)
  s = build_slices(mesh)
  assert dict(s.sampler.shape) == {"data": 2, "expert": 1, "tensor": 1}
  assert dict(s.learner.shape) == {"fsdp": 3, "expert": 1, "tensor": 2}
  assert not set(s.sampler.devices.flat) & set(s.learner.devices.flat)
  one = build_slices(mesh, devices=jax.devices()[:1])
  assert one.shared and one.sampler.devices.size == one.learner.devices.size == 1
  both = build_slices(dataclasses.replace(mesh, colocated=True))  # every device to each role
  assert both.shared and set(both.sampler.devices.flat) == set(both.learner.devices.flat) == set(jax.devices())
  assert dict(both.learner.shape) == {"fsdp": 4, "expert": 1, "tensor": 2} and both.replicas == (both.sampler,)


def test_colocated_runs_synchronously_only():
  with pytest.raises(ConfigError, match=r"config.mesh.colocated=True: generates then trains \(synchronous RL\): "
                                        r"needs rollout.max_head_offpolicyness=0, not 2"):
    validate(load_config("configs/math.py", **{"mesh.colocated": True, "rollout.max_head_offpolicyness": 2}))
  settings = validate(load_config("configs/math.py", **{"mesh.colocated": True, "rollout.max_head_offpolicyness": 0,
                                                        "mesh.sampler_devices": 0.25}), num_devices=8)
  assert settings.mesh.colocated  # sampler_devices unused: the sampler's data axis is all 8 devices


def test_a_colocated_pool_leaves_room_for_the_learners_step(monkeypatch):
  """Both roles on every device: the sampler's KV pool is sized from what the devices have free less the learner
  step's working memory (gradient accumulators, the largest program's compiled scratch), where the pool comes from
  free device memory; a split layout, fixed `sampler.num_pages` or a CPU's host memory reserve nothing."""
  from areal_jax.learner.learner import Learner
  from areal_jax.run import parts
  from areal_jax.sampler import engine as engine_lib

  settings = validate(load_config("configs/math.py", **{"mesh.colocated": True, "rollout.max_head_offpolicyness": 0,
                                                        "sampler.num_pages": 0}), num_devices=8, data=False)
  slices = build_slices(settings.mesh)
  learner = Learner(model_cfg=settings.model, config=settings.learner, mesh=slices.learner)
  cfg = settings.sampler
  assert parts.learner_reserve(learner, cfg, slices.replicas) == 0  # a CPU: the pool is sized from host memory
  free = 64 << 20
  monkeypatch.setattr(parts, "free_device_bytes", lambda device: free)  # devices that report their memory
  monkeypatch.setattr(engine_lib, "free_device_bytes", lambda device: free)
  reserve = parts.learner_reserve(learner, cfg, slices.replicas)
  grads = shd.device_bytes(learner.fns.abstract_args(settings.learner.max_tokens_per_mb)["accumulate"][1])
  scratch = max(p.compile().memory_analysis().temp_size_in_bytes
                for p in learner.fns.lower(settings.learner.max_tokens_per_mb).values())
  assert reserve == learner.working_bytes() == grads + scratch > grads > 0
  model = nnx.eval_shape(lambda: create(settings.model))
  small = cfg.replace(num_slots=512, max_seq_len=512)  # more slots than the pool holds: the memory decides
  beside = engine_lib.Engine(model=model, config=small, mesh=slices.sampler, reserved_bytes=reserve)
  alone = engine_lib.Engine(model=model, config=small, mesh=slices.sampler)
  param_bytes = engine_lib.param_bytes_per_device(beside.abstract_params, slices.sampler)
  per_page = engine_lib.page_bytes(settings.model, small)
  want = lambda held: int(small.memory_fraction * (free - param_bytes - held)) // per_page
  assert beside.num_pages // beside.num_shards == want(reserve) < alone.num_pages // alone.num_shards == want(0)
  assert parts.learner_reserve(learner, cfg.replace(num_pages=64), slices.replicas) == 0
  split = build_slices(dataclasses.replace(settings.mesh, colocated=False))
  split_learner = Learner(model_cfg=settings.model, config=settings.learner, mesh=split.learner)
  assert parts.learner_reserve(split_learner, cfg, split.replicas) == 0


def test_checkpoint_roundtrip_onto_shardings(tmp_path):
  mesh = shd.make_mesh(jax.devices()[:4], {"fsdp": 4, "tensor": 1})
  params = {"w": jax.device_put(jnp.arange(32.).reshape(8, 4), NamedSharding(mesh, P("fsdp")))}
  opt = {"mu": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("fsdp"))), "count": jnp.array(3)}
  ckpt = Checkpointer(str(tmp_path / "ckpt"), every_steps=2)
  assert not ckpt.save(1, params=params, opt_state=opt, meta=CheckpointMeta(step=1))
  meta = CheckpointMeta(step=2, controller={"dataset": {"epoch": 0, "index": 7}})
  assert ckpt.save(2, params=params, opt_state=opt, meta=meta)
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path / "ckpt"), every_steps=2)
  assert ckpt.latest_step() == 2
  p2, o2, restored = ckpt.restore(2, params=params, opt_state=opt)
  np.testing.assert_array_equal(np.asarray(p2["w"]), np.asarray(params["w"]))
  assert p2["w"].sharding.is_equivalent_to(params["w"].sharding, 2) and int(o2["count"]) == 3
  assert restored == meta
  ckpt.close()


def test_metrics_jsonl_appends(tmp_path):
  w = MetricsWriter(str(tmp_path), total_steps=10, tensorboard=True)
  w.write(1, {"reward/mean": np.float32(0.25), "learner/loss": 1.5})
  w.close()
  w = MetricsWriter(str(tmp_path), total_steps=10, tensorboard=False)
  w.write(2, {"reward/mean": 0.5})
  rows = read_metrics(str(tmp_path))
  assert rows == [{"step": 1, "reward/mean": 0.25, "learner/loss": 1.5}, {"step": 2, "reward/mean": 0.5}]
  assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
  assert any(p.name.startswith("events") for p in (tmp_path / "tensorboard").iterdir())
  assert "step 2/10" in w.progress_line(2, rows[1]) and "eta" in w.progress_line(2, rows[1])
  assert "mean reward 0.5 |" in w.progress_line(2, rows[1])
  assert "reward" not in w.progress_line(3, {"reward/mean": float("nan"), "learner/loss": float("nan")})
  assert "loss nan" in w.progress_line(3, {"reward/mean": float("nan"), "learner/loss": float("nan")})
