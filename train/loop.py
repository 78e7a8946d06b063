"""The training loop: a jitted step, evaluation, checkpoints, metrics, plots.

One optimizer step (`Trainer.train_step`, one `jax.jit`):

1. the batch `[grad_accum, micro_batch, seq_len + 1]` is consumed by a
   `lax.scan` over micro-batches, each a forward and backward pass of the GPT
   under the run's `nvfp4_jax.precision_rules` (traced `step`, so the late
   switch flips without recompiling) with a fresh stochastic-rounding key
   `fold_in(fold_in(sr_key, step), micro)` on the "nvfp4" RNG stream;
2. the mean loss and FP32 gradients decide: if any is NaN/Inf the step is
   skipped — parameters and optimizer state are returned unchanged (a
   `lax.cond`), and `skipped` counts it;
3. otherwise `master_weights(chain(clip_by_global_norm, adamw(WSD)))` updates
   the FP32 master and the model's parameters.

Everything that varies between steps is a function of `(seed, step)` or of the
state, so a run restored from a checkpoint continues bit-identically.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import shutil
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import nvfp4_jax
from models import GPT
from models import GPTConfig
from models import format_count
from models import param_count
from models import preset as model_preset
from train import data as data_lib
from train.checkpoint import Checkpointer
from train.config import TrainConfig
from train.diagnostics import with_diagnostics
from train.metrics import MetricsLog
from train.metrics import Progress
from train.metrics import read_metrics
from train.metrics import select
from train.metrics import truncate_metrics
from train.optim import make_optimizer
from train.plots import plot_diagnostics
from train.plots import plot_losses


class TrainState(NamedTuple):
  """Everything a checkpoint holds.

  Attributes:
    step: int32, optimizer steps taken (skipped ones included).
    params: the model's parameters (in the compute dtype).
    opt_state: the `master_weights` state, with the FP32 master copy.
    skipped: int32, steps skipped for a NaN/Inf loss or gradient.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  skipped: jax.Array


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


_HIGH_PRECISION = nvfp4_jax.PrecisionRules(default=nvfp4_jax.Recipe.bf16())


def default_dtype() -> str:
  """bfloat16 on accelerators; float32 on CPU (bf16 is emulated there)."""
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def model_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
  overrides = dict(vocab_size=vocab_size, dtype=cfg.dtype or default_dtype())
  if cfg.mlp is not None:
    overrides["mlp"] = cfg.mlp
  return model_preset(cfg.preset, **overrides)


def make_rules(cfg: TrainConfig, num_layers: int) -> nvfp4_jax.PrecisionRules:
  """The precision rules of `cfg.precision`.

  "bf16": every projection in high precision. Otherwise the paper's preset
  (first 2 and last ~15% of blocks in BF16) with that format elsewhere, and
  the late switch if configured.
  """
  if cfg.precision == "bf16":
    return nvfp4_jax.PrecisionRules(default=nvfp4_jax.Recipe.bf16())
  switch = None
  if cfg.late_switch_step is not None:
    switch = nvfp4_jax.LateSwitch(step=cfg.late_switch_step,
                                  mode=cfg.late_switch_mode)
  return nvfp4_jax.paper_rules(
      num_layers, recipe=nvfp4_jax.Recipe.from_name(cfg.precision),
      late_switch=switch)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets).mean()


def _flatten(config: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """`{"train": {"lr": ...}}` -> `{"train.lr": ...}`."""
  return {f"{group}.{k}": v for group, fields in config.items()
          for k, v in fields.items()}


def _all_finite(tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.stack(leaves).all()


class Trainer:
  """Builds the model, rules, optimizer, data and jitted functions of a run.

  Args:
    cfg: the `TrainConfig`.
    corpus: the `data.Corpus` to train on.
    model_cfg: a custom `GPTConfig`; default the preset's (`model_config`).
      Its `vocab_size` must cover the corpus.
  """

  def __init__(self, cfg: TrainConfig, corpus: data_lib.Corpus,
               model_cfg: GPTConfig | None = None):
    self.cfg = cfg
    self.corpus = corpus
    if model_cfg is None:
      model_cfg = model_config(cfg, corpus.vocab_size)
    if model_cfg.vocab_size < corpus.vocab_size:
      raise ValueError(
          f"the model embeds {model_cfg.vocab_size} token ids but the corpus "
          f"uses {corpus.vocab_size}; raise GPTConfig.vocab_size.")
    self.model_cfg = model_cfg
    self.model = GPT(self.model_cfg)
    self.rules = make_rules(cfg, self.model_cfg.num_layers)
    self.optimizer, self.schedule = make_optimizer(cfg)
    self.batcher = data_lib.Batcher(corpus.train, batch_size=cfg.batch_size,
                                    seq_len=cfg.seq_len, seed=cfg.seed)
    self.eval_data = data_lib.eval_batches(
        corpus.val, batch_size=cfg.micro_batch, seq_len=cfg.seq_len,
        num_batches=cfg.eval_batches * cfg.grad_accum)
    base = jax.random.key(cfg.seed)
    self._init_key = jax.random.fold_in(base, 0)
    self._sr_key = jax.random.fold_in(base, 1)
    self._eval_key = jax.random.fold_in(base, 2)
    self.train_step = jax.jit(self._train_step, donate_argnums=0)
    self.evaluate = jax.jit(self._evaluate)

  # -- pure functions ---------------------------------------------------------

  def _forward(self, params, tokens, step, key):
    with nvfp4_jax.precision_rules(self.rules, step=step):
      return self.model.apply({"params": params}, tokens,
                              rngs={"nvfp4": key})

  def _loss(self, params, batch, step, key):
    return cross_entropy(self._forward(params, batch[:, :-1], step, key),
                         batch[:, 1:])

  def init_state(self) -> TrainState:
    """The state before step 0 (same parameters for every precision)."""
    tokens = jnp.zeros((1, self.cfg.seq_len), jnp.int32)
    with nvfp4_jax.precision_rules(_HIGH_PRECISION):
      params = self.model.init(self._init_key, tokens)["params"]
    # Copies: for FP32 params the master would alias them, and the train
    # step donates the whole state.
    opt_state = jax.tree.map(jnp.copy, self.optimizer.init(params))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=opt_state,
                      skipped=jnp.zeros((), jnp.int32))

  def _train_step(self, state: TrainState, batch: jax.Array
                  ) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on `batch: int32 [grad_accum, micro, seq_len + 1]`."""
    step = state.step
    key = jax.random.fold_in(self._sr_key, step)
    grad_fn = jax.value_and_grad(self._loss)

    def micro(carry, xs):
      i, mb = xs
      loss, grads = grad_fn(state.params, mb, step, jax.random.fold_in(key, i))
      grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
      return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zeros = (jnp.zeros((), jnp.float32),
             jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32),
                          state.params))
    n = batch.shape[0]
    (loss, grads), _ = jax.lax.scan(micro, zeros, (jnp.arange(n), batch))
    loss, grads = loss / n, jax.tree.map(lambda g: g / n, grads)
    finite = jnp.isfinite(loss) & _all_finite(grads)

    def apply(_):
      updates, opt_state = self.optimizer.update(grads, state.opt_state,
                                                 state.params)
      return optax.apply_updates(state.params, updates), opt_state

    def skip(_):
      return state.params, state.opt_state

    params, opt_state = jax.lax.cond(finite, apply, skip, None)
    new = TrainState(step=step + 1, params=params, opt_state=opt_state,
                     skipped=state.skipped + (~finite).astype(jnp.int32))
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads),
               "lr": self.schedule(step - state.skipped), "finite": finite}
    return new, metrics

  def _evaluate(self, params, batches, step):
    """Validation loss (and diagnostics) over `batches: [n, micro, seq+1]`.

    Returns:
      `(mean loss, {layer path: {stat: mean over batches}})`; the dict is
      empty when `cfg.diagnostics` is off.
    """
    def forward(p, tokens):
      return self._forward(p, tokens, step, self._eval_key)
    fn = with_diagnostics(forward) if self.cfg.diagnostics else (
        lambda p, tokens: (forward(p, tokens), {}))

    def body(carry, mb):
      logits, stats = fn(params, mb[:, :-1])
      return jax.tree.map(jnp.add, carry,
                          (cross_entropy(logits, mb[:, 1:]), stats)), None
    zeros = jax.eval_shape(fn, params, batches[0, :, :-1])[1]
    zeros = (jnp.zeros((), jnp.float32),
             jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros))
    total, _ = jax.lax.scan(body, zeros, batches)
    return jax.tree.map(lambda t: t / batches.shape[0], total)

  # -- the loop ---------------------------------------------------------------

  def layer_paths(self) -> list[str]:
    """Module paths of the model's NVFP4Dense projections."""
    # High-precision rules while tracing: the paths do not depend on them.
    with nvfp4_jax.precision_rules(_HIGH_PRECISION):
      return nvfp4_jax.nvfp4_layer_paths(
          self.model, jnp.zeros((1, self.cfg.seq_len), jnp.int32))

  def describe(self) -> str:
    """One line: model size, precision, which layers are quantized."""
    paths = self.layer_paths()
    quantized = sum(self.rules.recipe_for(p).quantized for p in paths)
    m = self.model_cfg
    return (f"GPT {self.cfg.preset}: {format_count(param_count(m))} params "
            f"(d_model {m.d_model}, {m.num_layers} layers, {m.mlp}, "
            f"{m.dtype}); {self.cfg.precision}: {quantized}/{len(paths)} "
            f"projections quantized")

  def run(self, out_dir: str | pathlib.Path, *, resume: bool = False,
          progress: bool = True, label: str = "", log_every: int = 10,
          on_step: Callable[[int], None] | None = None) -> RunResult:
    """Trains to `cfg.steps`, writing metrics, checkpoints and plots.

    Args:
      out_dir: the run directory: `metrics.jsonl`, `config.json`,
        `checkpoints/`, `loss.png`, `diagnostics.png`.
      resume: continue from the latest checkpoint in `out_dir` (its config
        must equal this one). Otherwise earlier outputs there are replaced.
      progress: show the progress bar on stderr.
      label: prefix of the progress line.
      log_every: steps between host syncs for metrics (all steps are logged).
      on_step: called with the number of completed steps after each step's
        bookkeeping (checkpoint included).

    Returns:
      A `RunResult`.

    Raises:
      FileNotFoundError: `resume` without a checkpoint.
      ValueError: `resume` with a different config.
    """
    cfg = self.cfg
    out = pathlib.Path(out_dir)
    metrics_path = out / "metrics.jsonl"
    ckpt_dir = out / "checkpoints"
    config = {"train": cfg.to_dict(),
              "model": dataclasses.asdict(self.model_cfg)}
    if resume:
      if not ckpt_dir.is_dir():
        raise FileNotFoundError(
            f"--resume: no checkpoint in {ckpt_dir}; run without --resume to "
            f"start this run.")
    else:
      for p in (ckpt_dir, metrics_path, out / "loss.png",
                out / "diagnostics.png"):
        if p.is_dir():
          shutil.rmtree(p)
        elif p.exists():
          p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(ckpt_dir)
    try:
      state = self._start(ckpt, config, resume)
      start = int(state.step)
      truncate_metrics(metrics_path, start)
      (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
      with MetricsLog(metrics_path) as log:
        state = self._loop(state, start, log, ckpt, config, progress, label,
                           log_every, on_step)
    finally:
      ckpt.close()
    return self._finish(state, out, metrics_path)

  def _start(self, ckpt: Checkpointer, config: dict, resume: bool
             ) -> TrainState:
    if not resume:
      return self.init_state()
    step = ckpt.latest_step()
    if step is None:
      raise FileNotFoundError(
          f"--resume: no checkpoint in {ckpt.directory}; run without --resume "
          f"to start this run.")
    like = jax.eval_shape(self.init_state)
    state, saved = ckpt.restore(step, like)
    saved, current = _flatten(saved), _flatten(config)
    diff = sorted(k for k in set(saved) | set(current)
                  if saved.get(k) != current.get(k))
    if diff:
      changes = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
                          for k in diff)
      raise ValueError(
          f"--resume: the checkpoint in {ckpt.directory} was written by a "
          f"different configuration ({changes}); use the same flags or a new "
          f"--out.")
    return TrainState(*state)

  def _loop(self, state, start, log, ckpt, config, progress, label,
            log_every, on_step) -> TrainState:
    cfg = self.cfg
    tokens_per_step = cfg.batch_size * cfg.seq_len
    bar = Progress(cfg.steps, start=start, label=label, enabled=progress)
    pending = []
    t0 = time.perf_counter()

    def flush():
      for s, m in jax.device_get(pending):
        rec = {"kind": "train", "step": s, "loss": float(m["loss"]),
               "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
               "finite": bool(m["finite"]), "tokens": s * tokens_per_step,
               "time": round(time.perf_counter() - t0, 3)}
        log.write(rec)
      if pending:
        bar.update(pending[-1][0], float(rec["loss"]),
                   len(pending) * tokens_per_step)
      pending.clear()

    for step in range(start, cfg.steps):
      batch = self.batcher.batch(step).reshape(
          cfg.grad_accum, cfg.micro_batch, cfg.seq_len + 1)
      state, m = self.train_step(state, batch)
      done = step + 1
      pending.append((done, m))
      last = done == cfg.steps
      is_eval = done % cfg.eval_every == 0 or last
      is_ckpt = done % cfg.ckpt_every == 0 or last
      if done % log_every == 0 or start == step or is_eval or is_ckpt or last:
        flush()
      if is_eval:
        master = nvfp4_jax.master_params(state.opt_state)
        val, stats = jax.device_get(
            self.evaluate(master, self.eval_data, state.step))
        log.write({"kind": "eval", "step": done, "val_loss": float(val)})
        if stats:
          log.write({"kind": "diag", "step": done,
                     "layers": self._diag_record(stats, done)})
      if is_ckpt:
        ckpt.save(done, state, config)
      if on_step is not None:
        on_step(done)
    flush()
    bar.close()
    return state

  def _diag_record(self, stats, step: int) -> dict[str, dict[str, Any]]:
    quantized = {}
    switch = self.rules.late_switch
    for path in stats:
      recipe = self.rules.recipe_for(path)
      if switch is not None and step >= switch.step:
        recipe = switch.apply(recipe)
      quantized[path] = recipe.gemm_format("fprop") != "bf16"
    return {path: {**{k: float(v) for k, v in s.items()},
                   "quantized": quantized[path]}
            for path, s in stats.items()}

  def _finish(self, state: TrainState, out: pathlib.Path,
              metrics_path: pathlib.Path) -> RunResult:
    cfg = self.cfg
    records = read_metrics(metrics_path)
    train = [r["loss"] for r in select(records, "train") if r["finite"]]
    tail = train[-max(1, len(train) // 10):]
    evals = select(records, "eval")
    title = (f"GPT {cfg.preset}, {cfg.precision}, {cfg.steps} steps x "
             f"{cfg.batch_size} x {cfg.seq_len} tokens")
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
        skipped=int(state.skipped), records=records,
        params=jax.device_get(nvfp4_jax.master_params(state.opt_state)))
