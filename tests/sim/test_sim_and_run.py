"""The simulation runs the run's own admission code: a change to it moves a real run and its simulation alike."""

import numpy as np
import pytest

from areal_jax import config as config_lib
from areal_jax.rl import rollout_buffer
from areal_jax.run import trainer
from areal_jax.sim import plan
from areal_jax.hardware import device
from areal_jax.sim.lengths import Lengths
from run_checks import FAST, rollouts

pytestmark = pytest.mark.slow  # two whole runs

ETA = 2


def _real_staleness(workdir) -> np.ndarray:
  overrides = {"rollout.max_head_offpolicyness": ETA, "eval.every_steps": 100, "checkpoint.every_steps": 100}
  config = config_lib.load_config(FAST, total_steps=3, **overrides)
  trainer.run(config, str(workdir))
  return np.array([(r["step"] - 1) - v for r in rollouts(workdir) if not r["filtered"] for v in r["version_start"]])


def _simulated_staleness() -> np.ndarray:
  settings = config_lib.validate(config_lib.load_config(FAST), data=False)
  setup = plan.Setup(model=settings.model, device=device("v5p"), chips=4,
                     sampler=settings.sampler.replace(num_slots=16), batch_prompts=4, answers=4, prompt_len=20,
                     lengths=Lengths.parametric(mean=20, max=40), steps=3, warmup=0, max_concurrent=8)
  r = plan.simulate_split(setup, sampler_chips=2, eta=ETA)
  return np.concatenate([np.array(s) for s in r.staleness])


def test_a_buffer_that_never_looks_ahead_makes_both_the_run_and_its_simulation_synchronous(tmp_path, monkeypatch):
  """At η = 2 both train on answers of older policies; with the buffer's admission rule changed to admit no group
  before its batch's version (no lookahead), both are synchronous."""
  real, sim = _real_staleness(tmp_path / "as_is"), _simulated_staleness()
  assert real.max() > 0 and sim.max() > 0, (real, sim)

  def capacity_without_lookahead(self, version):
    return max(0, (version + 1) * self.batch_size - (self.accepted + len(self._out)))

  monkeypatch.setattr(rollout_buffer.RolloutBuffer, "_capacity", capacity_without_lookahead)
  real, sim = _real_staleness(tmp_path / "changed"), _simulated_staleness()
  assert real.max() == 0 and sim.max() == 0, (real, sim)
