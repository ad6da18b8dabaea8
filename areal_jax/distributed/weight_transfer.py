"""Weights from the learner to the samplers.

In one process, `transfer(params, shardings, dtype=...)` moves them device-to-device onto the sampler's shardings
(cast on the learner's devices first, so a narrower copy crosses over); no host round-trip (a transfer guard raises).

Between processes, the learner publishes each version and sampler processes pull it onto their devices:

    # learner leader                                        # each sampler process
    pub = WeightPublisher(abstract_params=..., tensor=t,     puller = WeightPuller(address=pub.address, ...)
                          devices=local_devices, host=h)
    staged = pub.stage(local)     # a fresh copy            params, fp = puller.pull(uuid, timeout_s=...)
    uuids, fp = pub.offer(staged, version, pullers=[0, 1])  # fp == the publisher's fingerprint, else corrupt

`jax.experimental.transfer` copies shard i of the published array into shard i of the puller's, with no resharding,
so both sides use the same layout: the sampler's parameter shardings on a (data 1 x tensor t) mesh of their first t
local devices. The sampler then reshards device-to-device onto its own (data x tensor) mesh. A published copy stays
alive until every puller has reported it (`pulled`) or left (`forget`); each puller gets its own uuid (a uuid can be
pulled once).

Under LoRA a published version is either `part="all"` (the whole model: the first) or `part="adapters"` (the
adapters alone, which the sampler joins to the base it keeps); each part has its own layout on both ends.

With `sync.delta`, a puller that holds the version before (`WeightPuller(keep=True)`) is offered
`pub.delta(staged, previous)` instead: only the elements whose bits changed (`weight_delta.py`), rebuilt on its
devices into a copy bit-identical to the full one; one that joins or missed a version is offered the full copy.

Pulls run under a watchdog (a pull whose peer is gone can hang past its own timeout), and every pull is checked
against the publisher's fingerprint (a position-weighted sum per leaf), so a layout mismatch that would copy the
wrong bytes fails loudly instead of training on garbage.
"""

from __future__ import annotations

import dataclasses
import itertools
import socket
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer as jax_transfer
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from areal_jax.distributed import weight_delta
from areal_jax.models import lora, weights
from areal_jax.models.weights import cast, fingerprint
from areal_jax.sharding import SAMPLER_RULES, make_mesh, state_shardings


def _identity(tree):
  return tree


def _stage(x: jax.Array, dst: NamedSharding) -> jax.Array:
  """Copies x shard-by-shard onto dst's devices (device-to-device), keeping x's partitioning."""
  if not isinstance(x, jax.Array):
    return x  # a host value: the transfer guard rejects it below
  src = x.sharding
  if src.device_set == dst.device_set:
    return x
  if not isinstance(src, NamedSharding):  # one device's array (a model built outside a mesh): copy it across
    return jax.device_put(x, NamedSharding(dst.mesh, P()))
  dst_devices = list(dst.mesh.devices.flat)
  if isinstance(src, NamedSharding) and src.mesh.devices.size == len(dst_devices):
    staged = Mesh(np.asarray(dst_devices, dtype=object).reshape(src.mesh.devices.shape), src.mesh.axis_names)
    return jax.device_put(x, NamedSharding(staged, src.spec))
  # Different device counts: replicate on the source (one leaf at a time), then copy the replica across.
  replicated = jax.jit(_identity, out_shardings=NamedSharding(src.mesh, P()))(x)
  return jax.device_put(replicated, NamedSharding(dst.mesh, P()))


def transfer(params, shardings, *, dtype=None, block: bool = True, owned: bool = False):
  """Puts `params` (e.g. fsdp-sharded on the learner slice) onto `shardings` (the sampler slice), with floating leaves
  cast to `dtype` first (None = as they are) where they live, so a narrower copy is what crosses over.

  Shards are copied device-to-device onto the sampler's devices, then resharded there by one compiled program.
  Host↔device copies raise here (explicit or implicit), so a host round-trip cannot slip in. With `block=False` the
  copy is only dispatched: `params` may then be donated at once (the copy is ordered before it). With `owned` (the
  caller's own arrays, which nothing donates: a sampler process's pull) `params` already on `shardings` in `dtype`
  are returned as they are, not copied.
  """
  if owned and _in_place(params, shardings, dtype):
    return params
  with jax.transfer_guard("disallow"), jax.transfer_guard_host_to_device("disallow_explicit"), \
      jax.transfer_guard_device_to_host("disallow_explicit"):
    if dtype is not None:
      params = cast(params, dtype)
    staged = jax.tree.map(_stage, params, shardings)
    out = jax.jit(_identity, out_shardings=shardings)(staged)
    if block:
      jax.block_until_ready(out)
  return out


def _in_place(params, shardings, dtype) -> bool:
  """Whether every leaf of `params` already has its sharding in `shardings` and, if floating, `dtype` (None: any)."""
  leaves, targets = jax.tree.leaves(params), jax.tree.leaves(shardings)
  if len(leaves) != len(targets):
    return False
  return all(isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim)
             and (dtype is None or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype)
             for x, s in zip(leaves, targets))


class ChangedFraction:
  """The share of a new version's elements whose bits differ from the version before (on the same shardings): what a
  lossless delta of it would carry, as a fraction of a full copy. Counted on the devices as the version is handed
  over (`count`, dispatched, never waited on) and read once done (`latest`), so the learner never waits for it."""

  def __init__(self):
    self._counts: tuple[list[jax.Array], int] | None = None
    self.value: float | None = None

  def count(self, new, old) -> None:
    leaves = jax.tree.leaves(new)
    self._counts = (weight_delta.count_changed(leaves, jax.tree.leaves(old)), sum(x.size for x in leaves))

  def latest(self) -> float | None:
    """The newest count that has finished (None before the first)."""
    if self._counts is not None and all(c.is_ready() for c in self._counts[0]):
      counts, total = self._counts
      self.value, self._counts = sum(int(np.sum(c)) for c in jax.device_get(counts)) / max(total, 1), None
    return self.value


def local_ip_towards(host: str) -> str:
  """The address of this machine's interface that reaches `host` (no packet is sent)."""
  if host in ("localhost", "127.0.0.1", "::1"):
    return "127.0.0.1"
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.connect((host, 9))
    return s.getsockname()[0]


def _server(devices: Sequence[jax.Device], host: str):
  # Both ends must name the same (non-zero) number of transport addresses.
  return jax_transfer.start_transfer_server(devices[0].client, f"{host}:0", [f"{host}:0"])


def transfer_mesh(devices: Sequence[jax.Device], tensor: int, expert: int = 1) -> Mesh:
  """One sampler's model copy: `expert` x `tensor` devices, sharded as the sampler's weights are."""
  if len(devices) < tensor * expert:
    raise ValueError(f"mesh.sampler_tensor={tensor}, mesh.sampler_expert={expert}: need {tensor * expert} local "
                     f"devices, this process has {len(devices)}")
  return make_mesh(list(devices)[:tensor * expert], {"data": 1, "expert": expert, "tensor": tensor})


def check_fingerprint(got: np.ndarray, want: np.ndarray, *, paths: Sequence[str], what: str) -> None:
  if got.shape != want.shape:
    raise ValueError(f"{what}: {got.shape[0]} leaves pulled, {want.shape[0]} published")
  bad = np.flatnonzero(np.any(got != want, axis=1))
  if bad.size:
    i = int(bad[0])
    raise ValueError(f"{what}: leaf {paths[i]} arrived corrupted (sums {got[i].tolist()} != published "
                     f"{want[i].tolist()}; {bad.size} leaves differ)")


def local_copy(params, mesh: Mesh):
  """`params` (sharded over `mesh`) as arrays this process can address: unchanged when `mesh` is all local, else
  every parameter whole on this process's first device of `mesh`.

  When `mesh` spans several processes this is a collective: every learner process must call it, in the same order.
  """
  mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  if len(mine) == mesh.devices.size:
    return params
  gather = jax.jit(_identity, out_shardings=NamedSharding(mesh, P()))  # pylint: disable=protected-access

  def one(x):  # one leaf at a time: a whole replica of the model never sits on every device at once
    whole = gather(x)
    return next(s.data for s in whole.addressable_shards if s.device == mine[0])

  return jax.tree.map(one, params)


def _leaf_paths(tree) -> list[str]:
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def parts(abstract_params) -> dict:
  """The trees a version can be published as: "all", and under LoRA "adapters"."""
  out = {"all": abstract_params}
  if lora.has_adapters(abstract_params):
    out["adapters"] = lora.split(abstract_params)[0]
  return out


def part_of(params, part: str):
  return lora.split(params)[0] if part == "adapters" else params


@dataclasses.dataclass(frozen=True, eq=False)
class Delta:
  """A version as the elements that changed since the one before (`weight_delta`): offered to pullers holding that
  one; `nbytes` is what each such pull moves."""

  codes: tuple[int, ...]  # per leaf, as `weight_delta.plan`
  payload: list
  changed_fraction: float  # of the version's elements
  nbytes: int


class WeightPublisher:
  """The learner leader's transfer server: offers each policy version to the sampler processes."""

  def __init__(self, *, abstract_params, tensor: int, devices: Sequence[jax.Device], host: str, expert: int = 1):
    """`abstract_params`: the sampler's parameter tree (shapes and dtypes: what the pullers expect)."""
    self.mesh = transfer_mesh(devices, tensor, expert)
    self.parts = parts(abstract_params)
    self.shardings = {k: state_shardings(v, self.mesh, SAMPLER_RULES) for k, v in self.parts.items()}
    floats = {x.dtype for x in jax.tree.leaves(abstract_params) if jnp.issubdtype(x.dtype, jnp.floating)}
    if len(floats) > 1:
      raise ValueError(f"published weights: floating leaves of several dtypes {sorted(map(str, floats))}")
    self._dtype = floats.pop() if floats else None
    self.server = _server(devices, host)
    self._uuids = itertools.count(1)  # a uuid can be pulled once: every offer to every puller gets its own
    self._offers = itertools.count()
    # offer -> (version, published leaves, {puller: uuid} still to pull): a staged copy lives until all have pulled
    self._live: dict[int, tuple[int, list, dict[int, int]]] = {}
    self._own = None  # a connection to this server, to take the pulls of pullers that left (`forget`)
    self._cond = threading.Condition()

  @property
  def address(self) -> str:
    return self.server.address()

  def nbytes(self, part: str = "all") -> int:
    return lora.nbytes(self.parts[part])

  def stage(self, params, part: str = "all", *, block: bool = True):
    """A fresh copy of `params`' `part` (any device of this process) in the pull layout, floating leaves cast to the
    dtype of `abstract_params` (the sampler's `param_dtype`: a bfloat16 sampler pulls half the bytes), checked against
    the sampler's tree first (never the learner's live buffers: the train step donates those). `block=False`: only
    dispatched (the learner may train on at once; `offer` and `delta` wait for it)."""
    params = part_of(params, part)
    if self._dtype is not None:
      params = weights.cast(params, self._dtype)
    what = "published weights" if part == "all" else f"published {part}"
    weights.check_compatible(params, self.parts[part], what=what)
    return transfer(params, self.shardings[part], block=block)

  def delta(self, staged, base) -> Delta:
    """`staged` as a lossless delta against `base` (both from `stage`, of the same part): what a puller holding
    `base` needs to rebuild `staged` bit for bit."""
    new, old = jax.tree.leaves(staged), jax.tree.leaves(base)
    codes, changed = weight_delta.plan(new, old)
    payload = weight_delta.encode(new, old, codes)
    return Delta(codes=tuple(codes), payload=payload, changed_fraction=changed / max(sum(x.size for x in new), 1),
                 nbytes=weight_delta.nbytes(payload))

  def offer(self, staged, version: int, pullers: Sequence[int], *,
            delta: Delta | None = None) -> tuple[dict[int, int], np.ndarray]:
    """Registers `staged` (or its `delta`) once per puller; returns ({puller: uuid}, the fingerprint of `staged`:
    what a puller checks its rebuilt copy against either way)."""
    fp = fingerprint(staged)
    leaves = delta.payload if delta is not None else jax.tree.leaves(staged)
    uuids = {i: next(self._uuids) for i in pullers}
    if not leaves:  # a delta of a version that changed nothing: there is nothing to pull
      return uuids, fp
    for uuid in uuids.values():
      self.server.await_pull(uuid, leaves)
    if uuids:
      with self._cond:
        self._live[next(self._offers)] = (version, leaves, dict(uuids))
    return uuids, fp

  def pulled(self, version: int, puller: int) -> None:
    """`puller` has version `version`: once every puller has it, the published copy is released."""
    with self._cond:
      for key, (v, _, waiting) in self._live.items():
        if v == version and waiting.pop(puller, None) is not None:
          self._release_if_done(key)
          return

  def forget(self, puller: int) -> None:
    """`puller` left: what it had still to pull is taken here, in the background (the transfer server holds an
    offered copy until it is pulled, and has no way to withdraw it), and copies only it was waiting for are
    released."""
    with self._cond:
      pending = []
      for key, (_, leaves, waiting) in list(self._live.items()):
        if puller in waiting:
          pending.append((waiting.pop(puller), leaves))
          self._release_if_done(key)
    if pending:
      threading.Thread(target=self._take, args=(pending,), name=f"weight-forget-{puller}", daemon=True).start()

  def _take(self, pending: list[tuple[int, list]]) -> None:
    with self._cond:
      if self._own is None:
        self._own = self.server.connect(self.address)
    for uuid, leaves in pending:
      # If the puller had started this pull before it left, it is gone and this waits forever: a daemon thread.
      jax.block_until_ready(self._own.pull(uuid, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                                  for x in leaves]))

  def _release_if_done(self, key: int) -> None:
    if not self._live[key][2]:
      del self._live[key]
      self._cond.notify_all()

  def wait_live_below(self, n: int, timeout: float | None = None) -> bool:
    """Waits until fewer than `n` published versions are live (a version's full copy and its delta count once);
    False if `timeout` passed first."""
    with self._cond:
      return self._cond.wait_for(lambda: len({v for v, _, _ in self._live.values()}) < n, timeout)


class WeightPuller:
  """A sampler process's end: pulls a published version onto its own devices."""

  def __init__(self, *, address: str, abstract_params, tensor: int, devices: Sequence[jax.Device], host: str,
               expert: int = 1, keep: bool = False):
    """`keep`: hold the latest pulled version of each part, the base a delta (`sync.delta`) is applied to (a copy of
    the weights on the pull mesh, unless a replica shares it)."""
    self.mesh = transfer_mesh(devices, tensor, expert)
    self.keep, self._held = keep, {}  # part -> the latest pulled leaves
    self.last_nbytes = 0  # what the latest pull moved
    self.paths, self._targets = {}, {}
    for part, tree in parts(abstract_params).items():
      shardings = state_shardings(tree, self.mesh, SAMPLER_RULES)
      self.paths[part] = _leaf_paths(tree)
      self._targets[part] = jax.tree.flatten(jax.tree.map(
          lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings))
    self.address = address
    self.server = _server(devices, host)
    self._conn = self.server.connect(address)

  def pull(self, uuid: int, *, part: str = "all", timeout_s: float, codes: Sequence[int] | None = None):
    """(`part`'s tree on the pull mesh, its fingerprint); TimeoutError when the pull does not finish in time. With
    `codes` the offer is a delta (`WeightPublisher.delta`) against the latest version pulled, rebuilt here."""
    targets, treedef = self._targets[part]
    if codes is None:
      leaves = self._pull(uuid, targets, timeout_s)
      self.last_nbytes = weight_delta.nbytes(targets)
    else:
      if part not in self._held:
        raise RuntimeError(f"weight pull {uuid}: a delta of {part!r}, but this puller holds no earlier version")
      payload_targets = weight_delta.targets(targets, list(codes))
      payload = self._pull(uuid, payload_targets, timeout_s) if payload_targets else []  # [] = nothing changed
      self.last_nbytes = weight_delta.nbytes(payload_targets)
      leaves = weight_delta.apply(self._held[part], payload, list(codes))
    if self.keep:
      self._held[part] = leaves
    return jax.tree.unflatten(treedef, leaves), fingerprint(leaves)

  def _pull(self, uuid: int, targets: list, timeout_s: float) -> list[jax.Array]:
    box: dict = {}

    def work():
      try:
        leaves = self._conn.pull(uuid, targets)
        jax.block_until_ready(leaves)
        box["leaves"] = leaves
      except BaseException as e:  # pylint: disable=broad-except  # re-raised below, in the caller's thread
        box["error"] = e

    thread = threading.Thread(target=work, name=f"weight-pull-{uuid}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
      raise TimeoutError(f"weight pull {uuid} from {self.address} did not finish in {timeout_s:.0f} s "
                         "(is the learner alive?)")
    if "error" in box:
      raise RuntimeError(f"weight pull {uuid} from {self.address} failed: {box['error']}") from box["error"]
    return box["leaves"]
