"""Agentic RL: agents written against the OpenAI API, trained unchanged (`agent`: the interface and its config;
`runner`: episodes on the training sampler, recorded token for token; `episodes`: completions to trajectories;
`demonstrations`: chat transcripts to warm-start examples; `calculator`: the bundled agent task)."""

from areal_jax.agents.agent import AgentConfig, demonstrator, load
from areal_jax.agents.demonstrations import demonstration_episodes, demonstration_pairs
from areal_jax.agents.episodes import Completion, assign_rewards, to_trajectories
from areal_jax.agents.runner import EpisodeResult, EpisodeRunner

__all__ = ["AgentConfig", "Completion", "EpisodeResult", "EpisodeRunner", "assign_rewards", "demonstration_episodes",
           "demonstration_pairs", "demonstrator", "load", "to_trajectories"]
