"""Timing helpers of `check_device` and the benchmarks (GPU; also, slowly, CPU).

`bench` times a jitted function by queueing `calls` launches back to back and
blocking once (so launch overhead overlaps with device work), `reps` times,
and returns the median seconds per call. Inputs rotate through several sets
larger than L2 so repeated calls do not hit in cache.
"""

from __future__ import annotations

import collections
import json
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp


def run_child(module: str, payload: Any, label: str) -> dict:
  """Runs `python -m module --child JSON(payload)` in a fresh process (the
  benchmarks time each configuration in its own) and returns the JSON
  object its last line of output prints; raises with the child's stderr,
  under `label`, if it fails."""
  out = subprocess.run(
      [sys.executable, "-m", module, "--child", json.dumps(payload)],
      capture_output=True, text=True, check=False)
  if out.returncode:
    raise RuntimeError(f"{label} failed:\n{out.stderr[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def bench(fn: Callable, arg_sets: Sequence[tuple], *, calls: int = 10,
          reps: int = 9, warmup_s: float = 0.1) -> float:
  """Median seconds per call of `fn(*args)` over rotating `arg_sets`."""
  return statistics.median(bench_samples(fn, arg_sets, calls=calls, reps=reps,
                                         warmup_s=warmup_s))


def bench_samples(fn: Callable, arg_sets: Sequence[tuple], *, calls: int = 10,
                  reps: int = 9, warmup_s: float = 0.1) -> list[float]:
  """`bench`'s samples: seconds per call of each of the `reps` repetitions."""
  for args in arg_sets:  # Compile.
    jax.block_until_ready(fn(*args))
  t_end = time.perf_counter() + warmup_s  # Let the clocks ramp up.
  while time.perf_counter() < t_end:
    jax.block_until_ready(fn(*arg_sets[0]))
  per_call = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for i in range(calls):
      out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - t0) / calls)
  return per_call


def trace_kernels(xplane: str, intervals: list | None = None
                ) -> dict[str, tuple[int, float]]:
  """{kernel name: (calls, total ns)} over the GPU planes of a trace;
  each kernel's `(start_ns, end_ns)` is appended to `intervals` if given."""
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  out: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
  for plane in ProfileData.from_file(xplane).planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    lines = list(plane.lines)
    # Kernels sit on the stream lines; XLA's "XLA Ops"/"XLA Modules" lines
    # repeat the same time under HLO names.
    streams = [l for l in lines if "stream" in l.name.lower()] or [
        l for l in lines if "xla" not in l.name.lower()]
    for line in streams:
      for ev in line.events:
        out[ev.name][0] += 1
        out[ev.name][1] += ev.duration_ns
        if intervals is not None:
          intervals.append((ev.start_ns, ev.start_ns + ev.duration_ns))
  return {k: (v[0], v[1]) for k, v in out.items()}


def gpu_kernels(fn: Callable, arg_sets: Sequence[tuple], *, calls: int = 10
                ) -> dict[str, tuple[float, float]]:
  """{kernel: (launches, GPU seconds)} per call of `fn(*args)`, from a
  `jax.profiler` trace of `calls` calls over rotating `arg_sets` (empty
  without a GPU). GPU time does not see the host's launch jitter and the
  gaps between kernels that wall time includes."""
  import glob  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  for args in arg_sets:  # Compile.
    jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    out = None
    for i in range(calls):
      out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    (xplane,) = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
    kernels = trace_kernels(xplane)
  return {name: (n / calls, ns / calls / 1e9) for name, (n, ns) in
          kernels.items()}


def gpu_seconds(fn: Callable, arg_sets: Sequence[tuple], *,
                calls: int = 10) -> float:
  """GPU seconds per call of `fn(*args)`: all its kernels (`gpu_kernels`);
  NaN without a GPU."""
  kernels = gpu_kernels(fn, arg_sets, calls=calls)
  return sum(t for _, t in kernels.values()) if kernels else float("nan")


def copy_bandwidth(n_bytes: int = 1 << 30) -> float:
  """Bytes/s of `a * 1.0001` on an FP32 array of `n_bytes` (read + write)."""
  n = n_bytes // 4
  xs = [jax.random.normal(jax.random.key(i), (n,), jnp.float32)
        for i in range(2)]
  f = jax.jit(lambda a: a * jnp.float32(1.0001))
  t = bench(f, [(x,) for x in xs], calls=10, reps=7)
  del xs
  return 2 * n_bytes / t


def bf16_matmul(m: int, n: int, k: int):
  """The cuBLAS baseline: bf16 `a @ b.T`, FP32 accumulation, bf16 out."""
  return jax.jit(lambda a, b: jax.lax.dot_general(
      a, b, (((1,), (1,)), ((), ())),
      preferred_element_type=jnp.float32).astype(jnp.bfloat16))


def max_rel_diff(got, want) -> float:
  """The largest |got - want| relative to the largest |want| (FP32): how the
  benchmarks report a result against its reference."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def table(rows: list[dict], cols: Sequence[str]) -> str:
  """A Markdown table of `rows` (dicts) with the given column order."""
  def fmt(v):
    if isinstance(v, float):
      return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "" if v is None else str(v)
  lines = ["| " + " | ".join(cols) + " |",
           "| " + " | ".join("---" for _ in cols) + " |"]
  for r in rows:
    lines.append("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")
  return "\n".join(lines)
