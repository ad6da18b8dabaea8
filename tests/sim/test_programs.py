"""The planner's learner FLOPs counted in the run's own learner programs, traced for a TPU topology."""

import pytest

pytest.importorskip("libtpu")

from areal_jax import config as config_lib  # noqa: E402
from areal_jax.sim import programs  # noqa: E402

SMALL = {"model.num_layers": 1, "learner.max_tokens_per_mb": 128}


@pytest.mark.parametrize("remat", ["none", "full"])
def test_learner_passes_count_the_proximal_pass_and_rematerialisation(remat):
  """A forward and backward is at least 3 forward passes' FLOPs and the proximal pass at least one (attention over
  the row's padding and the splash kernel's blocks add a little); full remat adds another forward."""
  settings = config_lib.validate(config_lib.load_config("configs/math.py:tiny", **SMALL, **{"model.remat": remat}),
                                 data=False)
  p = programs.learner_passes(settings, "v5e:2x2", seq_len=64)
  assert 1.0 <= p.proximal < 1.3, p
  if remat == "none":
    assert 4.0 <= p.total < 5.0, p
  else:
    assert 5.0 <= p.total < 6.3, p
  assert p.seq_len == 64 and p.topology == "v5e:2x2"
  # The scratch a colocated pool leaves free: the step's largest, as aot_check compiles the same programs.
  from areal_jax import aot_check  # pylint: disable=g-import-not-at-top
  reports = aot_check.check_learner(settings, "v5e:2x2", flop_seq_len=None)
  assert p.scratch_bytes == max(r.temp_bytes for r in reports) > 0


def test_learner_programs_that_do_not_fit_a_chip_are_refused_naming_the_settings():
  """A learner whose step exceeds a chip's HBM cannot train there, so the planner refuses to price it."""
  settings = config_lib.validate(config_lib.load_config("configs/math.py:tiny", **SMALL | {
      "learner.max_tokens_per_mb": 1 << 21}), data=False)
  with pytest.raises(ValueError, match=r"--learner_programs=v5e:2x2: the learner's step does not fit in a chip's "
                                       r"HBM at learner.max_tokens_per_mb=2097152"):
    programs.learner_passes(settings, "v5e:2x2", seq_len=64)
