"""The learner's hyperparameters as one frozen, validated record (from the config's `learner` group)."""

from __future__ import annotations

import dataclasses

from areal_jax.learner.advantages import ADV_NORMS
from areal_jax.learner.ppo import KL_ESTIMATORS


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerConfig:
  """Field meanings as in configs/math.py; 0 switches off `eps_clip_higher`, `c_clip` and `behav_imp_weight_cap`."""

  lr: float = 2e-5
  weight_decay: float = 0.05
  b1: float = 0.9
  b2: float = 0.95
  adam_eps: float = 1e-5
  grad_clip: float = 1.0
  warmup_steps: int = 0  # learner steps (each `ppo_n_minibatches` optimizer updates) of linear warmup
  eps_clip: float = 0.2
  eps_clip_higher: float = 0.0
  c_clip: float = 0.0
  behav_imp_weight_cap: float = 0.0
  use_decoupled_loss: bool = True
  ppo_n_minibatches: int = 4
  max_tokens_per_mb: int = 32768
  min_bucket: int = 128
  logits_chunk: int = 4096
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0
  reward_scale: float = 5.0
  adv_norm: str = "group"
  filter_uniform_groups: bool = True

  def __post_init__(self):
    def bad(field, why):
      raise ValueError(f"learner.{field}={getattr(self, field)!r}: {why}")

    for f in ("lr", "eps_clip", "ppo_n_minibatches", "max_tokens_per_mb", "min_bucket", "adam_eps"):
      if getattr(self, f) <= 0:
        bad(f, "must be positive")
    for f in ("weight_decay", "grad_clip", "warmup_steps", "eps_clip_higher", "behav_imp_weight_cap", "kl_coef",
              "entropy_coef", "logits_chunk"):
      if getattr(self, f) < 0:
        bad(f, "must be >= 0")
    if self.c_clip and self.c_clip <= 1.0:
      bad("c_clip", "the dual clip must be > 1 (or 0 = off)")
    if self.eps_clip >= 1.0:
      bad("eps_clip", "must be < 1")
    if self.kl_estimator not in KL_ESTIMATORS:
      bad("kl_estimator", f"choose one of {KL_ESTIMATORS}")
    if self.adv_norm not in ADV_NORMS:
      bad("adv_norm", f"choose one of {ADV_NORMS}")

  @classmethod
  def from_config(cls, c) -> LearnerConfig:
    """From the `learner` group of an ml_collections config; unknown keys raise."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(c.keys()) - names)
    if unknown:
      raise ValueError(f"unknown learner config keys {unknown}; known: {sorted(names)}")
    return cls(**dict(c.items()))

  def replace(self, **kw) -> LearnerConfig:
    return dataclasses.replace(self, **kw)

  @property
  def loss_kwargs(self) -> dict[str, float | None]:
    """Keyword arguments of `decoupled_ppo_loss` (0 = off becomes None)."""
    return dict(eps_clip=self.eps_clip, eps_clip_higher=self.eps_clip_higher or None,
                behav_imp_weight_cap=self.behav_imp_weight_cap or None, c_clip=self.c_clip or None)
