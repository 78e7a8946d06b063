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
import math
import os
import pathlib
import sys
import time
from typing import Any, Iterable, TextIO


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


def _fmt_time(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _fmt_rate(x: float) -> str:
  for unit, scale in (("M", 1e6), ("k", 1e3)):
    if x >= scale:
      return f"{x / scale:.1f}{unit}"
  return f"{x:.0f}"


class Progress:
  """A one-line progress bar: step, loss, tokens/s, ETA.

  On a terminal the line is redrawn in place; otherwise (logs, CI) a plain
  line is printed about every 10% of the run. `enabled=False` prints nothing.
  """

  def __init__(self, total: int, *, start: int = 0, label: str = "",
               enabled: bool = True, stream: TextIO | None = None):
    self.total = total
    self.start = start
    self.label = label
    self.enabled = enabled and total > start
    self.stream = sys.stderr if stream is None else stream
    self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
    self._t0 = None
    self._tokens = 0
    self._last_print = -1
    self._open = False

  def update(self, step: int, loss: float, tokens: int) -> None:
    """Reports that `step` is done; `tokens` processed since the last call."""
    if not self.enabled:
      return
    now = time.perf_counter()
    if self._t0 is None:
      # The first update includes compilation: rates start after it.
      self._t0, self._first = now, step
      self._tokens = 0
    else:
      self._tokens += tokens
    elapsed = now - self._t0
    done = step - self._first
    rate = self._tokens / elapsed if elapsed > 0 and done else float("nan")
    eta = (self.total - step) * elapsed / done if done else float("nan")
    width = 24
    filled = int(width * step / self.total)
    line = (f"{self.label}[{'#' * filled}{'.' * (width - filled)}] "
            f"{step}/{self.total} loss {loss:.4f} "
            f"{_fmt_rate(rate) if math.isfinite(rate) else '?'} tok/s "
            f"ETA {_fmt_time(eta)}")
    if self.tty:
      self.stream.write("\r" + line + "\x1b[K")
      self._open = step < self.total
      if not self._open:
        self.stream.write("\n")
      self.stream.flush()
    else:
      tenth = (10 * (step - self.start)) // max(1, self.total - self.start)
      if tenth != self._last_print or step >= self.total:
        self._last_print = tenth
        self.stream.write(line + "\n")
        self.stream.flush()

  def close(self) -> None:
    if self._open:
      self._open = False
      self.stream.write("\n")
      self.stream.flush()
