"""Periodic, atomic, resumable checkpoints with orbax.

A checkpoint holds the whole training state (step, parameters, optimizer state
with the FP32 master weights, the skipped-step count) and the run's
configuration as JSON. Orbax writes each step into a temporary directory
(`<step>.orbax-checkpoint-tmp`) and renames it when complete, so a run killed
mid-save leaves the previous checkpoint intact; the partial one is deleted
when the directory is next opened.

Saves are asynchronous where asked (`Checkpointer(asynchronous=True)`, what
`train.loop.Trainer` uses): `save` returns once the state is copied off the
devices, and orbax writes it in a background thread while training goes
on. A step counts as saved (`all_steps`, `latest_step`) only when its
directory has been renamed into place, and the checkpoint that `keep`
retires is deleted only after that: a run killed mid-write keeps every
checkpoint it had. The next `save`, `wait` and `close` wait for a write in
flight (and raise its error, if it failed). Synchronous saves
(`asynchronous=False`, the default) return with the step on disk.

The data order and every random key are functions of `(seed, step)`, so
restoring the state is all a resumed run needs to continue bit-identically.

Each saved step records the size of every file of its state (`FILES`), so
a truncated or missing array file is found before orbax reads it. A step directory
that exists but does not restore (truncated array files, a garbled config,
a missing `state/`) is damaged: `restore_latest` skips it,
names it and why, and restores the newest one that does; a writable
`Checkpointer` renames it `<step>.damaged` (nothing is deleted), so the run
saves that step anew.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp


class NoCheckpointError(FileNotFoundError):
  """`--resume` found no complete checkpoint."""


class ConfigMismatchError(ValueError):
  """`--resume` found a checkpoint written with another configuration."""


class DamagedCheckpointsError(NoCheckpointError):
  """Every checkpoint of the directory is damaged (none restores)."""


class RunExistsError(FileExistsError):
  """A run would start anew where checkpoints exist, unasked to replace them."""


DAMAGED_SUFFIX = ".damaged"
# In each step directory: `{relative path: size in bytes}` of the files of
# its state (the arrays; the config is checked by parsing it).
FILES = "nvfp4_files.json"


def existing_checkpoints(directory: str | os.PathLike) -> list[str]:
  """Names of the checkpoints under `directory`, complete or damaged (step
  directories and ones set aside as `<step>.damaged`), oldest first; not
  the temporary directories of interrupted saves."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    return []
  names = [p.name for p in directory.iterdir() if p.is_dir() and re.fullmatch(
      rf"\d+({re.escape(DAMAGED_SUFFIX)}\d*)?", p.name)]
  return sorted(names, key=lambda n: (int(n.split(".")[0]), n))


def _first_line(e: BaseException, limit: int = 160) -> str:
  text = (str(e).strip().splitlines() or [type(e).__name__])[0]
  text = f"{type(e).__name__}: {text}"
  return text if len(text) <= limit else text[:limit - 3] + "..."


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
                   defaults: dict[str, Any] | None = None,
                   ignore: tuple[str, ...] = ()) -> list[str]:
  """`"group.field: saved -> current"` for each field that differs.

  `defaults` (grouped like `current`): a field the saved configuration does
  not have (one a later version added) is unchanged where its current value
  is its default, which reproduces the older version's behaviour.
  `ignore`: fields ("group.field") the caller reconciles itself (e.g. a
  parameter layout it converts after restoring).
  """
  # Through JSON, as the saved one was: a tuple compares equal to its list.
  current = json.loads(json.dumps(current))
  defaults = _flatten(json.loads(json.dumps(defaults or {})))
  saved, current = _flatten(saved), _flatten(current)
  return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
          for k in sorted(set(saved) | set(current))
          if saved.get(k) != current.get(k) and k not in ignore
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
    asynchronous: `save` returns once the state is off the devices and the
      write goes on in the background (see the module's docstring); False:
      `save` returns when the step is on disk.
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int = 2,
               read_only: bool = False, asynchronous: bool = False):
    self.directory = pathlib.Path(directory).resolve()
    self._read_only = read_only
    self.asynchronous = asynchronous
    self._writing: int | None = None  # The step of a write in flight.
    if not read_only:
      self._remove_partial_saves()
    # Orbax's own cleanup of partial saves (`cleanup_tmp_directories`) runs
    # in a background thread that `close()` does not wait for: when the
    # process exits right after opening the directory (e.g. `--resume` finds
    # only a partial save and stops with an error), the thread is cut off at
    # interpreter shutdown and prints "RuntimeError: cannot schedule new
    # futures after interpreter shutdown". Removing them synchronously above
    # leaves no thread behind.
    # Both kinds of save go through orbax's asynchronous checkpointer (a
    # synchronous save waits for it): its callback records `FILES` in the
    # temporary directory before the rename, so a step directory has it
    # from the moment it exists.
    self._mngr = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=not read_only, read_only=read_only,
            enable_async_checkpointing=True, cleanup_tmp_directories=False,
            async_options=ocp.AsyncOptions(
                post_finalization_callback=self._record_files)))

  def _remove_partial_saves(self) -> None:
    if not self.directory.is_dir():
      return
    for name in ocp.step.tmp_checkpoints(self.directory):
      shutil.rmtree(self.directory / name, ignore_errors=True)

  def latest_step(self) -> int | None:
    """The newest complete step; None if there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def all_steps(self) -> list[int]:
    """Every complete step, oldest first: not one still being written
    (orbax lists it from the start of its save)."""
    return sorted(s for s in self._mngr.all_steps()
                  if s != self._writing or self.path(s).is_dir())

  def path(self, step: int) -> pathlib.Path:
    """The directory of `step`."""
    return self.directory / str(step)

  def damage(self, step: int) -> str | None:
    """Why `step` cannot restore, found without reading its arrays (no
    `state/`, a config that is not a JSON object); None if it looks whole."""
    path = self.path(step)
    if not (path / "state").is_dir():
      return "it has no state/ directory"
    meta = path / "config" / "metadata"
    try:
      config = json.loads(meta.read_text())
    except FileNotFoundError:
      return "it has no config/metadata file"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      return f"its config/metadata is not valid JSON ({_first_line(e)})"
    if not isinstance(config, dict):
      return "its config/metadata is not a JSON object"
    try:
      sizes = json.loads((path / FILES).read_text())
    except (OSError, ValueError):
      sizes = {}  # Saved by an older version, or killed before writing it.
    for name, size in sizes.items() if isinstance(sizes, dict) else ():
      try:
        now = (path / name).stat().st_size
      except OSError:
        return f"its file {name} is missing"
      if now != size:
        return (f"its file {name} has {now} bytes, {size} when saved "
                f"(truncated or overwritten)")
    return None

  def restore_latest(self, like: Any, *,
                     config: dict[str, Any] | None = None,
                     config_defaults: dict[str, Any] | None = None,
                     ignore: tuple[str, ...] = (),
                     on_skip: Any = None,
                     fix: str = "start the run again with --overwrite (or "
                                "another --out)"
                     ) -> tuple[int, Any, dict[str, Any]]:
    """The newest checkpoint that restores: `(step, state, saved config)`.

    A damaged newer checkpoint is skipped: `on_skip(path, reason)` is
    called with its directory and why it does not restore, and a writable
    `Checkpointer` renames it `<step>.damaged` (so the run can save that
    step again; nothing is deleted).

    Args:
      like, config, config_defaults, ignore: as `restore`.
      on_skip: called for each skipped checkpoint (default: nothing).
      fix: what to do when none restores, for the message.

    Raises:
      NoCheckpointError: no complete checkpoint.
      DamagedCheckpointsError: none restores (a `NoCheckpointError`); the
        message names each one and why.
      ConfigMismatchError: the newest checkpoint that reads was written by
        a different configuration.
    """
    steps = self.all_steps()
    damaged = existing_checkpoints(self.directory)
    if not steps and damaged:
      raise DamagedCheckpointsError(
          f"{self.directory} holds only damaged checkpoints "
          f"({', '.join(damaged)}); {fix}.")
    if not steps:
      raise NoCheckpointError(
          f"--resume: no complete checkpoint in {self.directory}; run "
          f"without --resume to start this run.")
    skipped = []
    for step in reversed(steps):
      reason = self.damage(step)
      if reason is None:
        try:
          state, saved = self.restore(step, like, config=config,
                                      config_defaults=config_defaults,
                                      ignore=ignore)
          return step, state, saved
        except ConfigMismatchError:
          raise
        except Exception as e:  # pylint: disable=broad-except
          # Orbax and TensorStore raise many types for unreadable bytes
          # (OUT_OF_RANGE, DATA_LOSS, ValueError, KeyError...).
          reason = f"its arrays do not read ({_first_line(e)})"
      path = self.path(step)
      if not self._read_only:
        path = self._set_aside(step)
        reason += f"; kept as {path.name}"
      skipped.append(f"{path} ({reason})")
      if on_skip is not None:
        on_skip(path, reason)
    raise DamagedCheckpointsError(
        f"no checkpoint in {self.directory} restores: "
        f"{'; '.join(skipped)}; {fix}.")

  def _set_aside(self, step: int) -> pathlib.Path:
    """Renames a damaged step directory out of orbax's sight."""
    src = self.path(step)
    dst = src.with_name(f"{step}{DAMAGED_SUFFIX}")
    n = 1
    while dst.exists():
      n += 1
      dst = src.with_name(f"{step}{DAMAGED_SUFFIX}{n}")
    src.rename(dst)
    self._mngr.reload()
    return dst

  def save(self, step: int, state: Any, config: dict[str, Any]) -> bool:
    """Writes `state` at `step` (overwriting nothing: steps are unique).

    Waits for the write in flight first. Asynchronous: returns once the
    state is copied off the devices (the caller may then donate or change
    its arrays); else when the step is on disk.

    Returns:
      False if `step` was already saved (or is being written), else True.
    """
    if step in self._mngr.all_steps():
      return False
    self.wait()
    self._writing = step
    self._mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        config=ocp.args.JsonSave(config)))
    if not self.asynchronous:
      self.wait()
    return True

  def wait(self) -> None:
    """Waits until the write in flight (if any) is on disk.

    Raises:
      Whatever the background write raised (orbax re-raises it here).
    """
    self._mngr.wait_until_finished()
    self._writing = None

  def _record_files(self) -> None:
    """Writes `FILES` into the temporary directory of the step being
    finalized (orbax's callback, on the first process, after every
    process's arrays are written and before the rename)."""
    step = self._writing
    prefix = f"{step}{ocp.step.TMP_DIR_SUFFIX}"
    tmps = [p for p in self.directory.iterdir()
            if p.is_dir() and p.name.startswith(prefix)]
    if len(tmps) != 1:
      raise RuntimeError(
          f"saving step {step}: expected one temporary directory "
          f"{prefix}* in {self.directory}, found "
          f"{sorted(p.name for p in tmps)}")
    path = tmps[0]
    sizes = {str(p.relative_to(path)): p.stat().st_size
             for p in sorted((path / "state").rglob("*")) if p.is_file()}
    (path / FILES).write_text(json.dumps(sizes, indent=0) + "\n")

  def saved_config(self, step: int) -> dict[str, Any]:
    """The configuration saved with `step` (the state is not read)."""
    out = self._mngr.restore(step, args=ocp.args.Composite(
        config=ocp.args.JsonRestore()))
    return dict(out["config"])

  def restore(self, step: int, like: Any, *,
              config: dict[str, Any] | None = None,
              config_defaults: dict[str, Any] | None = None,
              ignore: tuple[str, ...] = ()
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
      ignore: fields ("group.field") left out of the comparison: the
        caller reconciles them with the saved configuration it is given
        back (`train.loop.Trainer` converts the GPT's fused layout).

    Raises:
      ConfigMismatchError: `config` differs from the saved configuration;
        the message names every field that changed.
    """
    saved = self.saved_config(step)
    if config is not None:
      changes = config_changes(saved, config, config_defaults, ignore)
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
