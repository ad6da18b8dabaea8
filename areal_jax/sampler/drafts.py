"""Draft tokens for speculative rollout, from the rollouts RL already has: no draft model, never stale.

For a running answer, `SuffixDrafter.propose` finds the longest suffix of its context (prompt + tokens so far; at
least `min_match`, at most `max_match` tokens) that occurs in one of three sources and proposes the tokens that
followed its most recent occurrence there:
  own     the answer's own context, at an earlier position (prompt lookup);
  prompt  finished answers to the same prompt (equal tokens): this group's siblings and earlier epochs' answers;
  global  a bounded index of recent finished answers to any prompt.
The longest match wins; ties go to the more specific source (own, prompt, global), and within a source to the most
recent occurrence. A finished answer's text is its prompt's last `max_match` tokens followed by its tokens, so an
answer that has just begun (its context ends in the prompt) drafts its siblings' first tokens. A source whose
occurrence ends its text (nothing followed it) is passed over. A match of L tokens earns a draft of
min(n, max_draft, ceil(draft_factor * L)) tokens (SuffixDecoding's `max_spec_factor`; DAS likewise gives long
matches longer drafts), never past the end of the text it comes from.

Ours, not arctic-inference's SuffixDecoding: that ships only an sdist needing a C++/CUDA build against our pins.

Design. Every source is a suffix automaton (`_Automaton`) built token by token; each state keeps its most recent end
position, updated along the new token's suffix path for the at most `max_match` states whose strings are short
enough to be matched (found through path-compressed pointers: a run of one repeated token costs what natural text
does). An answer's own automaton is a copy of its prompt's, extended per token; its longest suffix that ended earlier
falls out of the extension. Against each history automaton a running answer keeps a matching state (state, matched
length) advanced per token in amortised O(1); when that automaton grows, a match of `max_match` tokens moves to the
state holding it now, a shorter one is matched again from the context's last `max_match` tokens at the next proposal.

Memory is bounded. A history is kept in generations of ceil(answers / 2) answers, an automaton each. A prompt's
history searches its two newest (the one filling included): between half and all of its `per_prompt_answers` most
recent answers. The global index searches its two newest full generations, between half and all of its
`global_answers` most recent (published half at a time, so that running answers resynchronise once per generation,
not per finished answer), while a third fills. Per-prompt histories hold `history_tokens` tokens in all, at about
150 bytes each (least recently started prompts go first, never one with an answer running).

Host cost, from `python -c "from areal_jax.sampler.drafts import _bench; _bench()"` (thread CPU time, on the shared
2-core CPU with load ~4.7; 256 running answers to 16 prompts, full histories, 1461 tokens and 1.2 finished answers
a call): 16-19 ms a call: 6-8 us a proposal, 5.6-6.8 us an extended token, 5 us a finished answer's token (its prompt
history and the global index), 30-45 us a start (copying a 200-token prompt's automaton). Automata take ~150 B a
token (histories) and ~130 (running answers).
"""

from __future__ import annotations

import collections
import math
from array import array
from collections.abc import Hashable, Sequence

import numpy as np

SEP = -1  # between texts in an automaton's text (tokens are >= 0)
SOURCES = ("own", "prompt", "global")


class _Automaton:
  """Suffix automaton of texts added token by token (`begin`, then `extend`).

  A state is a class of substrings with the same end positions; `end[v]` is the most recent of them (an index into
  `text`, kept for states holding a string of at most `max_match` tokens: the only ones matches are read from).
  Transitions: one inline per state (`tok`, `dst`), more in `more[v]` (a minority of states branch).
  """

  def __init__(self, max_match: int):
    self.max_match = max_match
    self.text = array("i")  # every text added, SEP between
    self.texts = 0
    self.link = array("i", [-1])
    self.length = array("i", [0])
    self.end = array("i", [-1])
    self.hop = array("i", [0])  # see `short`
    self.tok = array("i", [SEP])
    self.dst = array("i", [0])
    self.more: dict[int, dict[int, int]] = {}
    self.tail = 0  # the state of the text being added
    # (length, end) of the longest suffix (<= max_match) of the text being added that ended earlier: for an
    # automaton of one text, its own-context match
    self.repeat = (0, -1)

  def __len__(self) -> int:
    return len(self.length)

  def copy(self) -> _Automaton:
    other = _Automaton.__new__(_Automaton)
    other.__dict__.update(self.__dict__)
    for name in ("text", "link", "length", "end", "hop", "tok", "dst"):
      setattr(other, name, array("i", getattr(self, name)))
    other.more = {v: dict(d) for v, d in self.more.items()}
    return other

  def begin(self) -> None:
    if self.texts:
      self.text.append(SEP)
    self.texts += 1
    self.tail, self.repeat = 0, (0, -1)

  def _clone(self, p: int, q: int, c: int) -> int:
    """Splits q: a new state takes q's strings of up to length[p] + 1 tokens, and the transitions on c into q of
    p and its suffixes."""
    link, length, tok, dst, more = self.link, self.length, self.tok, self.dst, self.more
    clone = len(length)
    length.append(length[p] + 1)
    link.append(link[q])
    self.end.append(self.end[q])
    self.hop.append(clone)
    tok.append(tok[q])
    dst.append(dst[q])
    d = more.get(q)
    if d:
      more[clone] = dict(d)
    link[q] = clone
    while p >= 0:
      if tok[p] == c:
        if dst[p] != q:
          break
        dst[p] = clone
      else:
        d = more[p]  # p has a transition on c, not its inline one
        if d[c] != q:
          break
        d[c] = clone
      p = link[p]
    return clone

  def extend(self, tokens: Sequence[int]) -> None:
    """Appends `tokens` to the text being added."""
    text, link, length, end, hop, tok, dst, more = (self.text, self.link, self.length, self.end, self.hop, self.tok,
                                                    self.dst, self.more)
    m, cur = self.max_match, self.tail
    for c in tokens:
      i = len(text)
      text.append(c)
      p = cur
      if tok[p] == c:
        q = dst[p]
      else:
        d = more.get(p)
        q = -1 if d is None else d.get(c, -1)
      if q >= 0:  # another text had this prefix already
        cur = q if length[q] == length[p] + 1 else self._clone(p, q, c)
      else:
        cur = len(length)
        length.append(length[p] + 1)
        link.append(0)
        end.append(i)
        hop.append(cur)
        tok.append(SEP)
        dst.append(0)
        while p >= 0:  # p and its suffixes without a transition on c get one to cur
          t = tok[p]
          if t == c:
            q = dst[p]
            break
          if t == SEP:
            tok[p], dst[p] = c, cur
          else:
            d = more.get(p)
            if d is None:
              more[p] = {c: cur}
            else:
              q = d.get(c, -1)
              if q >= 0:
                break
              d[c] = cur
          p = link[p]
        if q >= 0:
          link[cur] = q if length[q] == length[p] + 1 else self._clone(p, q, c)
      r = self.short(cur)
      w = link[cur] if r == cur else r  # the longest suffix (<= m) that ended earlier
      self.repeat = (length[w] if length[w] < m else m, end[w]) if w > 0 else (0, -1)
      while r > 0:  # i is now the most recent end of every suffix of up to m tokens
        end[r] = i
        r = link[r]
    self.tail = cur

  def walk(self, v: int, l: int, tokens: Sequence[int]) -> tuple[int, int]:
    """Matching: from (state, length) of the longest suffix (<= max_match) of a context found here, that after
    `tokens` follow."""
    link, length, hop, tok, dst, more, m = (self.link, self.length, self.hop, self.tok, self.dst, self.more,
                                            self.max_match)
    for c in tokens:
      while True:  # down the suffix path to the longest suffix followed by c
        if tok[v] == c:
          q = dst[v]
        else:
          d = more.get(v)
          q = -1 if d is None else d.get(c, -1)
        if q >= 0 or v == 0:
          break
        v = link[v]
        l = length[v]
      if q < 0:
        v = l = 0
      elif l < m:
        v, l = q, l + 1
      else:  # the suffix of m tokens
        v = self.short(q)
    return v, l

  def short(self, v: int) -> int:
    """The first state on v's suffix path that holds a string of at most `max_match` tokens: the only states whose
    `end` is kept, and for a state that held a context's suffix of `max_match` tokens, the one holding it now (this
    automaton grew since). `hop[v]` is a state on that path at or below it: states only ever get longer (a clone
    takes over their shorter strings), so it is walked on, and every hop passed is set to the answer (path
    compression, as in union-find: a long run of one repeated token costs about what natural text does)."""
    hop, link, length, m = self.hop, self.link, self.length, self.max_match
    r = hop[v]
    if r == 0 or length[link[r]] < m:
      return r
    passed = [v]
    while r and length[link[r]] >= m:
      passed += (r, link[r])
      r = hop[link[r]]
    for x in passed:
      hop[x] = r
    return r

  def match(self, context: Sequence[int]) -> tuple[int, int]:
    return self.walk(0, 0, context[-self.max_match:])

  def follows(self, end: int, k: int) -> array:
    """Up to k tokens after position `end`, within its text."""
    out = self.text[end + 1:end + 1 + k]
    if SEP in out:
      out = out[:out.index(SEP)]
    return out


class _History:
  """Finished answers' texts in generations of `size` answers, one automaton each. `searched` lists those a match
  reads, newest first: with `deferred`, the `keep` newest full ones (a generation is published when it fills);
  without, the `keep` newest, the one being filled included. `tokens`: the text held (searched or filling)."""

  def __init__(self, *, size: int, keep: int, deferred: bool, max_match: int):
    self.size, self.keep, self.deferred, self.max_match = size, keep, deferred, max_match
    self.searched: list[_Automaton] = []
    self.filling: _Automaton | None = None
    self.tokens = 0

  def _publish(self, g: _Automaton) -> None:
    self.searched.insert(0, g)
    self.tokens -= sum(len(old.text) for old in self.searched[self.keep:])
    del self.searched[self.keep:]

  def add(self, text: Sequence[int]) -> None:
    g = self.filling
    if g is None:
      g = self.filling = _Automaton(self.max_match)
      if not self.deferred:
        self._publish(g)
    before = len(g.text)
    g.begin()
    g.extend(text)
    self.tokens += len(g.text) - before
    if g.texts == self.size:
      self.filling = None
      if self.deferred:
        self._publish(g)

  def held(self) -> list[_Automaton]:
    return self.searched + ([self.filling] if self.deferred and self.filling else [])


class _Prompt:
  __slots__ = ("automaton", "history", "running")

  def __init__(self, automaton: _Automaton, history: _History | None):
    self.automaton, self.history, self.running = automaton, history, 0

  def tokens(self) -> int:
    return len(self.automaton.text) + (self.history.tokens if self.history else 0)


class _Answer:
  __slots__ = ("prompt", "own", "start", "matchers")

  def __init__(self, prompt: _Prompt, own: _Automaton, start: int):
    self.prompt, self.own, self.start = prompt, own, start
    self.matchers: dict[_Automaton, list[int]] = {}  # automaton -> [state, length, its text's length when synced]


_EMPTY = np.zeros(0, np.int32)
_EMPTY.setflags(write=False)


class SuffixDrafter:
  """Drafts for running answers from their own context, their prompt's finished answers and recent answers.

  Per answer: `start(key, prompt)`, `extend(key, tokens)` as tokens are drawn, `propose(key, n)` before a call,
  `finish(key, keep)` at its end. A preempted answer keeps its state (its context is unchanged): nothing to call;
  one whose state was dropped is rebuilt by `start` and one `extend` with its tokens so far. Not thread-safe: one
  owner calls it.

  Memory: about 150 bytes per token held. Per-prompt histories (prompts and answers) hold at most
  `history_tokens` tokens together (least recently started prompts out first, never one with an answer running);
  the global index at most 1.5 * `global_answers` answers; each running answer its context.
  """

  def __init__(self, *, max_draft: int, min_match: int = 2, max_match: int = 32, global_answers: int = 256,
               per_prompt_answers: int = 64, history_tokens: int = 4_000_000, draft_factor: float = 1.0):
    if max_draft < 1 or min_match < 1 or max_match < min_match:
      raise ValueError(f"need max_draft >= 1 and 1 <= min_match <= max_match: max_draft={max_draft}, "
                       f"min_match={min_match}, max_match={max_match}")
    self.max_draft, self.min_match, self.max_match = max_draft, min_match, max_match
    self.per_prompt_answers, self.history_tokens, self.draft_factor = per_prompt_answers, history_tokens, draft_factor
    self._global = (_History(size=math.ceil(global_answers / 2), keep=2, deferred=True, max_match=max_match)
                    if global_answers > 0 else None)
    self._prompts: collections.OrderedDict[bytes, _Prompt] = collections.OrderedDict()  # least recently started first
    self._held = 0  # tokens in self._prompts
    self._answers: dict[Hashable, _Answer] = {}
    # proposals: calls; drafts: non-empty ones; tokens: tokens proposed; own/prompt/global: drafts by source
    self.stats = dict.fromkeys(("proposals", "drafts", "tokens") + SOURCES, 0)

  def start(self, key: Hashable, prompt: np.ndarray) -> None:
    """An answer to `prompt` begins; `key` names it until `finish`."""
    if key in self._answers:
      raise ValueError(f"answer {key!r} started twice")
    prompt = np.asarray(prompt, np.int32)
    entry = self._prompts.get(pk := prompt.tobytes())
    if entry is None:
      automaton = _Automaton(self.max_match)
      automaton.begin()
      automaton.extend(prompt.tolist())
      history = (_History(size=math.ceil(self.per_prompt_answers / 2), keep=2, deferred=False,
                          max_match=self.max_match) if self.per_prompt_answers > 0 else None)
      entry = self._prompts[pk] = _Prompt(automaton, history)
      self._held += entry.tokens()
    self._prompts.move_to_end(pk)
    entry.running += 1
    self._answers[key] = _Answer(entry, entry.automaton.copy(), len(prompt))
    self._evict()

  def _evict(self) -> None:
    if self._held <= self.history_tokens:
      return
    for pk in [pk for pk, entry in self._prompts.items() if not entry.running]:
      self._held -= self._prompts.pop(pk).tokens()
      if self._held <= self.history_tokens:
        return

  def extend(self, key: Hashable, tokens: Sequence[int] | np.ndarray) -> None:
    """Tokens drawn for answer `key`, appended to its context."""
    answer = self._answers[key]
    tokens = np.asarray(tokens).tolist()
    answer.own.extend(tokens)
    history = answer.prompt.history
    for searched in (history.searched if history else (), self._global.searched if self._global else ()):
      for g in searched:
        m = answer.matchers.get(g)
        if m is None:
          continue
        if m[2] != len(g.text):  # g grew
          if m[1] < self.max_match:
            continue  # a longer match may exist now: resynchronised when next proposed from
          m[0], m[2] = g.short(m[0]), len(g.text)  # no longer one can: the state holding it now
        m[0], m[1] = g.walk(m[0], m[1], tokens)

  def propose(self, key: Hashable, n: int, at_least: int = 0) -> np.ndarray:
    """Up to min(n, max_draft) tokens (int32) predicted to follow answer `key`'s context; empty if nothing
    matches. The match's length sets the draft's (`draft_factor`), but no shorter than `at_least` tokens where the
    text goes on (a caller whose device runs ahead of what it has read needs the draft to reach past it)."""
    answer = self._answers[key]
    self.stats["proposals"] += 1
    if min(n, self.max_draft) < 1:
      return _EMPTY
    own, matchers = answer.own, answer.matchers
    best, found = self.min_match - 1, None
    length, end = own.repeat
    if length > best:
      best, found = length, ("own", own, end)
    history = answer.prompt.history
    prompt_side = history.searched if history else ()
    global_side = self._global.searched if self._global else ()
    if len(matchers) > len(prompt_side) + len(global_side):  # drop those of generations gone
      matchers = answer.matchers = {g: matchers[g] for g in (*prompt_side, *global_side) if g in matchers}
    for source, searched in (("prompt", prompt_side), ("global", global_side)):
      for g in searched:  # newest first
        m = matchers.get(g)
        size = len(g.text)
        if m is None or (m[2] != size and m[1] < self.max_match):
          m = matchers[g] = [*g.match(own.text), size]
        elif m[2] != size:
          m[0], m[2] = g.short(m[0]), size
        if m[1] > best:
          e = g.end[m[0]]
          if e + 1 < size and g.text[e + 1] != SEP:
            best, found = m[1], (source, g, e)
    if found is None:
      return _EMPTY
    source, g, e = found
    k = min(n, self.max_draft, max(at_least, math.ceil(self.draft_factor * best)))
    draft = np.frombuffer(g.follows(e, k), np.int32).copy()
    self.stats["drafts"] += 1
    self.stats["tokens"] += len(draft)
    self.stats[source] += 1
    return draft

  def finish(self, key: Hashable, keep: bool = True) -> None:
    """Answer `key` ended; with `keep` its prompt's last `max_match` tokens and its tokens join its prompt's history
    and the global index (keep=False: dropped, e.g. aborted)."""
    answer = self._answers.pop(key)
    entry = answer.prompt
    entry.running -= 1
    if keep and len(answer.own.text) > answer.start:
      text = answer.own.text[max(answer.start - self.max_match, 0):]
      if entry.history:
        before = entry.history.tokens
        entry.history.add(text)
        self._held += entry.history.tokens - before  # (an entry is never evicted while an answer runs)
      if self._global:
        self._global.add(text)
    self._evict()

  def abandon(self) -> None:
    """Drops every running answer (kept histories stay): for a new owner of a drafter whose last owner may have
    stopped mid-answer."""
    for key in list(self._answers):
      self.finish(key, keep=False)

  def sizes(self) -> dict[str, int]:
    """What is held: running answers; prompts, answers and tokens in per-prompt histories; answers in the global
    index; states in all automata (memory is about proportional to them)."""
    histories = [e.history for e in self._prompts.values() if e.history]
    automata = ([e.automaton for e in self._prompts.values()] + [a.own for a in self._answers.values()] +
                [g for h in histories for g in h.held()] + (self._global.held() if self._global else []))
    return {"running": len(self._answers), "prompts": len(self._prompts),
            "prompt_answers": sum(g.texts for h in histories for g in h.held()), "prompt_tokens": self._held,
            "global_answers": sum(g.texts for g in self._global.held()) if self._global else 0,
            "states": sum(map(len, automata))}


def _nbytes(g: _Automaton) -> int:
  """Bytes an automaton holds (arrays, transition dicts and their int keys and values)."""
  import sys
  arrays = sum(a.buffer_info()[1] * a.itemsize for a in (g.text, g.link, g.length, g.end, g.hop, g.tok, g.dst))
  return arrays + sys.getsizeof(g.more) + sum(sys.getsizeof(d) + 64 * len(d) for d in g.more.values())


def _bench(*, prompts: int = 16, group: int = 16, prompt_len: int = 200, answer_len: int = 1000, calls: int = 60,
           seed: int = 0) -> None:
  """Host time per call for prompts * group running answers with full histories (64 answers per prompt, the global
  index full), answers finishing and new ones starting as they would.

  Answers imitate a group's overlap: each copies its prompt's reference solution, jumping to a random place in it or
  drawing a random token (vocabulary 32k) with probability 0.025 each per token. A call proposes up to 8 tokens for
  every answer and extends each by the draft's correct prefix + 1 token, at least 4."""
  import time
  rng = np.random.default_rng(seed)
  refs = [rng.integers(0, 32000, size=answer_len) for _ in range(prompts)]
  heads = [rng.integers(0, 32000, size=prompt_len) for _ in range(prompts)]

  def answer(p: int) -> np.ndarray:
    u = rng.random(answer_len)
    jumps = np.where(u < 0.025, rng.integers(answer_len, size=answer_len), -1)
    out, j = np.empty(answer_len, np.int64), 0
    for i in range(answer_len):
      j = jumps[i] if jumps[i] >= 0 else j
      out[i] = refs[p][j % answer_len] if not 0.025 <= u[i] < 0.05 else rng.integers(32000)
      j += 1
    return out

  d = SuffixDrafter(max_draft=8)
  t0, fill = time.thread_time(), 0
  for r in range(d.per_prompt_answers):
    for p in range(prompts):
      d.start(key := ("fill", r, p), heads[p])
      d.extend(key, answer(p))
      d.finish(key)
      fill += answer_len
  fill_s = time.thread_time() - t0
  running = {}
  for serial in range(prompts * group):  # each at a random point of its answer
    running[serial] = [text := answer(serial % prompts), int(rng.integers(answer_len))]
    d.start(serial, heads[serial % prompts])
    d.extend(serial, text[:running[serial][1]])
  timed = dict.fromkeys(("propose", "extend", "finish", "start"), 0.0)
  counts = dict.fromkeys(("proposals", "tokens", "finished_tokens", "starts"), 0)
  for call in range(calls + 1):
    if call == 1:  # the first call resynchronises every matcher once
      timed = dict.fromkeys(timed, 0.0)
      counts, stats = dict.fromkeys(counts, 0), dict(d.stats)
    t = time.thread_time()
    drafts = {k: d.propose(k, 8) for k in running}
    timed["propose"] += time.thread_time() - t
    new = {}
    for k, (text, at) in running.items():
      truth, draft = text[at:at + 9], drafts[k]
      ok = 0
      while ok < min(len(draft), len(truth) - 1) and draft[ok] == truth[ok]:
        ok += 1
      new[k] = truth[:max(ok + 1, 4)]
    t = time.thread_time()
    for k, tokens in new.items():
      d.extend(k, tokens)
    timed["extend"] += time.thread_time() - t
    for k, tokens in new.items():
      running[k][1] += len(tokens)
      counts["tokens"] += len(tokens)
    counts["proposals"] += len(running)
    for k in [k for k, (text, at) in running.items() if at >= len(text)]:
      t = time.thread_time()
      d.finish(k)
      timed["finish"] += time.thread_time() - t
      counts["finished_tokens"] += answer_len
      serial = max(running) + 1
      running[serial] = [answer(serial % prompts), 0]
      del running[k]
      t = time.thread_time()
      d.start(serial, heads[serial % prompts])
      timed["start"] += time.thread_time() - t
      counts["starts"] += 1
  stats = {k: v - stats[k] for k, v in d.stats.items()}
  histories = [g for e in d._prompts.values() if e.history for g in e.history.searched]
  own = [a.own for a in d._answers.values()]
  us = {k: 1e6 * v for k, v in timed.items()}
  print(f"histories filled: {fill} tokens, {1e6 * fill_s / fill:.1f} us/token (own, prompt and global automata)\n"
        f"{len(running)} running, {calls} calls, {counts['tokens'] / calls:.0f} tokens and "
        f"{counts['starts'] / calls:.1f} finished answers a call: {sum(us.values()) / 1e3 / calls:.1f} ms a call\n"
        f"  propose {us['propose'] / counts['proposals']:.2f} us each, extend {us['extend'] / counts['tokens']:.2f} us "
        f"a token, finish {us['finish'] / max(counts['finished_tokens'], 1):.2f} us a token, start "
        f"{us['start'] / max(counts['starts'], 1):.0f} us\n"
        f"  drafts {stats['drafts'] / stats['proposals']:.2f} of proposals, {stats['tokens'] / stats['drafts']:.1f} "
        f"tokens each; by source {[stats[s] for s in SOURCES]} (own, prompt, global)\n"
        f"memory: histories {sum(map(_nbytes, histories)) / sum(len(g.text) for g in histories):.0f} B/token, own "
        f"automata {sum(map(_nbytes, own)) / sum(len(g.text) for g in own):.0f} B/token; {d.sizes()}")


if __name__ == "__main__":
  _bench()
