"""JetStream's engine contract as an adapter over the core engine, without depending on JetStream.

JetStream (AI-Hypercomputer/JetStream, archived upstream in 2026; vLLM's tpu-inference succeeds it for TPU serving)
drives an engine through `jetstream.engine.engine_api.Engine`. `JetStreamEngine` speaks it (restated in
`engine_api.EngineApi`) over one `engine.Engine`: one prompt per prefill, one token per generate.

    engine = JetStreamEngine(model=model, config=SamplerConfig(...), mesh=mesh)
    params = engine.load_params(model)
    state = engine.init_decode_state()
    prefix, first = engine.prefill(params=params, padded_tokens=tokens, true_length=n)  # first: ResultTokens
    state = engine.insert(prefix, state, slot)        # or prefill_multisampling + bulk_insert for G samples
    state, result = engine.generate(params, state)    # one token per occupied slot; lengths = tokens generated
    engine.free_resource(slot)                        # idempotent; may come after the slot's next insert

Two versions are in use: `JetStreamEngine` speaks the head's, and `serve/jetstream.py`'s `EngineApi022` adapts it
to the release's:

* `0.2` — `google-jetstream` 0.2.2, the release on PyPI: `prefill` returns the prefix alone, the first answer token
  comes out of the next `generate`, slots are never freed (an insert replaces the answer).
* `0.3` — the GitHub head (version 0.3.0, never released): `prefill` returns the prefix and a `ResultTokens` of the
  first token, `free_resource` ends an answer, `prefill_multisampling` + `bulk_insert` give several samples.

The core engine inserts only into free slots. A JetStream driver inserts into a slot whose answer is still there
(0.2.2 never frees one; the head may send that answer's `free_resource` after the slot's next insert), so the
adapter releases such a slot itself before inserting, and, where the driver frees every slot it used
(`frees_slots`), counts the free the replaced answer still owes and ignores it when it comes: the new answer keeps
its pages. Prefills run without a data shard (every shard computes the prompt) because the driver picks the slot
after the prefill.

Both build their tokenizer with `engine.build_tokenizer(engine.get_tokenizer())` and dispatch on
`isinstance(x, engine_api.ResultTokens)`: `JetStreamTokenizer` follows JetStream's `tokenizer_api.Tokenizer`, and
`register_result_tokens` makes the engine's `ResultTokens` a virtual subclass of JetStream's (no conversion).

A vocabulary without a BOS token (the tiny character vocabulary, Qwen's) reports its pad id as `bos_id`: JetStream
prepends `bos_id` to token-id requests, and the engine's `prefill` drops that leading pad id, so prompts reach the
model as they were sent. Text requests are encoded without it. A JetStream orchestrator cannot preempt, so size the
pool for every slot at full length.
"""

from __future__ import annotations

import functools
import importlib.metadata
import itertools
import sys
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from areal_jax.sampler import engine_api
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.engine import Draws, Engine
from areal_jax.sampler.engine_api import ResultTokens, TokenizerParameters, pack_result
from areal_jax.sampler.requests import SamplingParams
from areal_jax.sampler.sampling import request_key
from areal_jax.sampler.slots import Placement
from areal_jax.sampler.state import DecodeState, Prefix, PrefixArrays, prefix_shardings
from areal_jax.tokenizer import load_tokenizer

# JetStream's prefill buckets (`token_utils.DEFAULT_PREFILL_BUCKETS`, the same in 0.2.2 and at the head): a padded
# prompt takes the smallest one that holds it, and `max_prefill_length` must be one of them.
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def prefill_bucket(max_seq_len: int) -> int:
  """The longest JetStream prefill bucket that leaves a cache of `max_seq_len` room for one answer token."""
  fits = [b for b in PREFILL_BUCKETS if b <= max_seq_len - 1]
  if not fits:
    raise ValueError(f"sampler.max_seq_len={max_seq_len}: JetStream's shortest prefill bucket is "
                     f"{PREFILL_BUCKETS[0]} tokens, which needs a cache of at least {PREFILL_BUCKETS[0] + 1}")
  return fits[-1]


def installed_api() -> str:
  """The engine API of the JetStream installed here: "0.2" for a `google-jetstream` 0.2.x release, else "0.3"."""
  try:
    version = importlib.metadata.version("google-jetstream")
  except importlib.metadata.PackageNotFoundError as e:
    raise ImportError("JetStream is not installed: pip install --no-deps google-jetstream==0.2.2 (PyPI), or "
                      "JetStream's GitHub repository") from e
  return "0.2" if version.startswith("0.2.") else "0.3"


def register_result_tokens() -> None:
  """Registers the engine's `ResultTokens` with JetStream's class (a virtual subclass: JetStream's detokenize thread
  dispatches on `isinstance`), once JetStream has been imported by whoever drives the engine."""
  theirs = sys.modules.get("jetstream.engine.engine_api")
  if theirs is not None and not issubclass(engine_api.ResultTokens, theirs.ResultTokens):
    theirs.ResultTokens.register(engine_api.ResultTokens)


class JetStreamTokenizer:
  """One of the project's tokenizers (`areal_jax.tokenizer`) behind JetStream's `tokenizer_api.Tokenizer`."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.has_bos = tokenizer.bos_id is not None

  def encode(self, s: str, *, is_bos: bool = True, prefill_lengths: Sequence[int] | None = None,
             max_prefill_length: int | None = None, jax_padding: bool = True):
    """(tokens padded to JetStream's bucket, true length), as JetStream's tokenizers return them, by JetStream's own
    `pad_tokens`; BOS only where the vocabulary has one."""
    from jetstream.engine import token_utils  # pylint: disable=g-import-not-at-top  # only JetStream calls this
    return token_utils.pad_tokens(np.asarray(self.tokenizer.encode(s), np.int32), self.bos_id, self.pad_id,
                                  is_bos=is_bos and self.has_bos, prefill_lengths=prefill_lengths,
                                  max_prefill_length=max_prefill_length, jax_padding=jax_padding)

  def decode(self, token_ids: Sequence[int], **kwargs) -> str:
    del kwargs  # is_streaming: every token decodes on its own here
    return self.tokenizer.decode([int(t) for t in token_ids])

  @property
  def pad_id(self) -> int:
    return self.tokenizer.pad_id

  @property
  def eos_id(self) -> int:
    return self.tokenizer.eos_id

  @property
  def bos_id(self) -> int:
    return self.tokenizer.bos_id if self.has_bos else self.tokenizer.pad_id

  @property
  def stop_tokens(self) -> set[int]:
    return {self.eos_id, self.pad_id}


def _unsupported(**kw) -> None:
  given = [k for k, v in kw.items() if v is not None]
  if given:
    raise NotImplementedError(f"JetStreamEngine: {given[0]} is not supported (JetStream's existing prefixes are not "
                              "reused: the scheduler's prefix cache is `sampler.prefix_cache`; sampling settings are "
                              "the engine's `sampling` or a request's SamplingParams)")


class JetStreamEngine(engine_api.EngineApi):
  """JetStream's engine contract over one core `Engine` (`core`). Prefills are one prompt each, computed on every data
  shard (the slot is chosen after them); `generate` draws one token per occupied slot with room."""

  frees_slots = True  # its driver frees every slot it used (JetStream's head); not JetStream 0.2.2

  def __init__(self, *, model: nnx.Module, config: SamplerConfig, mesh: Mesh | None = None,
               sampling: SamplingParams | None = None, tokenizer: str = "",
               params_loader: Callable[[JetStreamEngine], nnx.State] | None = None):
    """`model`, `config`, `mesh`: the core engine's. JetStream's prefills carry no sampling settings: `sampling`
    (default greedy) draws them. `tokenizer`: a spec for `load_tokenizer` (default the char vocabulary).
    `params_loader(engine)`: what `load_params()` without arguments returns (default: `model`'s own parameters)."""
    self.core = Engine(model=model, config=config, mesh=mesh)
    self._model, self._params_loader = model, params_loader
    self.sampling = sampling or SamplingParams(temperature=0.0)
    self._tokenizer = tokenizer
    self._prefills = itertools.count()  # names the draws of prefills without `rng`
    self._late_frees = np.zeros(config.num_slots, np.int64)  # per slot: frees owed by answers an insert replaced

  @property
  def slots(self):
    """The core engine's slot table (the host state of the slots this contract fills and frees)."""
    return self.core.slots

  def load_params(self, params=None) -> nnx.State:
    """As the core engine's; without an argument, as JetStream's server calls it: `params_loader(self)`, else the
    parameters of the model the engine was built with."""
    if params is None:
      if self._params_loader is not None:
        return self._params_loader(self)
      if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(self._model))):
        raise ValueError("JetStreamEngine.load_params() without parameters: the engine was built with an abstract "
                         "model; pass the parameters, or build the engine with a params_loader")
      params = self._model
    return self.core.load_params(params)

  def init_decode_state(self) -> DecodeState:
    with self.slots.lock:
      self._late_frees[:] = 0
      return self.core.init_decode_state()

  def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int, sampler=None,
              request_id=None) -> tuple[Prefix, ResultTokens] | Prefix:
    """The prompt `padded_tokens[:true_length]` and one first token, drawn with the engine's `sampling`: (prefix,
    first token). A vocabulary without BOS drops a leading pad id (JetStream's BOS for it)."""
    del request_id  # accepted for the contract; nothing here depends on it
    prefix, first = self.prefill_multisampling(params=params, existing_prefix=existing_prefix,
                                               padded_tokens=padded_tokens, true_length=true_length, sampler=sampler)
    return prefix, first

  def prefill_multisampling(self, *, params, existing_prefix=None, padded_tokens, true_length: int, sampler=None,
                            rng=None, num_samples: int = 1) -> tuple[Prefix, ResultTokens]:
    """As `prefill`, with `num_samples` first tokens (sample i's key: `rng` folded with i, or a fresh one per call
    under `sampling.seed`). The result holds the slot's samples, as JetStream reads it: `samples_per_slot` =
    `num_samples`, one token each, length 1."""
    _unsupported(existing_prefix=existing_prefix, sampler=sampler)
    if rng is None:
      n = next(self._prefills)
      keys = np.stack([request_key(self.sampling.seed, n, i) for i in range(num_samples)])
    else:
      keys = np.stack([np.asarray(jax.random.key_data(jax.random.fold_in(rng, i)), np.uint32).reshape(2)
                       for i in range(num_samples)])
    tokens = np.asarray(padded_tokens).reshape(-1)[:true_length]  # JetStream cuts a long prompt, keeps its length
    tok = self.jetstream_tokenizer
    if not tok.has_bos and len(tokens) > 1 and tokens[0] == tok.pad_id:
      tokens = tokens[1:]
    prefix, first = self.core.prefill_batch(params, [tokens], [Draws.of(keys, self.sampling)])
    ones = np.ones((num_samples, 1), np.int32)
    return prefix, pack_result(first.tokens[:num_samples, None], ones, ones[:, 0],
                               first.log_prob[:num_samples, None], samples_per_slot=num_samples)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, request_id=None) -> DecodeState:
    """Answer 0 of the prefix into `slot`; an answer still there is done and is replaced."""
    del request_id
    return self.bulk_insert(prefix, decode_state, [slot])

  def bulk_insert(self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int]) -> DecodeState:
    """Sample i of the prefix into slots[i]; the samples share the prompt's full pages. An answer still in one of
    the slots is done: it is released here, and its own `free_resource`, if the driver sends one, is ignored."""
    table = self.slots
    with table.lock:  # a free from the driver's other thread waits until the slots are counted and taken
      for slot in sorted(set(slots)):
        if table.active[slot]:
          self.core.free_resource(slot)
          self._late_frees[slot] += self.frees_slots
      return self.core.insert_many(prefix, decode_state, [Placement.new(0, list(slots))])

  def generate(self, params, decode_state: DecodeState, sampler=None) -> tuple[DecodeState, ResultTokens]:
    """One token for every occupied slot with room: prompt and answer together hold at most `sampler.max_seq_len`
    tokens, as in the scheduler. A full slot draws nothing: its row is not valid (the answer is done), holds the
    tokenizer's pad id (JetStream takes it as a stop token; at its head it also lists its id) and keeps its length.
    Lengths count generated tokens."""
    _unsupported(sampler=sampler)
    decode_state, tokens, valid, lengths, log_prob = self.generate_one(params, decode_state)
    return decode_state, pack_result(tokens[:, None], valid[:, None].astype(np.int32), lengths, log_prob[:, None])

  def generate_one(self, params, decode_state: DecodeState, hold: Sequence[int] = ()):
    """`generate`'s call, before packing: (state, tokens, valid, lengths, log_prob) per slot; the slots in `hold`
    draw nothing."""
    table = self.core.slots
    with table.lock:
      # cached = prompt + generated - 1 (the last drawn token is pending): room while prompt + generated < max.
      budget = (table.active & (table.cached + 1 < self.core.cfg.max_seq_len)).astype(np.int32)
      budget[np.asarray(hold, np.int32)] = 0
      decode_state, steps = self.core.generate_steps(params, decode_state, budget)
      table.advance(budget)  # no EOS stop and no early exit: the device draws exactly the budget
      lengths = table.generated.copy()
    valid = budget > 0
    tokens = jnp.where(valid, steps.tokens[:, 0], self.jetstream_tokenizer.pad_id)
    return decode_state, tokens, valid, lengths, steps.log_prob[:, 0]

  def free_resource(self, slot: int) -> None:
    """Releases the slot's pages (shared ones with their last holder). Idempotent; the free owed by an answer that an
    insert already replaced is ignored (the slot's new answer keeps its pages)."""
    with self.slots.lock:
      if self._late_frees[slot]:
        self._late_frees[slot] -= 1
      else:
        self.core.free_resource(slot)

  def get_prefix_destination_sharding(self) -> Prefix:
    mesh = self.core.mesh
    kv, rep = prefix_shardings(self.core.model_cfg, mesh), NamedSharding(mesh, P())
    return Prefix(arrays=PrefixArrays(k=kv, v=kv), true_length=rep, start=rep, draw_index=rep, array_row=rep,
                  first=rep, keys=rep, temperature=rep, top_p=rep, top_k=rep)

  def get_tokenizer(self) -> TokenizerParameters:
    return TokenizerParameters(path=self._tokenizer or "char")

  def build_tokenizer(self, metadata: TokenizerParameters) -> JetStreamTokenizer:
    """The tokenizer behind JetStream's `tokenizer_api.Tokenizer`. JetStream's threads call this first, so it also
    registers the engine's `ResultTokens` with JetStream's class."""
    register_result_tokens()
    return JetStreamTokenizer(load_tokenizer(metadata.path))

  @functools.cached_property
  def jetstream_tokenizer(self) -> JetStreamTokenizer:
    return JetStreamTokenizer(load_tokenizer(self._tokenizer or "char"))

  @property
  def max_concurrent_decodes(self) -> int:
    return self.core.cfg.num_slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    """The longest of JetStream's prefill buckets that leaves room for an answer token (JetStream pads prompts to its
    buckets and needs this to be one); `max_seq_len - 1` for a cache shorter than its smallest bucket."""
    try:
      return prefill_bucket(self.core.cfg.max_seq_len)
    except ValueError:
      return self.core.cfg.max_seq_len - 1

  @property
  def mesh(self) -> Mesh:
    return self.core.mesh

  @property
  def colocated_cpus(self) -> None:
    return None

  @property
  def use_chunked_prefill(self) -> bool:
    return False

  @property
  def prefill_chunk_size(self) -> int:
    return self.core.cfg.max_seq_len
