"""Answer-length tables for the simulator: parametric and from a run's rollouts."""

import json

import numpy as np
import pytest

from areal_jax.sampler.sampling import request_key
from areal_jax.sim.lengths import Lengths, RecordedGroups


def test_parametric_lengths_have_the_mean_asked_and_a_long_tail():
  dist = Lengths.parametric(mean=8000, max=27648)
  assert dist.mean == pytest.approx(8000, rel=0.02)
  assert dist.max == 27648  # the tail is cut at max (cut answers stop there)
  assert np.percentile(dist.table, 99) > 4 * np.median(dist.table)


def test_an_answer_keeps_its_length_and_answers_spread_over_the_table():
  dist = Lengths.parametric(mean=100, max=1000)
  keys = np.stack([request_key(0, g, i) for g in range(200) for i in range(8)])
  drawn = dist(keys)
  np.testing.assert_array_equal(drawn, dist(keys))
  assert drawn.mean() == pytest.approx(100, rel=0.15)


def test_lengths_from_a_runs_rollouts_and_from_a_text_file(tmp_path):
  rollouts = tmp_path / "rollouts.jsonl"
  rollouts.write_text("\n".join(json.dumps({"step": 1, "lengths": [3, 5]}) for _ in range(2)))
  assert sorted(Lengths.from_file(str(rollouts)).table) == [3, 3, 5, 5]
  text = tmp_path / "lengths.txt"
  text.write_text("7 9\n11\n")
  assert Lengths.from_file(str(text)).mean == 9
  text.write_text("7 nine\n")
  with pytest.raises(ValueError, match="lengths.txt: expected whitespace-separated integer"):
    Lengths.from_file(str(text))
  rollouts.write_text('{"step": 1}\n')
  with pytest.raises(ValueError, match=r"rollouts.jsonl:1: not a rollouts.jsonl line"):
    Lengths.from_file(str(rollouts))


def test_recorded_groups_keep_each_groups_lengths_with_its_rewards(tmp_path):
  rollouts = tmp_path / "rollouts.jsonl"
  rollouts.write_text(json.dumps({"lengths": [3, 5], "rewards": [1.0, 0.0]}) + "\n"
                      + json.dumps({"lengths": [8, 8], "rewards": [1.0, 1.0]}) + "\n")
  assert RecordedGroups.from_rollouts([str(rollouts)]).groups == [((3, 5), (1.0, 0.0)), ((8, 8), (1.0, 1.0))]
  rollouts.write_text(json.dumps({"lengths": [3, 5]}) + "\n")
  with pytest.raises(ValueError, match=r"rollouts.jsonl:1: not a rollouts.jsonl line with 'lengths' and 'rewards'"):
    RecordedGroups.from_rollouts([str(rollouts)])
  with pytest.raises(ValueError, match="one reward per answer"):
    RecordedGroups([((3, 5), (1.0,))], source="short")
