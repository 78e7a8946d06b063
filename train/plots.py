"""PNG plots of loss curves and quantization diagnostics (matplotlib, Agg)."""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from train.metrics import select  # noqa: E402


def smooth(values: Sequence[float], window: int) -> np.ndarray:
  """Trailing moving average (NaNs of skipped steps ignored)."""
  v = np.asarray(values, dtype=np.float64)
  if window <= 1 or len(v) == 0:
    return v
  ok = np.isfinite(v)
  csum = np.concatenate([[0.0], np.cumsum(np.where(ok, v, 0.0))])
  ccnt = np.concatenate([[0], np.cumsum(ok)])
  idx = np.arange(1, len(v) + 1)
  lo = np.maximum(0, idx - window)
  cnt = ccnt[idx] - ccnt[lo]
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(cnt > 0, (csum[idx] - csum[lo]) / np.maximum(cnt, 1),
                    np.nan)


def _window(n: int) -> int:
  return max(1, n // 50)


def plot_losses(runs: Mapping[str, Sequence[Mapping[str, Any]]],
                path: str | os.PathLike, *, title: str = "") -> str:
  """Training (smoothed) and validation loss of one or more runs vs step.

  Args:
    runs: label -> that run's metric records.
    path: the PNG to write.
    title: figure title.

  Returns:
    `path` as a string.
  """
  fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(11, 4.2))
  for i, (label, records) in enumerate(runs.items()):
    color = f"C{i}"
    train = select(records, "train")
    if train:
      steps = [r["step"] for r in train]
      loss = [r["loss"] if r.get("finite", True) else float("nan")
              for r in train]
      ax_t.plot(steps, loss, color=color, alpha=0.2, lw=0.8)
      ax_t.plot(steps, smooth(loss, _window(len(loss))), color=color,
                label=label)
    evals = select(records, "eval")
    if evals:
      ax_v.plot([r["step"] for r in evals], [r["val_loss"] for r in evals],
                "o-", color=color, label=label, ms=3)
  ax_t.set(xlabel="step", ylabel="train loss (nats/token)",
           title="training loss (raw and smoothed)")
  ax_v.set(xlabel="step", ylabel="validation loss (nats/token)",
           title="validation loss")
  for ax in (ax_t, ax_v):
    ax.grid(alpha=0.3)
    if ax.lines:
      ax.legend()
  _zoom(ax_t)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return os.fspath(path)


def _zoom(ax) -> None:
  """Clips the y axis to the later part of training (the start is steep)."""
  ys = np.concatenate([np.asarray(l.get_ydata(), float) for l in ax.lines]
                      or [np.zeros(0)])
  ys = ys[np.isfinite(ys)]
  if len(ys) > 10:
    lo, hi = np.percentile(ys, 0.5), np.percentile(ys, 90)
    ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.1 * (hi - lo))


def plot_diagnostics(records: Sequence[Mapping[str, Any]],
                     path: str | os.PathLike, *, title: str = "") -> str | None:
  """Per-layer NVFP4 quantization diagnostics of one run.

  Top: for each NVFP4Dense layer at the last sample, the fraction of nonzero
  values flushed to zero and the fraction of saturated blocks, for the layer
  input X and the weight W. Bottom: the same, averaged over layers, vs step.
  Layers the run's rules keep in high precision are marked "(hp)".

  Returns:
    `path`, or None when the records hold no diagnostics.
  """
  diags = select(records, "diag")
  if not diags:
    return None
  last = diags[-1]["layers"]
  names = list(last)
  labels = [n + ("" if last[n].get("quantized", True) else " (hp)")
            for n in names]
  keys = (("x_flushed", "X flushed to zero"), ("w_flushed", "W flushed to zero"),
          ("x_saturated", "X saturated blocks"),
          ("w_saturated", "W saturated blocks"))
  fig, (ax_l, ax_s) = plt.subplots(
      2, 1, figsize=(max(8, 0.35 * len(names) + 3), 8))
  x = np.arange(len(names))
  width = 0.2
  for i, (k, desc) in enumerate(keys):
    ax_l.bar(x + (i - 1.5) * width, [last[n][k] for n in names], width,
             label=desc)
  ax_l.set_xticks(x, labels, rotation=75, ha="right", fontsize=7)
  ax_l.set(ylabel="fraction", yscale="symlog",
           title=f"per layer at step {diags[-1]['step']}")
  ax_l.set_yscale("symlog", linthresh=1e-4)
  ax_l.legend(fontsize=8)
  ax_l.grid(alpha=0.3, axis="y")
  steps = [d["step"] for d in diags]
  for k, desc in keys:
    ax_s.plot(steps, [np.mean([d["layers"][n][k] for n in d["layers"]])
                      for d in diags], "o-", ms=3, label=desc)
  ax_s.set(xlabel="step", ylabel="mean over layers", title="over training")
  ax_s.set_yscale("symlog", linthresh=1e-4)
  ax_s.legend(fontsize=8)
  ax_s.grid(alpha=0.3)
  fig.suptitle(title or "NVFP4 quantization diagnostics (RTNE, 1x16 X, 16x16 W)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return os.fspath(path)
