"""Frozen records that cross thread, process or device boundaries."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trajectory:
  """One finished answer to one prompt, on the host. Produced by the sampler, scored by rewards, read by the learner."""

  prompt_ids: np.ndarray  # int32 [P]
  response_ids: np.ndarray  # int32 [R], R >= 1
  logprobs: np.ndarray  # float32 [R]: behaviour logprob of each response token (temperature-scaled logits)
  versions: np.ndarray  # int32 [R]: policy version that produced each response token
  finish_reason: str  # "eos" | "stop" | "length"
  group_id: int = 0  # the G answers of one prompt share a group id
  reward: float = 0.0  # verifier score in [0, 1]
  response_text: str = ""
  t_submit: float = 0.0  # time.monotonic() of the sampler receiving the prompt, its first token, this answer's end
  t_first_token: float = 0.0
  t_finish: float = 0.0
  # float32 [R]: 1 where the response token is the policy's, 0 where it is context inside the response (a tool's
  # output or a user turn between two turns of an agent's episode); None: every response token is the policy's.
  loss_mask: np.ndarray | None = None
  # int16 [P + R - 1, sparse layers, k]: a mixture of experts' routing of each position whose output is trained (the
  # experts the sampler used there; -1 where not recorded), for `learner.routing_replay`; None: not recorded.
  routes: np.ndarray | None = None

  @property
  def num_loss_tokens(self) -> int:
    return len(self.response_ids) if self.loss_mask is None else int(np.count_nonzero(self.loss_mask))

  @property
  def version_start(self) -> int:
    return int(self.versions[0])

  @property
  def version_end(self) -> int:
    return int(self.versions[-1])

  @property
  def num_tokens(self) -> int:
    return len(self.prompt_ids) + len(self.response_ids)

  def replace(self, **kw) -> Trajectory:
    return dataclasses.replace(self, **kw)
