"""What JetStream's own orchestrator and server need from the engine, without depending on JetStream.

JetStream (AI-Hypercomputer/JetStream, archived upstream in 2026; vLLM's tpu-inference succeeds it for TPU serving)
drives an engine through `jetstream.engine.engine_api.Engine`. Two versions are in use: the engine (`Engine`) speaks
the head's, and `serve/jetstream.py`'s `EngineApi022` adapts it to the release's:

* `0.2` — `google-jetstream` 0.2.2, the release on PyPI: `prefill` returns the prefix alone, the first answer token
  comes out of the next `generate`, slots are never freed (an insert replaces the answer).
* `0.3` — the GitHub head (version 0.3.0, never released): `prefill` returns the prefix and a `ResultTokens` of the
  first token, `free_resource` ends an answer, `prefill_multisampling` + `bulk_insert` give several samples.

Both build their tokenizer with `engine.build_tokenizer(engine.get_tokenizer())` and dispatch on
`isinstance(x, engine_api.ResultTokens)`: `JetStreamTokenizer` follows JetStream's `tokenizer_api.Tokenizer`, and
`register_result_tokens` makes the engine's `ResultTokens` a virtual subclass of JetStream's (no conversion).

A vocabulary without a BOS token (the tiny character vocabulary, Qwen's) reports its pad id as `bos_id`: JetStream
prepends `bos_id` to token-id requests, and the engine's `prefill` drops that leading pad id, so prompts reach the
model as they were sent. Text requests are encoded without it.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Sequence

import numpy as np

from areal_jax.sampler import engine_api

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
