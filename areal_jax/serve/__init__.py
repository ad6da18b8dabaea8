"""Serving a policy over HTTP the way agent code expects: OpenAI-compatible `/v1/completions` and
`/v1/chat/completions` (streaming, tools, top alternatives, echo) with per-token logprobs and the policy version,
backed by the continuous-batching sampler (every request shares one decode batch).

    server = build("gs://bucket/run", port=8000)  # a run's latest checkpoint, an Orbax policy or a HF directory
    server.serve_forever()

`backend` runs the scheduler in one thread; `openai_api` checks requests and shapes responses, `streaming` shapes
streamed chunks, `tool_calls` parses the model's tool calls, `scoring` gives top alternatives and echoed prompts'
logprobs; `server` has the routes and uvicorn; `policy` reads the checkpoint. `tools/serve.py` is the command line.
"""

from areal_jax.serve.backend import Backend, QueueFull
from areal_jax.serve.openai_api import ApiError
from areal_jax.serve.server import PolicyServer, build, create_app

__all__ = ["ApiError", "Backend", "PolicyServer", "QueueFull", "build", "create_app"]
