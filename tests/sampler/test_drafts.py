"""The suffix drafter: its drafts equal a brute-force longest-suffix search over the three sources (own context, the
prompt's finished answers, the global index) on random small-vocabulary answers; drafts continue the most recent
occurrence; histories are per prompt, shared across epochs, and bounded; dropped answers add nothing."""

import collections
import math

import numpy as np
import pytest

from areal_jax.sampler.drafts import SuffixDrafter


class _Reference:
  """What the drafter should propose, by brute force over the texts its documented rules search."""

  def __init__(self, *, max_draft, min_match, max_match, global_answers, per_prompt_answers, draft_factor=1.0):
    self.max_draft, self.min_match, self.max_match = max_draft, min_match, max_match
    self.global_answers, self.per_prompt_answers, self.draft_factor = global_answers, per_prompt_answers, draft_factor
    self.prompt_texts = collections.defaultdict(list)
    self.global_texts = []

  def finish(self, prompt, tokens, keep):
    if keep and tokens:
      text = list(prompt[max(len(prompt) - self.max_match, 0):]) + list(tokens)
      self.prompt_texts[tuple(prompt)].append(text)
      self.global_texts.append(text)

  def _prompt_searched(self, prompt):
    texts, size = self.prompt_texts[tuple(prompt)], math.ceil(self.per_prompt_answers / 2)
    if not texts or size == 0:
      return []
    newest = (len(texts) - 1) // size  # the generation being filled and the one before it
    return [t for j, t in enumerate(texts) if j // size >= newest - 1]

  def _global_searched(self):
    size = math.ceil(self.global_answers / 2)
    if size == 0:
      return []
    full = len(self.global_texts) // size  # the two newest full generations
    return self.global_texts[max(full - 2, 0) * size:full * size]

  def _longest(self, context, texts, earlier=False):
    """(length, text, end) of the longest suffix of `context` in `texts`, at its most recent occurrence; `earlier`:
    `texts` is [context] and the occurrence must end before the context does."""
    for length in range(min(self.max_match, len(context) - earlier), self.min_match - 1, -1):
      suffix = context[-length:]
      for t in reversed(texts):
        for e in range(len(t) - 1 - earlier, length - 2, -1):
          if t[e - length + 1:e + 1] == suffix:
            return length, t, e
    return 0, None, -1

  def propose(self, prompt, tokens, n):
    context = list(prompt) + list(tokens)
    best, found = 0, None
    for source, (length, t, e) in [("own", self._longest(context, [context], earlier=True)),
                                   ("prompt", self._longest(context, self._prompt_searched(prompt))),
                                   ("global", self._longest(context, self._global_searched()))]:
      if length > best and e + 1 < len(t):
        best, found = length, (source, t, e)
    if found is None or min(n, self.max_draft) < 1:
      return None, []
    source, t, e = found
    k = min(n, self.max_draft, math.ceil(self.draft_factor * best))
    return source, t[e + 1:e + 1 + k]


@pytest.mark.parametrize("vocab,params", [
    (2, dict(max_draft=4, min_match=2, max_match=5, global_answers=6, per_prompt_answers=4)),
    (3, dict(max_draft=6, min_match=1, max_match=8, global_answers=5, per_prompt_answers=3, draft_factor=0.5)),
    (4, dict(max_draft=8, min_match=3, max_match=32, global_answers=8, per_prompt_answers=64)),
    (3, dict(max_draft=3, min_match=2, max_match=4, global_answers=0, per_prompt_answers=2, draft_factor=2.0)),
    (6, dict(max_draft=5, min_match=2, max_match=6, global_answers=4, per_prompt_answers=0)),
    (12, dict(max_draft=4, min_match=2, max_match=3, global_answers=6, per_prompt_answers=6)),
    (1, dict(max_draft=4, min_match=2, max_match=5, global_answers=4, per_prompt_answers=4)),  # one token repeated
])
def test_drafts_equal_brute_force(vocab, params):
  """Random answers to 3 prompts, started, extended, proposed from and finished (kept or dropped) in random order:
  every draft and its source is what a brute-force search finds. Answers end in an end token (vocab) no context
  holds, as answers end in EOS."""
  rng = np.random.default_rng(vocab * 100 + params["max_match"])
  drafter, ref = SuffixDrafter(**params), _Reference(**params)
  prompts = [rng.integers(0, vocab, size=int(rng.integers(0, 9))).tolist() for _ in range(3)]
  running, next_key, checked = {}, 0, collections.Counter()
  for _ in range(1500):
    op = rng.random()
    if op < 0.06 or not running:
      prompt = prompts[int(rng.integers(3))]
      drafter.start(next_key, np.asarray(prompt, np.int32))
      running[next_key] = (prompt, [])
      next_key += 1
      continue
    key = list(running)[int(rng.integers(len(running)))]
    prompt, tokens = running[key]
    if op < 0.12 or len(tokens) > 40:
      keep = bool(rng.random() < 0.85)
      drafter.extend(key, [vocab])
      drafter.finish(key, keep=keep)
      ref.finish(prompt, tokens + [vocab], keep)
      del running[key]
    elif op < 0.55:
      size = int(rng.integers(1, 5))
      new = rng.integers(0, vocab, size=size).tolist()
      if ref.global_texts and rng.random() < 0.5:  # copied from a finished answer, as siblings overlap
        t = ref.global_texts[int(rng.integers(len(ref.global_texts)))]
        at = int(rng.integers(len(t)))
        new = [c for c in t[at:at + size] if c != vocab] or new
      drafter.extend(key, np.asarray(new))
      tokens.extend(new)
    else:
      n = int(rng.integers(0, 10))
      before = dict(drafter.stats)
      draft = drafter.propose(key, n)
      source, expected = ref.propose(prompt, tokens, n)
      assert draft.dtype == np.int32 and len(draft) <= min(n, params["max_draft"])
      assert draft.tolist() == expected, (prompt, tokens, n, source)
      if source is not None:
        assert drafter.stats[source] == before[source] + 1
      checked[source] += 1
  assert checked["own"] > 20 and checked[None] > 20
  if params["per_prompt_answers"]:
    assert checked["prompt"] > 20
  if params["global_answers"]:
    assert checked["global"] > 0


def test_most_recent_occurrence():
  """The same match with different continuations: the latest one in the own context, the latest finished sibling."""
  d = SuffixDrafter(max_draft=4, global_answers=0)
  d.start("a", np.array([7, 8, 1, 2, 3, 7, 8, 4, 5, 6]))
  d.extend("a", [9, 7, 8])
  assert d.propose("a", 4).tolist() == [4, 5]  # [7, 8] matched, its latest earlier occurrence followed by 4, 5, ...
  prompt = np.array([50, 51])
  for key, answer in [("s1", [1, 2, 3, 10, 11, 12, 0]), ("s2", [1, 2, 3, 20, 21, 22, 0])]:
    d.start(key, prompt)
    d.extend(key, answer)
    d.finish(key)
  d.start("s3", prompt)
  d.extend("s3", [1, 2, 3])
  assert d.propose("s3", 8).tolist() == [20, 21, 22, 0]  # 5 tokens matched (the prompt's and [1, 2, 3])
  assert d.stats["prompt"] == 1 and d.stats["own"] == 1


def test_at_least_lengthens_a_short_match_s_draft_to_the_text_s_end():
  """A 2-token match earns 2 tokens; `at_least` asks more (a device running ahead), never past the text's end."""
  d = SuffixDrafter(max_draft=16, global_answers=0)
  d.start("a", np.array([7, 8, 1, 2, 3, 4, 5, 9]))
  d.extend("a", [7, 8])
  assert d.propose("a", 16).tolist() == [1, 2]
  assert d.propose("a", 16, at_least=5).tolist() == [1, 2, 3, 4, 5]
  assert d.propose("a", 16, at_least=12).tolist() == [1, 2, 3, 4, 5, 9, 7, 8]
  assert d.propose("a", 3, at_least=12).tolist() == [1, 2, 3]


def test_a_full_length_match_moves_to_a_newer_sibling():
  """An answer matching max_match tokens keeps that length when a sibling finishes with the same tokens, and its
  draft moves to that sibling's (newer) continuation."""
  d = SuffixDrafter(max_draft=4, max_match=4, global_answers=0)
  for key, answer in [("s1", [9, 1, 2, 3, 4, 5, 0]), ("r", [8, 9, 1, 2])]:
    d.start(key, np.array([50]))
    d.extend(key, answer)
  d.finish("s1")
  assert d.propose("r", 4).tolist() == [3, 4, 5]  # 3 tokens matched: 3 drafted
  d.extend("r", [3, 4])  # [1, 2, 3, 4]: max_match tokens matched
  assert d.propose("r", 4).tolist() == [5, 0]
  d.start("s2", np.array([50]))
  d.extend("s2", [7, 1, 2, 3, 4, 6, 0])
  d.finish("s2")
  assert d.propose("r", 4).tolist() == [6, 0]
  d.extend("r", [6])
  assert d.propose("r", 4).tolist() == [0]


def test_sources_are_scoped_by_prompt():
  """Siblings and a later epoch (same prompt tokens, new keys) draft from the prompt's answers; another prompt sees
  them only through the global index, once its generation is published."""
  answer = [30, 31, 32, 33, 34, 35, 0]
  for global_answers in (0, 4):
    d = SuffixDrafter(max_draft=8, global_answers=global_answers)
    d.start(("epoch0", 0), np.array([1, 2, 3]))
    d.start(("epoch0", 1), np.array([1, 2, 3]))
    d.extend(("epoch0", 0), answer)
    d.finish(("epoch0", 0))
    assert d.propose(("epoch0", 1), 3).tolist() == [30, 31, 32]  # a sibling: the prompt's tail matches
    d.extend(("epoch0", 1), [30, 31])
    assert d.propose(("epoch0", 1), 8).tolist() == [32, 33, 34, 35, 0]
    d.finish(("epoch0", 1), keep=False)
    d.start(("epoch1", 0), np.array([1, 2, 3]))  # the same prompt, an epoch later
    d.extend(("epoch1", 0), [30, 31, 32])
    assert d.propose(("epoch1", 0), 8).tolist() == [33, 34, 35, 0]
    d.start("other", np.array([9, 9, 4]))  # another prompt
    d.extend("other", [30, 31, 32])
    assert d.propose("other", 8).size == 0  # the global index's first generation is not full yet
    d.extend(("epoch1", 0), [33, 34, 35, 0])
    d.finish(("epoch1", 0))  # fills a generation of global_answers / 2 = 2 answers: published
    assert d.propose("other", 8).tolist() == ([33, 34, 35] if global_answers else [])
    assert d.stats["prompt"] == 3 and d.stats["global"] == (1 if global_answers else 0)


def test_nothing_matches_and_limits():
  d = SuffixDrafter(max_draft=3)
  d.start(0, np.arange(10, 20))
  assert d.propose(0, 4).size == 0  # no repeated suffix, no history
  d.extend(0, [10, 11, 12, 13, 14, 15])  # [10..15] repeats the prompt's start
  assert d.propose(0, 8).tolist() == [16, 17, 18]  # max_draft
  assert d.propose(0, 2).tolist() == [16, 17]  # n
  assert d.propose(0, 0).size == 0
  d = SuffixDrafter(max_draft=8, min_match=2)
  d.start(0, np.array([5, 6, 7, 8, 9]))
  d.extend(0, [5, 6])
  assert d.propose(0, 8).tolist() == [7, 8]  # a 2-token match earns 2 tokens (draft_factor 1)
  d.extend(0, [7])
  assert d.propose(0, 8).tolist() == [8, 9, 5]  # 3 earn 3, and the own context goes on past the prompt
  with pytest.raises(ValueError, match="started twice"):
    d.start(0, np.array([1]))
  with pytest.raises(ValueError, match="min_match"):
    SuffixDrafter(max_draft=4, min_match=5, max_match=4)


def test_occurrence_at_a_text_end_is_passed_over():
  d = SuffixDrafter(max_draft=4, global_answers=0)
  d.start("a", np.array([1]))
  d.extend("a", [2, 3, 4, 5])  # ends without an end token (a length limit)
  d.finish("a")
  d.start("b", np.array([1]))
  d.extend("b", [2, 3, 4, 5])
  assert d.propose("b", 4).size == 0  # matched at the sibling's end: nothing followed it


def test_dropped_answers_add_nothing_and_a_rebuilt_answer_drafts_the_same():
  d = SuffixDrafter(max_draft=4, global_answers=4)
  d.start("a", np.array([1, 2]))
  d.extend("a", [3, 4, 5, 6])
  before = d.sizes()
  d.finish("a", keep=False)
  assert d.sizes() == dict(before, running=0, states=before["states"] - 7)  # its own automaton (6 tokens + root)
  assert d.sizes()["prompt_answers"] == d.sizes()["global_answers"] == 0
  d.start("b", np.array([1, 2]))
  d.extend("b", [3, 4])
  assert d.propose("b", 4).size == 0
  d.extend("b", [1, 2, 3])
  first = d.propose("b", 4).tolist()
  d.finish("b", keep=False)  # state dropped (e.g. preempted and lost): rebuilt from its tokens so far
  d.start("b", np.array([1, 2]))
  d.extend("b", [3, 4, 1, 2, 3])
  assert d.propose("b", 4).tolist() == first == [4, 1, 2]


def test_memory_is_bounded():
  """500 answers to 10 prompts: the per-prompt histories' tokens, their answers per prompt and the global index stay
  within their bounds, and the automata's states stop growing."""
  rng = np.random.default_rng(0)
  d = SuffixDrafter(max_draft=4, global_answers=8, per_prompt_answers=4, history_tokens=600)
  prompts = [rng.integers(0, 50, size=6) for _ in range(10)]
  states = []
  for i in range(500):
    d.start(i, prompts[i % 10])
    d.extend(i, rng.integers(0, 50, size=30))
    if i >= 2:
      d.finish(i - 2)  # three running at a time
    sizes = d.sizes()
    assert sizes["prompt_tokens"] <= 600 and sizes["running"] <= 3
    assert sizes["prompt_answers"] <= 4 * sizes["prompts"] and sizes["global_answers"] <= 8 + 4
    states.append(sizes["states"])
  assert sizes["prompts"] >= 3 and sizes["prompt_answers"] >= 3
  assert max(states[250:]) <= 1.2 * max(states[:250])
