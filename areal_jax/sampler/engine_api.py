"""The engine contract of JetStream (AI-Hypercomputer/JetStream, `jetstream/engine/engine_api.py`), restated.

JetStream's orchestrator drives any engine through this interface: a prefill thread calls `prefill`, a generate thread
`insert`s prefixes into free slots and calls `generate` once per step, and a detokenize thread reads each slot's
`ResultTokens`, decides which answers are complete (a stop token, an invalid token, or more generated tokens than its
limit) and calls `free_resource` on their slots, possibly after it has handed the slot to the generate thread again.
JetStream itself is not a dependency (its released package needs TensorFlow and an old JAX); this module states the
same members, argument names and result layout (as `EngineApi`, JetStream's `Engine`) so that the adapter
`areal_jax.sampler.jetstream.JetStreamEngine` can be checked against them. JetStream's own server and orchestrator
drive that adapter too: `sampler/jetstream.py` has what their code needs beyond this (its tokenizer interface, its
`ResultTokens` class registration); `serve/jetstream.py` the 0.2 release's API.

Result layout: one array `data` [slots * samples_per_slot, width] holding, in column ranges, the tokens of each step
(`tokens_idx`), whether each token is real output (`valid_idx`) and the number of tokens generated so far, the new
ones included (`length_idx`, one column). One array is one device-to-host copy.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from flax import struct


@struct.dataclass
class SlotData:
  """One slot's (or several slots') view of `ResultTokens`: tokens [samples, steps], valid [samples, steps],
  lengths [samples] (generated tokens so far) and optionally log_prob [samples, steps]."""

  tokens: Any
  valid: Any
  lengths: Any
  log_prob: Any = None


@struct.dataclass
class ResultTokens:
  """What `prefill` (the first token) and `generate` (one step) return, packed for one host copy."""

  data: Any  # int32 [slots * samples_per_slot, width]
  tokens_idx: tuple[int, int] = struct.field(pytree_node=False)
  valid_idx: tuple[int, int] = struct.field(pytree_node=False)
  length_idx: tuple[int, int] = struct.field(pytree_node=False)
  samples_per_slot: int = struct.field(pytree_node=False)
  log_prob: Any = None  # float32 [slots * samples_per_slot, steps]

  def copy_to_host_async(self) -> None:
    for x in (self.data, self.log_prob):
      if isinstance(x, jax.Array):
        x.copy_to_host_async()

  def convert_to_numpy(self) -> ResultTokens:
    return self.replace(data=np.asarray(self.data),
                        log_prob=None if self.log_prob is None else np.asarray(self.log_prob))

  def _rows(self, rows) -> SlotData:
    return SlotData(tokens=self.data[rows, self.tokens_idx[0]:self.tokens_idx[1]],
                    valid=self.data[rows, self.valid_idx[0]:self.valid_idx[1]],
                    lengths=self.data[rows, self.length_idx[0]:self.length_idx[1]][:, 0],
                    log_prob=None if self.log_prob is None else self.log_prob[rows])

  def get_result_at_slot(self, slot: int) -> SlotData:
    n = self.samples_per_slot
    return self._rows(slice(slot * n, (slot + 1) * n))

  def get_result_at_slots(self, slots) -> SlotData:
    return self._rows(np.asarray(slots))


def pack_result(tokens, valid, lengths, log_prob=None, *, samples_per_slot: int = 1) -> ResultTokens:
  """`ResultTokens` from tokens [N, steps], valid [N, steps] and lengths [N] (numpy or jax arrays alike)."""
  xp = np if all(isinstance(x, np.ndarray) for x in (tokens, valid, lengths)) else jax.numpy
  steps = tokens.shape[1]
  data = xp.concatenate([xp.asarray(tokens, xp.int32), xp.asarray(valid, xp.int32),
                         xp.asarray(lengths, xp.int32)[:, None]], axis=1)
  return ResultTokens(data=data, tokens_idx=(0, steps), valid_idx=(steps, 2 * steps),
                      length_idx=(2 * steps, 2 * steps + 1), samples_per_slot=samples_per_slot, log_prob=log_prob)


@dataclasses.dataclass(frozen=True)
class TokenizerParameters:
  """What an orchestrator needs to build the engine's tokenizer: `areal_jax.tokenizer.load_tokenizer(path)`."""

  path: str


class EngineApi(abc.ABC):
  """The members a JetStream orchestrator calls. `Prefix` and `DecodeState` are pytrees of the engine's choosing."""

  @abc.abstractmethod
  def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int,
              sampler: Callable | None = None, request_id=None) -> tuple[Any, ResultTokens]:
    """The prompt's cache and its first generated token (one sample); JetStream 0.2's API: the cache alone."""

  @abc.abstractmethod
  def prefill_multisampling(self, *, params, existing_prefix=None, padded_tokens, true_length: int,
                            sampler: Callable | None = None, rng=None,
                            num_samples: int = 1) -> tuple[Any, ResultTokens]:
    """As `prefill`, drawing `num_samples` first tokens (one slot of `num_samples` rows)."""

  @abc.abstractmethod
  def generate(self, params, decode_state, sampler: Callable | None = None) -> tuple[Any, ResultTokens]:
    """One token for every occupied slot: the new decode state and a `ResultTokens` of one step per slot."""

  @abc.abstractmethod
  def insert(self, prefix, decode_state, slot: int, request_id=None) -> Any:
    """Places a prefix into `slot` (whose previous answer is done, freed or not); returns the new decode state."""

  @abc.abstractmethod
  def bulk_insert(self, prefix, decode_state, slots: list[int]) -> Any:
    """Places one multisampled prefix into several slots, sample i into slots[i]."""

  def free_resource(self, slot: int) -> Any:
    """Releases what the slot holds (cache pages). Safe to call more than once, and after an insert into the same
    slot has already taken its place."""
    return None

  @abc.abstractmethod
  def load_params(self, *args, **kwargs) -> Any:
    """Parameters placed where `prefill` and `generate` expect them."""

  @abc.abstractmethod
  def get_prefix_destination_sharding(self) -> Any:
    """Shardings of a prefix on this engine (a pytree matching `prefill`'s prefix): the target of `device_put` when
    prefill and generate run on different engines."""

  @abc.abstractmethod
  def get_tokenizer(self) -> TokenizerParameters:
    """How to build the tokenizer (`build_tokenizer`)."""

  def build_tokenizer(self, metadata: TokenizerParameters) -> Any:
    from areal_jax.tokenizer import load_tokenizer  # pylint: disable=g-import-not-at-top
    return load_tokenizer(metadata.path)

  @abc.abstractmethod
  def init_decode_state(self, *args, **kwargs) -> Any:
    """A decode state with every slot free."""

  @property
  @abc.abstractmethod
  def max_concurrent_decodes(self) -> int:
    """Slots."""

  @property
  @abc.abstractmethod
  def samples_per_slot(self) -> int:
    """Rows of `ResultTokens` per slot."""

  @property
  @abc.abstractmethod
  def max_prefill_length(self) -> int:
    """Longest `padded_tokens` that `prefill` takes."""

  @property
  @abc.abstractmethod
  def mesh(self) -> jax.sharding.Mesh:
    """The devices the engine runs on."""

  @property
  @abc.abstractmethod
  def colocated_cpus(self) -> list | None:
    """CPU devices next to the accelerators, if the engine uses them."""

  @property
  @abc.abstractmethod
  def use_chunked_prefill(self) -> bool:
    """Whether prompts are prefilled in chunks."""

  @property
  @abc.abstractmethod
  def prefill_chunk_size(self) -> int:
    """Tokens per prefill chunk."""
