import numpy as np
import pytest

from areal_jax.learner.advantages import (sequence_advantages, shape_rewards, token_advantages,
                                          uniform_group_mask)

REWARDS = np.array([1, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 1], np.float64)
GROUPS = np.repeat([7, 3, 5], 4)


def test_shaping_is_plus_minus_scale():
  np.testing.assert_allclose(shape_rewards(np.array([0.0, 1.0, 0.5]), 5.0), [-5.0, 5.0, 0.0])


def test_group_normalisation():
  adv = sequence_advantages(REWARDS, GROUPS, scale=5.0, norm="group")
  # Group 7: one success in four: shaped [5, -5, -5, -5], mean -2.5, std sqrt(18.75).
  np.testing.assert_allclose(adv[:4], np.array([7.5, -2.5, -2.5, -2.5]) / (np.sqrt(18.75) + 1e-5), rtol=1e-6)
  np.testing.assert_allclose(adv[4:8], 0.0)  # uniform group: no signal
  np.testing.assert_allclose(adv[8:], [-1, 1, -1, 1], rtol=1e-5)


def test_batch_normalisation_and_none():
  shaped = (REWARDS - 0.5) * 10
  want = (shaped - shaped.mean()) / (shaped.std() + 1e-5)
  np.testing.assert_allclose(sequence_advantages(REWARDS, GROUPS, scale=5.0, norm="batch"), want, rtol=1e-6)
  np.testing.assert_allclose(sequence_advantages(REWARDS, GROUPS, scale=5.0, norm="none"), shaped)
  with pytest.raises(ValueError, match="'token'"):
    sequence_advantages(REWARDS, GROUPS, scale=5.0, norm="token")


def test_uniform_groups_are_filtered():
  np.testing.assert_array_equal(uniform_group_mask(REWARDS, GROUPS), np.repeat([True, False, True], 4))


def test_advantage_broadcast_over_response_tokens():
  out = token_advantages(np.array([0.5, -1.0], np.float32), [3, 1])
  np.testing.assert_array_equal(out[0], [0.5, 0.5, 0.5])
  np.testing.assert_array_equal(out[1], [-1.0])
