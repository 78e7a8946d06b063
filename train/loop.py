"""The training loop: a `Trainer` runs, checkpoints and resumes a run.

`Trainer` builds a run's model, precision rules, optimizer and data, jits the
pure functions of `train.step` (one optimizer step, evaluation), and `run`
drives them: data for step `s` is `Batcher.batch(s)`, metrics go to JSONL,
evaluations and diagnostics every `eval_every` steps, an orbax checkpoint
every `ckpt_every` (written in the background while the next steps run),
and `train.report` sums the run up at the end. Everything that varies
between steps is a function of `(seed, step)` or of the state, so a run
restored from a checkpoint continues bit-identically.

`run(handle_signals=True)` (what `python -m train` does) stops on SIGTERM
or SIGINT after the step in flight, with a checkpoint of it
(`train.preemption`): the run loses at most that step.

With a device mesh (`Trainer(..., mesh=)`), the state is sharded as
`nvfp4_jax.MeshRules` says (parameters, FP32 master weights and optimizer
moments over `fsdp`; the linear layers over `model`), each batch is split
over `data` x `fsdp`, and checkpoints hold the sharded state: a run resumed
on another mesh (or on one device) reshards it and continues.

`TrainState`, `RunResult`, `cross_entropy` and the builders of `train.build`
(`model_config`, `make_rules`, ...) are re-exported here, where they were
defined before they got modules of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import shutil
import signal
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nvfp4_jax
from models import GPT
from models import GPTConfig
from models import convert_fused_layout
from models import saved_fused_layout
from train import data as data_lib
from train import report
from train.checkpoint import Checkpointer
from train.checkpoint import NoCheckpointError
from train.checkpoint import RunExistsError
from train.checkpoint import existing_checkpoints
from train.build import default_dtype
from train.build import imported_init_state
from train.build import make_rules
from train.build import model_config
from train.build import run_recipe
from train.config import TrainConfig
from train.metrics import MemoryLog
from train.metrics import MetricsLog
from train.metrics import Progress
from train.metrics import truncate_metrics
from train.optim import make_optimizer
from train.preemption import StopSignals
from train.report import RunResult
from train.step import StepFunctions
from train.step import TrainState
from train.step import cross_entropy

__all__ = ["RunResult", "TrainState", "Trainer", "cross_entropy",
           "default_dtype", "make_rules", "model_config", "run_recipe"]


def threefry_kernels() -> None:
  """Lowers threefry to JAX's GPU kernel (`jax_threefry_gpu_kernel_lowering`)
  for the rest of the process.

  The kernel computes the same bits as the unrolled rounds XLA otherwise
  fuses, in one call instead of ~1,100 instructions per key: for GPT base in
  NVFP4 (a fold_in and the seed draws of every quantized layer) that was
  about half of XLA's compile (BENCHMARKS.md, start-up). Its cost, outputs
  materialised in memory, is nothing here: the run draws keys and seed
  words, no large random tensors (the GPT has no dropout). A JAX without
  the option keeps its lowering.
  """
  try:
    jax.config.update("jax_threefry_gpu_kernel_lowering", True)
  except AttributeError:
    pass


class Trainer:
  """Builds the model, rules, optimizer, data and jitted functions of a run.

  Attributes:
    fns: the run's pure functions (`train.step.StepFunctions`).
    init_state: `fns.init_state`, the state before step 0.
    train_step: `fns.train_step`, jitted, donating the state.
    evaluate: `fns.evaluate`, jitted.

  Args:
    cfg: the `TrainConfig`.
    corpus: the `data.Corpus` to train on.
    model_cfg: a custom `GPTConfig`; default the preset's (`model_config`)
      with the corpus's vocabulary. Its `vocab_size` must exceed every
      token id of the corpus. `cfg.tokenizer` is taken from the corpus.
    mesh: a `jax.sharding.Mesh` with axes `data`, `fsdp`, `model`
      (`nvfp4_jax.sharding.make_mesh`) to train on; None: one device.

  Raises:
    ValueError: a batch or a layer that does not split over `mesh`; a token
      id outside the model's vocabulary; `cfg.tokenizer` not the corpus's.
  """

  def __init__(self, cfg: TrainConfig, corpus: data_lib.Corpus,
               model_cfg: GPTConfig | None = None,
               mesh: jax.sharding.Mesh | None = None):
    self.cfg = cfg
    self.corpus = corpus
    threefry_kernels()
    if model_cfg is None:
      model_cfg = model_config(cfg, corpus.vocab_size)
    corpus.check_vocab(model_cfg.vocab_size)
    self.cfg = cfg = cfg.replace(tokenizer=corpus.run_tokenizer(cfg.tokenizer))
    self.model_cfg = model_cfg
    self.model = GPT(self.model_cfg)
    self.rules = make_rules(cfg, self.model_cfg.num_layers)
    self.optimizer, self.schedule = make_optimizer(cfg)
    self.batcher = data_lib.Batcher(corpus.train, batch_size=cfg.batch_size,
                                    seq_len=cfg.seq_len, seed=cfg.seed)
    self.eval_data = data_lib.eval_batches(
        corpus.val, batch_size=cfg.micro_batch, seq_len=cfg.seq_len,
        num_batches=cfg.eval_batches * cfg.grad_accum)
    self.mesh_rules = (None if mesh is None else nvfp4_jax.MeshRules(
        mesh=mesh, partial_sums=cfg.tp_partial_sums, amax=cfg.amax,
        wgrad_schedule=cfg.wgrad_schedule, wgrad_sums=cfg.wgrad_sums,
        sequence_parallel=cfg.sequence_parallel,
        collective_matmul=cfg.collective_matmul))
    self.fns = StepFunctions(cfg, self.model, self.rules, self.optimizer,
                             self.schedule, mesh_rules=self.mesh_rules)
    if self.mesh_rules is None:
      # Jitted as on a mesh: XLA's fused initializers can differ from the
      # op-by-op ones in the last bit, and every mesh starts from the same
      # parameters.
      self.init_state = jax.jit(self.fns.init_state)
      self.train_step = jax.jit(self.fns.train_step, donate_argnums=0)
      self.evaluate = jax.jit(self.fns.evaluate)
    else:
      self._shard(self.mesh_rules)
    if cfg.init_from is not None:
      # The state before step 0 from the HF checkpoint's weights.
      self.init_state = imported_init_state(self)

  def _shard(self, mr: nvfp4_jax.MeshRules) -> None:
    """Checks that the run splits over the mesh and jits its functions
    with the state, batch and evaluation shardings."""
    cfg = self.cfg
    dp = mr.data_parallel
    if cfg.micro_batch % dp:
      raise ValueError(
          f"a micro-batch of {cfg.micro_batch} sequences does not split into "
          f"the {dp} batch shards of mesh axes {mr.batch}; make --batch-size "
          f"a multiple of {dp * cfg.grad_accum} (grad accumulation x shards) "
          f"or put fewer devices on {mr.batch}.")
    abstract = jax.eval_shape(self.fns.init_state)
    self._check_layers(mr, abstract.params)
    self.state_shardings = mr.shardings(
        mr.state_specs(abstract, abstract.params))
    self.batch_sharding = NamedSharding(mr.mesh, mr.batch_spec(3, axis=1))
    replicated = NamedSharding(mr.mesh, P())
    self.init_state = jax.jit(self.fns.init_state,
                              out_shardings=self.state_shardings)
    self.train_step = jax.jit(
        self.fns.train_step, donate_argnums=0,
        in_shardings=(self.state_shardings, self.batch_sharding),
        out_shardings=(self.state_shardings, replicated))
    self.evaluate = jax.jit(
        self.fns.evaluate,
        in_shardings=(mr.shardings(mr.param_specs(abstract.params)),
                      self.batch_sharding, replicated))
    self.eval_data = self.put_batch(self.eval_data)

  def _check_layers(self, mr: nvfp4_jax.MeshRules, params) -> None:
    """Raises a ValueError (naming the layer, the dimension and the mesh
    axes) for a linear layer whose shards would split a scale block."""
    cfg = self.cfg
    tokens = cfg.micro_batch * cfg.seq_len
    steps = [None]
    if self.rules.late_switch is not None:
      steps.append(self.rules.late_switch.step)
    for path in self.layer_paths():
      node = params
      for part in path.split("/"):
        node = node[part]
      if node["kernel"].ndim != 2:
        continue  # Stacked experts: `ragged_dot` checks its own sizes.
      k, n = node["kernel"].shape
      for step in steps:
        mr.linear(path).check(self.rules.recipe_at(path, step), tokens, k, n,
                              name=f"layer {path!r}: ")

  def put_batch(self, batch: np.ndarray) -> jax.Array:
    """A host batch `[n, sequences, seq_len + 1]` as a device array (split
    over the mesh's batch axes: each process supplies its devices' shards
    of the batch that every process computes alike)."""
    if self.mesh_rules is None:
      return batch
    batch = np.asarray(batch)
    sharding = NamedSharding(self.mesh_rules.mesh,
                             self.mesh_rules.batch_spec(batch.ndim, axis=1))
    return jax.make_array_from_callback(batch.shape, sharding,
                                        lambda idx: batch[idx])

  def abstract_state(self) -> TrainState:
    """Shapes, dtypes and shardings of the train state (what a checkpoint
    restores onto, whatever mesh wrote it)."""
    like = jax.eval_shape(self.fns.init_state)
    if self.mesh_rules is None:
      one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      shardings = jax.tree.map(lambda _: one, like)
    else:
      shardings = self.state_shardings
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        like, shardings)

  def layer_paths(self) -> list[str]:
    """Module paths of the model's NVFP4Dense projections."""
    # High-precision rules while tracing: the paths do not depend on them.
    with nvfp4_jax.precision_rules(
        nvfp4_jax.PrecisionRules.high_precision()):
      return nvfp4_jax.nvfp4_layer_paths(
          self.model, jnp.zeros((1, self.cfg.seq_len), jnp.int32))

  def describe(self) -> str:
    """One line: model size, precision, which layers are quantized."""
    return report.describe(self.cfg, self.model_cfg, self.rules,
                           self.layer_paths())

  def run(self, out_dir: str | pathlib.Path, *, resume: bool = False,
          overwrite: bool = False, progress: bool = True, label: str = "",
          log_every: int = 10,
          on_step: Callable[[int], None] | None = None,
          handle_signals: bool = False,
          async_checkpoints: bool = True) -> RunResult:
    """Trains to `cfg.steps`, writing metrics, checkpoints and plots.

    With `handle_signals`, SIGTERM or SIGINT stops the run after the step
    in flight: the metrics of every completed step are written, a
    checkpoint of the last one is saved (waiting for its write), and `run`
    returns a `RunResult` whose `stopped` names the signal (no plots are
    drawn); `resume=True` continues it bit-identically (on CPU). Every
    process of a multi-process run stops at the same step, whichever of
    them got the signal. A second SIGTERM while stopping is ignored; a
    second SIGINT ends the process at once (`os._exit(130)`), leaving the
    previous checkpoint (`train.preemption`). A signal in the last step
    lets the run finish as usual.

    Args:
      out_dir: the run directory: `metrics.jsonl`, `config.json`,
        `checkpoints/`, `loss.png`, `diagnostics.png`.
      resume: continue from the newest checkpoint in `out_dir` that
        restores (its config must equal this one). A newer damaged one is
        skipped with a line on stderr naming it and why, and renamed
        `<step>.damaged` (kept, not deleted).
      overwrite: start anew where `out_dir` holds checkpoints, deleting
        them. Without `resume` or `overwrite`, a directory with checkpoints
        is refused (`RunExistsError`); one without any is started anew
        (its metrics and plots, of a run killed before its first
        checkpoint, are replaced).
      progress: show the progress bar on stderr.
      label: prefix of the progress line.
      log_every: steps between host syncs for metrics (all steps are logged).
      on_step: called with the number of completed steps after each step's
        bookkeeping (checkpoint included).
      handle_signals: catch SIGTERM and SIGINT while training (from the
        first step to the last; in the main thread only), as above. False
        (the default) leaves the process's handlers alone: Ctrl-C raises
        `KeyboardInterrupt` out of `run`, as anywhere in Python.
      async_checkpoints: write checkpoints in the background while the
        next steps run (orbax's asynchronous checkpointing); a checkpoint
        counts, and the older one `keep` retires is deleted, only once its
        write has finished, and `run` returns only after the last one has.
        False: every save is written before the next step starts.

    Returns:
      A `RunResult` (`stopped` is the signal's name if `handle_signals`
      stopped the run early, else None).

    Raises:
      train.checkpoint.NoCheckpointError: `resume` without a complete
        checkpoint, or with none that restores (`DamagedCheckpointsError`)
        (a `FileNotFoundError`).
      train.checkpoint.ConfigMismatchError: `resume` with a different config
        (a `ValueError`).
      train.checkpoint.RunExistsError: neither `resume` nor `overwrite`
        where checkpoints exist (a `FileExistsError`).
      ValueError: both `resume` and `overwrite`; `handle_signals` outside
        the main thread.
    """
    cfg = self.cfg
    out = pathlib.Path(out_dir)
    metrics_path = out / "metrics.jsonl"
    ckpt_dir = out / "checkpoints"
    config = {"train": cfg.to_dict(),
              "model": dataclasses.asdict(self.model_cfg)}
    if resume and overwrite:
      raise ValueError(
          f"resume and overwrite contradict each other for {out}: resume "
          f"continues its run, overwrite deletes its checkpoints; give one.")
    if resume:
      if not ckpt_dir.is_dir():
        raise NoCheckpointError(
            f"--resume: no checkpoint in {ckpt_dir}; run without --resume to "
            f"start this run.")
    else:
      saved = existing_checkpoints(ckpt_dir)
      if saved and not overwrite:
        raise RunExistsError(
            f"{out} already holds checkpoints ({', '.join(saved)} in "
            f"{ckpt_dir}); resume that run (resume=True, --resume) or "
            f"delete them and start again (overwrite=True, --overwrite).")
      # Several processes (`jax.distributed`): the first writes the run's
      # files; all write their shards of each checkpoint (orbax).
      _all_processes_at(f"checked {out}")
      if _first_process():
        for p in (ckpt_dir, metrics_path, out / "loss.png",
                  out / "diagnostics.png"):
          if p.is_dir():
            shutil.rmtree(p)
          elif p.exists():
            p.unlink()
    if _first_process():
      out.mkdir(parents=True, exist_ok=True)
    _all_processes_at(f"prepared {out}")
    ckpt = Checkpointer(ckpt_dir, asynchronous=async_checkpoints)
    try:
      state = self._start(ckpt, config, resume)
      start = int(state.step)
      if _first_process():
        truncate_metrics(metrics_path, start)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
      signals = (StopSignals(describe=lambda: _survivor(ckpt))
                 if handle_signals else contextlib.nullcontext())
      with signals, (MetricsLog(metrics_path) if _first_process()
                     else MemoryLog()) as log:
        state, stopped = self._loop(
            state, start, log, ckpt, config, progress, label, log_every,
            on_step, signals if handle_signals else None)
    finally:
      ckpt.close()  # Waits for the write in flight.
    result = report.finish(
        cfg, out, metrics_path, skipped=int(state.skipped),
        master_params=nvfp4_jax.master_params(state.opt_state),
        records=None if _first_process() else log.records,
        plot=stopped is None)
    result.step = int(state.step)
    result.checkpoint = ckpt.path(int(state.step))
    result.stopped = None if stopped is None else stopped.name
    return result

  def _start(self, ckpt: Checkpointer, config: dict, resume: bool
             ) -> TrainState:
    if not resume:
      return self.init_state()
    skipped = []  # Named once a checkpoint restores (else the error does).
    step, state, saved = ckpt.restore_latest(
        self.abstract_state(), config=config,
        config_defaults={"train": _field_defaults(self.cfg),
                         "model": _field_defaults(self.model_cfg)},
        # The fused layout is converted below; the weight gradients' schedule
        # under FSDP changes the order of work, not the numbers.
        ignore=("model.fused_layout", "train.wgrad_schedule"),
        on_skip=lambda path, reason: skipped.append((path, reason)))
    for path, reason in skipped:
      print(f"warning: --resume: skipped the damaged checkpoint {path} "
            f"({reason})", file=sys.stderr, flush=True)
    if skipped:
      print(f"warning: --resume: resuming from step {step}, the newest "
            f"checkpoint that restores", file=sys.stderr, flush=True)
    # The fused qkv and [gate, up] kernels' column order: a checkpoint of
    # another layout (one written before `fused_layout` existed is
    # "concatenated") is converted, its parameters, FP32 master weights and
    # optimizer moments alike.
    src = saved_fused_layout(saved.get("model", {}))
    if src != self.model_cfg.fused_layout:
      state = convert_fused_layout(state, self.model_cfg, src,
                                   self.model_cfg.fused_layout)
      if _first_process():
        print(f"note: --resume: converted the checkpoint of step {step} "
              f"from the fused layout {src!r} to "
              f"{self.model_cfg.fused_layout!r} (models.gpt.fused_layout)",
              file=sys.stderr, flush=True)
    return TrainState(*state)

  def _loop(self, state, start, log, ckpt, config, progress, label,
            log_every, on_step, signals
            ) -> tuple[TrainState, signal.Signals | None]:
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
      state, m = self.train_step(state, self.put_batch(batch))
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
                     "layers": report.diag_record(self.rules, stats,
                                                  done)})
      if is_ckpt:
        ckpt.save(done, state, config)
      if on_step is not None:
        on_step(done)
      # Every process asks after every step (the agreement needs it); a
      # signal in the last step lets the run end as usual.
      if signals is not None and signals.should_stop(done) and not last:
        flush()
        ckpt.save(done, state, config)  # A no-op if just saved above.
        ckpt.wait()
        bar.close()
        return state, signals.signal
    flush()
    bar.close()
    return state, None


def _survivor(ckpt: Checkpointer) -> str:
  """The end of the line a second SIGINT prints: which checkpoint is left."""
  step = ckpt.latest_step()
  if step is None:
    return "; no complete checkpoint in " + str(ckpt.directory)
  return f"; the newest complete checkpoint is {ckpt.path(step)}"


def _first_process() -> bool:
  return jax.process_index() == 0


def _all_processes_at(name: str) -> None:
  """Waits for every process of a multi-process run (a no-op alone)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)


def _field_defaults(obj) -> dict:
  """The dataclass `obj`'s fields that have a default, with their defaults."""
  return {f.name: f.default for f in dataclasses.fields(obj)
          if f.default is not dataclasses.MISSING}
