"""A real run replayed in virtual time: its own groups and recorded timings through the simulation train the same
groups at each step, each answer at the same staleness."""

import jax
import pytest

from areal_jax import config as config_lib
from areal_jax.distributed.slices import split_devices
from areal_jax.run import trainer
from areal_jax.sim import replay
from areal_jax.sim.job import simulate
from run_checks import FAST

pytestmark = pytest.mark.slow  # a whole run


def test_a_replayed_run_trains_every_group_at_the_step_and_staleness_it_did(tmp_path):
  """η = 2, 10 steps of 4 groups of 4, the sampler's programs compiled before the run: the replay spreads each
  step's recorded sampler seconds evenly over its decode steps, which would misplace a compile inside a step
  (seconds, against milliseconds)."""
  overrides = {"rollout.max_head_offpolicyness": 2, "eval.every_steps": 100, "checkpoint.every_steps": 100,
               "sampler.warmup": True}
  config = config_lib.load_config(FAST, total_steps=10, **overrides)
  trainer.run(config, str(tmp_path / "run"))
  settings = config_lib.validate(config, data=False)
  shards = split_devices(jax.device_count(), settings.mesh.sampler_devices)[0] // settings.mesh.sampler_tensor
  job, costs = replay.replay_job(str(tmp_path / "run"), settings, num_shards=shards, prompt_len=25)
  real, sim = replay.run_schedule(str(tmp_path / "run")), replay.sim_schedule(simulate(job, costs))
  assert sorted(real) == list(range(1, 11))
  assert {s for groups in real.values() for stale in groups.values() for s in stale} == {0, 1, 2}
  assert sim == real
