"""The learner's hyperparameters as one frozen, validated record (from the config's `learner` group)."""

from __future__ import annotations

import dataclasses

from areal_jax.learner.advantages import ADV_NORMS
from areal_jax.learner import objectives
from areal_jax.learner.ppo import KL_ESTIMATORS, Rejection

# How token losses become a minibatch's loss: token-mean (Σ ℓ / Σ tokens: AReaL, the paper), seq-mean-token-mean
# (the mean over sequences of each sequence's token mean: GRPO), seq-mean-token-sum-norm (the mean over sequences of
# each sequence's token sum / loss_agg_max_tokens: Dr. GRPO).
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# Where the decoupled loss's proximal logprobs come from: a forward pass with the step's starting parameters
# (recompute), or interpolated from the behaviour and current logprobs by the tokens' versions (loglinear; AReaL's
# approximation, one forward pass fewer per step; see `ppo.loglinear_alpha`).
PROX_LOGP_METHODS = ("recompute", "loglinear")
# Fields whose 0 means off, passed to an objective as None.
OFF_AS_NONE = ("eps_clip_higher", "c_clip")
# learner.critic: "" = critic-free (the paper's), "copy" = a value model copied from the policy, "lora" = a LoRA
# branch of a LoRA policy (its base shared) with a value head (learner/critic.py).
CRITICS = ("", "copy", "lora")


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
  loss: str = "ppo"  # the policy objective (`objectives.OBJECTIVES`); its parameters: `objective_kwargs`
  eps_clip: float = 0.2
  eps_clip_higher: float = 0.0
  c_clip: float = 0.0
  behav_imp_weight_cap: float = 0.0
  rejection: Rejection | None = None  # off-policy correction of the behaviour weights (`ppo.Rejection`); None = off
  importance_sampling_level: str = "token"  # ppo / sapo: "sequence" is GSPO's sequence-level ratio
  tau_pos: float = 1.0  # sapo: gate temperature where A > 0
  tau_neg: float = 1.05  # sapo: gate temperature where A < 0
  m2_threshold: float = 0.0  # M2PO: mask tokens of largest (log pi_behav - log pi_prox)^2 per minibatch; 0 = off
  use_decoupled_loss: bool = True
  prox_logp_method: str = "recompute"
  ppo_n_minibatches: int = 4
  max_tokens_per_mb: int = 32768
  min_bucket: int = 128
  vocab_chunk: int = 8192  # vocabulary entries per chunk of the output projection; 0 = all at once
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0
  aux_loss_coef: float = 0.001  # a mixture-of-experts model's load-balancing loss (HF's router_aux_loss_coef)
  routing_replay: bool = False  # proximal and training passes route as the sampler did (`Trajectory.routes`)
  reward_scale: float = 5.0
  adv_norm: str = "group"
  filter_uniform_groups: bool = True
  loss_agg: str = "token-mean"
  loss_agg_max_tokens: int = 0  # the constant of seq-mean-token-sum-norm; 0 = the sampler's max_new_tokens
  critic: str = ""  # CRITICS; with a critic, advantages are GAE's
  gae_gamma: float = 1.0
  gae_lambda: float = 1.0
  value_clip: float = 0.2  # the value loss's clip around the step's starting values
  critic_lr: float = 0.0  # 0 = lr
  # Parameters of registered objectives that no field above names ({name: value}; in the config, `learner.<name>`).
  objective_params: dict = dataclasses.field(default_factory=dict, hash=False)

  def __post_init__(self):
    def bad(field, why):
      raise ValueError(f"learner.{field}={getattr(self, field)!r}: {why}")

    for f in ("lr", "eps_clip", "ppo_n_minibatches", "max_tokens_per_mb", "min_bucket", "adam_eps"):
      if getattr(self, f) <= 0:
        bad(f, "must be positive")
    for f in ("weight_decay", "grad_clip", "warmup_steps", "eps_clip_higher", "behav_imp_weight_cap", "kl_coef",
              "entropy_coef", "vocab_chunk", "m2_threshold"):
      if getattr(self, f) < 0:
        bad(f, "must be >= 0")
    if self.c_clip and self.c_clip <= 1.0:
      bad("c_clip", "the dual clip must be > 1 (or 0 = off)")
    if self.eps_clip > 1.0:
      bad("eps_clip", "must be <= 1 (1: no lower bound on the ratio)")
    if self.loss not in objectives.OBJECTIVES:
      bad("loss", f"choose one of {sorted(objectives.OBJECTIVES)}")
    if self.importance_sampling_level not in objectives.IS_LEVELS:
      bad("importance_sampling_level", f"choose one of {objectives.IS_LEVELS}")
    for f in ("tau_pos", "tau_neg"):
      if getattr(self, f) <= 0:
        bad(f, "SAPO's gate temperatures must be positive")
    declared, fields = objectives.declared_params(), {f.name for f in dataclasses.fields(self)}
    for name in self.objective_params:
      if name in fields:
        bad("objective_params", f"sets {name!r}, a field of its own: set learner.{name}")
      if name not in declared:
        bad("objective_params", f"no registered objective takes {name!r}; they take {sorted(declared)}")
    if self.use_decoupled_loss and not objectives.OBJECTIVES[self.loss].decoupled:
      bad("loss", "does not compose with the decoupled loss (AReaL refuses it too); set "
          "learner.use_decoupled_loss=False")
    if self.m2_threshold:
      if not self.recompute_proximal:
        bad("m2_threshold", "masks by the proximal pass's logprobs; needs learner.use_decoupled_loss=True and "
            "learner.prox_logp_method='recompute'")
      if self.loss_agg != "token-mean":
        bad("m2_threshold", f"renormalises the token mean over the tokens it keeps; needs learner.loss_agg="
            f"'token-mean', not {self.loss_agg!r}")
    if self.kl_estimator not in KL_ESTIMATORS:
      bad("kl_estimator", f"choose one of {KL_ESTIMATORS}")
    if self.adv_norm not in ADV_NORMS:
      bad("adv_norm", f"choose one of {ADV_NORMS}")
    if self.loss_agg not in LOSS_AGGS:
      bad("loss_agg", f"choose one of {LOSS_AGGS}")
    if self.loss_agg_max_tokens < 0:
      bad("loss_agg_max_tokens", "must be >= 0")
    if self.rejection is not None:
      if self.behav_imp_weight_cap:
        bad("behav_imp_weight_cap", "is token-level rejection by ratio; set it or learner.rejection, not both")
      if not self.use_decoupled_loss:
        raise ValueError("learner.rejection corrects the decoupled loss's behaviour weights; needs "
                         "learner.use_decoupled_loss=True")
    if self.critic not in CRITICS:
      bad("critic", f"choose one of {CRITICS}")
    for f in ("gae_gamma", "gae_lambda"):
      if not 0 <= getattr(self, f) <= 1:
        bad(f, "must lie in [0, 1]")
    if self.value_clip <= 0:
      bad("value_clip", "must be positive")
    if self.critic_lr < 0:
      bad("critic_lr", "must be >= 0 (0 = learner.lr)")
    if self.prox_logp_method not in PROX_LOGP_METHODS:
      bad("prox_logp_method", f"choose one of {PROX_LOGP_METHODS}")
    if self.prox_logp_method == "loglinear" and not self.use_decoupled_loss:
      bad("prox_logp_method", "approximates the decoupled loss's proximal logprobs; needs "
          "learner.use_decoupled_loss=True")

  @property
  def recompute_proximal(self) -> bool:
    """Whether a step runs the forward pass for proximal logprobs."""
    return self.use_decoupled_loss and self.prox_logp_method == "recompute"

  @property
  def loglinear_proximal(self) -> bool:
    return self.use_decoupled_loss and self.prox_logp_method == "loglinear"

  @property
  def objective_kwargs(self) -> dict:
    """The chosen objective's keyword arguments, read by the names it declares (`objectives.register`): the field of
    that name (0 = off becomes None for `eps_clip_higher` and `c_clip`), else `objective_params`' entry, else the
    objective's own default."""
    fields = {f.name for f in dataclasses.fields(self)} - {"objective_params"}
    out = {}
    for name in objectives.OBJECTIVES[self.loss].params:
      if name in fields:
        value = getattr(self, name)
        out[name] = (value or None) if name in OFF_AS_NONE else value
      elif name in self.objective_params:
        out[name] = self.objective_params[name]
    return out

  @classmethod
  def from_config(cls, c, *, max_new_tokens: int = 0) -> LearnerConfig:
    """From the `learner` group of an ml_collections config; unknown keys raise. A registered objective's parameter
    that no field names (`learner.beta`) goes into `objective_params`. `max_new_tokens` (the sampler's) stands in for
    `loss_agg_max_tokens=0`. The `lora` group shapes the model (`ModelConfig.with_lora`)."""
    names = {f.name for f in dataclasses.fields(cls)} - {"objective_params"}
    declared = set(objectives.declared_params()) - names
    unknown = sorted(set(c.keys()) - names - declared - {"lora"})
    if unknown:
      raise ValueError(f"unknown learner config keys {unknown}; known: {sorted(names | declared | {'lora'})}")
    fields = {k: v for k, v in c.items() if k in names}
    fields["objective_params"] = {k: v for k, v in c.items() if k in declared}
    if "rejection" in fields:  # a group whose level "" is off
      group = dict(fields["rejection"].items())
      try:
        fields["rejection"] = Rejection(**group) if group.get("level") else None
      except (TypeError, ValueError) as e:
        raise ValueError(f"learner.{str(e).replace('rejection ', 'rejection.')}") from None
    out = cls(**fields)
    return out.replace(loss_agg_max_tokens=out.loss_agg_max_tokens or max_new_tokens)

  def loss_weighting(self, response_lengths) -> tuple[list[float], float]:
    """(weight of each sequence's loss tokens, denominator) of one minibatch under `loss_agg`: its loss is
    Σ_i weight_i · Σ_t ℓ_it / denominator, computed on the host so micro-batches and data shards add up exactly."""
    n = len(response_lengths)
    if self.loss_agg == "token-mean":
      return [1.0] * n, float(sum(response_lengths))
    if self.loss_agg == "seq-mean-token-mean":
      return [1.0 / r for r in response_lengths], float(n)
    if not self.loss_agg_max_tokens:
      raise ValueError("learner.loss_agg='seq-mean-token-sum-norm' needs learner.loss_agg_max_tokens > 0")
    return [1.0] * n, float(n * self.loss_agg_max_tokens)

  def replace(self, **kw) -> LearnerConfig:
    return dataclasses.replace(self, **kw)

  @property
  def rejection_rule(self) -> Rejection | None:
    """The off-policy correction of the behaviour weights: `rejection`, or `behav_imp_weight_cap` as token-level
    masking by ratio."""
    if self.behav_imp_weight_cap:
      return Rejection(upper=self.behav_imp_weight_cap)
    return self.rejection
