"""Output for people: metrics as JSONL and a progress bar on stderr.

Every record is one JSON object per line with a `kind`:

- `{"kind": "train", "step", "loss", "grad_norm", "lr", "finite", "tokens",
  "time"}` — one per optimizer step (`step` counts from 1; `finite` is false
  for a skipped NaN/Inf step, whose update was not applied);
- `{"kind": "eval", "step", "val_loss"}`;
- `{"kind": "diag", "step", "layers": {path: {...}}}` — quantization
  diagnostics (see `train.diagnostics`).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from typing import Any, Iterable, TextIO

import tqdm


class MemoryLog:
  """A `MetricsLog` that keeps its records in memory (`records`): the log
  of a process other than the first in a multi-process run, which writes
  the run's files."""

  def __init__(self, records: list[dict[str, Any]] | None = None):
    self.records = list(records or [])

  def write(self, record: dict[str, Any]) -> None:
    self.records.append(json.loads(json.dumps(record, allow_nan=True)))

  def close(self) -> None:
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class MetricsLog:
  """Appends records to a JSONL file (flushed on every write)."""

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._f = open(self.path, "a", encoding="utf-8")

  def write(self, record: dict[str, Any]) -> None:
    self._f.write(json.dumps(record, allow_nan=True) + "\n")
    self._f.flush()

  def close(self) -> None:
    self._f.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
  """All records of a JSONL metrics file (a torn last line is ignored)."""
  records = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return records


def truncate_metrics(path: str | os.PathLike, last_step: int) -> None:
  """Drops the records after `last_step`: a resumed run rewrites those steps.

  Written to a temporary file and renamed, so a crash leaves either version.
  """
  path = pathlib.Path(path)
  if not path.exists():
    return
  keep = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
  tmp = path.with_suffix(path.suffix + ".tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    for r in keep:
      f.write(json.dumps(r, allow_nan=True) + "\n")
  os.replace(tmp, path)


def select(records: Iterable[dict[str, Any]], kind: str) -> list[dict]:
  return [r for r in records if r.get("kind") == kind]


class _Lines:
  """A stream for tqdm where the output is not a terminal (a log file, CI):
  each redraw of the bar becomes a line of its own instead of a `\r`
  overwrite."""

  def __init__(self, stream: TextIO):
    self._stream = stream
    self._last = None

  def write(self, text: str) -> None:
    line = text.replace("\r", "").rstrip()
    if line and line != self._last:
      self._last = line
      self._stream.write(line + "\n")

  def flush(self) -> None:
    self._stream.flush()


class Progress:
  """A tqdm progress bar of the optimizer steps: step, loss, tokens/s, ETA.

  On a terminal the bar is redrawn in place; otherwise (logs, CI) a plain
  line is printed about every 10% of the run. `enabled=False` prints nothing.
  The bar starts at the first `update`, so the rates and the ETA leave out
  the compilation that the first step includes.

  Args:
    total: the run's last step.
    start: the step the run starts from (a resumed run's checkpoint).
    label: shown before the bar (e.g. the precision).
    enabled: False prints nothing.
    stream: where the bar goes (default stderr).
  """

  def __init__(self, total: int, *, start: int = 0, label: str = "",
               enabled: bool = True, stream: TextIO | None = None):
    self.total = total
    self.start = start
    self.label = label.strip()
    self.enabled = enabled and total > start
    self.stream = sys.stderr if stream is None else stream
    self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
    self._bar = None
    self._tokens = 0

  def update(self, step: int, loss: float, tokens: int) -> None:
    """Reports that `step` is done; `tokens` processed since the last call."""
    if not self.enabled:
      return
    if self._bar is None:
      # The first update includes compilation: rates start after it.
      tenth = -((step - self.total) // 10)  # Steps in 10% of the rest.
      self._bar = tqdm.tqdm(
          total=self.total, initial=step, desc=self.label or None,
          unit="step", file=self.stream if self.tty else _Lines(self.stream),
          dynamic_ncols=self.tty, smoothing=0, leave=True,
          mininterval=0.1 if self.tty else 0,
          miniters=None if self.tty else max(1, tenth),
          bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} "
          "[{elapsed}<{remaining}{postfix}]",
          postfix=f"loss {loss:.4f}, ? tok/s")
      return
    self._tokens += tokens
    elapsed = self._bar.format_dict["elapsed"]
    rate = (f"{tqdm.tqdm.format_sizeof(self._tokens / elapsed)} tok/s"
            if elapsed > 0 else "? tok/s")
    self._bar.set_postfix_str(f"loss {loss:.4f}, {rate}", refresh=False)
    self._bar.update(step - self._bar.n)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None
