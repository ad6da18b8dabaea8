"""Agentic RL: agents written against the OpenAI API, trained unchanged (`agent`: the interface and its config;
`runner`: episodes on the training sampler, recorded token for token; `episodes`: completions to trajectories)."""

from areal_jax.agents.agent import AgentConfig, load
from areal_jax.agents.episodes import Completion, assign_rewards, to_trajectories
from areal_jax.agents.runner import EpisodeResult, EpisodeRunner

__all__ = ["AgentConfig", "Completion", "EpisodeResult", "EpisodeRunner", "assign_rewards", "load",
           "to_trajectories"]
