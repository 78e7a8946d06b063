"""Step time around a checkpoint save: synchronous against asynchronous.

    python -m benchmarks.bench_checkpoint                  # CPU: GPT tiny
    python -m benchmarks.bench_checkpoint --preset base    # a GPU

Trains one `Trainer` (`train.loop`) `--rounds` times each way, alternating,
with a checkpoint every `--ckpt-every` steps: `Trainer.run(
async_checkpoints=False)` writes each checkpoint before the next step;
`async_checkpoints=True` copies the state off the devices and writes it in
the background. Metrics are synced every step (`log_every=1`), so the time
between two consecutive `on_step` calls is that step's wall time, its
bookkeeping (the save's blocking part) included. The table gives the median
of the steps without a save (the first two, which compile, and the last,
which evaluates and saves, left out), of the steps that save, and of the
steps after them (when an asynchronous write runs beside them), in
milliseconds, with the checkpoint's size.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile
import time


def run_once(trainer, out: pathlib.Path, asynchronous: bool) -> list[float]:
  """Seconds of each step (index i: step i + 1) of one run into `out`."""
  stamps = [time.perf_counter()]
  trainer.run(out, overwrite=True, progress=False, log_every=1,
              async_checkpoints=asynchronous,
              on_step=lambda done: stamps.append(time.perf_counter()))
  return [b - a for a, b in zip(stamps, stamps[1:])]


def summarize(times: list[list[float]], every: int, steps: int) -> dict:
  """Median milliseconds by kind of step over all rounds."""
  kinds = {"plain": [], "save": [], "after": [], "after2": []}
  for run in times:
    for i, t in enumerate(run):
      step = i + 1
      if step <= 2 or step == steps:
        continue
      if step % every == 0:
        kinds["save"].append(t)
      elif step % every == 1:
        kinds["after"].append(t)
      elif step % every == 2:
        kinds["after2"].append(t)
      else:
        kinds["plain"].append(t)
  return {k: 1e3 * statistics.median(v) if v else float("nan")
          for k, v in kinds.items()}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="tiny")
  p.add_argument("--precision", default="bf16")
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--ckpt-every", type=int, default=8)
  p.add_argument("--batch-size", type=int)
  p.add_argument("--seq-len", type=int)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--out", help="where the runs go (default: a temporary "
                 "directory, removed at the end)")
  args = p.parse_args(argv)

  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from train import data as data_lib  # pylint: disable=g-import-not-at-top
  from train.config import TrainConfig  # pylint: disable=g-import-not-at-top
  from train.loop import Trainer  # pylint: disable=g-import-not-at-top

  if args.ckpt_every < 4 or args.steps < 2 * args.ckpt_every:
    p.error(f"--ckpt-every {args.ckpt_every} with --steps {args.steps}: "
            f"need --ckpt-every >= 4 (steps without a save between saves) "
            f"and --steps >= 2 x --ckpt-every")
  cfg = TrainConfig.for_preset(
      args.preset, precision=args.precision, steps=args.steps,
      batch_size=args.batch_size, seq_len=args.seq_len,
      ckpt_every=args.ckpt_every, eval_every=args.steps, diagnostics=False)
  corpus = data_lib.load_corpus(None)
  trainer = Trainer(cfg, corpus)
  root = pathlib.Path(args.out or tempfile.mkdtemp(prefix="bench-ckpt-"))
  try:
    run_once(trainer, root / "warmup", False)  # Compiles every program.
    times = {False: [], True: []}
    for _ in range(args.rounds):
      for asynchronous in (False, True):
        times[asynchronous].append(
            run_once(trainer, root / f"async={asynchronous}", asynchronous))
    ckpt = root / "async=False" / "checkpoints" / str(args.steps)
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
  finally:
    if args.out is None:
      shutil.rmtree(root, ignore_errors=True)
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"jax {jax.__version__}, orbax {ocp.__version__}")
  print(f"GPT {args.preset} {args.precision}, {cfg.batch_size} x "
        f"{cfg.seq_len} tokens, {args.steps} steps, a checkpoint "
        f"({size / 2**20:.1f} MiB) every {args.ckpt_every}, {args.rounds} "
        f"rounds; median ms per step")
  head = (f"{'saves':<6} {'no save':>8} {'save step':>10} {'next':>8} "
          f"{'2nd next':>9} {'save cost':>10}")
  print(head)
  print("-" * len(head))
  for asynchronous in (False, True):
    s = summarize(times[asynchronous], args.ckpt_every, args.steps)
    cost = s["save"] + s["after"] + s["after2"] - 3 * s["plain"]
    print(f"{'async' if asynchronous else 'sync':<6} {s['plain']:>8.1f} "
          f"{s['save']:>10.1f} {s['after']:>8.1f} {s['after2']:>9.1f} "
          f"{cost:>10.1f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
