"""Peak memory of the GPT train step and the largest micro-batch that fits.

    python -m benchmarks.bench_memory --presets base,large --seq 1024 \\
        --precisions bf16,nvfp4 --remat none,quantized

Each configuration runs in its own process. The compiled step's peak is
XLA's own account (`compiled.memory_analysis()`: arguments + outputs -
donated aliases + temporaries). Nothing here is timed.

1. Search (compiles only): the peaks at `--batch` and twice that give the
   growth per sequence (the line). The largest micro-batch (a multiple of
   8) whose peak stays within the device's allocator limit
   (`memory_stats()["bytes_limit"]`, or `--limit-gib`) is then searched by
   compiling: each next batch is read off the line through the two
   compiled points nearest the limit, kept strictly inside the bracket of
   batches known to fit and known not to (off its outer eighths, so a bent
   line still shrinks it), until the bracket is 8 wide or `--compiles` is
   spent. Peaks need not grow linearly (at large batches XLA's schedule
   changes): the answer is a compiled batch, never an extrapolation.
2. Run: the largest batch that fits by XLA's count is compiled (a hit in
   the persistent compilation cache the search filled) and run for two
   steps, in a fresh process (a clean allocator, nothing left of the
   search). If it runs out of memory (the runtime needs memory beyond
   XLA's count), the next run is the batch whose peak is `--run-margin-gib`
   lower by the line, at most four runs in all. Up to `--jobs` processes
   run side by side, each within its own allocator limit (with
   `XLA_PYTHON_CLIENT_MEM_FRACTION=f`, keep `--jobs` x f below 1).

Each try is logged to stderr as it ends (batch, peak, seconds), and each
configuration's progress is written to `--state-dir` after every compile and
run: a second invocation with the same directory resumes where the first
stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import bench_step

MULTIPLE = 8  # Micro-batches searched are multiples of this.
# A step whose XLA peak is within the allocator limit can still run out of
# memory. On the H100 at a 19.8 GiB limit, with preallocation off, steps
# failed from 17.3 GiB of XLA peak without the remat policy and from 14.3
# GiB with it (BENCHMARKS.md); with the default preallocation (see
# `child_env`) none has yet. After a failed run, the next targets this much
# less.
RUN_MARGIN = 2.5 * 2**30
MAX_RUNS = 4


def peak_bytes(mem) -> int:
  """A compiled program's peak device memory by XLA's memory analysis."""
  return (mem.argument_size_in_bytes + mem.output_size_in_bytes
          - mem.alias_size_in_bytes + mem.temp_size_in_bytes)


def largest_fit(b0: int, p0: float, b1: int, p1: float, limit: float,
                multiple: int = MULTIPLE) -> int:
  """The largest batch (a multiple of `multiple`, at least `multiple`) whose
  peak on the line through (b0, p0), (b1, p1) is at most `limit`."""
  slope = (p1 - p0) / (b1 - b0)
  if slope <= 0:
    raise ValueError(f"peak memory does not grow with the batch "
                     f"({p0:.3g} B at {b0}, {p1:.3g} B at {b1}).")
  b = int((limit - (p0 - slope * b0)) / slope)
  return max(multiple, b // multiple * multiple)


def next_batch(peaks: dict[int, float], limit: float,
               multiple: int = MULTIPLE) -> int | None:
  """The next batch to compile in the search for the largest that fits.

  Args:
    peaks: compiled batches and their peaks, in the order compiled (at least
      the two of the first line).
    limit: the memory limit, same units as the peaks.

  Returns:
    A batch strictly inside the bracket (the largest batch known to fit, the
    smallest known not to), or None when the bracket is `multiple` wide: the
    answer is its lower end (0 when even `multiple` is over the limit).

  The guess is the line through the two compiled batches nearest the limit
  (one each side once both are known, else the two largest), kept off the
  bracket's outer eighths.
  """
  fit = [b for b, p in peaks.items() if p <= limit]
  over = [b for b, p in peaks.items() if p > limit]
  lo = max(fit, default=0)
  hi = min(over, default=None)
  if hi is not None and hi - lo <= multiple:
    return None
  if hi is not None and min(peaks) == hi and hi <= multiple:
    return None  # Even the smallest batch is over.
  a, b = (lo, hi) if hi is not None and fit else tuple(sorted(peaks)[-2:])
  try:
    guess = largest_fit(a, peaks[a], b, peaks[b], limit, multiple)
  except ValueError:  # Not growing between them: step past what fits.
    guess = 2 * max(lo, multiple)
  if hi is None:
    return max(guess, lo + multiple)
  # Kept off the bracket's outer eighths, so a bent line still halves it
  # within a few compiles.
  margin = max(multiple, (hi - lo) // 8 // multiple * multiple)
  return min(max(guess, lo + margin), hi - margin)


def _limit(limit_gib: float | None) -> float:
  import jax  # pylint: disable=g-import-not-at-top
  if limit_gib is not None:
    return limit_gib * 2**30
  dev = jax.devices()[0]
  stats = dev.memory_stats() or {}
  if "bytes_limit" not in stats:
    raise SystemExit(f"{dev.device_kind} reports no memory limit; pass "
                     f"--limit-gib.")
  return float(stats["bytes_limit"])


def _log(cfg: bench_step.StepConfig, msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {cfg.preset} {cfg.precision} "
        f"remat={cfg.remat}: {msg}", file=sys.stderr, flush=True)


def _compile_at(cfg: bench_step.StepConfig, batch: int):
  """The compiled step at `batch`, its state and data, and its XLA peak."""
  t = time.perf_counter()
  trainer, state, data = bench_step.build(dataclasses.replace(cfg,
                                                              batch=batch))
  compiled = trainer.train_step.lower(state, data).compile()
  peak = peak_bytes(compiled.memory_analysis())
  _log(cfg, f"batch {batch}: peak {peak / 2**30:.2f} GiB "
       f"(compiled in {time.perf_counter() - t:.0f} s)")
  return compiled, state, data, peak


def _runs(compiled, state, data) -> bool:
  """Whether two steps run, False on running out of device memory."""
  import jax  # pylint: disable=g-import-not-at-top
  try:
    for _ in range(2):
      state, m = compiled(state, data)
    jax.block_until_ready(m)
    return True
  except Exception as e:  # pylint: disable=broad-except
    msg = str(e).lower()
    if "resource_exhausted" not in msg and "out of memory" not in msg:
      raise
    return False


def _load_state(state_file: str) -> dict:
  st = {"peaks": [], "runs": []}
  if os.path.exists(state_file):
    with open(state_file) as f:
      st.update(json.load(f))
  return st


def _save_state(state_file: str, st: dict) -> None:
  tmp = state_file + ".tmp"
  with open(tmp, "w") as f:
    json.dump(st, f)
  os.replace(tmp, state_file)


def same_limit(st: dict, limit: float, state_file: str) -> float:
  """`limit`, refusing a state searched under another allocator limit: its
  peaks (XLA rematerializes to fit the limit it compiles for) and its
  bracket belong to that limit, so reusing them would mix two searches."""
  if "limit" in st and not math.isclose(st["limit"], limit, rel_tol=1e-6):
    raise SystemExit(
        f"{state_file} was searched under an allocator limit of "
        f"{st['limit'] / 2**30:.2f} GiB, this run has {limit / 2**30:.2f} "
        f"GiB; pass the same --limit-gib (or XLA_PYTHON_CLIENT_MEM_FRACTION), "
        f"or another --state-dir.")
  return limit


def _search(cfg: bench_step.StepConfig, limit_gib: float | None,
            compiles: int, state_file: str) -> dict:
  """The search (compiles only; nothing runs). Its progress is kept in
  `state_file` after every compile and picked up from there."""
  st = _load_state(state_file)
  st["limit"] = same_limit(st, _limit(limit_gib), state_file)
  peaks = {int(b): p for b, p in st["peaks"]}

  def compile_at(b):
    peaks[b] = _compile_at(cfg, b)[3]
    st["peaks"] = [[k, v] for k, v in peaks.items()]
    _save_state(state_file, st)

  for b in (cfg.batch, 2 * cfg.batch):
    if b not in peaks:
      compile_at(b)
  while len(peaks) < compiles:
    b = next_batch(peaks, st["limit"])
    if b is None:
      break
    compile_at(b)
  return _summary(cfg, st)


def _summary(cfg: bench_step.StepConfig, st: dict) -> dict:
  """A configuration's state as a result: its line, the bracket the search
  reached, and its runs."""
  peaks = {int(b): p for b, p in st["peaks"]}
  limit = st["limit"]
  fit = [b for b, p in peaks.items() if p <= limit]
  over = [b for b, p in peaks.items() if p > limit]
  lo, hi = max(fit, default=0), min(over, default=None)
  return {"b0": cfg.batch, "b1": 2 * cfg.batch, "peak0": peaks[cfg.batch],
          "peak1": peaks[2 * cfg.batch], "peaks": st["peaks"],
          "limit": limit, "fits": lo, "over": hi,
          "exact": hi is not None and hi - lo <= MULTIPLE,
          "runs": st.get("runs", [])}


def _run_once(cfg: bench_step.StepConfig, batch: int) -> dict:
  """`batch` compiled and run for two steps, in a fresh process (a clean
  allocator: nothing left of other compiles and states)."""
  import jax  # pylint: disable=g-import-not-at-top
  compiled, state, data, peak = _compile_at(cfg, batch)
  ok = _runs(compiled, state, data)
  _log(cfg, f"batch {batch}: " + ("two steps ran" if ok else
                                  "out of memory when run"))
  return {"batch": batch, "ok": ok, "peak": peak,
          "device": jax.devices()[0].device_kind, "jax": jax.__version__}


def next_run(summary: dict, margin: float = RUN_MARGIN) -> int | None:
  """The next batch to run, or None when done.

  First the search's answer. After a run out of memory at batch `b` (XLA
  peak `p`), the batch whose peak is `margin` bytes less, read off the line
  through `b` and the largest compiled batch below it (a multiple of 8, at
  least 8 less than `b`). Done once a run succeeds, at the smallest batch,
  or after `MAX_RUNS` runs.
  """
  runs = summary["runs"]
  if summary["fits"] == 0 or any(r["ok"] for r in runs) or (
      len(runs) >= MAX_RUNS):
    return None
  if not runs:
    return summary["fits"]
  b, p = min((r["batch"], r["peak"]) for r in runs)
  if b <= MULTIPLE:
    return None
  below = {int(k): v for k, v in summary["peaks"] if int(k) < b}
  nb = b - MULTIPLE
  if below:
    a = max(below)
    slope = (p - below[a]) / (b - a)
    if slope > 0:
      nb = min(nb, int(b - margin / slope) // MULTIPLE * MULTIPLE)
  return max(nb, MULTIPLE)


def child_env(environ, state_dir: str) -> dict[str, str]:
  """The children's environment: the persistent compilation cache in
  `state_dir` (unless set), and JAX's default preallocation of the
  allocator's whole arena, even where the caller turned it off. With
  `XLA_PYTHON_CLIENT_PREALLOCATE=false` the arena grows in pieces, and a
  step's temporaries, one contiguous buffer of up to the limit, may find no
  piece to fit: on the H100 at 19.8 GiB such runs failed from 14.3 GiB of
  XLA's count, where the default arena runs every batch whose count is
  within the limit (BENCHMARKS.md, 2026-11-26, later). Users run with the
  default."""
  env = dict(environ)
  env.setdefault("JAX_COMPILATION_CACHE_DIR",
                 os.path.join(state_dir, "jax_cache"))
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
  return env


def _child_cmd(c: bench_step.StepConfig, extra=()) -> list[str]:
  return [sys.executable, "-m", "benchmarks.bench_memory", "--child",
          json.dumps(dataclasses.asdict(c)), *extra]


def _slug(label: str) -> str:
  return "".join(ch if ch.isalnum() else "_" for ch in label)


def _gib(b) -> str:
  return "" if b is None else f"{b / 2**30:.2f}"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--child", help=argparse.SUPPRESS)
  p.add_argument("--state-file", help=argparse.SUPPRESS)
  p.add_argument("--try-batch", type=int, help=argparse.SUPPRESS)
  p.add_argument("--presets", default="base,large")
  p.add_argument("--batch", type=int, default=8,
                 help="micro-batch of the first compile (the second is 2x)")
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--precisions", default="bf16,nvfp4")
  p.add_argument("--remat", default="none,quantized")
  p.add_argument("--attention", default="fused")
  p.add_argument("--limit-gib", type=float, default=None,
                 help="memory budget instead of the device's allocator limit")
  p.add_argument("--compiles", type=int, default=8,
                 help="compiles per configuration in the search, the "
                 "line's two included")
  p.add_argument("--jobs", type=int, default=3,
                 help="configurations at once, each its own process within "
                 "its own allocator limit (keep jobs x the memory fraction "
                 "below 1)")
  p.add_argument("--configs", default="",
                 help="comma list of precision:remat pairs to run instead of "
                 "every pair of --precisions and --remat, e.g. "
                 "'nvfp4:none,nvfp4:quantized'")
  p.add_argument("--run-margin-gib", type=float,
                 default=RUN_MARGIN / 2**30,
                 help="after a run out of memory, the next run's XLA peak "
                 "is this much lower (read off the line)")
  p.add_argument("--no-run", action="store_true",
                 help="search only: report the largest batch by XLA's count "
                 "without running it")
  p.add_argument("--state-dir", default=os.path.join(
      tempfile.gettempdir(), "nvfp4_bench_memory"),
                 help="each configuration's progress (one JSON file per "
                 "configuration, written after every compile and run); a "
                 "second invocation with the same directory resumes")
  a = p.parse_args(argv)
  run = not a.no_run
  if a.child:
    c = bench_step.StepConfig(**json.loads(a.child))
    r = (_run_once(c, a.try_batch) if a.try_batch else
         _search(c, a.limit_gib, a.compiles, a.state_file))
    print(json.dumps(r))
    return
  from benchmarks import timing  # pylint: disable=g-import-not-at-top
  pairs = ([tuple(pr.split(":")) for pr in a.configs.split(",")]
           if a.configs else [(prec, remat) for remat in a.remat.split(",")
                              for prec in a.precisions.split(",")])
  configs = [bench_step.StepConfig(preset, prec, a.batch, a.seq, a.attention,
                                   remat, steps=2)
             for preset in a.presets.split(",") for prec, remat in pairs]
  os.makedirs(a.state_dir, exist_ok=True)
  # A rerun of a configuration compiles the same programs again: the
  # persistent compilation cache makes those hits.
  env = child_env(os.environ, a.state_dir)
  extra = ["--compiles", str(a.compiles)] + (
      [] if a.limit_gib is None else ["--limit-gib", str(a.limit_gib)]) + (
          [] if run else ["--no-run"])
  state_file = lambda c: os.path.join(a.state_dir, _slug(c.label) + ".json")
  results = {}
  # A pool of `--jobs` processes. A configuration has one process at a time:
  # its search, then each run in a fresh process.
  todo = [(c, None) for c in configs]
  running = []
  while todo or running:
    while todo and len(running) < a.jobs:
      c, batch = todo.pop(0)
      args = ([*extra, "--state-file", state_file(c)] if batch is None else
              ["--try-batch", str(batch)])
      running.append((c, batch, subprocess.Popen(
          _child_cmd(c, args), stdout=subprocess.PIPE, text=True, env=env)))
    time.sleep(1)
    for c, batch, proc in [r for r in running if r[2].poll() is not None]:
      running.remove((c, batch, proc))
      out = proc.stdout.read()
      if proc.returncode:
        raise RuntimeError(f"{c.label} failed (exit {proc.returncode}); its "
                           f"log is above.")
      r = json.loads(out.strip().splitlines()[-1])
      if batch is not None:  # A run: kept in the configuration's state.
        st = _load_state(state_file(c))
        st["runs"] = st.get("runs", []) + [r]
        _save_state(state_file(c), st)
        r = _summary(c, st)
      results[c.label] = r
      nxt = next_run(r, a.run_margin_gib * 2**30) if run else None
      if nxt is not None:
        todo.insert(0, (c, nxt))
  rows = []
  for c in configs:
    r = results[c.label]
    peaks = {b: p for b, p in r["peaks"]}
    over = r["over"]
    row = {"preset": c.preset, "precision": c.precision, "remat": c.remat,
           f"peak_gib_{r['b0']}": r["peak0"] / 2**30,
           f"peak_gib_{r['b1']}": r["peak1"] / 2**30,
           "fits_by_xla": r["fits"],
           "over_by_xla": "" if over is None else
                          f"{over} ({_gib(peaks[over])})",
           "compiles": len(peaks), "limit_gib": r["limit"] / 2**30}
    if run:
      ok = [t for t in r["runs"] if t["ok"]]
      b = ok[0]["batch"] if ok else "none ran"
      # Run before the search converged: a lower bound.
      row["max_batch_run"] = b if r["exact"] or not ok else f">= {b}"
      row["peak_gib_max"] = ok[0]["peak"] / 2**30 if ok else ""
      row["oom_when_run"] = ", ".join(str(t["batch"]) for t in r["runs"]
                                      if not t["ok"])
    rows.append(row)
  cols = ["preset", "precision", "remat", f"peak_gib_{a.batch}",
          f"peak_gib_{2 * a.batch}", "fits_by_xla", "over_by_xla",
          "compiles", "max_batch_run", "peak_gib_max", "oom_when_run"]
  print(f"allocator limit {rows[0]['limit_gib']:.1f} GiB; seq {a.seq}; "
        f"micro-batch = sequences per step; peaks by XLA's memory analysis")
  print(timing.table(rows, [k for k in cols if any(k in r for r in rows)]))


if __name__ == "__main__":
  main()
