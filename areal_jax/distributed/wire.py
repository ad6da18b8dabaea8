"""The control plane's message format: typed msgpack, never pickle, so a peer can send data but not code.

    data = encode(("sampler", Answer(index=0, trajectory=t)))   # bytes
    kind, payload = decode(data)                                 # an Answer again; lists where tuples were sent

Values are None, bools, ints, floats, strings, bytes, lists/tuples and dicts of them, numpy arrays and scalars, and
the records in `RECORDS` (rebuilt field by field through their constructors, so their own checks run). Anything else
is refused on the way out (TypeError naming it) and on the way in (ValueError).
"""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np

from areal_jax.distributed import messages
from areal_jax.sampler.requests import Request, SamplingParams
from areal_jax.types import Trajectory

RECORDS = {cls.__name__: cls for cls in (Trajectory, Request, SamplingParams, *messages.RECORDS)}
_ARRAY, _RECORD = 1, 2


def _default(x):
  if isinstance(x, np.ndarray):
    if x.dtype.hasobject:
      raise TypeError(f"control message: an object array ({x.dtype}) cannot be sent")
    return msgpack.ExtType(_ARRAY, msgpack.packb([x.dtype.str, list(x.shape), np.ascontiguousarray(x).tobytes()]))
  if isinstance(x, np.generic):
    return x.item()
  if dataclasses.is_dataclass(x) and type(x).__name__ in RECORDS and RECORDS[type(x).__name__] is type(x):
    fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if f.init}
    return msgpack.ExtType(_RECORD, msgpack.packb([type(x).__name__, fields], default=_default))
  raise TypeError(f"control message: {type(x).__qualname__} cannot be sent (see areal_jax.distributed.wire)")


def _as_tuples(x):
  return tuple(_as_tuples(v) for v in x) if isinstance(x, list) else x


def _ext_hook(code: int, data: bytes):
  if code == _ARRAY:
    dtype, shape, raw = msgpack.unpackb(data)
    dtype = np.dtype(dtype)
    if dtype.hasobject:
      raise ValueError(f"control message: object arrays are refused ({dtype})")
    return np.frombuffer(raw, dtype).reshape(shape).copy()
  if code == _RECORD:
    name, fields = msgpack.unpackb(data, ext_hook=_ext_hook, strict_map_key=False)
    cls = RECORDS.get(name)
    if cls is None or not isinstance(fields, dict):
      raise ValueError(f"control message: unknown record {name!r}")
    tuples = {f.name for f in dataclasses.fields(cls) if isinstance(f.default, tuple)}
    return cls(**{k: _as_tuples(v) if k in tuples else v for k, v in fields.items()})
  raise ValueError(f"control message: unknown extension type {code}")


def encode(message) -> bytes:
  return msgpack.packb(message, default=_default)


def decode(data: bytes):
  try:
    return msgpack.unpackb(data, ext_hook=_ext_hook, strict_map_key=False)
  except (TypeError, ValueError, msgpack.UnpackException) as e:
    raise ValueError(f"control message: unreadable ({type(e).__name__}: {e})") from None
