"""The engine's jitted device functions, pure in (params, decode state, small index arrays).

`build_programs(graphdef, model_cfg, cfg, mesh)` needs no parameter values, so the same functions serve
the engine and AOT lowering from `jax.ShapeDtypeStruct`s (see `areal_jax.sampler.aot`).

* `prefill(params, tokens [B, T], lengths [B], rows [S], sharded) -> (PrefixArrays, logits [S, V])`: causal forward
  over padded sequences (the learner's attention, in query blocks for long ones), keys/values of every layer and
  position, and the last position's logits of row `rows[a]` for each answer a (fixed [S] layout: every answer needs a
  slot); with `sampler.record_routes`, a mixture of experts' routing of every position (`PrefixArrays.experts`).
  With `sharded` (static; B a multiple of `data`) the rows are split over `data`, B / data per shard, and each
  shard computes and keeps its own rows' keys and values (the scheduler's prefills: a row's slots are on its shard);
  else every shard computes every row (a JetStream prefill, inserted into any slot after it).
* `prefill_after(params, k_pool, v_pool, page_rows [B, M], start [B], tokens, lengths, rows)`: the sharded prefill
  of rows that continue `start[b]` tokens already in the pool (pages `page_rows[b]` of the row's own data shard, the
  prefix cache's): positions start there and queries also attend to those keys (`attention.prefill_attention_after`,
  which loops over the pages held, so one program serves any `start`). Layers run unrolled, each reading its own
  layer's pool.
* `sample(logits [S, V], keys, index, temperature, top_p, top_k) -> (tokens, logprobs)`: draws the first tokens.
* `insert(state, prefix, first [S], chunks, slots) -> state`: copies page-sized chunks of the prefix into pages and
  sets the slots' page-table rows, pending tokens and sampling settings; a sharded prefix's chunks are read on the
  shard that holds them.
* `decode(params, state, budget [S], stop_eos [S], eos [E], grow [3, G], refill_at) -> (state, DecodeSteps)`: adds
  new pages (slot, column, page) to the page table, then runs up to `cfg.decode_steps` steps in one `lax.while_loop`:
  each step caches every live slot's pending token, draws its next one and records it. Slot s stops after
  `budget[s]` tokens, or (if `stop_eos[s]`) once its pending token is in `eos`; the loop ends when no slot is live,
  or once `refill_at` > 0 slots have stopped (so that the host can refill them with waiting answers). Drawing uses
  `fold_in(key, index)` as one step at a time does, so the tokens do not depend on the number of steps per call.
  With `sampler.record_routes` each step also records the experts its input token was routed to.
  The loop carries the KV pool and updates it in place: the cache write is one `dynamic_update_slice` per slot
  (`attention.write_decode_kv`). A scatter there let XLA's TPU layout assignment carry the pool in a layout of its
  own, which cost a copy of the pool into and one out of the loop and, per layer and step, one into the Pallas
  kernel's layout (by `tools/aot_check.py`, 101 GiB of temporaries for the 1.5B preset's 49 GiB pool). A step runs
  its layers unrolled (`run_layers(unroll=True)`), each on its own layer's pool: a scan over layers would slice a
  copy of a layer's pool per layer and step. With `cfg.decode_steps` = 1 the step runs without a loop.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from areal_jax.models.config import ModelConfig
from areal_jax.sampler import attention
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.sampling import sample, verify
from areal_jax.sampler.state import DecodeState, DecodeSteps, PrefixArrays, decode_state_shardings, prefix_shardings
from areal_jax.sharding import SAMPLER_RULES, use_rules


@struct.dataclass(frozen=True)
class Chunks:
  """Prefix chunk c (row `src_row`, chunk `src_chunk`) goes to local page `dst` of data shard `shard` (-1: skip)."""

  src_row: jax.Array
  src_chunk: jax.Array
  dst: jax.Array
  shard: jax.Array


@struct.dataclass(frozen=True)
class SlotUpdate:
  """Per inserted slot, padded to num_slots entries (`slot` = num_slots: padding, ignored). The pending token is
  `override` if >= 0, else first token `src` of the prefill's draw."""

  slot: jax.Array
  rows: jax.Array  # [S, pages_per_seq] page table rows
  src: jax.Array
  override: jax.Array
  lengths: jax.Array
  index: jax.Array
  keys: jax.Array
  temperature: jax.Array
  top_p: jax.Array
  top_k: jax.Array


@dataclasses.dataclass(frozen=True)
class Programs:
  prefill: Callable
  prefill_after: Callable
  sample: Callable
  insert: Callable
  decode: Callable
  speculate: Callable | None  # with `sampler.speculation`: decode with drafts
  attention: str  # the decode (and verify) attention in use: "jax" | "pallas_tpu" | "pallas_gpu"


def resolve_attention(cfg: SamplerConfig, model_cfg: ModelConfig, mesh: Mesh) -> str:
  """`auto` picks the Pallas TPU kernel on TPU for a bfloat16 cache and head_dim a multiple of 128 (the kernel reads
  keys and values in bfloat16, so a float32 cache would lose precision), the Pallas GPU kernel on GPU for head_dim a
  power of two >= 16 (Triton's tiles), else pure JAX. `pallas_tpu` needs TPU devices, or Pallas' TPU interpret mode
  forced (`pltpu.force_tpu_interpret_mode()`: the kernel runs interpreted on CPU); `pallas_gpu` needs GPU devices."""
  platform, d = mesh.devices.flat[0].platform, model_cfg.head_dim
  if cfg.attention == "pallas_tpu":
    if platform != "tpu" and not attention.tpu_interpret_forced():
      raise ValueError(f"sampler.attention='pallas_tpu' needs TPU devices; the sampler mesh has {platform!r}")
    return "pallas_tpu"
  if cfg.attention == "pallas_gpu":
    if platform != "gpu":
      raise ValueError(f"sampler.attention='pallas_gpu' needs GPU devices; the sampler mesh has {platform!r}")
    return "pallas_gpu"
  if cfg.attention == "auto" and platform == "tpu" and d % 128 == 0 and model_cfg.compute_dtype == jnp.bfloat16:
    return "pallas_tpu"
  if cfg.attention == "auto" and platform == "gpu" and d >= 16 and d & (d - 1) == 0:
    return "pallas_gpu"
  return "jax"


def _insert(write_chunks, state: DecodeState, prefix: PrefixArrays, first, chunks: Chunks,
            upd: SlotUpdate) -> DecodeState:
  """The insert program: prefilled pages copied into the pool (`write_chunks(rows_per_shard)`, for the prefix's
  layout), slot rows set from `upd`."""
  write_chunks = write_chunks(prefix.rows_per_shard)
  ks, vs = [], []
  for i, (kp, vp) in enumerate(zip(state.k, state.v)):
    kp, vp = write_chunks(kp, vp, prefix.k[i], prefix.v[i], chunks.src_row, chunks.src_chunk, chunks.dst,
                          chunks.shard)
    ks.append(kp)
    vs.append(vp)
  pending = jnp.where(upd.override >= 0, upd.override, first[upd.src])
  put = lambda x, val: x.at[upd.slot].set(val.astype(x.dtype), mode="drop")
  return state.replace(
      k=tuple(ks), v=tuple(vs), page_table=put(state.page_table, upd.rows), tokens=put(state.tokens, pending),
      lengths=put(state.lengths, upd.lengths), index=put(state.index, upd.index), keys=put(state.keys, upd.keys),
      temperature=put(state.temperature, upd.temperature), top_p=put(state.top_p, upd.top_p),
      top_k=put(state.top_k, upd.top_k))


def _experts(routed) -> jax.Array | None:
  """The experts of a forward's sparse layers (`run_layers(routing=True)`), int16 [sparse layers, B, T, k]."""
  return None if routed is None else routed["experts"].astype(jnp.int16)


def _more(live, k_steps: int, refill_at):
  """The decode loop's condition over its carry (step, state, live slots, ...): steps left, a slot live, and, with
  `refill_at` > 0, fewer than that many of the slots `live` at the start stopped."""
  started = jnp.sum(live)

  def more(carry):
    i, now = carry[0], carry[2]
    return (i < k_steps) & jnp.any(now) & ((refill_at <= 0) | (started - jnp.sum(now) < refill_at))

  return more


def _decode(graphdef, model_cfg: ModelConfig, mesh, decode_attend, draw, k_steps: int, record: bool, params,
            state: DecodeState, budget, stop_eos, eos, grow, refill_at):
  """Up to `k_steps` decode steps for every live slot in one `lax.while_loop` (see `Programs.decode`)."""
  model = nnx.merge(graphdef, params)
  state = state.replace(page_table=state.page_table.at[grow[0], grow[1]].set(grow[2], mode="drop"))
  ends = lambda tokens: stop_eos & jnp.any(tokens[:, None] == eos[None, :], axis=-1)

  def step(carry):
    i, st, live, count, out_tokens, out_logp, out_experts = carry
    pos = st.lengths
    with use_rules(mesh, SAMPLER_RULES):
      def attend(layer, q, k, v):
        out, kp, vp = decode_attend(q[:, 0], k[:, 0], v[:, 0], st.k[layer], st.v[layer], st.page_table, pos, live)
        return out[:, None], (kp, vp)

      h, kv, routed = model.run_layers(model.embed_tokens(st.tokens[:, None]), pos[:, None], attend, remat=False,
                                       unroll=True, routing=True)
      tokens, log_prob = draw(model.logits(h[:, 0]), st.keys, st.index, st.temperature, st.top_p, st.top_k)
    inc = live.astype(jnp.int32)
    st = st.replace(k=tuple(k for k, _ in kv), v=tuple(v for _, v in kv), tokens=jnp.where(live, tokens, st.tokens),
                    lengths=pos + inc, index=st.index + inc)
    out_tokens = out_tokens.at[:, i].set(jnp.where(live, tokens, -1))
    out_logp = out_logp.at[:, i].set(jnp.where(live, log_prob, 0.0))
    if out_experts is not None:  # [sparse layers, S, 1, k] -> [S, sparse layers, k]
      out_experts = out_experts.at[:, i].set(jnp.swapaxes(_experts(routed)[:, :, 0], 0, 1))
    count = count + inc
    return i + 1, st, live & (count < budget) & ~ends(tokens), count, out_tokens, out_logp, out_experts

  s = budget.shape[0]
  live = (budget > 0) & ~ends(state.tokens)
  more = _more(live, k_steps, refill_at)

  experts = None
  if record and model_cfg.num_experts:
    experts = jnp.full((s, k_steps, sum(model_cfg.sparse_layers()), model_cfg.num_experts_per_tok), -1, jnp.int16)
  init = (jnp.int32(0), state, live, jnp.zeros(s, jnp.int32), jnp.full((s, k_steps), -1, jnp.int32),
          jnp.zeros((s, k_steps), jnp.float32), experts)
  loop = step if k_steps == 1 else functools.partial(jax.lax.while_loop, more, step)
  _, state, _, count, tokens, log_prob, experts = loop(init)
  return state, DecodeSteps(tokens=tokens, log_prob=log_prob, count=count, experts=experts)


def _speculate(graphdef, mesh, verify_attend, check, k_steps: int, nq: int, params, state: DecodeState, budget,
               stop_eos, eos, grow, refill_at, drafts, draft_at, draft_len):
  """`_decode` with drafts (see `Programs.speculate`): each loop step feeds every live slot its pending token and up
  to Q - 1 = spec_tokens draft tokens, one forward over the Q positions, and emits the accepted drafts + 1 tokens
  (`sampling.verify`), at most its budget; keys and values of rejected positions are left past the slot's length
  (overwritten later)."""
  model = nnx.merge(graphdef, params)
  state = state.replace(page_table=state.page_table.at[grow[0], grow[1]].set(grow[2], mode="drop"))
  ends = lambda tokens: stop_eos & jnp.any(tokens[:, None] == eos[None, :], axis=-1)
  s, width = drafts.shape
  j, cols = jnp.arange(nq), jnp.arange(k_steps)

  def step(carry):
    i, st, live, count, out_tokens, out_logp, stats = carry
    # The draft continues the slot's answer where the host proposed it (`draft_at`, an answer index); a call in flight
    # since then drew `cursor` tokens, the last of which (the pending one) must be the draft's to go on.
    cursor = st.index - draft_at
    prev = jnp.take_along_axis(drafts, jnp.clip(cursor - 1, 0, width - 1)[:, None], axis=1)[:, 0]
    on = (draft_at >= 0) & (cursor >= 0) & (cursor < draft_len) & ((cursor == 0) | (prev == st.tokens))
    n = jnp.where(live & on, jnp.clip(jnp.minimum(draft_len - cursor, budget - count - 1), 0, nq - 1), 0)
    guess = jnp.take_along_axis(drafts, jnp.clip(cursor[:, None] + j[None, :nq - 1], 0, width - 1), axis=1)
    inputs = jnp.concatenate([st.tokens[:, None], guess], axis=1)
    pos = st.lengths
    with use_rules(mesh, SAMPLER_RULES):
      def attend(layer, q, k, v):
        out, kp, vp = verify_attend(q, k, v, st.k[layer], st.v[layer], st.page_table, pos, n + 1, live)
        return out, (kp, vp)

      h, kv = model.run_layers(model.embed_tokens(inputs), pos[:, None] + j[None, :], attend, remat=False,
                               unroll=True)
      tokens, log_prob, emitted = check(model.logits(h), guess, n, st.keys, st.index, st.temperature, st.top_p,
                                        st.top_k)
    # An EOS among the emitted tokens ends the slot there.
    stop = stop_eos[:, None] & jnp.any(tokens[:, :, None] == eos[None, None, :], axis=-1) & (j[None] < emitted[:, None])
    emitted = jnp.where(jnp.any(stop, axis=1), jnp.argmax(stop, axis=1) + 1, emitted)
    emitted = jnp.where(live, emitted, 0)
    last = jnp.take_along_axis(tokens, jnp.maximum(emitted - 1, 0)[:, None], axis=1)[:, 0]
    st = st.replace(k=tuple(k for k, _ in kv), v=tuple(v for _, v in kv), tokens=jnp.where(live, last, st.tokens),
                    lengths=pos + emitted, index=st.index + emitted)
    # Column c of the call's output takes emitted token c - count, each slot its own columns: a gather along the
    # row (a scatter at per-slot columns would be all-gathered over the data shards by the partitioner).
    at = cols[None] - count[:, None]
    put = (at >= 0) & (at < emitted[:, None])
    at = jnp.clip(at, 0, nq - 1)
    out_tokens = jnp.where(put, jnp.take_along_axis(tokens, at, axis=1), out_tokens)
    out_logp = jnp.where(put, jnp.take_along_axis(log_prob, at, axis=1), out_logp)
    drafted = j[None, :nq - 1] < n[:, None]
    accepted = drafted & (j[None, :nq - 1] < emitted[:, None] - 1)
    stats = (stats[0] + jnp.sum(live), stats[1] + jnp.sum(drafted, axis=0), stats[2] + jnp.sum(accepted, axis=0))
    count = count + emitted
    return i + 1, st, live & (count < budget) & ~ends(last), count, out_tokens, out_logp, stats

  live = (budget > 0) & ~ends(state.tokens)
  more = _more(live, k_steps, refill_at)

  zeros = jnp.zeros(nq - 1, jnp.int32)
  init = (jnp.int32(0), state, live, jnp.zeros(s, jnp.int32), jnp.full((s, k_steps), -1, jnp.int32),
          jnp.zeros((s, k_steps), jnp.float32), (jnp.int32(0), zeros, zeros))
  _, state, _, count, tokens, log_prob, (forwards, drafted, accepted) = jax.lax.while_loop(more, step, init)
  return state, DecodeSteps(tokens=tokens, log_prob=log_prob, count=count, forwards=forwards, drafted_at=drafted,
                            accepted_at=accepted)


@functools.lru_cache(maxsize=16)
def build_programs(graphdef: nnx.GraphDef, model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Mesh) -> Programs:
  """Cached: engines with the same graph, configs and mesh share compiled programs."""
  impl = resolve_attention(cfg, model_cfg, mesh)
  block = cfg.attention_block or (32 if mesh.devices.flat[0].platform == "cpu" else 256)
  pages_per_block = max(1, block // cfg.page_size)
  decode_attend = attention.sharded_decode_attention(mesh, model_cfg.num_kv_heads, impl=impl,
                                                     pages_per_block=pages_per_block)
  write_chunks = functools.lru_cache(functools.partial(attention.sharded_write_chunks, mesh, model_cfg.num_kv_heads))
  attend_after = attention.sharded_prefill_attention_after(mesh, model_cfg.num_kv_heads,
                                                           pages_per_block=pages_per_block)
  state_sh = decode_state_shardings(model_cfg, mesh)
  data = mesh.shape["data"]
  draw = functools.partial(sample, vocab_limit=cfg.vocab_limit)

  def prefill(params, tokens, lengths, rows, sharded=False, past=None):
    b, t = tokens.shape
    if sharded and b % data:
      raise ValueError(f"a sharded prefill of {b} rows over {data} data shards: rows must be a multiple of them")
    model = nnx.merge(graphdef, params)
    with use_rules(mesh, SAMPLER_RULES):
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
      if sharded:  # every shard its own rows (SAMPLER_RULES split the forward's batch over data where it divides)
        by_row = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data", *(None,) * (x.ndim - 1))))
        tokens, lengths, positions = by_row(tokens), by_row(lengths), by_row(positions)
      if past is None:
        attend = lambda i, q, k, v: (attention.prefill_attention(q, k, v, lengths), (k, v))
      else:
        k_pool, v_pool, page_rows, start = past
        positions = positions + start[:, None]

        def attend(i, q, k, v):
          return attend_after(q, k, v, lengths, k_pool[i], v_pool[i], page_rows, start), (k, v)

      h, kv, routed = model.run_layers(model.embed_tokens(tokens), positions, attend, remat=False,
                                       unroll=True if past is not None else None, routing=True)
      if isinstance(kv, list):  # unrolled layers (model.scan_layers=False): stack them as the scan does
        kv = jax.tree.map(lambda *layers: jnp.stack(layers), *kv)
      k, v = kv
      last = h[jnp.arange(b), lengths - 1]  # [B, E] on the rows' shards: only these cross to the answers' draws
      logits = model.logits(last[rows])  # [S, V]: the last position of row rows[a], per answer a
    pin = lambda x: jax.lax.with_sharding_constraint(x, prefix_shardings(model_cfg, mesh, sharded=sharded))
    return PrefixArrays(k=pin(k), v=pin(v), experts=_experts(routed) if cfg.record_routes else None,
                        rows_per_shard=b // data if sharded else 0), logits

  def decode(params, state: DecodeState, budget, stop_eos, eos, grow, refill_at):
    return _decode(graphdef, model_cfg, mesh, decode_attend, draw, cfg.decode_steps, cfg.record_routes, params, state,
                   budget, stop_eos, eos, grow, refill_at)

  speculate = None
  if cfg.speculation != "off":
    verify_attend = attention.sharded_verify_attention(mesh, model_cfg.num_kv_heads, impl=impl,
                                                       pages_per_block=pages_per_block)
    check = functools.partial(verify, vocab_limit=cfg.vocab_limit)

    def speculate(params, state: DecodeState, budget, stop_eos, eos, grow, refill_at, drafts, draft_at, draft_len):
      return _speculate(graphdef, mesh, verify_attend, check, cfg.decode_steps, cfg.spec_tokens + 1, params, state,
                        budget, stop_eos, eos, grow, refill_at, drafts, draft_at, draft_len)

    speculate = jax.jit(speculate, donate_argnums=1, out_shardings=(state_sh, None))

  def prefill_after(params, k_pool, v_pool, page_rows, start, tokens, lengths, rows):
    return prefill(params, tokens, lengths, rows, sharded=True, past=(k_pool, v_pool, page_rows, start))

  return Programs(
      prefill=jax.jit(prefill, static_argnames="sharded"),
      prefill_after=jax.jit(prefill_after),
      sample=jax.jit(draw),
      insert=jax.jit(functools.partial(_insert, write_chunks), donate_argnums=0, out_shardings=state_sh),
      decode=jax.jit(decode, donate_argnums=1, out_shardings=(state_sh, None)),
      speculate=speculate,
      attention=impl)
