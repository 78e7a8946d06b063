"""Periodic, atomic, resumable checkpoints with orbax.

A checkpoint holds the whole training state (step, parameters, optimizer state
with the FP32 master weights, the skipped-step count) and the run's
configuration as JSON. Orbax writes each step into a temporary directory
(`<step>.orbax-checkpoint-tmp`) and renames it when complete, so a run killed
mid-save leaves the previous checkpoint intact; the partial one is deleted
when the directory is next opened. Saving is synchronous: when `save`
returns, the step is on disk.

The data order and every random key are functions of `(seed, step)`, so
restoring the state is all a resumed run needs to continue bit-identically.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp


class NoCheckpointError(FileNotFoundError):
  """`--resume` found no complete checkpoint."""


class ConfigMismatchError(ValueError):
  """`--resume` found a checkpoint written with another configuration."""


def _flatten(config: dict[str, Any]) -> dict[str, Any]:
  """`{"train": {"lr": ...}}` -> `{"train.lr": ...}`."""
  flat = {}
  for group, fields in config.items():
    if isinstance(fields, dict):
      flat.update({f"{group}.{k}": v for k, v in fields.items()})
    else:
      flat[group] = fields
  return flat


def config_changes(saved: dict[str, Any], current: dict[str, Any],
                   defaults: dict[str, Any] | None = None) -> list[str]:
  """`"group.field: saved -> current"` for each field that differs.

  `defaults` (grouped like `current`): a field the saved configuration does
  not have (one a later version added) is unchanged where its current value
  is its default, which reproduces the older version's behaviour.
  """
  # Through JSON, as the saved one was: a tuple compares equal to its list.
  current = json.loads(json.dumps(current))
  defaults = _flatten(json.loads(json.dumps(defaults or {})))
  saved, current = _flatten(saved), _flatten(current)
  return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
          for k in sorted(set(saved) | set(current))
          if saved.get(k) != current.get(k)
          and not (k not in saved and k in defaults
                   and current.get(k) == defaults[k])]


class Checkpointer:
  """Saves and restores `(state, config dict)` under `directory`.

  Args:
    directory: where step directories go (created if missing).
    keep: how many most recent checkpoints to keep.
    read_only: only read (e.g. to export a run that may still be training):
      create nothing, and leave the temporary directory of a save that may
      be in progress alone.
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int = 2,
               read_only: bool = False):
    self.directory = pathlib.Path(directory).resolve()
    if not read_only:
      self._remove_partial_saves()
    # Orbax's own cleanup of partial saves (`cleanup_tmp_directories`) runs
    # in a background thread that `close()` does not wait for: when the
    # process exits right after opening the directory (e.g. `--resume` finds
    # only a partial save and stops with an error), the thread is cut off at
    # interpreter shutdown and prints "RuntimeError: cannot schedule new
    # futures after interpreter shutdown". Removing them synchronously above
    # leaves no thread behind.
    self._mngr = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=not read_only, read_only=read_only,
            enable_async_checkpointing=False, cleanup_tmp_directories=False))

  def _remove_partial_saves(self) -> None:
    if not self.directory.is_dir():
      return
    for name in ocp.step.tmp_checkpoints(self.directory):
      shutil.rmtree(self.directory / name, ignore_errors=True)

  def latest_step(self) -> int | None:
    """The newest complete step; None if there is none."""
    return self._mngr.latest_step()

  def save(self, step: int, state: Any, config: dict[str, Any]) -> None:
    """Writes `state` at `step` (overwriting nothing: steps are unique)."""
    if step in self._mngr.all_steps():
      return
    self._mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        config=ocp.args.JsonSave(config)))
    self._mngr.wait_until_finished()

  def saved_config(self, step: int) -> dict[str, Any]:
    """The configuration saved with `step` (the state is not read)."""
    out = self._mngr.restore(step, args=ocp.args.Composite(
        config=ocp.args.JsonRestore()))
    return dict(out["config"])

  def restore(self, step: int, like: Any, *,
              config: dict[str, Any] | None = None,
              config_defaults: dict[str, Any] | None = None
              ) -> tuple[Any, dict[str, Any]]:
    """The state saved at `step`, shaped and typed like `like`, and its config.

    Args:
      step: a step from `latest_step()`.
      like: a state pytree (or `jax.ShapeDtypeStruct`s, with shardings) of
        the same structure.
      config: the configuration the caller runs with: checked against the
        saved one before the state is read (a different model would not
        even have the same parameter shapes).
      config_defaults: the defaults of `config`'s fields (`config_changes`):
        a checkpoint of an older version resumes where the fields it lacks
        keep their defaults.

    Raises:
      ConfigMismatchError: `config` differs from the saved configuration;
        the message names every field that changed.
    """
    saved = self.saved_config(step)
    if config is not None:
      changes = config_changes(saved, config, config_defaults)
      if changes:
        hint = ""
        if any(c.startswith("model.vocab_size:") for c in changes):
          hint = (" (model.vocab_size follows the data's vocabulary: resume "
                  "with the --data the run started with)")
        raise ConfigMismatchError(
            f"--resume: the checkpoint in {self.directory} was written by a "
            f"different configuration ({', '.join(changes)}){hint}; use the "
            f"same flags or a new --out.")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))
    return out["state"], saved

  def close(self) -> None:
    self._mngr.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
