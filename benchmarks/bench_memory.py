"""Peak memory of the GPT train step and the largest micro-batch that fits.

    python -m benchmarks.bench_memory --presets base,large --seq 1024 \\
        --precisions bf16,nvfp4 --remat none,quantized

Each configuration runs in its own processes. The compiled step's peak is
XLA's own account (`compiled.memory_analysis()`: arguments + outputs -
donated aliases + temporaries). Nothing here is timed.

1. Search (compiles only, `--jobs` configurations at once): the peaks at
   `--batch` and twice that give the growth per sequence (the line). The
   largest micro-batch (a multiple of 8) whose peak stays within the
   device's allocator limit (`memory_stats()["bytes_limit"]`, or
   `--limit-gib`) is then searched by compiling: each next batch is read
   off the line through the two compiled points nearest the limit, kept
   strictly inside the bracket of batches known to fit and known not to
   (off its outer eighths, so a bent line still shrinks it), until the bracket
   is 8 wide or `--compiles` is spent. Peaks need not grow linearly (at
   large batches XLA's schedule changes): the answer is a compiled batch,
   never an extrapolation.
2. Run (one configuration at a time, alone on the device): the largest
   batch that fits by XLA's count is compiled (a hit in the persistent
   compilation cache the search filled) and run for two steps; if it runs
   out of memory, the next smaller multiple of 8 is tried, at most three
   times in all.

Each try is logged to stderr as it ends (batch, peak, seconds), so a call cut
short still shows where it stood; `--cache FILE` keeps finished searches and
runs and resumes from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import bench_step

MULTIPLE = 8  # Micro-batches searched are multiples of this.


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


def _search(cfg: bench_step.StepConfig, limit_gib: float | None,
            compiles: int) -> dict:
  """Phase 1 (compiles only): the line and the largest batch that fits by
  XLA's count."""
  limit = _limit(limit_gib)
  b0, b1 = cfg.batch, 2 * cfg.batch
  peaks = {}
  for b in (b0, b1):
    peaks[b] = _compile_at(cfg, b)[3]
  while len(peaks) < compiles:
    b = next_batch(peaks, limit)
    if b is None:
      break
    peaks[b] = _compile_at(cfg, b)[3]
  fit = [b for b, p in peaks.items() if p <= limit]
  over = [b for b, p in peaks.items() if p > limit]
  lo, hi = max(fit, default=0), min(over, default=None)
  return {"b0": b0, "b1": b1, "peak0": peaks[b0], "peak1": peaks[b1],
          "peaks": [[b, p] for b, p in peaks.items()], "limit": limit,
          "fits": lo, "over": hi,
          "exact": hi is not None and hi - lo <= MULTIPLE}


def _run(cfg: bench_step.StepConfig, search: dict) -> dict:
  """Phase 2 (alone on the device): the search's batch compiled and run for
  two steps, stepping down by 8 while it runs out of memory."""
  import jax  # pylint: disable=g-import-not-at-top

  def runs(compiled, state, data) -> bool:
    """Whether two steps run, False on running out of device memory."""
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

  tried = []
  b = search["fits"]
  while b >= MULTIPLE and len(tried) < 3:
    compiled, state, data, peak = _compile_at(cfg, b)
    if runs(compiled, state, data):
      _log(cfg, f"batch {b}: two steps ran")
      dev = jax.devices()[0]
      return {"max_batch": b, "peak_max": peak, "oom_tried": tried,
              "device": dev.device_kind, "jax": jax.__version__}
    _log(cfg, f"batch {b}: out of memory when run")
    tried.append({"batch": b, "peak": peak, "why": "out of memory when run"})
    del compiled, state, data
    b -= MULTIPLE
  return {"error": ("the smallest batch does not fit" if b < MULTIPLE else
                    f"out of memory at {[t['batch'] for t in tried]}"),
          "oom_tried": tried}


def _child_cmd(c: bench_step.StepConfig, phase: str, extra=()) -> list[str]:
  return [sys.executable, "-m", "benchmarks.bench_memory", "--child",
          json.dumps(dataclasses.asdict(c)), "--phase", phase, *extra]


def _result(label: str, out: str, rc: int) -> dict:
  if rc:
    raise RuntimeError(f"{label} failed (exit {rc}); its log is above.")
  return json.loads(out.strip().splitlines()[-1])


def _gib(b) -> str:
  return "" if b is None else f"{b / 2**30:.2f}"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--child", help=argparse.SUPPRESS)
  p.add_argument("--phase", choices=("search", "run"), help=argparse.SUPPRESS)
  p.add_argument("--search", help=argparse.SUPPRESS)
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
  p.add_argument("--jobs", type=int, default=4,
                 help="configurations searched at once (compiles only; the "
                 "runs are one at a time)")
  p.add_argument("--configs", default="",
                 help="comma list of precision:remat pairs to run instead of "
                 "every pair of --precisions and --remat, e.g. "
                 "'nvfp4:none,nvfp4:quantized'")
  p.add_argument("--no-run", action="store_true",
                 help="search only: report the largest batch by XLA's count "
                 "without running it")
  p.add_argument("--cache", default="",
                 help="JSON file of finished searches and runs: read at the "
                 "start, written as each finishes, so a run cut short picks "
                 "up where it stopped")
  a = p.parse_args(argv)
  if a.child:
    c = bench_step.StepConfig(**json.loads(a.child))
    r = (_search(c, a.limit_gib, a.compiles) if a.phase == "search"
         else _run(c, json.loads(a.search)))
    print(json.dumps(r))
    return
  from benchmarks import timing  # pylint: disable=g-import-not-at-top
  pairs = ([tuple(pr.split(":")) for pr in a.configs.split(",")]
           if a.configs else [(prec, remat) for remat in a.remat.split(",")
                              for prec in a.precisions.split(",")])
  configs = [bench_step.StepConfig(preset, prec, a.batch, a.seq, a.attention,
                                   remat, steps=2)
             for preset in a.presets.split(",") for prec, remat in pairs]
  cache = {"search": {}, "run": {}}
  if a.cache and os.path.exists(a.cache):
    with open(a.cache) as f:
      cache.update(json.load(f))

  def save():
    if a.cache:
      with open(a.cache, "w") as f:
        json.dump(cache, f, indent=1)

  # The runs' compiles hit the persistent cache the searches filled.
  env = dict(os.environ)
  env.setdefault("JAX_COMPILATION_CACHE_DIR",
                 os.path.join(tempfile.gettempdir(), "nvfp4_bench_memory"))
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  limit_arg = ([] if a.limit_gib is None else ["--limit-gib",
                                                str(a.limit_gib)])
  searches = cache["search"]
  pending = [c for c in configs if c.label not in searches]
  while pending:
    batch, pending = pending[:a.jobs], pending[a.jobs:]
    procs = [(c, subprocess.Popen(
        _child_cmd(c, "search", ["--compiles", str(a.compiles), *limit_arg]),
        stdout=subprocess.PIPE, text=True, env=env)) for c in batch]
    for c, proc in procs:
      out, _ = proc.communicate()
      searches[c.label] = _result(c.label, out, proc.returncode)
      save()
  rows = []
  for c in configs:
    s = searches[c.label]
    r = cache["run"].get(c.label)
    if r is None and not a.no_run:
      out = subprocess.run(
          _child_cmd(c, "run", ["--search", json.dumps(s)]),
          stdout=subprocess.PIPE, text=True, check=False, env=env)
      r = cache["run"][c.label] = _result(c.label, out.stdout, out.returncode)
      save()
    peaks = dict((b, p) for b, p in s["peaks"])
    over = s["over"]
    row = {"preset": c.preset, "precision": c.precision, "remat": c.remat,
           f"peak_gib_{s['b0']}": s["peak0"] / 2**30,
           f"peak_gib_{s['b1']}": s["peak1"] / 2**30,
           "fits_by_xla": s["fits"],
           "over_by_xla": "" if over is None else
                          f"{over} ({_gib(peaks[over])})",
           "compiles": len(peaks), "limit_gib": s["limit"] / 2**30}
    if r is not None:
      row["max_batch_run"] = r.get("max_batch", r.get("error"))
      row["peak_gib_max"] = (r["peak_max"] / 2**30 if "peak_max" in r
                             else "")
      row["oom_when_run"] = ", ".join(str(t["batch"])
                                      for t in r["oom_tried"])
      row["device"] = r.get("device")
    rows.append(row)
  cols = ["preset", "precision", "remat", f"peak_gib_{a.batch}",
          f"peak_gib_{2 * a.batch}", "fits_by_xla", "over_by_xla",
          "compiles", "max_batch_run", "peak_gib_max", "oom_when_run"]
  print(f"allocator limit {rows[0]['limit_gib']:.1f} GiB; seq {a.seq}; "
        f"micro-batch = sequences per step; peaks by XLA's memory analysis")
  print(timing.table(rows, [k for k in cols if any(k in r for r in rows)]))


if __name__ == "__main__":
  main()
