"""The convergence study: the paper's findings at small scale, reproducibly.

    python -m train.study --list                    # the configurations
    python -m train.study --dry-run                 # the commands it runs
    python -m train.study --preset small --steps 2000 --out runs/study
    python -m train.study ... --stop-after 420     # in a 10-minute job
    python -m train.study --preset base --mesh data=4 --only bf16-s0,nvfp4-s0

Runs a named set of configurations (same data, seeds, token budget and
schedule) one after another on one device (or one `--mesh`), each as `python -m train` in its
own process. A killed study picks up where it stopped: finished runs (a final
evaluation in their metrics) are not redone, and an interrupted run continues
from its last checkpoint (`--resume`). Then it writes `results.md` (final
validation loss per run, every run of the study found in `--out` included,
the gap to BF16 with the seed spread, tokens, step time, the exact
commands) and the loss curves (`curves.png`, with a log-scale
panel of the tail so small gaps are visible) into `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Sequence

PROG = "python -m train.study"


@dataclasses.dataclass(frozen=True)
class Run:
  """One configuration of a study.

  Attributes:
    name: its label (and directory).
    flags: its `python -m train` flags beyond the study's common ones.
    seeds: the seeds it runs with (None: the study's `--seeds`).
  """

  name: str
  flags: tuple[str, ...]
  seeds: tuple[int, ...] | None = (0,)


def _switch(fraction: float, mode: str):
  """Flags of a late switch for the last `fraction` of the steps (filled in
  when the step count is known)."""
  return ("--late-switch-fraction", f"{fraction}", "--late-switch-mode", mode)


STUDIES: dict[str, tuple[Run, ...]] = {
    "paper": (
        Run("bf16", ("--precision", "bf16"), seeds=None),
        Run("nvfp4", ("--precision", "nvfp4"), seeds=None),
        Run("nvfp4-no-sr", ("--precision", "nvfp4", "--no-sr"), seeds=None),
        Run("nvfp4-no-rht", ("--precision", "nvfp4", "--no-rht")),
        Run("nvfp4-no-2d", ("--precision", "nvfp4", "--no-2d")),
        Run("nvfp4-all-quantized", ("--precision", "nvfp4",
                                    "--all-quantized")),
        Run("nvfp4-4over6", ("--precision", "nvfp4", "--four-over-six",
                             "all")),
        Run("mxfp4", ("--precision", "mxfp4")),
        Run("nvfp4-switch-forward", ("--precision", "nvfp4")
            + _switch(0.2, "forward")),
        Run("nvfp4-switch-all", ("--precision", "nvfp4")
            + _switch(0.2, "all")),
    ),
}


def commands(study: str, args) -> list[tuple[str, pathlib.Path, list[str]]]:
  """`(label, run dir, argv)` of every run of `study`."""
  out = []
  seeds = [int(s) for s in args.seeds.split(",")]
  for run in STUDIES[study]:
    for seed in (run.seeds if run.seeds is not None else seeds):
      flags = list(run.flags)
      if "--late-switch-fraction" in flags:
        i = flags.index("--late-switch-fraction")
        step = int(round(args.steps * (1 - float(flags[i + 1]))))
        flags[i:i + 2] = ["--late-switch-step", str(step)]
      label = f"{run.name}-s{seed}"
      root = pathlib.Path(args.out) / label
      argv = [*flags, "--preset", args.preset, "--steps", str(args.steps),
              "--seed", str(seed), "--out", str(root), "--no-progress"]
      for name in ("batch_size", "seq_len", "eval_every", "ckpt_every",
                   "data", "mesh"):
        v = getattr(args, name)
        if v is not None:
          argv += [f"--{name.replace('_', '-')}", str(v)]
      precision = flags[flags.index("--precision") + 1]
      out.append((label, root / f"{args.preset}-{precision}", argv))
  return out


def _records(run_dir: pathlib.Path) -> list[dict]:
  from train.metrics import read_metrics  # pylint: disable=g-import-not-at-top
  path = run_dir / "metrics.jsonl"
  return read_metrics(path) if path.exists() else []


def finished(run_dir: pathlib.Path, steps: int) -> bool:
  return any(r.get("kind") == "eval" and r["step"] == steps
             for r in _records(run_dir))


def step_seconds(train: list[dict]) -> float:
  """Median seconds per step of a run's train records (NaN if unknown).

  The trainer writes its records in batches (one device fetch per log
  interval), so the records of a batch share one time stamp: the rate is
  taken between consecutive batches, which also leaves out the first
  batch's compilation.
  """
  marks: list[tuple[int, float]] = []  # (last step, time) of each batch
  for r in train:
    if marks and marks[-1][1] == r["time"]:
      marks[-1] = (r["step"], r["time"])
    else:
      marks.append((r["step"], r["time"]))
  rates = [(t1 - t0) / (s1 - s0)
           for (s0, t0), (s1, t1) in zip(marks, marks[1:]) if s1 > s0]
  return statistics.median(rates) if rates else math.nan


def summarize(runs, steps: int) -> tuple[str, dict[str, list[dict]]]:
  """The results table (Markdown) and each run's records."""
  records = {label: _records(d) for label, d, _ in runs}
  groups: dict[str, list[float]] = {}
  rows = []
  for label, run_dir, argv in runs:
    recs = records[label]
    evals = [r for r in recs if r.get("kind") == "eval"]
    train = [r for r in recs if r.get("kind") == "train"]
    val = evals[-1]["val_loss"] if evals else math.nan
    group = label.rsplit("-s", 1)[0]
    groups.setdefault(group, []).append(val)
    rows.append((label, group, val, train[-1]["tokens"] if train else 0,
                 step_seconds(train) * 1e3,
                 "python -m train " + " ".join(argv)))
  base = statistics.mean(groups.get("bf16", [math.nan]))
  lines = ["| run | final val loss | gap to BF16 (group mean ± sd) | tokens "
           "| step ms | command |", "| --- | --- | --- | --- | --- | --- |"]
  for label, group, val, tokens, ms, cmd in rows:
    g = groups[group]
    mean = statistics.mean(g)
    sd = statistics.stdev(g) if len(g) > 1 else 0.0
    gap = (f"{100 * (mean / base - 1):+.2f}% ± {100 * sd / base:.2f}%"
           if math.isfinite(base) else "-")
    lines.append(f"| {label} | {val:.4f} | {gap} | {tokens:,} | {ms:.1f} | "
                 f"`{cmd}` |")
  return "\n".join(lines), records


def _group_curves(records: dict[str, list[dict]]
                  ) -> dict[str, tuple[list[int], list[list[float]]]]:
  """`{group: (steps, [val losses per seed])}` over the steps every seed of
  the group evaluated (a group: the label without its `-sN`)."""
  groups: dict[str, list[dict[int, float]]] = {}
  for label, recs in records.items():
    ev = {r["step"]: r["val_loss"] for r in recs if r.get("kind") == "eval"}
    if ev:
      groups.setdefault(label.rsplit("-s", 1)[0], []).append(ev)
  out = {}
  for g, evs in groups.items():
    steps = sorted(set.intersection(*(set(e) for e in evs)))
    out[g] = (steps, [[e[s] for s in steps] for e in evs])
  return out


def plot(records: dict[str, list[dict]], path: pathlib.Path, title: str):
  """Three panels: validation loss (mean over seeds), its tail on a log
  scale, and each group's gap to BF16 in percent (mean over seeds; a band
  of +-1 sd where a group has several seeds)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  curves = _group_curves(records)
  fig, (ax, tail, gap) = plt.subplots(1, 3, figsize=(15, 4.2))
  base = curves.get("bf16")
  base_mean = dict(zip(base[0], np.mean(base[1], axis=0))) if base else {}
  for i, (g, (steps, vals)) in enumerate(curves.items()):
    v = np.asarray(vals)
    mean = v.mean(axis=0)
    style = "-" if g in ("bf16", "nvfp4") else "--"
    kw = dict(label=f"{g} (x{len(vals)})" if len(vals) > 1 else g, lw=1.2,
              color=f"C{i % 10}")
    ax.plot(steps, mean, style, **kw)
    half = len(steps) // 2
    tail.plot(steps[half:], mean[half:], style, **kw)
    if base_mean and g != "bf16":
      keep = [j for j, s in enumerate(steps) if s in base_mean]
      b = np.asarray([base_mean[steps[j]] for j in keep])
      rel = 100 * (v[:, keep] / b - 1)
      x = [steps[j] for j in keep]
      gap.plot(x, rel.mean(axis=0), style, **kw)
      if len(vals) > 1:
        sd = rel.std(axis=0, ddof=1)
        gap.fill_between(x, rel.mean(axis=0) - sd, rel.mean(axis=0) + sd,
                         color=kw["color"], alpha=0.15, lw=0)
  ax.set_xlabel("step")
  ax.set_ylabel("validation loss")
  ax.set_title(title, fontsize=9)
  tail.set_yscale("log")
  tail.set_xlabel("step (second half)")
  tail.set_title("tail, log scale", fontsize=9)
  gap.axhline(0, color="k", lw=0.6)
  gap.set_xlabel("step")
  gap.set_ylabel("% above BF16 (mean of its seeds)")
  gap.set_title("gap to BF16", fontsize=9)
  tail.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return str(path)


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
  p.add_argument("--study", choices=list(STUDIES), default="paper")
  p.add_argument("--preset", default="small")
  p.add_argument("--steps", type=int, default=2000)
  p.add_argument("--seeds", default="0,1,2",
                 help="seeds of the BF16 and full-recipe runs")
  p.add_argument("--batch-size", type=int)
  p.add_argument("--seq-len", type=int)
  p.add_argument("--eval-every", type=int)
  p.add_argument("--ckpt-every", type=int,
                 help="steps between checkpoints (what an interrupted run "
                 "resumes from)")
  p.add_argument("--data")
  p.add_argument("--mesh", metavar="AXIS=N,...",
                 help="each run's device mesh (`python -m train --mesh`), "
                 "e.g. data=4; --batch-size is then the global batch")
  p.add_argument("--out", default="runs/study")
  p.add_argument("--only", help="comma list of run labels to run")
  p.add_argument("--stop-after", type=float, metavar="SECONDS",
                 help="start no further run once this much time has passed "
                 "(for time-limited jobs: rerun the study to go on)")
  p.add_argument("--list", action="store_true")
  p.add_argument("--dry-run", action="store_true")
  args = p.parse_args(argv)
  runs = commands(args.study, args)
  every = runs
  if args.only:
    keep = set(args.only.split(","))
    unknown = keep - {label for label, _, _ in runs}
    if unknown:
      p.error(f"--only: unknown run(s) {sorted(unknown)}; see --list")
    runs = [r for r in runs if r[0] in keep]
  if args.list or args.dry_run:
    for label, run_dir, cmd in runs:
      done = "done" if finished(run_dir, args.steps) else "to run"
      print(f"{label:<28} {done:<7} "
            + (f"python -m train {' '.join(cmd)}" if args.dry_run else ""))
    return 0
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  start = time.monotonic()
  for label, run_dir, cmd in runs:
    if finished(run_dir, args.steps):
      print(f"[{label}] finished earlier; skipped")
      continue
    if (args.stop_after is not None
        and time.monotonic() - start >= args.stop_after):
      left = [lb for lb, rd, _ in runs if not finished(rd, args.steps)]
      print(f"{PROG}: --stop-after {args.stop_after:g} s reached; "
            f"{len(left)} run(s) left ({', '.join(left)}): run the study "
            f"again to go on")
      return 0
    resume = (run_dir / "checkpoints").is_dir() and any(
        (run_dir / "checkpoints").iterdir())
    full = [sys.executable, "-m", "train", *cmd] + (["--resume"] if resume
                                                    else [])
    print(f"[{label}] {'resuming' if resume else 'running'}: "
          f"python -m train {' '.join(cmd)}", flush=True)
    rc = subprocess.run(full, check=False).returncode
    if rc:
      print(f"{PROG}: {label} exited with {rc}; run the study again to "
            f"resume it", file=sys.stderr)
      return rc
  # The report covers the runs just made and every other run of the study
  # already in `--out` (one `--only` call a run, e.g. one a device session,
  # still gives one table with the gap to BF16).
  ran = {label for label, _, _ in runs}
  table, records = summarize(
      [r for r in every if r[0] in ran or _records(r[1])], args.steps)
  curves = plot(records, out / "curves.png",
                f"{args.study} study: {args.preset}, {args.steps} steps")
  (out / "results.md").write_text(
      f"# {args.study} study: GPT {args.preset}, {args.steps} steps\n\n"
      f"{table}\n\n![curves](curves.png)\n")
  print(table)
  print(f"results: {out / 'results.md'}; curves: {curves}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
