"""`dispatch`: the next group goes to the sampler with the least work outstanding in tokens (prompts not yet answered
plus the budgets of answers not back), not the fewest answers; the accounting returns to nothing as answers come
back; an episode's turns stay with one sampler."""

import numpy as np
import pytest

from areal_jax.sampler import Request, SamplingParams
from areal_jax.sampler.dispatch import Dispatcher, Load, Outstanding, least_loaded


def _group(group_id: int, answers: int, max_new_tokens: int, prompt: int = 10) -> Request:
  return Request(group_id=group_id, prompt_ids=np.full(prompt, 3, np.int32), num_answers=answers,
                 sampling=SamplingParams(max_new_tokens=max_new_tokens))


def test_skewed_groups_send_the_next_to_the_replica_with_less_work():
  """16 answers of 20k tokens on one replica, 32 of 100 on the other: the one with more answers takes the next."""
  busy, light = Outstanding(), Outstanding()
  busy.add(_group(0, 16, 20_000))
  light.add(_group(1, 16, 100))
  light.add(_group(2, 16, 100))
  assert (busy.answers, light.answers) == (16, 32)
  assert (busy.tokens, light.tokens) == (10 + 16 * 20_000, 2 * (10 + 16 * 100))
  assert least_loaded({0: busy.load(free_pages=100), 1: light.load(free_pages=50)}) == 1


def test_ties_go_to_free_pages_then_answers_then_the_lowest_key():
  assert least_loaded({0: Load(tokens=5, answers=1, free_pages=3), 1: Load(tokens=5, answers=1, free_pages=9)}) == 1
  assert least_loaded({0: Load(tokens=5, answers=2), 1: Load(tokens=5, answers=1)}) == 1
  assert least_loaded({1: Load(tokens=0, answers=0), 0: Load(tokens=0, answers=0)}) == 0
  with pytest.raises(ValueError, match="no sampler"):
    least_loaded({})


def test_work_leaves_as_answers_come_back():
  """The prompt leaves with its group's first answer (it was prefilled), each answer's budget with it; a group
  taken back whole leaves nothing."""
  out = Outstanding()
  out.add(_group(7, 3, 50, prompt=12))
  out.add(_group(8, 2, 30, prompt=5))
  assert 7 in out and len(out) == 2 and out.tokens == 12 + 150 + 5 + 60
  out.answered(7)
  assert out.tokens == 100 + 5 + 60 and out.answers == 4
  out.answered(7)
  out.answered(7)
  assert 7 not in out and out.tokens == 65 and list(out) == [8]
  with pytest.raises(ValueError, match="group 8 is already in flight"):
    out.add(_group(8, 1, 1))
  out.remove(8)
  assert (out.tokens, out.answers, len(out)) == (0, 0, 0)


def test_an_episode_s_turns_go_where_its_first_went_while_that_sampler_lives():
  dispatcher = Dispatcher(remember=2)
  idle, busy = Load(tokens=0, answers=0), Load(tokens=500, answers=4)
  turn = lambda episode: Request(group_id=0, prompt_ids=[3, 4], episode=episode)
  assert dispatcher.choose(turn("a"), {0: idle, 1: busy}) == 0
  assert dispatcher.choose(turn("a"), {0: busy, 1: idle}) == 0  # kept, though busier now
  assert dispatcher.choose(turn(None), {0: busy, 1: idle}) == 1  # no episode: the least loaded
  assert dispatcher.choose(turn("a"), {1: idle, 2: busy}) == 1  # its sampler gone: the least loaded, kept from then
  assert dispatcher.choose(turn("a"), {1: busy, 2: idle}) == 1 and dispatcher.kept == 2
  dispatcher.choose(turn("b"), {1: busy, 2: idle})
  dispatcher.choose(turn("c"), {1: busy, 2: idle})  # the oldest remembered ("a") is forgotten
  assert dispatcher.choose(turn("a"), {1: busy, 2: idle}) == 2
