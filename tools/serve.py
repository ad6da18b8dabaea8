r"""Serves a policy over HTTP with OpenAI-compatible `/v1/completions`, `/v1/chat/completions` and `/v1/responses`,
and Anthropic's `/v1/messages` (per-token logprobs and the policy version in every response); all requests share the
sampler's continuous batch.

  # the latest checkpoint of a run (local or gs://); tokenizer and cache length from the run's config.json
  python tools/serve.py --checkpoint_dir=gs://bucket/run --port=8000
  # a HF model directory
  python tools/serve.py --checkpoint_dir=/ckpt/Qwen2.5-1.5B-Instruct --max_seq_len=4096

  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
      -d '{"prompt": "1+1=", "max_tokens": 8, "temperature": 0, "logprobs": 0}'

  # JetStream's own gRPC server over the same engine (JetStream installed: see `areal_jax.serve.jetstream`)
  python tools/serve.py --checkpoint_dir=gs://bucket/run --api=jetstream --port=9000

See `areal_jax.serve` for the fields served and the errors returned.
"""

import os

from absl import app, flags

from areal_jax.serve import build

_DIR = flags.DEFINE_string("checkpoint_dir", None, "Run directory, its checkpoints/ directory, an Orbax policy "
                           "directory or a local HF model directory; local or gs://.", required=True)
_STEP = flags.DEFINE_string("step", "latest", "'latest' or a step number of a run's checkpoints.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
_KEY = flags.DEFINE_string("api_key", None, "Key every request but /health must carry, as a bearer token (OpenAI "
                           "clients send their api_key so) or x-api-key (Anthropic's); default $AREAL_JAX_API_KEY, "
                           "which other users cannot read off the command line. Unset: no authentication.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on (0: any free port, logged).")
_NAME = flags.DEFINE_string("model_name", None, "Model id served (default: the directory's name, @step for a run).")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "Tokenizer spec (default: the run's; a HF directory's own).")
_DTYPE = flags.DEFINE_string("dtype", "", "Compute dtype for a model directory (default float32).")
_QUEUE = flags.DEFINE_integer("max_queue", 256, "Requests that may wait for a decode slot; more get HTTP 429.")
_SEQ = flags.DEFINE_integer("max_seq_len", None, "Prompt + answer tokens per sequence (default: the run's "
                            "sampler.max_seq_len, else the model's context up to 4096).")
_SLOTS = flags.DEFINE_integer("num_slots", 64, "Answers decoded at once.")
_PAGE = flags.DEFINE_integer("page_size", 16, "KV cache page size.")
_PAGES = flags.DEFINE_integer("num_pages", 0, "KV cache pages over the mesh (0: fill --memory_fraction).")
_MEM = flags.DEFINE_float("memory_fraction", 0.8, "Share of free device memory for the KV cache.")
_STEPS = flags.DEFINE_integer("decode_steps", 8, "Decode steps per device call.")
_TP = flags.DEFINE_integer("tensor_parallel", 1, "Tensor-parallel degree of the sampling mesh.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Compile every sampler program before serving.")
_API = flags.DEFINE_enum("api", "openai", ["openai", "jetstream"], "openai: this project's OpenAI-compatible HTTP "
                         "server; jetstream: JetStream's gRPC server (its Driver) over the same engine.")
_DISAGG = flags.DEFINE_bool("jetstream_disaggregated", False, "--api=jetstream: prefill on the first half of the "
                            "devices, generate on the second (default: both on all devices, interleaved).")
_CACHE = flags.DEFINE_string("compilation_cache_dir", "", "A persistent XLA compilation cache (local or gs://): a "
                             "restart with the same model and sizing loads the programs instead of compiling them.")


def main(argv):
  del argv
  if _CACHE.value:
    import jax  # pylint: disable=g-import-not-at-top  # after areal_jax: it picks the backend before JAX loads

    jax.config.update("jax_compilation_cache_dir", _CACHE.value)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
  if _API.value == "jetstream":
    from areal_jax.serve import jetstream  # pylint: disable=g-import-not-at-top  # JetStream is optional
    jetstream.build(_DIR.value, step=_STEP.value, tokenizer=_TOKENIZER.value, dtype=_DTYPE.value, port=_PORT.value,
                    max_seq_len=_SEQ.value, num_slots=_SLOTS.value, page_size=_PAGE.value,
                    decode_steps=_STEPS.value, disaggregated=_DISAGG.value).wait_for_termination()
    return
  build(_DIR.value, step=_STEP.value, tokenizer=_TOKENIZER.value, dtype=_DTYPE.value, model_name=_NAME.value,
        host=_HOST.value, port=_PORT.value, max_queue=_QUEUE.value, max_seq_len=_SEQ.value, num_slots=_SLOTS.value,
        page_size=_PAGE.value, num_pages=_PAGES.value, memory_fraction=_MEM.value, decode_steps=_STEPS.value,
        tensor_parallel=_TP.value, warmup=_WARMUP.value,
        api_key=_KEY.value or os.environ.get("AREAL_JAX_API_KEY")).serve_forever()


if __name__ == "__main__":
  app.run(main)
