"""Periodic, atomic, resumable checkpoints with orbax.

A checkpoint holds the whole training state (step, parameters, optimizer state
with the FP32 master weights, the skipped-step count) and the run's
`TrainConfig` as JSON. Orbax writes each step into a temporary directory and
renames it when complete, so a run killed mid-save leaves the previous
checkpoint intact (and the partial one is cleaned up on the next start).
Saving is synchronous: when `save` returns, the step is on disk.

The data order and every random key are functions of `(seed, step)`, so
restoring the state is all a resumed run needs to continue bit-identically.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves and restores `(state, config dict)` under `directory`.

  Args:
    directory: where step directories go (created if missing).
    keep: how many most recent checkpoints to keep.
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int = 2):
    self.directory = pathlib.Path(directory).resolve()
    self._mngr = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False,
            cleanup_tmp_directories=True))

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def save(self, step: int, state: Any, config: dict[str, Any]) -> None:
    """Writes `state` at `step` (overwriting nothing: steps are unique)."""
    if step in self._mngr.all_steps():
      return
    self._mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        config=ocp.args.JsonSave(config)))
    self._mngr.wait_until_finished()

  def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
    """The state saved at `step`, shaped and typed like `like`, and its config.

    Args:
      step: a step from `latest_step()`.
      like: a state pytree (or `jax.ShapeDtypeStruct`s) of the same structure.
    """
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract),
        config=ocp.args.JsonRestore()))
    return out["state"], dict(out["config"])

  def close(self) -> None:
    self._mngr.close()
