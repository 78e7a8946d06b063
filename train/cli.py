"""`python -m train` / `nvfp4-train`: train the GPT, compare precisions.

With no arguments it runs `--preset tiny --compare bf16,nvfp4`: the tiny GPT
trained twice on the same data, seed and steps, a table of final losses and
one plot with both curves. That takes a few minutes on two CPU cores; on a GPU
scale it up with `--preset small|base|large`.

A run directory (`<out>/<preset>-<precision>`) that holds checkpoints is
never started anew silently: `--resume` continues it (from the newest
checkpoint that restores, naming any damaged one it skips), `--overwrite`
deletes its checkpoints and starts again, and without either the command
refuses in one line naming both.

SIGTERM (what SLURM, Kubernetes and spot instances send before they kill a
job) and SIGINT (Ctrl-C) stop training after the step in flight: its
checkpoint is saved, one line on stderr names the step, the checkpoint and
`--resume`, and the status is the signal's (143, 130). With several
processes (`--distributed`) every process saves the same step.

Exit status: 0 on success, 2 for a bad flag or path (one line on stderr), 1
for a failure during training, 143 or 130 when SIGTERM or SIGINT stopped it
(128 + the signal's number).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import signal
import sys
import time
from typing import Sequence

from models import PRESETS
from models.gpt import ATTENTION_KINDS
from models.gpt import MLP_KINDS
from models.gpt import REMAT_KINDS
from nvfp4_jax.core.recipe import FOUR_OVER_SIX_MODES
from nvfp4_jax.core.recipe import RESIDUALS
from train import mesh_flags
from train.config import MAX_SEED
from train.config import MAX_STEPS
from train.config import ABLATIONS
from train.config import PRECISIONS
from train.config import SWITCH_MODES
from train.config import TrainConfig

PROG = "nvfp4-train"


class UsageError(Exception):
  """A bad command line: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):

  def error(self, message):
    raise UsageError(message)


def _int_in(low: int, high: int | None = None, what: str | None = None):
  """An argparse type: an integer in `[low, high]` (no upper bound: None)."""
  below = what or {0: "an integer >= 0", 1: "a positive integer"}[low]
  above = what or f"an integer in [{low}, {high}]"

  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      value = low - 1
    if value < low:
      raise argparse.ArgumentTypeError(f"expected {below}, got {text!r}")
    if high is not None and value > high:
      raise argparse.ArgumentTypeError(f"expected {above}, got {text!r}")
    return value
  return parse


# Sizes and counts fit an int32 (the step counter is one): a larger value is
# a typo, and would fail deep inside NumPy or XLA.
_positive = _int_in(1, MAX_STEPS)
_nonnegative = _int_in(0, MAX_STEPS)


def _positive_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(f"expected a positive finite number, "
                                     f"got {text!r}")
  return value


def _one_of(choices) -> str:
  """The metavar of a choice that `TrainConfig` validates (in one place)."""
  return "{" + ",".join(choices) + "}"


class _Given(argparse.Action):
  """Stores the value and records that the flag was given (`--init-from`
  refuses an explicit `--preset`, not the default one)."""

  def __call__(self, parser, namespace, values, option_string=None):
    setattr(namespace, self.dest, values)
    namespace.given = getattr(namespace, "given", set()) | {option_string}


def build_parser() -> argparse.ArgumentParser:
  p = _Parser(
      prog=PROG,
      description="Train a GPT with the NVFP4 recipe and compare it with "
      "BF16. No arguments: --preset tiny --compare bf16,nvfp4 (minutes on a "
      "CPU).")
  p.add_argument("--preset", choices=list(PRESETS), default="tiny",
                 action=_Given,
                 help="model size (default tiny; parameter counts: "
                 "python -m models)")
  p.add_argument("--init-from", metavar="HF_DIR",
                 help="continue training a HF checkpoint (config.json + "
                 "safetensors of a Llama, Mistral or Mixtral): the model and "
                 "its initial weights are the checkpoint's (no --preset, "
                 "--mlp)")
  what = p.add_mutually_exclusive_group()
  what.add_argument("--precision", choices=PRECISIONS,
                    help="train one run in this precision")
  what.add_argument("--compare", metavar="P1,P2[,...]",
                    help="train one run per precision on the same data, "
                    "seed and steps (default bf16,nvfp4)")
  p.add_argument("--steps", type=_positive,
                 help="optimizer steps (preset default)")
  p.add_argument("--batch-size", type=_positive,
                 help="sequences per step (preset default)")
  p.add_argument("--seq-len", type=_positive,
                 help="tokens per sequence (preset default)")
  p.add_argument("--grad-accum", type=_positive,
                 help="micro-batches per step (preset default)")
  p.add_argument("--lr", type=_positive_float, help="peak learning rate "
                 "(preset default)")
  p.add_argument("--seed", default=0, type=_int_in(
      0, MAX_SEED, what=f"an integer in [0, {MAX_SEED}]"),
                 help="seeds the initialization, the data order and the "
                 "stochastic rounding (default 0)")
  p.add_argument("--mlp", metavar=_one_of(MLP_KINDS),
                 help="MLP type (default swiglu)")
  p.add_argument("--late-switch-step", type=_nonnegative, metavar="STEP",
                 help="switch quantized layers to BF16 from this step on")
  p.add_argument("--late-switch-mode", metavar=_one_of(SWITCH_MODES),
                 default="all",
                 help="what the late switch moves to BF16: all GEMMs "
                 "(default) or only the forward GEMM")
  p.add_argument("--eval-every", type=_positive,
                 help="steps between validation evaluations and diagnostics "
                 "(default steps/5, at most 1000)")
  p.add_argument("--ckpt-every", type=_positive,
                 help="steps between checkpoints (default steps/5, at most "
                 "1000)")
  p.add_argument("--no-diagnostics", action="store_true",
                 help="skip the per-layer quantization diagnostics")
  ab = p.add_argument_group(
      "recipe ablations (applied to the precisions they concern)")
  ab.add_argument("--no-sr", action="store_true",
                  help="round gradients to nearest (nvfp4, mxfp4)")
  ab.add_argument("--no-rht", action="store_true",
                  help="no Random Hadamard Transform on the Wgrad operands")
  ab.add_argument("--no-2d", action="store_true",
                  help="1x16 weight scales instead of 16x16 tiles")
  ab.add_argument("--four-over-six", metavar=_one_of(FOUR_OVER_SIX_MODES[1:]),
                  help="Four-over-Six block scaling on these NVFP4 operands")
  ab.add_argument("--residuals", metavar=_one_of(RESIDUALS),
                  help="how NVFP4 layers save the operands their backward "
                  "pass multiplies: codes (4.5 bits, the default) or values "
                  "(bf16 block values: no dequantize pass where the GEMM is "
                  "emulated, as on Hopper; bf16's activation memory)")
  ab.add_argument("--all-quantized", action="store_true",
                  help="quantize every projection (no BF16 blocks)")
  ab.add_argument("--bf16-layers", metavar="PATHS",
                  help="keep exactly these comma-separated layers in BF16 "
                  "(e.g. block_0/attn/qkv,block_5/mlp/down) and quantize "
                  "the rest: the rules python -m train.sensitivity suggests")
  p.add_argument("--attention", metavar=_one_of(ATTENTION_KINDS),
                 default="fused",
                 help="fused: jax.nn.dot_product_attention (cuDNN on GPU); "
                 "reference: explicit FP32 scores")
  p.add_argument("--remat", metavar=_one_of(REMAT_KINDS), default="none",
                 help="quantized: blocks keep only the FP4 residuals of "
                 "their NVFP4 layers and recompute the rest (less memory); "
                 "full: blocks keep only their inputs and recompute "
                 "everything, quantization included (least memory)")
  mesh_flags.add_mesh_flags(p)
  p.add_argument("--data", metavar="PATH",
                 help="text file, directory of text files, .npy token file "
                 "(python -m train.data tokenize; its tokenizer's vocabulary) "
                 "or uint16 .bin token file (default: the Python standard "
                 "library's source)")
  p.add_argument("--out", metavar="DIR", default="runs",
                 help="output directory (default runs/)")
  p.add_argument("--resume", action="store_true",
                 help="continue from the newest checkpoint in the run "
                 "directory that restores (a damaged newer one is skipped, "
                 "named and kept as <step>.damaged)")
  p.add_argument("--overwrite", action="store_true",
                 help="delete the run directory's checkpoints and start "
                 "again (without --resume or --overwrite, a run directory "
                 "that holds checkpoints is refused)")
  p.add_argument("--distributed", action="store_true",
                 help="multi-host: call jax.distributed.initialize() first "
                 "(one process per host, same flags); on SLURM or Open MPI "
                 "it needs no more, elsewhere give --coordinator, "
                 "--num-processes and --process-id")
  p.add_argument("--coordinator", metavar="HOST:PORT",
                 help="with --distributed: process 0's address")
  p.add_argument("--num-processes", type=_positive,
                 help="with --distributed: number of processes")
  p.add_argument("--process-id", type=_nonnegative,
                 help="with --distributed: this process's index")
  p.add_argument("--no-progress", action="store_true",
                 help="no progress bar")
  return p


def make_mesh(args):
  """The run's device mesh: `--mesh`, else all devices on `data`; None on a
  single device without `--mesh` (the unsharded step)."""
  import jax  # pylint: disable=g-import-not-at-top
  from nvfp4_jax import sharding  # pylint: disable=g-import-not-at-top
  if args.mesh is None and jax.device_count() == 1:
    return None
  try:
    return sharding.make_mesh(**(args.mesh or {}))
  except ValueError as e:
    raise UsageError(f"--mesh: {e}") from None


def describe_mesh(mesh) -> str:
  if mesh is None:
    return "1 device"
  return (f"{mesh.devices.size} devices, mesh "
          + " x ".join(f"{a}={n}" for a, n in mesh.shape.items()))


def parse_precisions(args) -> list[str]:
  if args.precision:
    return [args.precision]
  if args.compare is None:
    return ["bf16", "nvfp4"]
  names = [n.strip() for n in args.compare.split(",") if n.strip()]
  bad = [n for n in names if n not in PRECISIONS]
  if bad:
    raise UsageError(f"--compare: unknown precision {bad[0]!r}; choose from "
                     f"{','.join(PRECISIONS)}")
  if len(names) < 2 or len(set(names)) != len(names):
    raise UsageError(f"--compare needs two or more different precisions, "
                     f"e.g. bf16,nvfp4; got {args.compare!r}")
  return names


def _ablations(args, precisions: list[str]) -> dict[str, dict]:
  """Per precision, the ablation fields its config takes from the flags."""
  out = {p: {} for p in precisions}
  for flag, (field, value, formats) in ABLATIONS.items():
    given = getattr(args, flag)
    if not given:
      continue
    if not set(precisions) & set(formats):
      raise UsageError(
          f"--{flag.replace('_', '-')} has no effect with --precision/"
          f"--compare {','.join(precisions)}; it applies to "
          f"{' or '.join(formats)}.")
    for p in precisions:
      if p in formats:
        out[p][field] = given if value is None else value
  return out


def make_configs(args, precisions: list[str]) -> list[TrainConfig]:
  ablations = _ablations(args, precisions)
  try:
    return [TrainConfig.for_preset(
        args.preset, precision=p, steps=args.steps,
        batch_size=args.batch_size, seq_len=args.seq_len,
        grad_accum=args.grad_accum, lr=args.lr, seed=args.seed, mlp=args.mlp,
        late_switch_step=args.late_switch_step,
        late_switch_mode=args.late_switch_mode, eval_every=args.eval_every,
        ckpt_every=args.ckpt_every,
        diagnostics=not args.no_diagnostics, attention=args.attention,
        remat=args.remat, init_from=args.init_from,
        **mesh_flags.knob_config(args), **ablations[p]) for p in precisions]
  except (TypeError, ValueError) as e:
    raise UsageError(str(e)) from None


def check_paths(args) -> None:
  if args.data is not None and not args.data.strip():
    raise UsageError(f"--data {args.data!r} is an empty path; give a text "
                     f"file, a directory or a .bin token file")
  if args.data is not None and not pathlib.Path(args.data).expanduser().exists():
    raise UsageError(f"--data {args.data}: no such file or directory")
  if not args.out.strip():
    raise UsageError(f"--out {args.out!r} is an empty path; use --out . for "
                     f"the current directory")
  out = pathlib.Path(args.out)
  if out.exists() and not out.is_dir():
    raise UsageError(f"--out {args.out}: exists and is not a directory")
  # The first existing ancestor must be a directory for the run to create
  # its own below it.
  parent = next(p for p in out.absolute().parents if p.exists())
  if not parent.is_dir():
    raise UsageError(f"--out {args.out}: {parent} is a file, not a "
                     f"directory; choose another --out")
  if args.resume and args.overwrite:
    raise UsageError("--resume and --overwrite contradict each other: "
                     "--resume continues the run, --overwrite deletes its "
                     "checkpoints and starts again; give one of them")
  if args.resume:
    for run in run_dirs(args):
      if not (run / "checkpoints").is_dir():
        raise UsageError(f"--resume: no checkpoint in {run}; run without "
                         f"--resume to start it")
  elif not args.overwrite:
    for run in run_dirs(args):
      if not (run / "checkpoints").is_dir():
        continue
      from train.checkpoint import existing_checkpoints  # pylint: disable=g-import-not-at-top
      saved = existing_checkpoints(run / "checkpoints")
      if saved:
        raise UsageError(
            f"{run} already holds checkpoints (steps {', '.join(saved)}); "
            f"add --resume to continue that run, or --overwrite to delete "
            f"them and start again (or choose another --out)")


def resolve_model(args) -> None:
  """Checks `--init-from` against the model flags (with it, the default
  `--preset` tiny only sets the training defaults)."""
  if args.init_from is not None:
    given = [f for f, v in (("--preset", "--preset" in getattr(
        args, "given", ())), ("--mlp", args.mlp is not None)) if v]
    if given:
      raise UsageError(
          f"{given[0]} conflicts with --init-from {args.init_from}: the "
          f"model's configuration is the checkpoint's; drop {given[0]}")
    path = pathlib.Path(args.init_from).expanduser()
    if not (path / "config.json").is_file():
      raise UsageError(f"--init-from {args.init_from}: no config.json there; "
                       f"give a HF checkpoint directory (config.json and "
                       f"model.safetensors, as save_pretrained writes them)")


def _run_name(args) -> str:
  if args.init_from is not None:
    return pathlib.Path(args.init_from).expanduser().resolve().name
  return args.preset


def run_dirs(args) -> list[pathlib.Path]:
  return [pathlib.Path(args.out) / f"{_run_name(args)}-{p}"
          for p in parse_precisions(args)]


def format_table(results) -> str:
  """Final losses and the relative gap of each run to the first one."""
  ref = results[0]
  head = (f"{'precision':<10} {'train loss':>10} {'val loss':>9} "
          f"{'val gap vs ' + ref.config.precision:>16} {'skipped':>8}")
  rows = [head, "-" * len(head)]
  for r in results:
    if r is ref:
      gap = "-"
    else:
      gap = f"{100 * (r.final_val_loss - ref.final_val_loss) / ref.final_val_loss:+.2f}%"
    rows.append(f"{r.config.precision:<10} {r.final_train_loss:>10.4f} "
                f"{r.final_val_loss:>9.4f} {gap:>16} {r.skipped:>8}")
  return "\n".join(rows)


def run(argv: Sequence[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  resolve_model(args)
  precisions = parse_precisions(args)
  configs = make_configs(args, precisions)
  check_paths(args)

  given = [f for f in ("coordinator", "num_processes", "process_id")
           if getattr(args, f) is not None]
  if given and not args.distributed:
    flag = "--" + given[0].replace("_", "-")
    raise UsageError(f"{flag} {getattr(args, given[0])} has no effect without "
                     f"--distributed; add --distributed (one process per "
                     f"host, same flags) or drop {flag}")

  # Heavy imports after the flags are known to be good: errors stay fast.
  import jax
  if args.distributed:
    try:
      jax.distributed.initialize(coordinator_address=args.coordinator,
                                 num_processes=args.num_processes,
                                 process_id=args.process_id)
    except (ValueError, RuntimeError) as e:
      raise UsageError(
          f"--distributed: jax.distributed.initialize() failed: {e} Outside "
          f"SLURM and Open MPI give --coordinator HOST:PORT (process 0's "
          f"address), --num-processes N and --process-id I") from None
  mesh = make_mesh(args)
  from models import format_count
  from models import param_count
  from train import data as data_lib
  from train.checkpoint import ConfigMismatchError
  from train.checkpoint import NoCheckpointError
  from train.checkpoint import RunExistsError
  from train.loop import Trainer
  from train.loop import model_config
  from train.plots import plot_losses
  from train.preemption import exit_code
  from train.report import gemm_report

  t_start = time.perf_counter()
  try:
    corpus = data_lib.load_corpus(args.data)
    corpus.check_seq_len(configs[0].seq_len)
  except (OSError, ValueError) as e:
    raise UsageError(str(e)) from None
  cfg0 = configs[0]
  try:
    mcfg = model_config(cfg0, corpus.vocab_size)
  except ValueError as e:  # An --init-from checkpoint the GPT cannot load.
    raise UsageError(str(e)) from None
  print(f"data: {corpus.describe()}")
  what = (cfg0.preset if cfg0.init_from is None
          else f"from {cfg0.init_from}")
  print(f"model: GPT {what}, {format_count(param_count(mcfg))} "
        f"parameters (d_model {mcfg.d_model}, {mcfg.num_layers} layers, "
        f"{mcfg.num_heads} heads, {mcfg.mlp}, {mcfg.dtype} compute) on "
        f"{jax.default_backend()} ({describe_mesh(mesh)})")
  print(f"training: {cfg0.steps} steps x {cfg0.batch_size} sequences x "
        f"{cfg0.seq_len} tokens, seed {cfg0.seed}; precisions "
        f"{', '.join(precisions)}")

  results = []
  for cfg, out in zip(configs, run_dirs(args)):
    try:
      trainer = Trainer(cfg, corpus, mesh=mesh)
    except ValueError as e:
      raise UsageError(str(e)) from None
    except MemoryError:
      raise UsageError(
          f"not enough memory for batches of --batch-size {cfg.batch_size} "
          f"x --seq-len {cfg.seq_len} tokens; use smaller values") from None
    print(f"\n[{cfg.precision}] {trainer.describe()} -> {out}")
    # From the traced step, not the configuration: what really runs. The
    # jitted functions themselves, so that the run reuses these traces
    # (jit's cache: the same function and argument types) instead of
    # tracing its train step a second time.
    batch = jax.ShapeDtypeStruct(
        (cfg.grad_accum, cfg.micro_batch, cfg.seq_len + 1), jax.numpy.int32)
    print(f"[{cfg.precision}] " + gemm_report(
        trainer.train_step, jax.eval_shape(trainer.init_state),
        batch).summary())
    t0 = time.perf_counter()
    try:
      result = trainer.run(out, resume=args.resume, overwrite=args.overwrite,
                           progress=not args.no_progress,
                           label=f"{cfg.precision:>5} ", handle_signals=True)
    except (NoCheckpointError, ConfigMismatchError, RunExistsError) as e:
      raise UsageError(str(e)) from None
    if result.stopped is not None:
      rest = [c.precision for c in configs[len(results) + 1:]]
      later = f" (not started: {', '.join(rest)})" if rest else ""
      print(f"{PROG}: {result.stopped}: stopped after step {result.step} of "
            f"{cfg.steps}, checkpoint saved in {result.checkpoint}{later}; "
            f"continue with the same flags and --resume", file=sys.stderr,
            flush=True)
      return exit_code(signal.Signals[result.stopped])
    print(f"[{cfg.precision}] train loss {result.final_train_loss:.4f}, val "
          f"loss {result.final_val_loss:.4f}, {result.skipped} skipped steps, "
          f"{time.perf_counter() - t0:.0f}s; plots: {result.loss_plot}"
          + (f", {result.diag_plot}" if result.diag_plot else ""))
    results.append(result)

  if len(results) > 1:
    print()
    print(format_table(results))
    plot = pathlib.Path(args.out) / f"{_run_name(args)}-{'-vs-'.join(precisions)}.png"
    plot_losses({r.config.precision: r.records for r in results}, plot,
                title=f"GPT {cfg0.preset}: {cfg0.steps} steps x "
                f"{cfg0.batch_size} x {cfg0.seq_len} tokens, seed {cfg0.seed}")
    print(f"\ncomparison plot: {plot}")
  print(f"done in {time.perf_counter() - t_start:.0f}s")
  bad = [r for r in results if not math.isfinite(r.final_val_loss)]
  for r in bad:
    print(f"{PROG}: the {r.config.precision} run diverged (validation loss "
          f"{r.final_val_loss}, {r.skipped} skipped steps); try a lower --lr",
          file=sys.stderr)
  return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
  """Console entry point; returns the exit status."""
  try:
    return run(argv)
  except UsageError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"{PROG}: interrupted; continue with the same flags and --resume",
          file=sys.stderr)
    return 130
