"""An agent's episode as training data: its completions, as the sampler drew them, become trajectories with rewards.

    rewards = assign_rewards(completions, reward, discount=0.9)  # one per completion
    trajs = to_trajectories(completions, rewards, group_id=7)

Rewards follow AReaL's rule (its `apply_reward_discount`): an episode's reward (a number) belongs to its last
completion, a dict gives rewards by response id (unset ones are 0), and then, from the last completion back, each
earlier one adds the next one's reward times `agent.turn_discount`.

Merging: when a completion's prompt extends the previous completion's prompt and answer token for token (the chat
template rendered the history back as it was drawn), the two become one sequence whose loss mask covers only the
policy's tokens (the tool outputs and user turns between them are context). Otherwise each completion is a sequence
of its own. A merged sequence takes the reward of its last completion.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from areal_jax.types import Trajectory


@dataclasses.dataclass(frozen=True, kw_only=True)
class Completion:
  """One answer an agent received: the prompt's token ids (the chat template's rendering) and the answer's tokens,
  behaviour logprobs and policy versions as drawn (through a stop string that cut it)."""

  response_id: str
  prompt_ids: np.ndarray  # int32 [P]
  tokens: np.ndarray  # int32 [R]
  logprobs: np.ndarray  # float32 [R]
  versions: np.ndarray  # int32 [R]
  finish_reason: str
  text: str = ""


def assign_rewards(completions: list[Completion], reward, discount: float) -> list[float]:
  """One reward per completion (see the module docstring). Raises TypeError / ValueError naming a bad `reward`."""
  rewards: list[float | None] = [None] * len(completions)
  if isinstance(reward, dict):
    ids = {c.response_id: i for i, c in enumerate(completions)}
    for key, value in reward.items():
      if key not in ids:
        raise ValueError(f"reward for response id {key!r}: not a completion of this episode ({sorted(ids)})")
      rewards[ids[key]] = _number(value, f"reward[{key!r}]")
  elif completions:
    rewards[-1] = _number(reward, "reward")
  out = [0.0 if r is None else r for r in rewards]
  for i in reversed(range(len(out) - 1)):
    out[i] += out[i + 1] * discount
  return out


def _number(value, what: str) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(float(value)):
    raise TypeError(f"{what}={value!r}: the agent must return a finite number (or a dict of them by response id)")
  return float(value)


def _extends(prompt: np.ndarray, history: np.ndarray) -> bool:
  return len(prompt) > len(history) and np.array_equal(prompt[:len(history)], history)


def to_trajectories(completions: list[Completion], rewards: list[float], *, group_id: int) -> list[Trajectory]:
  """The episode's training sequences, merged where the prompts allow (see the module docstring)."""
  out, parts = [], []

  def close():
    if not parts:
      return
    first = parts[0][0]
    ids, masks, lps, vers = [], [], [], []
    for c, context, _ in parts:
      last_version = vers[-1][-1] if vers else int(c.versions[0])
      ids += [context, c.tokens]
      masks += [np.zeros(len(context), np.float32), np.ones(len(c.tokens), np.float32)]
      lps += [np.zeros(len(context), np.float32), c.logprobs]
      vers += [np.full(len(context), last_version, np.int32), c.versions]
    mask = np.concatenate(masks)
    out.append(Trajectory(prompt_ids=first.prompt_ids, response_ids=np.concatenate(ids).astype(np.int32),
                          logprobs=np.concatenate(lps).astype(np.float32),
                          versions=np.concatenate(vers).astype(np.int32), finish_reason=parts[-1][0].finish_reason,
                          group_id=group_id, reward=parts[-1][2],
                          response_text="".join(c.text for c, _, _ in parts),
                          loss_mask=None if mask.all() else mask))
    parts.clear()

  history = None
  for c, r in zip(completions, rewards):
    if history is not None and _extends(c.prompt_ids, history):
      parts.append((c, c.prompt_ids[len(history):], r))
    else:
      close()
      parts.append((c, np.zeros(0, np.int32), r))
    history = np.concatenate([c.prompt_ids, c.tokens])
  close()
  return out
