"""What a run tells people: its one-line description, diagnostics, result.

- `describe`: model size, precision and how many projections are quantized;
- `diag_record`: the per-layer quantization statistics of one evaluation,
  each layer flagged by what its forward GEMM runs at that step;
- `finish`: the `RunResult` of a finished run, with its loss and diagnostics
  plots.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any, Iterable, Mapping

import jax
import numpy as np

import nvfp4_jax
from models import GPTConfig
from models import format_count
from models import param_count
from train.config import TrainConfig
from train.metrics import read_metrics
from train.metrics import select
from train.plots import plot_diagnostics
from train.plots import plot_losses


@dataclasses.dataclass
class RunResult:
  """What a finished run reports.

  Attributes:
    config: the run's `TrainConfig`.
    out_dir: the run directory.
    metrics_path: its JSONL metrics.
    loss_plot: PNG of its loss curves.
    diag_plot: PNG of its quantization diagnostics (None if off).
    final_train_loss: mean training loss over the last 10% of steps.
    final_val_loss: validation loss at the last step.
    skipped: number of skipped (non-finite) steps.
    records: all metric records.
    params: the final FP32 master parameters.
    step: the number of completed steps (`config.steps` unless stopped).
    checkpoint: the directory of the checkpoint of `step`.
    stopped: the name of the signal that stopped the run before
      `config.steps` ("SIGTERM", "SIGINT"; `Trainer.run(handle_signals=
      True)`), None if it ran to the end.
  """

  config: TrainConfig
  out_dir: pathlib.Path
  metrics_path: pathlib.Path
  loss_plot: str
  diag_plot: str | None
  final_train_loss: float
  final_val_loss: float
  skipped: int
  records: list[dict[str, Any]]
  params: Any
  step: int | None = None
  checkpoint: pathlib.Path | None = None
  stopped: str | None = None


def describe(cfg: TrainConfig, model_cfg: GPTConfig,
             rules: nvfp4_jax.PrecisionRules, layer_paths: Iterable[str]
             ) -> str:
  """One line: model size, precision, which layers are quantized.

  Args:
    cfg: the run's `TrainConfig`.
    model_cfg: its model's `GPTConfig`.
    rules: its precision rules.
    layer_paths: the module paths of the model's NVFP4 layers.
  """
  paths = list(layer_paths)
  # At the start of the run, before any late switch.
  quantized = sum(rules.recipe_at(p).quantized for p in paths)
  m = model_cfg
  name = cfg.preset if cfg.init_from is None else f"from {cfg.init_from}"
  return (f"GPT {name}: {format_count(param_count(m))} params "
          f"(d_model {m.d_model}, {m.num_layers} layers, {m.mlp}, "
          f"{m.dtype}); {cfg.precision}: {quantized}/{len(paths)} "
          f"projections quantized")


def gemm_report(train_step, state_like: Any, batch_like: Any
                ) -> nvfp4_jax.Report:
  """`nvfp4_jax.report` of one train step, traced abstractly (no FLOPs).

  Args:
    train_step: the pure step `(state, batch) -> (state, metrics)`.
    state_like, batch_like: arrays or `jax.ShapeDtypeStruct`s of its inputs.
  """
  return nvfp4_jax.report(train_step, state_like, batch_like)


def diag_record(rules: nvfp4_jax.PrecisionRules,
                stats: Mapping[str, Mapping[str, Any]], step: int
                ) -> dict[str, dict[str, Any]]:
  """The `layers` field of a "diag" metrics record.

  Args:
    rules: the run's precision rules.
    stats: `{layer path: {stat name: scalar}}` from the evaluation.
    step: the number of completed steps when they were measured.

  Returns:
    `{layer path: {stat name: float, "quantized": bool}}`, where `quantized`
    says whether the layer's forward GEMM runs in a low-precision format at
    `step` (the late switch included).
  """
  return {path: {**{k: float(v) for k, v in s.items()},
                 "quantized": rules.recipe_at(path, step).gemm_format(
                     "fprop") != "bf16"}
          for path, s in stats.items()}


def finish(cfg: TrainConfig, out: pathlib.Path, metrics_path: pathlib.Path,
           *, skipped: int, master_params: Any,
           records: list[dict[str, Any]] | None = None,
           plot: bool = True) -> RunResult:
  """Reads back a finished run's metrics, plots them and sums them up.

  Args:
    cfg: the run's `TrainConfig`.
    out: the run directory (the plots go there).
    metrics_path: its JSONL metrics.
    skipped: the final state's count of skipped steps.
    master_params: the final FP32 master parameters (on the host).
    records: the metric records of a process that writes no files (not
      the first of a multi-process run): summed up, not plotted.
    plot: draw the plots (False: `loss_plot` and `diag_plot` are None).

  Returns:
    The `RunResult`.
  """
  plots = records is None and plot
  if records is None:
    records = read_metrics(metrics_path)
  train = [r["loss"] for r in select(records, "train") if r["finite"]]
  tail = train[-max(1, len(train) // 10):]
  evals = select(records, "eval")
  title = (f"GPT {cfg.preset}, {cfg.precision}, {cfg.steps} steps x "
           f"{cfg.batch_size} x {cfg.seq_len} tokens")
  loss_plot = diag_plot = None
  if plots:
    loss_plot = plot_losses({cfg.precision: records}, out / "loss.png",
                            title=title)
    diag_plot = plot_diagnostics(
        records, out / "diagnostics.png",
        title=f"NVFP4 quantization diagnostics — {cfg.preset}, "
              f"{cfg.precision} run")
  return RunResult(
      config=cfg, out_dir=out, metrics_path=metrics_path,
      loss_plot=loss_plot, diag_plot=diag_plot,
      final_train_loss=float(np.mean(tail)) if tail else math.nan,
      final_val_loss=evals[-1]["val_loss"] if evals else math.nan,
      skipped=skipped, records=records, params=_on_host(master_params))


def _on_host(tree: Any) -> Any:
  """`tree` as NumPy arrays; arrays split over several processes' devices
  are gathered from all of them (every process calls this)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return jax.tree.map(
      lambda a: (multihost_utils.process_allgather(a, tiled=True)
                 if isinstance(a, jax.Array) and not a.is_fully_addressable
                 else jax.device_get(a)), tree)
