"""Agentic RL: agents written against the OpenAI API, trained unchanged (`agent`: the interface and its config;
`runner`: episodes on the training sampler, recorded token for token; `episodes`: completions to trajectories;
`demonstrations`: chat transcripts to warm-start examples; `calculator`: the bundled agent task).

`EpisodeRunner` and `EpisodeResult` load the HTTP stack (FastAPI, the OpenAI client) on first use, so a config that
names an agent loads without it."""

from areal_jax.agents.agent import AgentConfig, demonstrator, load
from areal_jax.agents.demonstrations import demonstration_episodes, demonstration_pairs
from areal_jax.agents.episodes import Completion, assign_rewards, to_trajectories

_LAZY = {"EpisodeResult", "EpisodeRunner"}  # from agents.runner

__all__ = ["AgentConfig", "Completion", "EpisodeResult", "EpisodeRunner", "assign_rewards", "demonstration_episodes",
           "demonstration_pairs", "demonstrator", "load", "to_trajectories"]


def __getattr__(name: str):
  if name in _LAZY:
    from areal_jax.agents import runner  # pylint: disable=import-outside-toplevel
    return getattr(runner, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
