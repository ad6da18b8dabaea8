"""The sampler: a JetStream-style engine over a paged KV cache, continuous batching, interruptible weight updates.

`generate(model, prompts, ...)` for users and evaluation; `Engine` (the device side over a `SlotTable` of host slot
state), `Scheduler` (continuous batching on the host) and `Sampler` (the loop that drives it: requests in, futures of
answers out, weights swappable; what the run, a sampler process, the server and the simulator hold) for the system; `jetstream.JetStreamEngine`, JetStream's engine contract (`engine_api`) over an `Engine`.
"""

from areal_jax.sampler.api import Completion, generate
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.engine import Draws, Engine
from areal_jax.sampler import engine_api
from areal_jax.sampler.engine_api import ResultTokens
from areal_jax.sampler.paging import PagePool, PoolExhausted
from areal_jax.sampler.requests import Request, SamplingParams
from areal_jax.sampler.sampler import QueueFull, Sampler, Tokens
from areal_jax.sampler.scheduler import Scheduler
from areal_jax.sampler.slots import Placement, SlotTable
from areal_jax.sampler.state import DecodeState, Prefix

__all__ = ["Completion", "DecodeState", "Draws", "Engine", "PagePool", "Placement", "PoolExhausted", "Prefix",
           "QueueFull", "Request", "ResultTokens", "Sampler", "SamplerConfig", "SamplingParams", "Scheduler",
           "SlotTable", "Tokens", "engine_api", "generate"]
