"""Trained batches on disk (`metrics.save_batches`): `<workdir>/batches/step_<N>.npz`, the scored trajectories of
learner step N (every field the learner reads: tokens, behaviour logprobs, versions, loss masks, rewards, groups,
recorded routes), to replay a step elsewhere (a NaN hunt, a single-process check of a multi-process step). Texts and
timings are not kept."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence

import numpy as np
from etils import epath

from areal_jax.types import Trajectory

_ARRAYS = ("prompt_ids", "response_ids", "logprobs", "versions")
_OPTIONAL = ("loss_mask", "routes")  # saved where not None
_SCALARS = ("finish_reason", "group_id", "reward")


def save_batch(workdir: str, step: int, trajectories: Sequence[Trajectory]) -> None:
  arrays = {f"{i}/{k}": getattr(t, k) for i, t in enumerate(trajectories) for k in _ARRAYS}
  arrays |= {f"{i}/{k}": getattr(t, k) for i, t in enumerate(trajectories) for k in _OPTIONAL
             if getattr(t, k) is not None}
  meta = [{k: getattr(t, k) for k in _SCALARS} for t in trajectories]
  buf = io.BytesIO()
  np.savez(buf, meta=np.asarray(json.dumps(meta)), **arrays)
  path = epath.Path(workdir) / "batches"
  path.mkdir(parents=True, exist_ok=True)
  (path / f"step_{step}.npz").write_bytes(buf.getvalue())


def load_batch(workdir: str, step: int) -> list[Trajectory]:
  with np.load(io.BytesIO((epath.Path(workdir) / "batches" / f"step_{step}.npz").read_bytes())) as z:
    meta = json.loads(str(z["meta"]))
    return [Trajectory(**{k: z[f"{i}/{k}"] for k in _ARRAYS}, **m,
                       **{k: z[f"{i}/{k}"] if f"{i}/{k}" in z else None for k in _OPTIONAL}) for i, m in enumerate(meta)]
