"""The engine under JetStream's own code: PyPI's google-jetstream 0.2.2 (installed with --no-deps by the README's test
command) serves it with its gRPC server (`server_lib.run`, which builds its `orchestrator.Driver`) to its
`jetstream_pb2_grpc` stub, interleaved and disaggregated, through `tools/serve.py --api=jetstream`'s builder; and
the contract points 0.2.2 never calls (prefill's first token, frees, multi-sampling: JetStream's GitHub head, which
CI cannot fetch) tested on the engine directly, as the head calls them.

On this JAX, 0.2.2 needs `jax.tree_map` (removed in JAX 0.6) and a stand-in for seqio (it imports it for its own
SentencePiece vocabularies, unused here; seqio pulls in TensorFlow): `areal_jax.serve.jetstream.import_jetstream`
gives both to JetStream's modules alone, and the server tests run through it. JetStream's requester
(`jetstream/tools/requester.py`) is not in the 0.2.2 wheel: the tests send its requests through the same stub.
"""

import dataclasses
import inspect
import pathlib
import socket
import subprocess
import sys
import threading

import grpc
import jax
import numpy as np
import pytest

from areal_jax.models import orbax_io
from areal_jax.sampler import SamplerConfig, engine_api, generate
from areal_jax.sampler.jetstream import JetStreamEngine
from areal_jax.serve import jetstream as jetstream_server
from areal_jax.tokenizer import CharTokenizer
from helpers import TINY, tiny_model

MAX_SEQ = 32


@pytest.fixture(scope="module")
def model():
  return tiny_model(TINY, seed=7)


@pytest.fixture(scope="module")
def engine(model):
  # The pool holds every slot at full length: a JetStream orchestrator cannot preempt.
  cfg = SamplerConfig(num_slots=8, page_size=4, num_pages=8 * (MAX_SEQ // 4) + 1, max_seq_len=MAX_SEQ,
                      max_new_tokens=MAX_SEQ, decode_steps=4)
  return JetStreamEngine(model=model, config=cfg)


def test_every_member_with_the_contract_s_arguments(engine):
  assert isinstance(engine, engine_api.EngineApi)  # instantiable: no abstract member is left
  for name, member in vars(engine_api.EngineApi).items():
    if name.startswith("_") or not callable(member) and not isinstance(member, property):
      continue
    if isinstance(member, property):
      assert isinstance(getattr(type(engine), name), property), name
      getattr(engine, name)
      continue
    ours = inspect.signature(getattr(type(engine), name)).parameters
    theirs = inspect.signature(member).parameters
    if any(p.kind == p.VAR_POSITIONAL for p in theirs.values()):
      continue  # load_params(*args, **kwargs), init_decode_state(*args, **kwargs): the engine's own arguments
    assert [(p.name, p.kind) for p in ours.values()] == [(p.name, p.kind) for p in theirs.values()], name
  assert engine.max_concurrent_decodes == 8 and engine.samples_per_slot == 1
  assert engine.max_prefill_length == 16 and engine.mesh.shape["data"] == 1  # JetStream's bucket below MAX_SEQ - 1
  with pytest.raises(NotImplementedError, match="existing_prefix"):
    engine.prefill(params=None, existing_prefix=object(), padded_tokens=np.ones(4), true_length=2)


def test_prefix_is_a_pytree_that_moves_and_full_slots_report_done(model, engine):
  params = engine.load_params(model)
  state = engine.init_decode_state()
  prompt = np.arange(2, 2 + MAX_SEQ - 3, dtype=np.int32)  # room for 3 tokens: the first and two more
  prefix, first = engine.prefill(params=params, padded_tokens=np.pad(prompt, (0, 3)), true_length=len(prompt),
                                 request_id="r0")
  moved = jax.device_put(prefix, engine.get_prefix_destination_sharding())
  assert jax.tree.structure(moved) == jax.tree.structure(prefix)
  state = engine.insert(moved, state, 5, request_id="r0")
  tokens, valid, lengths = [int(first.get_result_at_slot(0).tokens[0, 0])], [], []
  for _ in range(4):
    state, result = engine.generate(params, state)
    result.copy_to_host_async()
    row = result.convert_to_numpy().get_result_at_slot(5)
    valid.append(bool(row.valid[0, 0]))
    lengths.append(int(row.lengths[0]))
    if valid[-1]:
      tokens.append(int(row.tokens[0, 0]))
  assert valid == [True, True, False, False] and lengths == [2, 3, 3, 3]  # then the cache is full: done
  assert int(row.tokens[0, 0]) == CharTokenizer().pad_id  # a done row holds the pad id (a stop token), never -1
  ref = generate(model, [prompt], max_new_tokens=3, temperature=0.0)[0][0]
  assert tokens == list(ref.tokens)
  engine.free_resource(5)
  engine.slots.check()


def test_a_free_that_arrives_after_the_next_insert_is_ignored(model, engine):
  params = engine.load_params(model)
  state = engine.init_decode_state()
  a, _ = engine.prefill(params=params, padded_tokens=np.arange(2, 11), true_length=9)
  b, _ = engine.prefill(params=params, padded_tokens=np.arange(3, 9), true_length=6)
  state = engine.insert(a, state, 2)
  state = engine.insert(b, state, 2)  # a is done; its free has not come yet
  pages = list(engine.slots.pages[2])
  engine.free_resource(2)  # a's free, late: b keeps its pages
  assert engine.slots.active[2] and engine.slots.cached[2] == 6 and engine.slots.pages[2] == pages
  assert all(engine.slots.pool.refcount(0, p) for p in pages)
  state, result = engine.generate(params, state)  # b keeps running
  assert bool(result.convert_to_numpy().get_result_at_slot(2).valid[0, 0]) and engine.slots.cached[2] == 7
  engine.free_resource(2)
  engine.free_resource(2)
  engine.slots.check()
  assert not engine.slots.active.any() and engine.slots.pool.num_free(0) == engine.slots.pool.capacity


def test_multisampling_reports_a_slot_s_samples_and_frees_them(model, engine):
  """As JetStream's head reads them: the first tokens as one slot of `num_samples` rows, then one row per slot."""
  params = engine.load_params(model)
  state = engine.init_decode_state()
  prompt = np.arange(2, 12, dtype=np.int32)
  prefix, first = engine.prefill_multisampling(params=params, padded_tokens=np.pad(prompt, (0, 6)), true_length=10,
                                               num_samples=3, rng=jax.random.key(0))
  assert first.samples_per_slot == 3 and first.get_result_at_slot(0).tokens.shape == (3, 1)
  state = engine.bulk_insert(prefix, state, [1, 4, 6])
  state, result = engine.generate(params, state)
  rows = result.convert_to_numpy().get_result_at_slots([1, 4, 6])
  assert rows.valid.all() and list(rows.lengths) == [2, 2, 2]
  for slot in (1, 4, 6):
    engine.free_resource(slot)
  engine.slots.check()
  assert engine.slots.pool.num_free(0) == engine.slots.pool.capacity


def test_api_0_2_prefill_returns_the_prefix_and_generate_reports_the_first_token(model):
  cfg = SamplerConfig(num_slots=4, page_size=4, num_pages=4 * (MAX_SEQ // 4) + 1, max_seq_len=MAX_SEQ,
                      max_new_tokens=MAX_SEQ, decode_steps=4)
  engine = jetstream_server.EngineApi022(model=model, config=cfg)
  params = engine.load_params()  # as JetStream's server calls it: the model the engine was built with
  state = engine.init_decode_state()
  prompt = np.arange(2, 9, dtype=np.int32)
  # JetStream prepends its BOS to a token request; the char vocabulary has none, so it is the pad id and is dropped.
  bos = engine.build_tokenizer(engine.get_tokenizer()).bos_id
  prefix = engine.prefill(params=params, padded_tokens=np.concatenate([[bos], prompt, [0] * 8]), true_length=8)
  state = engine.insert(prefix, state, 2)
  tokens = []
  for step in range(3):
    state, result = engine.generate(params, state)
    row = result.convert_to_numpy().get_result_at_slot(2)
    assert row.valid[0, 0] and row.lengths[0] == step + 1
    tokens.append(int(row.tokens[0, 0]))
  assert tokens == list(generate(model, [prompt], max_new_tokens=3, temperature=0.0)[0][0].tokens)
  state = engine.insert(prefix, state, 2)  # 0.2.2 inserts over a done answer and never frees it: no free is owed
  engine.free_resource(2)
  engine.slots.check()
  assert not engine.slots.active.any() and engine.slots.pool.num_free(0) == engine.slots.pool.capacity


# --- JetStream's own server ---------------------------------------------------------------------------------------

SERVED = dataclasses.replace(TINY, vocab_size=CharTokenizer().vocab_size)  # every id the char vocabulary decodes
STOP = {CharTokenizer().pad_id, CharTokenizer().eos_id}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  model = tiny_model(SERVED, seed=7)
  path = str(tmp_path_factory.mktemp("jetstream") / "policy")
  orbax_io.save_orbax(model, path)
  return model, path


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _reference(model, prompt, max_tokens):
  """Greedy `generate()`, cut before the first stop token (JetStream 0.2.2 ends an answer there, without it)."""
  ids = [int(t) for t in generate(model, [prompt], max_new_tokens=max_tokens, temperature=0.0)[0][0].tokens]
  return ids[:next((i for i, t in enumerate(ids) if t in STOP), len(ids))]


def _decode(port, request, *, cancel_after=None):
  """(token ids, text) of one streamed Decode through JetStream's stub; `cancel_after` responses, then hang up."""
  from jetstream.core.proto import jetstream_pb2_grpc  # pylint: disable=g-import-not-at-top
  ids, text = [], []
  with grpc.insecure_channel(f"localhost:{port}") as channel:
    call = jetstream_pb2_grpc.OrchestratorStub(channel).Decode(request)
    for i, response in enumerate(call):
      sample = response.stream_content.samples[0]
      ids += list(sample.token_ids)
      text.append(sample.text)
      if cancel_after is not None and i + 1 >= cancel_after:
        call.cancel()
        break
  return ids, "".join(text)


def _serve(path, *, disaggregated: bool):
  port = _free_port()
  server = jetstream_server.build(path, tokenizer="char", port=port, max_seq_len=MAX_SEQ, num_slots=8, page_size=4,
                                  decode_steps=4, devices=jax.devices()[:2 if disaggregated else 1],
                                  disaggregated=disaggregated, threads=32)
  return server, port


def _check_pools(server):
  """Every engine's page accounting is consistent and, its last answers freed, the pool is whole (0.2.2 never
  frees: an insert replaces the answer in a slot)."""
  driver = server._driver  # pylint: disable=protected-access  # JetStream's own tests read its driver too
  for engine in {id(e): e for e in driver._prefill_engines + driver._generate_engines}.values():  # pylint: disable=protected-access
    engine.slots.check()
    for slot in range(engine.max_concurrent_decodes):
      engine.free_resource(slot)
    assert engine.slots.pool.num_free(0) == engine.slots.pool.capacity


@pytest.mark.slow
@pytest.mark.parametrize("disaggregated", [False, True], ids=["interleaved", "disaggregated"])
def test_jetstream_s_own_server_serves_the_engine(served, disaggregated):
  """Concurrent token and text requests through JetStream 0.2.2's gRPC server and stub: every answer is greedy
  `generate()`'s (to its first stop token), a request that fills the cache ends there, a client that hangs up
  mid-answer costs nothing, and the page pool is whole afterwards."""
  from jetstream.core.proto import jetstream_pb2  # pylint: disable=g-import-not-at-top
  model, path = served
  server, port = _serve(path, disaggregated=disaggregated)
  tok = CharTokenizer()
  rng = np.random.default_rng(int(disaggregated))
  requests = [(rng.integers(2, SERVED.vocab_size, size=int(rng.integers(2, 16))).astype(np.int32),
               int(rng.integers(1, 10))) for _ in range(24)]
  requests.append((rng.integers(2, SERVED.vocab_size, size=15).astype(np.int32), 100))  # fills the 32-token cache
  texts = ["q: 12+7=", "a: 3*4", "what is 2+2?"]
  out, text_out = [None] * len(requests), [None] * len(texts)

  def ask(i):
    prompt, n = requests[i]
    content = jetstream_pb2.DecodeRequest.TokenContent(token_ids=[int(t) for t in prompt])
    out[i] = _decode(port, jetstream_pb2.DecodeRequest(token_content=content, max_tokens=n))[0]

  def ask_text(i):
    content = jetstream_pb2.DecodeRequest.TextContent(text=texts[i])
    text_out[i] = _decode(port, jetstream_pb2.DecodeRequest(text_content=content, max_tokens=8))[1]

  try:
    hang_up = jetstream_pb2.DecodeRequest(text_content=jetstream_pb2.DecodeRequest.TextContent(text="1+1="),
                                          max_tokens=20)
    assert len(_decode(port, hang_up, cancel_after=1)[0]) == 0  # text answers come back as text
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(requests))]
    threads += [threading.Thread(target=ask_text, args=(i,)) for i in range(len(texts))]
    for t in threads:
      t.start()
    for t in threads:
      t.join(300)
  finally:
    server.stop()
  for (prompt, n), got in zip(requests, out):
    assert got == _reference(model, prompt, min(n, MAX_SEQ - len(prompt))), (prompt, n)
  assert len(out[-1]) == MAX_SEQ - 15 or STOP & set(generate(model, [requests[-1][0]], max_new_tokens=17,
                                                              temperature=0.0)[0][0].tokens.tolist())
  for text, got in zip(texts, text_out):
    assert got == tok.decode(_reference(model, np.asarray(tok.encode(text), np.int32), 8)), text
  _check_pools(server)


@pytest.mark.slow
def test_a_request_jetstream_would_die_on_is_refused_and_the_server_serves_on(served):
  """A text the tokenizer cannot encode ('W' is not in the char vocabulary) or a token id outside the vocabulary
  would raise in JetStream's prefill thread, whose Driver then kills the process: each is refused with
  INVALID_ARGUMENT naming it, and the next good request on the same server is answered."""
  from jetstream.core.proto import jetstream_pb2  # pylint: disable=g-import-not-at-top
  model, path = served
  server, port = _serve(path, disaggregated=False)
  try:
    bad_text = jetstream_pb2.DecodeRequest(text_content=jetstream_pb2.DecodeRequest.TextContent(text="What is 2+2?"),
                                           max_tokens=4)
    with pytest.raises(grpc.RpcError) as info:
      _decode(port, bad_text)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'W'" in info.value.details()
    bad_ids = jetstream_pb2.DecodeRequest(
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[3, SERVED.vocab_size]), max_tokens=4)
    with pytest.raises(grpc.RpcError, match="outside the vocabulary"):
      _decode(port, bad_ids)
    prompt = np.array([3, 4, 5], np.int32)
    good = jetstream_pb2.DecodeRequest(token_content=jetstream_pb2.DecodeRequest.TokenContent(
        token_ids=prompt.tolist()), max_tokens=5)
    assert _decode(port, good)[0] == _reference(model, prompt, 5)
  finally:
    server.stop()
  _check_pools(server)


def test_importing_any_module_and_jetstream_changes_nothing_in_jax_or_sys_modules():
  """JetStream 0.2.2's shims reach JetStream's own modules alone: no `jax.tree_map`, no seqio stand-in left behind."""
  code = ("import importlib, pkgutil, sys, jax, areal_jax\n"
          "for m in pkgutil.walk_packages(areal_jax.__path__, 'areal_jax.'):\n"
          "  importlib.import_module(m.name)\n"
          "from areal_jax.serve import jetstream\n"
          "_, _, orchestrator = jetstream.import_jetstream()\n"
          "print(hasattr(jax, 'tree_map'), 'seqio' in sys.modules, hasattr(orchestrator.jax, 'tree_map'))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
  assert out.stdout.split() == ["False", "False", "True"], out.stdout + out.stderr[-2000:]


def test_the_core_engine_names_nothing_of_jetstream():
  """JetStream's contract lives in its adapter (`sampler/jetstream.py`); the core engine knows shards and slots."""
  root = pathlib.Path(__file__).parents[2] / "areal_jax" / "sampler"
  for name in ("engine.py", "slots.py"):
    assert "jetstream" not in (root / name).read_text().lower(), name
