"""Critic-free advantages (paper default): γ = λ = 1, one shaped reward per answer broadcast over its tokens.

A reward r ∈ [0, 1] becomes `(r - 0.5) * 2 * scale` (±scale for a binary verifier; the paper uses ±5), then is
normalised by the mean and standard deviation of its prompt group ("group") or of the whole batch ("batch"), or left
as is ("none"). Statistics are over answers: each answer counts once, whatever its length. Groups whose answers all
score the same carry no learning signal under group normalisation and can be filtered out first.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ADV_NORMS = ("group", "batch", "none")


def shape_rewards(rewards: np.ndarray, scale: float) -> np.ndarray:
  """Maps verifier scores in [0, 1] to [-scale, scale]."""
  return (np.asarray(rewards, np.float64) - 0.5) * 2.0 * scale


def uniform_group_mask(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
  """[N] bool: True for answers whose group has at least two distinct rewards (the ones worth training on)."""
  rewards, group_ids = np.asarray(rewards), np.asarray(group_ids)
  keep = np.zeros(len(rewards), bool)
  for g in np.unique(group_ids):
    sel = group_ids == g
    keep[sel] = np.ptp(rewards[sel]) > 0
  return keep


def sequence_advantages(rewards: np.ndarray, group_ids: np.ndarray, *, scale: float, norm: str,
                        eps: float = 1e-5) -> np.ndarray:
  """[N] float32 advantage of each answer: shaped reward, normalised per `norm` (group | batch | none)."""
  a = shape_rewards(rewards, scale)
  group_ids = np.asarray(group_ids)
  if norm == "none":
    return a.astype(np.float32)
  if norm == "batch":
    return ((a - a.mean()) / (a.std() + eps)).astype(np.float32)
  if norm != "group":
    raise ValueError(f"adv_norm={norm!r}: choose one of {ADV_NORMS}")
  out = np.empty_like(a)
  for g in np.unique(group_ids):
    sel = group_ids == g
    out[sel] = (a[sel] - a[sel].mean()) / (a[sel].std() + eps)
  return out.astype(np.float32)


def token_advantages(seq_advantages: np.ndarray, response_lengths: Sequence[int]) -> list[np.ndarray]:
  """γ = λ = 1 with the reward at the last token: every response token's advantage is its answer's."""
  return [np.full(n, a, np.float32) for a, n in zip(seq_advantages, response_lengths)]
