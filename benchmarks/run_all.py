"""Runs every benchmark in one process and prints the tables (Markdown).

    python -m benchmarks.run_all            # full sizes (GPU)
    python -m benchmarks.run_all --small    # smoke run with small shapes

Writes `results.md` and `results.json` to `--out` (default: $OUT if set).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import jax

from benchmarks import bench_gemm
from benchmarks import bench_quantize
from nvfp4_jax.tools import speed
from nvfp4_jax.tools import timing


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--small", action="store_true")
  p.add_argument("--sweep", action="store_true")
  p.add_argument("--quick", action="store_true",
                 help="GEMM at 8192^3 and 3 transformer shapes only")
  p.add_argument("--skip", default="", help="comma list: quantize,gemm,weight_only,dense")
  p.add_argument("--out", default=os.environ.get("OUT", ""))
  a = p.parse_args()
  skip = set(filter(None, a.skip.split(",")))
  dev = jax.devices()[0]
  head = (f"device: {dev.device_kind} ({dev.platform}); jax {jax.__version__}; "
          f"date {datetime.date.today()}")
  print(head, flush=True)
  t0 = time.time()
  bw = timing.copy_bandwidth(1 << 24 if a.small else 1 << 30)
  sections = [head, f"copy bandwidth (FP32 a*1.0001, read+write): "
              f"{bw / 1e12:.3f} TB/s"]
  results = {"head": head, "copy_tbps": bw / 1e12}
  print(sections[-1], flush=True)
  tq = (256, 512) if a.small else (8192, 8192)
  if a.sweep:
    rows = bench_quantize.sweep(*tq, copy_bw=bw)
    results["sweep"] = rows
    sections.append("## Tile sweep\n" + timing.table(
        rows, ("kernel", "us", "of_copy")))
    print(sections[-1], flush=True)
  if "quantize" not in skip:
    rows = bench_quantize.run(*tq, copy_bw=bw)
    results["quantize"] = rows
    sections.append("## Quantize\n" + timing.table(rows, bench_quantize.COLS))
    print(sections[-1], flush=True)
  if "gemm" not in skip:
    shapes = [(512, 512, 512, True)] if a.small else None
    if a.quick:
      shapes = [(8192, 8192, 8192, True), (8192, 4096, 4096, False),
                (8192, 14336, 4096, False), (8192, 4096, 14336, False)]
    rows = bench_gemm.run(shapes)
    results["gemm"] = rows
    sections.append("## GEMM\n" + timing.table(rows, bench_gemm.COLS))
    print(sections[-1], flush=True)
  if "weight_only" not in skip:
    rows = bench_gemm.run_weight_only(((4, 256, 256),) if a.small else
                                      bench_gemm.DECODE_SHAPES)
    results["weight_only"] = rows
    sections.append("## Weight-only (packed NVFP4 weight, decode)\n" +
                    timing.table(rows, bench_gemm.WEIGHT_ONLY_COLS))
    print(sections[-1], flush=True)
  if "dense" not in skip:
    rows = (speed.layer_speed(256, 256, 256) if a.small
            else speed.layer_speed())
    results["dense"] = rows
    sections.append("## Dense fwd+bwd\n"
                    + timing.table(rows, speed.LAYER_COLS))
    print(sections[-1], flush=True)
  sections.append(f"total {time.time() - t0:.0f} s")
  print(sections[-1])
  if a.out:
    with open(os.path.join(a.out, "results.md"), "w") as f:
      f.write("\n\n".join(sections) + "\n")
    with open(os.path.join(a.out, "results.json"), "w") as f:
      json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
  main()
