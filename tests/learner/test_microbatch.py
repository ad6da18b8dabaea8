import numpy as np
import pytest

from areal_jax.learner.microbatch import (Layout, assemble, balanced_split, bucket_lengths, dynamic_microbatches,
                                          plan_packed, unpack)
from areal_jax.types import Trajectory


def test_alg1_worked_example():
  # Longest first: 5 opens A; 4 opens B; 3 fits both, fewest sequences tie -> A (8); 3 -> B (7); 2 fits none -> C;
  # 1 fits B (2 sequences) and C (1 sequence) -> C. First-fit would have put it into B.
  assert dynamic_microbatches([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3], [4, 5]]


def test_alg1_respects_budget_and_places_everything():
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 300, 200)
  groups = dynamic_microbatches(lengths, 512)
  assert sorted(i for g in groups for i in g) == list(range(200))
  assert all(lengths[g].sum() <= 512 for g in groups)
  assert len(groups) <= 2 * np.ceil(lengths.sum() / 512)


def test_too_long_sequence_is_named():
  with pytest.raises(ValueError, match="sequence 1 has 9 tokens.*max_tokens_per_mb=8"):
    dynamic_microbatches([3, 9], 8)


def test_balanced_split():
  groups = balanced_split([10, 9, 8, 1, 1, 1], 3)
  assert sorted(sum([10, 9, 8, 1, 1, 1][i] for i in g) for g in groups) == [10, 10, 10]


def test_buckets():
  assert bucket_lengths(2048, 128) == (128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
  assert bucket_lengths(3000, 1024) == (1024, 1536, 2048, 3000)
  assert bucket_lengths(64, 128) == (64,)


def test_plan_rows_and_buckets():
  rng = np.random.default_rng(1)
  lengths = rng.integers(5, 100, 37)
  layouts = plan_packed(lengths, max_tokens=200, rows=4, min_bucket=32)
  assert all(len(l.rows) == 4 for l in layouts)
  assert sorted(i for l in layouts for r in l.rows for i in r) == list(range(37))
  for l in layouts:
    assert l.length in (32, 48, 64, 96, 128, 192, 200)
    used = [lengths[list(r)].sum() if r else 0 for r in l.rows]
    assert max(used) <= l.length and (l.length == 32 or max(used) > l.length * 2 // 3)


def _traj(prompt, response, lps):
  return Trajectory(prompt_ids=np.array(prompt, np.int32), response_ids=np.array(response, np.int32),
                    logprobs=np.array(lps, np.float32), versions=np.zeros(len(response), np.int32),
                    finish_reason="eos")


def test_assemble_places_predictions_one_before_each_response_token():
  trajs = [_traj([1, 2], [3, 4, 5], [-1, -2, -3]), _traj([6], [7], [-4]), _traj([8, 9, 10], [11], [-5])]
  adv = [np.full(3, 0.5, np.float32), np.full(1, -1.0, np.float32), np.full(1, 2.0, np.float32)]
  mb = assemble(Layout(rows=((0, 1), (2,)), length=8), trajs, adv)
  np.testing.assert_array_equal(mb.tokens, [[1, 2, 3, 4, 5, 6, 7, 0], [8, 9, 10, 11, 0, 0, 0, 0]])
  np.testing.assert_array_equal(mb.positions, [[0, 1, 2, 3, 4, 0, 1, 0], [0, 1, 2, 3, 0, 0, 0, 0]])
  np.testing.assert_array_equal(mb.segment_ids, [[1, 1, 1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0, 0, 0]])
  np.testing.assert_array_equal(mb.loss_mask, [[0, 1, 1, 1, 0, 1, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(mb.behavior_logprobs, [[0, -1, -2, -3, 0, -4, 0, 0], [0, 0, -5, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(mb.advantages, [[0, .5, .5, .5, 0, -1, 0, 0], [0, 0, 2, 0, 0, 0, 0, 0]])
  assert mb.num_tokens == 11
  back = unpack(mb.layout, mb.behavior_logprobs, trajs)
  for i, t in enumerate(trajs):
    np.testing.assert_array_equal(back[i], t.logprobs)
  with pytest.raises(ValueError, match="cannot hold sequence 1"):
    assemble(Layout(rows=((0, 1),), length=6), trajs, adv)
