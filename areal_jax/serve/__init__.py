"""Serving a policy over HTTP the way agent code expects: OpenAI-compatible `/v1/completions`,
`/v1/chat/completions` (streaming, tools, top alternatives, echo) and `/v1/responses`, and Anthropic's `/v1/messages`,
with per-token logprobs and the policy version, backed by the continuous-batching sampler (every request shares one
decode batch).

    server = build("gs://bucket/run", port=8000)  # a run's latest checkpoint, an Orbax policy or a HF directory
    server.serve_forever()

A `sampler.Sampler` runs the scheduler; `openai_api` checks requests and shapes responses, `responses_api` and
`messages_api` translate the other two APIs to chat requests and shape their answers, `streaming` shapes streamed
events, `tool_calls` parses the model's tool calls (`sampler.scoring` gives top alternatives and echoed
prompts' logprobs); `server` has the routes and uvicorn; `policy` reads the checkpoint. `tools/serve.py` is the command line.
The names below load on first use: importing `serve.tool_calls` (the agents' warm-start does) loads no HTTP stack.
"""

import importlib

_WHERE = {"ApiError": "openai_api", "PolicyServer": "server", "build": "server", "create_app": "server"}

__all__ = ["ApiError", "PolicyServer", "build", "create_app"]


def __getattr__(name: str):
  if name in _WHERE:
    return getattr(importlib.import_module(f"areal_jax.serve.{_WHERE[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
