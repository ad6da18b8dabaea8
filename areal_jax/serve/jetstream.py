"""A policy behind JetStream's own gRPC server (`jetstream.core.server_lib`), so that JetStream's clients and
benchmarks (`jetstream/tools/requester.py`, `benchmarks/benchmark_serving.py`) run against a trained policy:
`tools/serve.py --api=jetstream`.

    server = build("gs://bucket/run", port=9000)   # JetStream's server, started, over this project's engine
    server.wait_for_termination()

JetStream is not a dependency: install it (`pip install --no-deps google-jetstream==0.2.2`, or its GitHub head) to use
this. `import_jetstream` says what the 0.2.2 release needs on this JAX, given only to JetStream's own modules. The
engine speaks the installed JetStream's API: the head's is `sampler.jetstream.JetStreamEngine`'s, 0.2.2's is
`EngineApi022` here (see `sampler/jetstream.py`); the page pool holds every slot at full length, since JetStream's
orchestrator cannot preempt an answer. A request JetStream's prefill thread would fail on (a text the tokenizer cannot encode, a token id
outside the vocabulary) is refused with INVALID_ARGUMENT before it reaches JetStream's Driver, which would otherwise
kill the server; at the head, requests for several samples are served (`multi_sampling`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
import sys
import types

import grpc
import jax
import numpy as np

from areal_jax.sampler import jetstream as api
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.engine_api import pack_result
from areal_jax.serve import policy
from areal_jax.sharding import make_mesh
from areal_jax.tokenizer import load_tokenizer

_log = logging.getLogger(__name__)


class EngineApi022(api.JetStreamEngine):
  """The engine as `google-jetstream` 0.2.2 (PyPI) drives it: `prefill` returns the prefix alone, the first answer
  token comes out of the next `generate` (its log_prob NaN: the prefill kept it on the device), and slots are never
  freed (an insert replaces the answer in a slot)."""

  frees_slots = False

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self._unreported: dict[int, int] = {}  # slot -> its first token, which the next `generate` reports

  def prefill(self, **kwargs):
    prefix, _ = super().prefill(**kwargs)
    return prefix

  def bulk_insert(self, prefix, decode_state, slots):
    decode_state = super().bulk_insert(prefix, decode_state, slots)
    first = np.asarray(prefix.first)[np.asarray(prefix.draw_index)[0]]
    self._unreported.update({slot: int(first[i]) for i, slot in enumerate(slots)})
    return decode_state

  def generate(self, params, decode_state, sampler=None):
    if sampler is not None:
      return super().generate(params, decode_state, sampler=sampler)  # refused there, naming it
    held = sorted(self._unreported)
    decode_state, tokens, valid, lengths, log_prob = self.generate_one(params, decode_state, hold=held)
    if held:
      tokens = tokens.at[np.array(held)].set(np.array([self._unreported.pop(s) for s in held], np.int32))
      log_prob = log_prob.at[np.array(held)].set(np.nan)
      valid[held] = True
    return decode_state, pack_result(tokens[:, None], valid[:, None].astype(np.int32), lengths, log_prob[:, None])


class _JaxWithTreeMap:
  """`jax` as JetStream 0.2.2's orchestrator calls it: with `jax.tree_map`, removed in JAX 0.6 (it deletes each
  inserted prefix with it). Given to that module alone; `jax` itself is not changed."""

  tree_map = staticmethod(jax.tree.map)

  def __getattr__(self, name):
    return getattr(jax, name)


@contextlib.contextmanager
def _seqio_stand_in():
  """JetStream imports seqio at module level for its own SentencePiece vocabularies, which an engine that brings its
  own tokenizer never uses; seqio pulls in TensorFlow. Where it is not installed, an empty stand-in
  (`Vocabulary`, `SentencePieceVocabulary`: classes nothing instantiates) is importable for the duration of the
  import of JetStream's modules, and taken out of `sys.modules` after."""
  if "seqio" in sys.modules or importlib.util.find_spec("seqio") is not None:
    yield
    return
  vocabularies = types.ModuleType("seqio.vocabularies")
  vocabularies.Vocabulary = type("Vocabulary", (), {})
  vocabularies.SentencePieceVocabulary = type("SentencePieceVocabulary", (vocabularies.Vocabulary,), {})
  seqio = types.ModuleType("seqio")
  seqio.vocabularies = vocabularies
  sys.modules.update({"seqio": seqio, "seqio.vocabularies": vocabularies})
  try:
    yield
  finally:
    for name in ("seqio", "seqio.vocabularies"):
      sys.modules.pop(name, None)


def import_jetstream():
  """JetStream's `config_lib`, `server_lib` and `orchestrator`, imported so that the PyPI release (0.2.2) runs on
  this JAX (`_seqio_stand_in`, `_JaxWithTreeMap`). The orchestrator sets the root logger to DEBUG with a handler on
  stdout when imported; both are put back."""
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  try:
    with _seqio_stand_in():
      from jetstream.core import config_lib, orchestrator, server_lib  # pylint: disable=g-import-not-at-top
  finally:
    root.setLevel(level)
    root.handlers[:] = handlers
  if not hasattr(jax, "tree_map") and "tree_map(" in inspect.getsource(orchestrator):
    orchestrator.jax = _JaxWithTreeMap()
  return config_lib, server_lib, orchestrator


def request_problem(request, tokenizer, vocab_size: int) -> str | None:
  """Why a `DecodeRequest` cannot be served (None: it can): a text the tokenizer cannot encode, a token id outside
  the vocabulary. JetStream's prefill thread would raise on it, and its Driver then kills the whole server."""
  if request.HasField("text_content"):
    try:
      tokenizer.encode(request.text_content.text)
    except Exception as e:  # pylint: disable=broad-except  # each tokenizer raises its own kind
      return f"text_content.text: {e}"
  elif request.HasField("token_content"):
    bad = [t for t in request.token_content.token_ids if not 0 <= t < vocab_size]
    if bad:
      return f"token_content.token_ids: {bad[0]} is outside the vocabulary [0, {vocab_size})"
  return None


def _checked_orchestrator(orchestrator, tokenizer, vocab_size: int):
  """JetStream's `LLMOrchestrator` with its `Decode` refusing what `request_problem` finds (INVALID_ARGUMENT) before
  the request reaches the Driver; every other request goes to JetStream's own `Decode`."""

  class CheckedOrchestrator(orchestrator.LLMOrchestrator):

    async def Decode(self, request, context=None):  # pylint: disable=invalid-name  # JetStream's RPC name
      problem = request_problem(request, tokenizer, vocab_size)
      if problem is not None:
        _log.warning("refused a Decode request: %s", problem)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
      async for response in super().Decode(request, context):
        yield response

  return CheckedOrchestrator


def build(checkpoint_dir: str, *, step: str = "latest", tokenizer: str | None = None, dtype: str = "",
          port: int = 9000, max_seq_len: int | None = None, num_slots: int = 64, page_size: int = 16,
          decode_steps: int = 8, devices: list[jax.Device] | None = None, disaggregated: bool = False,
          threads: int | None = None):
  """JetStream's gRPC server on `port`, started, over engines for `checkpoint_dir` (see `policy.describe`; the other
  arguments as for `areal_jax.serve.build`). Interleaved (prefill and generate share one engine on `devices`,
  default all), or `disaggregated`: a prefill engine on the first half of the devices, a generate engine on the
  second, prefixes moved between them by JetStream's transfer thread. Returns JetStream's `JetStreamServer`."""
  config_lib, server_lib, orchestrator = import_jetstream()
  version = api.installed_api()
  engine_class = EngineApi022 if version == "0.2" else api.JetStreamEngine
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
    return engine_class(model=model, config=cfg, mesh=mesh, tokenizer=tokenizer,
                        params_loader=lambda engine: policy.load_params(source, engine.core))

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
  # JetStream's server builds its servicer from `orchestrator.LLMOrchestrator`: the checked one, for this call only.
  multi = {"multi_sampling": True} if version != "0.2" else {}  # the head serves num_samples > 1 only so
  theirs = orchestrator.LLMOrchestrator
  orchestrator.LLMOrchestrator = _checked_orchestrator(orchestrator, tok, source.model_cfg.vocab_size)
  try:
    return server_lib.run(port=port, config=config, devices=devices, threads=threads, **multi)
  finally:
    orchestrator.LLMOrchestrator = theirs
