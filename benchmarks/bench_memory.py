"""Peak memory of the GPT train step and the largest micro-batch that fits.

    python -m benchmarks.bench_memory --presets base,large --seq 1024 \\
        --precisions bf16,nvfp4 --remat none,quantized

Each configuration runs in its own processes. The compiled step's peak is
XLA's own account (`compiled.memory_analysis()`: arguments + outputs -
donated aliases + temporaries). It grows linearly with the micro-batch, so
two compiles, at `--batch` and at twice that, give the line (phase 1: only
compiles, `--jobs` configurations at once). The line predicts the largest
micro-batch whose peak stays within the device's allocator limit
(`memory_stats()["bytes_limit"]`, or `--limit-gib`), rounded down to a
multiple of 8. That batch is then compiled and run for two steps to confirm
it (phase 2: one configuration at a time, alone on the device). If it does not fit (past the limit by XLA's count, or out of
memory), the batch steps down by an eighth, at most three times. Nothing here is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

from benchmarks import bench_step


def peak_bytes(mem) -> int:
  """A compiled program's peak device memory by XLA's memory analysis."""
  return (mem.argument_size_in_bytes + mem.output_size_in_bytes
          - mem.alias_size_in_bytes + mem.temp_size_in_bytes)


def largest_fit(b0: int, p0: float, b1: int, p1: float, limit: float,
                multiple: int = 8) -> int:
  """The largest batch (a multiple of `multiple`, at least `multiple`) whose
  peak on the line through (b0, p0), (b1, p1) is at most `limit`."""
  slope = (p1 - p0) / (b1 - b0)
  if slope <= 0:
    raise ValueError(f"peak memory does not grow with the batch "
                     f"({p0:.3g} B at {b0}, {p1:.3g} B at {b1}).")
  b = int((limit - (p0 - slope * b0)) / slope)
  return max(multiple, b // multiple * multiple)


def _compile_at(cfg: bench_step.StepConfig, batch: int):
  trainer, state, data = bench_step.build(dataclasses.replace(cfg,
                                                              batch=batch))
  return trainer.train_step.lower(state, data).compile(), state, data


def _line(cfg: bench_step.StepConfig) -> dict:
  """Phase 1 (compiles only, may run beside other configurations): the
  peaks at `cfg.batch` and twice that."""
  b0, b1 = cfg.batch, 2 * cfg.batch
  return {"b0": b0, "b1": b1,
          "peak0": peak_bytes(_compile_at(cfg, b0)[0].memory_analysis()),
          "peak1": peak_bytes(_compile_at(cfg, b1)[0].memory_analysis())}


def _fit(cfg: bench_step.StepConfig, line: dict,
         limit_gib: float | None) -> dict:
  """Phase 2 (alone on the device): the largest batch the line predicts,
  compiled and run for two steps, stepping down while it does not fit."""
  import jax  # pylint: disable=g-import-not-at-top

  dev = jax.devices()[0]
  if limit_gib is not None:
    limit = limit_gib * 2**30
  else:
    stats = dev.memory_stats() or {}
    if "bytes_limit" not in stats:
      raise SystemExit(f"{dev.device_kind} reports no memory limit; pass "
                       f"--limit-gib.")
    limit = stats["bytes_limit"]
  b = largest_fit(line["b0"], line["peak0"], line["b1"], line["peak1"], limit)

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
  for _ in range(5):
    compiled, state, data = _compile_at(cfg, b)
    peak = peak_bytes(compiled.memory_analysis())
    # Past the limit by XLA's own count (the line was off), or out of memory.
    over = peak > limit
    if not over and runs(compiled, state, data):
      break
    tried.append({"batch": b, "peak": peak,
                  "why": "XLA's peak over the limit" if over else
                  "out of memory when run"})
    if b == 8:
      return {"error": "the smallest batch (8) does not fit", "tried": tried}
    if over:
      # The peak grows faster than the small-batch line: a new line through
      # this compile and the line's larger point predicts again.
      try:
        b_next = largest_fit(line["b1"], line["peak1"], b, peak, limit)
      except ValueError:  # Not growing between the two: no line.
        b_next = b
      b = min(b_next, b - 8) if b_next < b else b - max(8, b // 8) // 8 * 8
    else:
      b = b - max(8, b // 8) // 8 * 8
    b = max(8, b)
  else:
    return {"error": f"no fit at batches {[t['batch'] for t in tried]}",
            "tried": tried}
  return dict(line, max_batch=b, peak_max=peak, oom_tried=tried, limit=limit,
              device=dev.device_kind, jax=jax.__version__)


def _child_cmd(c: bench_step.StepConfig, phase: str, extra=()) -> list[str]:
  return [sys.executable, "-m", "benchmarks.bench_memory", "--child",
          json.dumps(dataclasses.asdict(c)), "--phase", phase, *extra]


def _result(label: str, out: str, err: str, rc: int) -> dict:
  if rc:
    raise RuntimeError(f"{label} failed:\n{err[-2000:]}")
  return json.loads(out.strip().splitlines()[-1])


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--child", help=argparse.SUPPRESS)
  p.add_argument("--presets", default="base,large")
  p.add_argument("--batch", type=int, default=8,
                 help="micro-batch of the first compile (the second is 2x)")
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--precisions", default="bf16,nvfp4")
  p.add_argument("--remat", default="none,quantized")
  p.add_argument("--attention", default="fused")
  p.add_argument("--limit-gib", type=float, default=None,
                 help="memory budget instead of the device's allocator limit")
  p.add_argument("--jobs", type=int, default=4,
                 help="configurations compiled at once in the first phase "
                 "(compiles only; the runs of the second phase are one at a "
                 "time)")
  p.add_argument("--configs", default="",
                 help="comma list of precision:remat pairs to run instead of "
                 "every pair of --precisions and --remat, e.g. "
                 "'nvfp4:none,nvfp4:quantized'")
  p.add_argument("--cache", default="",
                 help="JSON file of finished lines and fits: read at the "
                 "start, written as each finishes, so a run cut short picks "
                 "up where it stopped")
  p.add_argument("--phase", choices=("line", "fit"), help=argparse.SUPPRESS)
  p.add_argument("--line", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.child:
    c = bench_step.StepConfig(**json.loads(a.child))
    r = (_line(c) if a.phase == "line"
         else _fit(c, json.loads(a.line), a.limit_gib))
    print(json.dumps(r))
    return
  from benchmarks import timing  # pylint: disable=g-import-not-at-top
  pairs = ([tuple(pr.split(":")) for pr in a.configs.split(",")]
           if a.configs else [(prec, remat) for remat in a.remat.split(",")
                              for prec in a.precisions.split(",")])
  configs = [bench_step.StepConfig(preset, prec, a.batch, a.seq, a.attention,
                                   remat, steps=2)
             for preset in a.presets.split(",") for prec, remat in pairs]
  # Phase 1: the two compiles per configuration that give its line, `--jobs`
  # processes at a time (CPU-bound; nothing runs on the device).
  cache = {"line": {}, "fit": {}}
  if a.cache and os.path.exists(a.cache):
    with open(a.cache) as f:
      cache = json.load(f)

  def save():
    if a.cache:
      with open(a.cache, "w") as f:
        json.dump(cache, f, indent=1)

  lines = cache["line"]
  pending = [c for c in configs if c.label not in lines]
  while pending:
    batch, pending = pending[:a.jobs], pending[a.jobs:]
    procs = [(c, subprocess.Popen(_child_cmd(c, "line"),
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
             for c in batch]
    for c, proc in procs:
      out, err = proc.communicate()
      lines[c.label] = _result(c.label, out, err, proc.returncode)
      save()
      print(f"{c.label}: line {json.dumps(lines[c.label])}", file=sys.stderr,
            flush=True)
  rows = []
  for c in configs:
    extra = ["--line", json.dumps(lines[c.label])]
    if a.limit_gib is not None:
      extra += ["--limit-gib", str(a.limit_gib)]
    if c.label in cache["fit"]:
      r = cache["fit"][c.label]
    else:
      out = subprocess.run(_child_cmd(c, "fit", extra), capture_output=True,
                           text=True, check=False)
      r = cache["fit"][c.label] = _result(c.label, out.stdout, out.stderr,
                                          out.returncode)
      save()
    row = {"preset": c.preset, "precision": c.precision, "remat": c.remat}
    if "error" in r:
      rows.append(dict(row, note=r["error"] + "".join(
          f"; {t['batch']}: {t['why']} ({t['peak'] / 2**30:.1f} GiB)"
          for t in r.get("tried", []))))
      continue
    rows.append(dict(
        row, **{f"peak_gib_{r['b0']}": r["peak0"] / 2**30,
                f"peak_gib_{r['b1']}": r["peak1"] / 2**30},
        max_batch=r["max_batch"], peak_gib_max=r["peak_max"] / 2**30,
        note=("; ".join(f"{t['batch']}: {t['why']} ({t['peak'] / 2**30:.1f} "
                        f"GiB)" for t in r["oom_tried"])
              if r["oom_tried"] else ""),
        device=r["device"], limit_gib=r["limit"] / 2**30))
    print(f"{c.label}: max batch {r['max_batch']}, peak "
          f"{r['peak_max'] / 2**30:.2f} GiB, tried {r['oom_tried']}",
          file=sys.stderr, flush=True)
  cols = ["preset", "precision", "remat", f"peak_gib_{a.batch}",
          f"peak_gib_{2 * a.batch}", "max_batch", "peak_gib_max", "note"]
  first = next((r for r in rows if "device" in r), {})
  print(f"device: {first.get('device')}; allocator limit "
        f"{first.get('limit_gib', float('nan')):.1f} GiB; seq {a.seq}; "
        f"micro-batch = sequences per step")
  print(timing.table(rows, cols))


if __name__ == "__main__":
  main()
