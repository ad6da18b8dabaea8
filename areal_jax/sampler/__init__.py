"""The sampler: a JetStream-style engine over a paged KV cache, continuous batching, interruptible weight updates.

`generate(model, prompts, ...)` for users and evaluation; `Engine` (JetStream Engine API), `Scheduler` (continuous
batching on the host) and `SamplerLoop` (the background thread the RL controller talks to) for the system.
"""

from areal_jax.sampler.api import Completion, generate
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.loop import SamplerLoop
from areal_jax.sampler.paging import PagePool, PoolExhausted
from areal_jax.sampler.requests import Request, SamplingParams
from areal_jax.sampler.scheduler import Scheduler
from areal_jax.sampler.state import DecodeState, Prefix, ResultTokens

__all__ = ["Completion", "DecodeState", "Engine", "PagePool", "PoolExhausted", "Prefix", "Request", "ResultTokens",
           "SamplerConfig", "SamplerLoop", "SamplingParams", "Scheduler", "generate"]
