"""A policy behind JetStream's own gRPC server (`jetstream.core.server_lib`), so that JetStream's clients and
benchmarks (`jetstream/tools/requester.py`, `benchmarks/benchmark_serving.py`) run against a trained policy:
`tools/serve.py --api=jetstream`.

    server = build("gs://bucket/run", port=9000)   # JetStream's server, started, over this project's engine
    server.wait_for_termination()

JetStream is not a dependency: install it (`pip install --no-deps google-jetstream==0.2.2`, or its GitHub head) to use
this. `import_jetstream` says what the 0.2.2 release needs on this JAX. The engine speaks the installed JetStream's API
(`sampler/jetstream.py`); its page pool holds every slot at full length, since JetStream's orchestrator cannot
preempt an answer.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types

import jax

from areal_jax.sampler import jetstream as api
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.engine import Engine
from areal_jax.serve import policy
from areal_jax.sharding import make_mesh
from areal_jax.tokenizer import load_tokenizer

_log = logging.getLogger(__name__)


def import_jetstream():
  """JetStream's `config_lib` and `server_lib`, imported so that the PyPI release (0.2.2) runs on this JAX:

  * 0.2.2's orchestrator deletes each inserted prefix with `jax.tree_map`, removed in JAX 0.6: it gets `jax.tree.map`.
  * JetStream imports seqio at module level for its own SentencePiece vocabularies, which an engine that brings its
    own tokenizer never uses; seqio pulls in TensorFlow, so when it is not installed an empty stand-in module takes
    its place (`Vocabulary`, `SentencePieceVocabulary`: classes nothing instantiates).
  * The orchestrator sets the root logger to DEBUG with a handler on stdout when imported; both are put back.
  """
  if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map
  if "seqio" not in sys.modules and importlib.util.find_spec("seqio") is None:
    vocabularies = types.ModuleType("seqio.vocabularies")
    vocabularies.Vocabulary = type("Vocabulary", (), {})
    vocabularies.SentencePieceVocabulary = type("SentencePieceVocabulary", (vocabularies.Vocabulary,), {})
    seqio = types.ModuleType("seqio")
    seqio.vocabularies = vocabularies
    sys.modules.update({"seqio": seqio, "seqio.vocabularies": vocabularies})
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  try:
    from jetstream.core import config_lib, server_lib  # pylint: disable=g-import-not-at-top
  finally:
    root.setLevel(level)
    root.handlers[:] = handlers
  return config_lib, server_lib


def build(checkpoint_dir: str, *, step: str = "latest", tokenizer: str | None = None, dtype: str = "",
          port: int = 9000, max_seq_len: int | None = None, num_slots: int = 64, page_size: int = 16,
          decode_steps: int = 8, devices: list[jax.Device] | None = None, disaggregated: bool = False,
          threads: int | None = None):
  """JetStream's gRPC server on `port`, started, over engines for `checkpoint_dir` (see `policy.describe`; the other
  arguments as for `areal_jax.serve.build`). Interleaved (prefill and generate share one engine on `devices`,
  default all), or `disaggregated`: a prefill engine on the first half of the devices, a generate engine on the
  second, prefixes moved between them by JetStream's transfer thread. Returns JetStream's `JetStreamServer`."""
  config_lib, server_lib = import_jetstream()
  version = api.installed_api()
  source = policy.describe(checkpoint_dir, step=step, dtype=dtype)
  tokenizer = tokenizer or source.tokenizer
  if not tokenizer:
    raise ValueError(f"{checkpoint_dir}: no run config.json beside it to take the tokenizer from; pass --tokenizer")
  tok = load_tokenizer(tokenizer)
  seq_len = max_seq_len or source.run_sampler.get("max_seq_len") or min(source.model_cfg.max_position_embeddings, 4096)
  api.prefill_bucket(seq_len)  # a cache JetStream's prefill buckets fit, or a clear error now
  pages_per_seq = -(-seq_len // page_size)
  model = policy.abstract_model(source.model_cfg)

  def create(slice_devices):
    mesh = make_mesh(list(slice_devices), {"data": -1, "tensor": 1})
    slots = -(-num_slots // mesh.shape["data"]) * mesh.shape["data"]
    cfg = SamplerConfig(num_slots=slots, page_size=page_size, max_seq_len=seq_len, max_new_tokens=seq_len,
                        num_pages=mesh.shape["data"] * (slots // mesh.shape["data"] * pages_per_seq + 1),
                        decode_steps=decode_steps, vocab_limit=tok.vocab_size)
    return Engine(model=model, config=cfg, mesh=mesh, tokenizer=tokenizer, jetstream_api=version,
                  params_loader=lambda engine: policy.load_params(source, engine))

  devices = list(devices or jax.devices())
  name = devices[0].platform
  if disaggregated:
    if len(devices) < 2 or len(devices) % 2:
      raise ValueError(f"disaggregated serving splits the devices in two halves; {len(devices)} devices")
    half = f"{name}={len(devices) // 2}"
    config = config_lib.ServerConfig(prefill_slices=(half,), generate_slices=(half,),
                                     prefill_engine_create_fns=(create,), generate_engine_create_fns=(create,))
  else:
    config = config_lib.ServerConfig(interleaved_slices=(f"{name}={len(devices)}",),
                                     interleaved_engine_create_fns=(create,))
  _log.info("JetStream %s API: serving %s on port %d (%s)", version, source.name, port,
            "disaggregated" if disaggregated else "interleaved")
  return server_lib.run(port=port, config=config, devices=devices, threads=threads)
