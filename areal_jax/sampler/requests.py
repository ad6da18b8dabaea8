"""What the sampler is asked for (a prompt group with sampling settings) and its per-answer progress on the host."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from areal_jax.types import Trajectory


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """temperature 0 = greedy; top_k -1 and top_p 1 = off. `stop`: token sequences that end an answer (kept in it).
  EOS ends an answer unless `ignore_eos`. Answer i of group g draws from PRNG key (seed, g, i)."""

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  max_new_tokens: int = 1024
  stop: tuple[tuple[int, ...], ...] = ()
  ignore_eos: bool = False
  seed: int = 0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p}: must lie in (0, 1]")
    if self.top_k == 0 or self.top_k < -1:
      raise ValueError(f"top_k={self.top_k}: must be positive or -1 (off)")
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
    if any(len(s) == 0 for s in self.stop):
      raise ValueError(f"stop={self.stop}: stop sequences must be non-empty")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
  """A prompt group: `num_answers` (G) answers to one prompt."""

  group_id: int
  prompt_ids: np.ndarray
  num_answers: int = 1
  sampling: SamplingParams = SamplingParams()
  min_version: int = 0  # generated from this policy version or newer (a sampler holds the group until then)
  # The agent episode or multi-turn series this request is a turn of: its turns go to one sampler while it lives, so
  # the prefix cache there holds the turn before (`dispatch.Dispatcher`); None: any sampler.
  episode: str | None = None

  def __post_init__(self):
    object.__setattr__(self, "prompt_ids", np.asarray(self.prompt_ids, np.int32).reshape(-1))
    if len(self.prompt_ids) == 0:
      raise ValueError(f"group {self.group_id}: empty prompt")
    if self.num_answers < 1:
      raise ValueError(f"group {self.group_id}: num_answers={self.num_answers} must be >= 1")


@dataclasses.dataclass(eq=False, kw_only=True)
class Sequence:
  """One answer in progress (host-side, owned by the scheduler thread)."""

  request: Request
  answer: int
  key: np.ndarray  # uint32 [2]
  order: tuple[int, int]  # (arrival number, answer): lower = older = higher priority
  t_submit: float
  _tokens: list[int] = dataclasses.field(default_factory=list, repr=False)
  _logprobs: list[float] = dataclasses.field(default_factory=list, repr=False)
  _versions: list[int] = dataclasses.field(default_factory=list, repr=False)
  # With `sampler.record_routes`: the experts each position was routed to, from position 0 on, in chunks of int16
  # [positions, sparse layers, k] (-1: not recorded, a prefix-cache hit's positions).
  routes: list[np.ndarray] = dataclasses.field(default_factory=list)
  slot: int = -1
  finish_reason: str | None = None
  preemptions: int = 0
  t_first_token: float = 0.0
  t_finish: float = 0.0
  # Set by the scheduler while the answer holds a slot: moves tokens the scheduler recorded in bulk (its per-slot
  # buffers) into the lists below, so that `tokens`, `logprobs` and `versions` are always up to date when read.
  sync: Callable[[Sequence], None] | None = dataclasses.field(default=None, repr=False)

  @property
  def tokens(self) -> list[int]:
    if self.sync is not None:
      self.sync(self)
    return self._tokens

  @property
  def logprobs(self) -> list[float]:
    if self.sync is not None:
      self.sync(self)
    return self._logprobs

  @property
  def versions(self) -> list[int]:
    if self.sync is not None:
      self.sync(self)
    return self._versions

  @property
  def prompt(self) -> np.ndarray:
    return self.request.prompt_ids

  def context(self) -> np.ndarray:
    """Tokens whose keys/values a (re-)prefill computes: prompt + generated tokens except the pending last one."""
    return np.concatenate([self.prompt, np.asarray(self.tokens[:-1], np.int32)]) if self.tokens else self.prompt

  def append(self, token: int, logprob: float, version: int, *, eos_ids: frozenset[int], max_seq_len: int) -> bool:
    """Records a generated token; returns True (and sets finish_reason) if the answer is finished."""
    if not self.tokens:  # synced: the lists below hold every token so far
      self.t_first_token = time.monotonic()
    self._tokens.append(token)
    self._logprobs.append(logprob)
    self._versions.append(version)
    sp = self.request.sampling
    if token in eos_ids and not sp.ignore_eos:
      self.finish_reason = "eos"
    elif any(len(s) <= len(self.tokens) and tuple(self.tokens[-len(s):]) == s for s in sp.stop):
      self.finish_reason = "stop"
    elif len(self.tokens) >= sp.max_new_tokens or len(self.prompt) + len(self.tokens) >= max_seq_len:
      self.finish_reason = "length"
    if self.finish_reason:
      self.t_finish = time.monotonic()
    return self.finish_reason is not None

  def trajectory(self, text: str = "") -> Trajectory:
    routes = np.concatenate(self.routes)[:len(self.prompt) + len(self.tokens) - 1] if self.routes else None
    return Trajectory(
        prompt_ids=self.prompt, response_ids=np.asarray(self.tokens, np.int32),
        logprobs=np.asarray(self.logprobs, np.float32), versions=np.asarray(self.versions, np.int32),
        finish_reason=self.finish_reason, group_id=self.request.group_id, response_text=text,
        t_submit=self.t_submit, t_first_token=self.t_first_token, t_finish=self.t_finish, routes=routes)
