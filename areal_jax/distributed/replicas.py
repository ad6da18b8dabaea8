"""Engine replicas in one process behind one dispatcher: `LocalRollout`, the `rl.rollout.Rollout` of a process that
holds its samplers itself (a one-process run's sampler slice, a sampler process's local devices).

    rollout = LocalRollout(abstract_model=model, config=sampler_cfg, meshes=replica_meshes(...), params=params,
                           version=0, eos_ids=[tok.eos_id], detokenize=tok.decode)
    futures = rollout.submit(request)  # the group goes whole to the least loaded replica
    rollout.publish(params, version=1)  # a copy per replica, device-to-device; each swaps at its own step
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from flax import nnx
from jax.sharding import Mesh

from areal_jax import faults
from areal_jax.distributed import weight_transfer
from areal_jax.errors import SamplerLost
from areal_jax.models import lora
from areal_jax.sampler import dispatch
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.dispatch import Outstanding
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.requests import Request
from areal_jax.sampler.sampler import Sampler

_log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Replica:
  """One engine of the sampler slice and the sampler that drives it; the groups `outstanding` on it and the answers
  `dispatched` in all (under the rollout's lock), `failed` once its sampler stopped on an error."""

  index: int
  engine: Engine
  sampler: Sampler
  base: object = None  # under LoRA, its copy of the frozen base
  outstanding: Outstanding = dataclasses.field(default_factory=Outstanding)
  dispatched: int = 0
  failed: BaseException | None = None

  def free_pages(self) -> int:
    return sum(self.engine.slots.free_pages(s) for s in range(self.engine.num_shards))


def summed_stats(per: Sequence[dict[str, float]]) -> dict[str, float]:
  """Samplers' counters summed (versions: the oldest; the most answers one call advanced: the largest)."""
  out = {k: sum(p.get(k, 0) for p in per) for k in per[0]}
  out["version"] = min(p["version"] for p in per)
  for k in ("max_batch_answers", "max_batch_requests"):
    out[k] = max(p[k] for p in per)
  return out


class LocalRollout:
  """`Sampler`s on this process's sampler slice, one per replica mesh (`mesh.sampler_replicas`), running from
  construction. A group goes whole to one replica (`dispatch.Dispatcher`: an episode's turns to the replica of its last,
  anything else to the one with the fewest tokens of work outstanding, then the most free pages); each replica swaps
  weights at its own step boundary, so one replica's recompute never stops another's decoding. With several replicas,
  one whose sampler fails is dropped: its groups' answers fail with `SamplerLost` (the controller generates them again
  on the others) and `check()` raises only once none is left."""

  def __init__(self, *, abstract_model, config: SamplerConfig, meshes: Sequence[Mesh], params, version: int, eos_ids,
               detokenize, reserved_bytes: int = 0):
    """`reserved_bytes`: per device, what each engine's KV pool leaves free for a colocated learner's step."""
    if not meshes:
      raise ValueError("LocalRollout: no sampler mesh")
    self._lock = threading.Lock()
    self._bytes = 0
    self._learner_s = 0.0
    self._changed = weight_transfer.ChangedFraction()
    self._dispatcher = dispatch.Dispatcher()
    self.replicas: list[_Replica] = []
    for i, mesh in enumerate(meshes):
      engine = Engine(model=abstract_model, config=config, mesh=mesh, reserved_bytes=reserved_bytes)
      moved = self._move(params, engine.param_shardings, engine.param_dtype)
      self._bytes += lora.nbytes(moved)
      base = lora.split(moved)[1] if lora.has_adapters(moved) else None  # held under LoRA
      sampler = Sampler(engine=engine, params=moved, version=version, eos_ids=eos_ids, detokenize=detokenize,
                        gather=True, name=f"sampler{i}").start()
      self.replicas.append(_Replica(index=i, engine=engine, sampler=sampler, base=base))

  @staticmethod
  def _move(params, shardings, dtype, *, block: bool = True, owned: bool = False):
    """Onto a replica's shardings, device-to-device, cast to `sampler.param_dtype` on the learner's devices first
    (so the narrower copy is what crosses over); see `weight_transfer.transfer` for `block` and `owned`."""
    return weight_transfer.transfer(params, shardings, dtype=dtype, block=block, owned=owned)

  def _live(self) -> list[_Replica]:
    return [r for r in self.replicas if r.failed is None]

  def _note_failures(self) -> None:
    """Marks the replicas whose sampler stopped on an error (with answers open or idle, e.g. in a weight swap)."""
    for r in self.replicas:
      error = r.sampler.error
      if r.failed is None and error is not None:
        r.failed = error
        _log.warning("sampler replica %d of %d failed (%s: %s); its groups are generated on the others", r.index,
                     len(self.replicas), type(error).__name__, error)

  def submit(self, request: Request) -> list[Future]:
    with self._lock:
      self._note_failures()
      live = {r.index: r for r in self._live()}
      if not live:
        self.check()
      r = live[self._dispatcher.choose(request, {i: r.outstanding.load(r.free_pages()) for i, r in live.items()})]
      r.outstanding.add(request)
      r.dispatched += request.num_answers
    try:
      inner = r.sampler.submit(request)
    except BaseException:
      with self._lock:
        r.outstanding.remove(request.group_id)
        r.dispatched -= request.num_answers
      raise
    outer = [Future() for _ in inner]
    for a, b in zip(inner, outer):
      a.add_done_callback(functools.partial(self._relay, r, request.group_id, b))
    return outer

  def _relay(self, r: _Replica, group_id: int, outer: Future, inner: Future) -> None:
    """An answer of replica `r` done: its result, or its replica's failure (`SamplerLost` while others live)."""
    with self._lock:
      r.outstanding.answered(group_id)
      error = None if inner.cancelled() else inner.exception()
      self._note_failures()
      lost = r.failed is not None and len(self.replicas) > 1 and bool(self._live())
    if outer.done():
      return
    if inner.cancelled():
      outer.cancel()
    elif error is None:
      outer.set_result(inner.result())
    elif lost:
      outer.set_exception(SamplerLost(f"sampler replica {r.index} failed: {error}"))
    else:
      outer.set_exception(error)

  def publish(self, params, version: int, *, owned: bool = False) -> None:
    """Hands each live replica its own copy of the learner's weights (under LoRA only the adapters) as soon as that
    copy is dispatched: each swaps it in at its own next step, waiting only for its own copy, and the caller waits
    for none of them (`sync/learner_seconds`: the dispatches alone; `params` may be donated at once, each copy is
    ordered before). `owned`: `params` are the caller's own arrays, which nothing donates (a sampler process's pull):
    a replica whose shardings and dtype they already have takes them without a copy."""
    start = time.perf_counter()
    nbytes, first = 0, True
    for r in self._live():
      e = r.engine
      if r.base is None:
        m = self._move(params, e.param_shardings, e.param_dtype, block=False, owned=owned)
        nbytes += lora.nbytes(m)
      else:
        adapters = self._move(lora.split(params)[0], lora.split(e.param_shardings)[0], e.param_dtype, block=False,
                              owned=owned)
        nbytes += lora.nbytes(adapters)
        m = nnx.merge_state(r.base, adapters)
      if first:  # against what the first replica holds now (the same on every one); under LoRA, its adapters
        old = r.sampler.scheduler.next_params
        self._changed.count(*((m, old) if r.base is None else (lora.split(m)[0], lora.split(old)[0])))
        faults.reach("weight_update")
        first = False
      r.sampler.update_params(m, version)
    self._bytes = nbytes
    self._learner_s = time.perf_counter() - start

  def stats(self) -> dict[str, float]:
    return summed_stats([r.sampler.stats() for r in self.replicas])

  def sync_metrics(self) -> dict[str, float]:
    """`sync/bytes` moved per version, `sync/learner_seconds` (what the latest `publish` held its caller),
    `sync/changed_fraction` (the newest counted: `ChangedFraction`)."""
    changed = self._changed.latest()
    return {"sync/bytes": float(self._bytes), "sync/learner_seconds": self._learner_s,
            **({} if changed is None else {"sync/changed_fraction": changed})}

  def sampler_metrics(self) -> dict[str, float]:
    """Per replica: `sampler/replica{i}/answers` (dispatched to it), `/busy` (seconds stepping), `/tokens`, `/swaps`,
    `/failed` and `/prefix_hits` (the share of its prompts' tokens found in its prefix cache, not prefilled); a
    sampler's counters move when its step ends."""
    out = {}
    for r in self.replicas:
      st = r.sampler.stats()
      key = f"sampler/replica{r.index}"
      hits = st["cached_tokens"] / max(st["cached_tokens"] + st["prefill_tokens"], 1)
      out.update({f"{key}/answers": float(r.dispatched), f"{key}/busy": st["busy_s"], f"{key}/tokens": st["tokens"],
                  f"{key}/swaps": st["weight_updates"], f"{key}/failed": float(r.failed is not None),
                  f"{key}/prefix_hits": hits})
    return out

  def check(self) -> None:
    """Raises a lone replica's error, or once every replica has failed; with others left a failed one is dropped."""
    if len(self.replicas) == 1:
      return self.replicas[0].sampler.check()
    with self._lock:
      self._note_failures()
      live = self._live()
    if not live:
      raise RuntimeError(f"all {len(self.replicas)} sampler replicas failed") from self.replicas[0].failed
    return None

  def stop(self) -> None:
    for r in self.replicas:
      try:
        r.sampler.stop()
      except RuntimeError:
        if r.failed is None or len(self.replicas) == 1:
          raise
