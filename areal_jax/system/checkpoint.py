"""Orbax checkpoints of a run: named items, asynchronous saves, local or gs://.

Items per step: `params` and `opt_state` (array trees, restored straight onto the learner's shardings) and `meta`
(JSON: learner step, policy version, data iterator state, RNG, model config, rollout counters).
"""

from __future__ import annotations

from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:

  def __init__(self, directory: str, *, every_steps: int, max_to_keep: int = 3):
    self.directory = epath.Path(directory)
    self.every_steps = every_steps
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=True,
                                           create=True)
    self._mngr = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def save(self, step: int, *, params, opt_state, meta: dict[str, Any], force: bool = False) -> bool:
    """Saves at multiples of `every_steps` (or always with `force`); returns whether a save started."""
    if not force and step % self.every_steps:
      return False
    if step in self._mngr.all_steps():
      return False
    return self._mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta)), force=True)

  def restore(self, step: int, *, params, opt_state) -> tuple[Any, Any, dict[str, Any]]:
    """Restores onto the shardings of the given (live or abstract) `params` / `opt_state` trees."""
    out = self._mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(_abstract(params)), opt_state=ocp.args.StandardRestore(_abstract(opt_state)),
        meta=ocp.args.JsonRestore()))
    return out.params, out.opt_state, out.meta

  def read_meta(self, step: int) -> dict[str, Any]:
    """The JSON `meta` item of `step` alone (no arrays read)."""
    return self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()
