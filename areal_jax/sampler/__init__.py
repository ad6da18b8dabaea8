"""The sampler: a JetStream-style engine over a paged KV cache, continuous batching, interruptible weight updates.

`generate(model, prompts, ...)` for users and evaluation; `Engine` (the device side over a `SlotTable` of host slot
state), `Scheduler` (continuous batching on the host) and `SamplerLoop` (the background thread the RL controller
talks to) for the system; `jetstream.JetStreamEngine`, JetStream's engine contract (`engine_api`) over an `Engine`.
"""

from areal_jax.sampler.api import Completion, generate
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.engine import Draws, Engine
from areal_jax.sampler import engine_api
from areal_jax.sampler.engine_api import ResultTokens
from areal_jax.sampler.loop import SamplerLoop
from areal_jax.sampler.paging import PagePool, PoolExhausted
from areal_jax.sampler.requests import Request, SamplingParams
from areal_jax.sampler.scheduler import Scheduler
from areal_jax.sampler.slots import Placement, SlotTable
from areal_jax.sampler.state import DecodeState, Prefix

__all__ = ["Completion", "DecodeState", "Draws", "Engine", "PagePool", "Placement", "PoolExhausted", "Prefix",
           "Request", "ResultTokens", "SamplerConfig", "SamplerLoop", "SamplingParams", "Scheduler", "SlotTable",
           "engine_api", "generate"]
