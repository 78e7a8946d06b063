"""Where the GPU time of a GPT train step goes, kernel by kernel.

    python -m benchmarks.profile_step --preset small --batch 64 --seq 512

Traces `--steps` train steps of each precision with `jax.profiler` (each
precision in its own process, as `bench_step` does), reads the GPU kernels
back from the trace and prints two tables: the GPU time per step by kernel
class for each precision, with the NVFP4 - BF16 difference (the overhead by
name), and the largest kernels of the NVFP4 step. Classes come from the
kernel names: the library's Pallas kernels are named `nvfp4_*`; cuBLAS and
CUTLASS GEMMs, cuDNN attention and XLA's fusions have recognizable names.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

from nvfp4_jax.tools import timing

# (class, regex on the kernel name), first match wins.
CLASSES = (
    ("pallas: quantize x + rht_t (pair)", r"nvfp4_quantize_x_and_rht_t"),
    ("pallas: quantize rht_t (Wgrad)", r"nvfp4_quantize_rht_t"),
    ("pallas: rht amax", r"nvfp4_rht_amax"),
    ("pallas: quantize 16x16 (weights)", r"nvfp4_quantize_2d"),
    ("pallas: quantize 1x16", r"nvfp4_quantize"),
    ("pallas: block values (dequantize)", r"nvfp4_block_values"),
    ("pallas: other", r"nvfp4_"),
    ("attention (cuDNN)", r"cudnn|flash|fmha|sdpa"),
    # `kernel_mosaic_gpu_kernel`: `nvfp4_jax.ops.block_scaled_matmul.pallas_mosaic_gpu`.
    ("GEMM (cuBLAS/CUTLASS/Mosaic)",
     r"gemm|xmma|cutlass|sm\d+_.*_tn|nvjet|wgmma|mosaic_gpu"),
    ("XLA reduction fusions", r"reduce|reduction"),
    ("XLA fusions", r"fusion|wrapped_|loop_|input_"),
    ("copies and transposes", r"copy|transpose|memcpy|memset"),
)


def classify(name: str) -> str:
  for label, pat in CLASSES:
    if re.search(pat, name, re.IGNORECASE):
      return label
  return "other"


def busy_and_span(intervals) -> tuple[float, float]:
  """(time covered by the union of `[start, end)` intervals, time from the
  first start to the last end): the GPU's busy time and the span it fell
  in. Kernels of several streams may overlap; the union counts once."""
  ivs = sorted(intervals)
  if not ivs:
    return 0.0, 0.0
  busy, (cur_s, cur_e) = 0.0, ivs[0]
  last = cur_e
  for s, e in ivs[1:]:
    last = max(last, e)
    if s > cur_e:  # A gap: close the current run.
      busy += cur_e - cur_s
      cur_s, cur_e = s, e
    else:
      cur_e = max(cur_e, e)
  return busy + cur_e - cur_s, last - ivs[0][0]




# An HLO instruction with its JAX source path: `%name = ... op_name="..."`.
_HLO_OP = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?op_name="([^"]*)"',
                     re.M)
_LAYER = re.compile(r"nvfp4_layer\[[^\]]*\]/")


def layer_ops(hlo_text: str, kernels: dict[str, tuple[float, float]]
              ) -> tuple[dict[str, list[float]], float]:
  """The kernels inside the NVFP4 layers, by the JAX op that made them.

  Looks each kernel up in the compiled HLO (the trace names a fusion
  `loop_add_fusion_3` where the HLO has `%loop_add_fusion.3`) and reads the
  `op_name` its source path left: ops under an `nvfp4_layer[...]` scope
  (`training.names.layer_scope`) are keyed by the path after it, named regions
  unwrapped (`nvfp4_quantize_w/transpose`), with "bwd " in the backward
  pass. The library's Pallas kernels (named `nvfp4_*`) are keyed by name.

  Returns:
    `({op: [calls, us]}, us of the kernels outside the layers)`.
  """
  source = {}
  for m in _HLO_OP.finditer(hlo_text):
    source.setdefault(m.group(1).replace(".", "_"), m.group(2))
  ops: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
  outside = 0.0
  for name, (calls, us) in kernels.items():
    if name.startswith("nvfp4_"):
      key = "pallas " + re.sub(r"__\d+$", "", name)
    else:
      op = source.get(name, "")
      if not _LAYER.search(op):
        outside += us
        continue
      key = re.sub(r"jit\(([^()]*)\)", r"\1", _LAYER.split(op)[-1])
      if "transpose(jvp(" in op:
        key = "bwd " + key
    ops[key][0] += calls
    ops[key][1] += us
  return dict(ops), outside


def _child(preset: str, precision: str, batch: int, seq: int,
           steps: int, hlo_dir: str = "", residuals: str = "codes") -> dict:
  import jax  # pylint: disable=g-import-not-at-top

  from benchmarks import bench_step  # pylint: disable=g-import-not-at-top

  trainer, state, b = bench_step.build(
      bench_step.StepConfig(preset, precision, batch, seq,
                            residuals=residuals if precision == "nvfp4"
                            else "codes"))
  step = trainer.train_step.lower(state, b).compile()
  if hlo_dir:  # The compiled HLO: kernel names in the trace are its fusions.
    with open(f"{hlo_dir}/{preset}-{precision}.hlo.txt", "w") as f:
      f.write(step.as_text())
  for _ in range(3):  # Warm-up.
    state, m = step(state, b)
  jax.block_until_ready(m)
  t0 = time.perf_counter()  # The wall clock, untraced, same step count.
  for _ in range(steps):
    state, m = step(state, b)
  jax.block_until_ready(m)
  wall_us = (time.perf_counter() - t0) / steps * 1e6
  d = tempfile.mkdtemp()
  jax.profiler.start_trace(d)
  for _ in range(steps):
    state, m = step(state, b)
  jax.block_until_ready(m)
  jax.profiler.stop_trace()
  (xplane,) = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
  intervals = []
  kernels = timing.trace_kernels(xplane, intervals)
  busy, span = busy_and_span(intervals)
  return {"kernels": {k: [c / steps, ns / steps / 1e3]
                      for k, (c, ns) in kernels.items()},
          "clocks": {"wall_us": wall_us, "busy_us": busy / steps / 1e3,
                     "span_us": span / steps / 1e3},
          "device": jax.devices()[0].device_kind, "jax": jax.__version__}


def print_layer_ops(hlo_dir: str, preset: str, kernels, top: int) -> None:
  """Prints `layer_ops` of the NVFP4 step from its HLO in `hlo_dir`."""
  path = f"{hlo_dir}/{preset}-nvfp4.hlo.txt"
  if not os.path.exists(path):  # Saved gzipped (the base HLO is > 16 MB).
    path += ".gz"
  with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
    ops, outside = layer_ops(f.read(), kernels)
  rows = [{"op": k, "calls": c, "us": us}
          for k, (c, us) in sorted(ops.items(), key=lambda kv: -kv[1][1])]
  print(f"\nkernels inside the NVFP4 layers, by op ({outside:.0f} us in "
        f"kernels outside them or not named in the HLO: library calls such "
        f"as cuBLAS and cuDNN)")
  print(timing.table(rows[:top], ("op", "calls", "us")))


def main(argv=None):
  from benchmarks import bench_step  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  bench_step.step_arguments(p)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--top", type=int, default=15)
  p.add_argument("--residuals", default="codes",
                 help="the NVFP4 layers' Recipe.residuals: codes or values")
  p.add_argument("--hlo-dir", default="",
                 help="write each precision's compiled HLO here, to look up "
                 "the XLA fusions the tables name")
  p.add_argument("--from-hlo-dir", default="",
                 help="print the NVFP4 layers' kernels by op from a "
                 "directory an earlier --hlo-dir run wrote (no GPU)")
  a = p.parse_args(argv)
  if a.from_hlo_dir:
    with open(f"{a.from_hlo_dir}/{a.preset}-kernels.json") as f:
      kernels = json.load(f)["nvfp4"]["kernels"]
    print_layer_ops(a.from_hlo_dir, a.preset, kernels, a.top)
    return
  if a.child:  # `_child`'s arguments, as `timing.run_child` passes them.
    print(json.dumps(_child(*json.loads(a.child))))
    return
  runs = {}
  for prec in a.precisions.split(","):
    runs[prec] = timing.run_child(
        "benchmarks.profile_step",
        [a.preset, prec, a.batch, a.seq, a.steps, a.hlo_dir, a.residuals],
        prec)
  precs = list(runs)
  if a.hlo_dir:  # Every kernel's time, beside the HLO that names them.
    with open(f"{a.hlo_dir}/{a.preset}-kernels.json", "w") as f:
      json.dump(runs, f)
  by_class = {prec: collections.Counter() for prec in precs}
  for prec in precs:
    for name, (_, us) in runs[prec]["kernels"].items():
      by_class[prec][classify(name)] += us
  labels = sorted({c for prec in precs for c in by_class[prec]},
                  key=lambda c: -max(by_class[prec][c] for prec in precs))
  rows = []
  for c in labels + ["total GPU time"]:
    r = {"class": c}
    for prec in precs:
      r[f"{prec}_us"] = (sum(by_class[prec].values()) if c == "total GPU time"
                         else by_class[prec][c])
    if len(precs) >= 2:
      r["difference_us"] = r[f"{precs[-1]}_us"] - r[f"{precs[0]}_us"]
    rows.append(r)
  cols = ["class"] + [f"{prec}_us" for prec in precs] + (
      ["difference_us"] if len(precs) >= 2 else [])
  print(f"device: {runs[precs[0]]['device']}; jax {runs[precs[0]]['jax']}; "
        f"{a.preset} {a.batch}x{a.seq}; GPU time per step (us), mean of "
        f"{a.steps} traced steps")
  print(timing.table(rows, cols))
  print("\nthe two clocks, per step: wall (untraced), the GPU busy (union of "
        "its kernels) and idle (traced span less busy)")
  print(timing.table(
      [{"precision": prec,
        "wall_us": runs[prec]["clocks"]["wall_us"],
        "gpu_busy_us": runs[prec]["clocks"]["busy_us"],
        "gpu_idle_us": (runs[prec]["clocks"]["span_us"]
                        - runs[prec]["clocks"]["busy_us"]),
        "wall_minus_busy_us": (runs[prec]["clocks"]["wall_us"]
                               - runs[prec]["clocks"]["busy_us"])}
       for prec in precs],
      ("precision", "wall_us", "gpu_busy_us", "gpu_idle_us",
       "wall_minus_busy_us")))
  if a.hlo_dir and "nvfp4" in runs:
    print_layer_ops(a.hlo_dir, a.preset, runs["nvfp4"]["kernels"], a.top)
  for prec in precs:
    top = sorted(runs[prec]["kernels"].items(), key=lambda kv: -kv[1][1])
    print(f"\nlargest kernels of the {prec} step")
    print(timing.table(
        [{"kernel": k[:90], "class": classify(k), "calls": c, "us": us}
         for k, (c, us) in top[:a.top]], ("kernel", "class", "calls", "us")))


if __name__ == "__main__":
  main()
