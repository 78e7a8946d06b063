"""The time before a GPT's first train step: trace, lower, compile, load.

    python -m benchmarks.bench_startup --preset base --batch 16 --seq 1024 \\
        --precisions bf16,nvfp4 --repeats 2

Every row is one fresh process (`--child`), as a user's run starts: the
process imports the library, builds the trainer and its initial state, then
traces, lowers and compiles the train step (`jax.jit`'s ahead-of-time
stages, timed one by one) and runs the first step. Each configuration runs
twice per round against its own persistent compilation cache
(`jax_compilation_cache_dir`): "cold" on an empty cache, "warm" on the cache
the cold process filled (a restarted or resumed run). `start_to_step` is
from the process's start (the interpreter's, before any import) to the
first step's result; `xla_compile` sums JAX's backend-compile events of the
process (the initial state's programs too; a cache hit counts its load).
The table reports medians over the rounds and each phase's ratio to the
first configuration's. `--profile N` runs one cold process per configuration
under `cProfile` instead and prints the N functions of the trace and the
lowering with the most cumulative time (where start-up goes, by function),
the lowered step's custom calls, and the N host events of XLA's compile
(its passes, autotuning, LLVM and ptxas under `jax.profiler`) with the most
self time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

_PHASES = ("build", "trace", "lower", "compile", "first_step", "xla_compile",
           "start_to_step")


@dataclasses.dataclass(frozen=True)
class StartConfig:
  preset: str
  precision: str
  batch: int
  seq: int
  cache_dir: str = ""
  profile: int = 0

  @property
  def label(self) -> str:
    return f"{self.preset} {self.precision} {self.batch}x{self.seq}"


def _process_start() -> float:
  """The wall-clock time this process started (Linux: /proc; else now)."""
  try:
    with open("/proc/self/stat", encoding="ascii") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime", encoding="ascii") as f:
      uptime = float(f.read().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError):
    return time.time()


def _child(cfg: StartConfig) -> dict:
  """Times the start of `cfg`'s training in this process."""
  started = _process_start()
  import jax  # pylint: disable=g-import-not-at-top
  import jax.monitoring  # pylint: disable=g-import-not-at-top

  from benchmarks import bench_step  # pylint: disable=g-import-not-at-top

  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda e, d, **kw: compiles.append(d)
      if e == "/jax/core/compile/backend_compile_duration" else None)
  jax.config.update("jax_compilation_cache_dir", cfg.cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  t = {}
  t0 = time.perf_counter()
  trainer, state, batch = bench_step.build(bench_step.StepConfig(
      cfg.preset, cfg.precision, cfg.batch, cfg.seq))
  if trainer.mesh_rules is None:
    batch = jax.device_put(batch, jax.devices()[0])
  jax.block_until_ready((state, batch))
  t["build"] = time.perf_counter() - t0
  if cfg.profile:
    import cProfile  # pylint: disable=g-import-not-at-top
    import io  # pylint: disable=g-import-not-at-top
    import pstats  # pylint: disable=g-import-not-at-top
    for stage in ("trace", "lower"):
      prof = cProfile.Profile()
      t0 = time.perf_counter()
      prof.enable()
      if stage == "trace":
        traced = trainer.train_step.trace(state, batch)
      else:
        traced.lower()
      prof.disable()
      out = io.StringIO()
      stats = pstats.Stats(prof, stream=out)
      # The library's and Pallas' own functions by cumulative time, then
      # every function by its own time.
      stats.sort_stats("cumulative").print_stats(
          "nvfp4_jax|pallas|triton|mosaic", cfg.profile)
      stats.sort_stats("tottime").print_stats(cfg.profile)
      print(f"== {cfg.label} {stage}: {time.perf_counter() - t0:.1f} s "
            f"under cProfile\n{out.getvalue()}", file=sys.stderr)
    lowered = traced.lower()
    print(f"== {cfg.label} custom calls in the lowered step:\n"
          + _custom_calls(lowered.as_text()), file=sys.stderr)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
      jax.profiler.start_trace(d)
      lowered.compile()
      jax.profiler.stop_trace()
      wall = time.perf_counter() - t0
      print(f"== {cfg.label} XLA compile: {wall:.1f} s under the profiler\n"
            + compile_events(d, cfg.profile), file=sys.stderr)
    return {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
  t0 = time.perf_counter()
  traced = trainer.train_step.trace(state, batch)
  t["trace"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  lowered = traced.lower()
  t["lower"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  compiled = lowered.compile()
  t["compile"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  _, m = compiled(state, batch)
  jax.block_until_ready(m)
  t["first_step"] = time.perf_counter() - t0
  t["start_to_step"] = time.time() - started
  t["xla_compile"] = sum(compiles)
  dev = jax.devices()[0]
  return {**t, "device": dev.device_kind, "jax": jax.__version__}


def _custom_calls(hlo: str) -> str:
  """The lowered program's custom calls by target, and its distinct kernels
  (Pallas names each kernel in the call's backend config)."""
  import collections  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  calls = collections.Counter(a or b for a, b in re.findall(
      r'custom_call @([\w$.]+)|call_target_name = "([^"]+)"', hlo))
  names = collections.Counter(re.findall(r'name = "([^"]+)"', hlo))
  lines = [f"  {n:6d}  {t}" for t, n in calls.most_common()]
  lines.append(f"  {len(names)} distinct kernel names over "
               f"{sum(names.values())} calls")
  return "\n".join(lines)


def compile_events(trace_dir: str, top: int) -> str:
  """The host's traced events (XLA's passes, autotuning, LLVM, ptxas) of a
  `jax.profiler` trace, summed by name: self time (less the events nested
  in them on the same thread), total, count; the `top` by self time."""
  import collections  # pylint: disable=g-import-not-at-top
  import glob  # pylint: disable=g-import-not-at-top
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  (xplane,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
  own = collections.defaultdict(float)
  total = collections.defaultdict(float)
  count = collections.Counter()
  for plane in ProfileData.from_file(xplane).planes:
    if plane.name.startswith("/device:"):
      continue
    for line in plane.lines:
      events = sorted(((e.start_ns, e.duration_ns, e.name)
                       for e in line.events), key=lambda e: (e[0], -e[1]))
      stack: list[list] = []  # [end_ns, name]
      for start, dur, name in events:
        while stack and stack[-1][0] <= start:
          stack.pop()
        if stack:
          own[stack[-1][1]] -= dur
        own[name] += dur
        total[name] += dur
        count[name] += 1
        stack.append([start + dur, name])
  rows = sorted(own, key=own.get, reverse=True)[:top]
  return "\n".join(f"  {own[n] / 1e9:8.2f} s self {total[n] / 1e9:8.2f} s "
                   f"total {count[n]:6d}x  {n[:100]}" for n in rows)


def run(configs: list[StartConfig], repeats: int) -> list[dict]:
  """Every configuration cold then warm, interleaved, `repeats` rounds."""
  from nvfp4_jax.tools import timing  # pylint: disable=g-import-not-at-top
  results: dict[tuple[str, str], list[dict]] = {}
  for _ in range(repeats):
    for c in configs:
      cache = tempfile.mkdtemp(prefix="nvfp4-bench-startup-")
      try:
        for start in ("cold", "warm"):
          r = timing.run_child("benchmarks.bench_startup", dataclasses.asdict(
              dataclasses.replace(c, cache_dir=cache)), f"{c.label} {start}")
          results.setdefault((c.label, start), []).append(r)
          print(f"{c.label} {start}: " + " ".join(
              f"{k} {r[k]:.1f}" for k in _PHASES), file=sys.stderr, flush=True)
      finally:
        shutil.rmtree(cache, ignore_errors=True)
  rows, first = [], {}
  for (label, start), runs in results.items():
    row = {"config": label, "cache": start}
    for k in _PHASES:
      row[k] = statistics.median(r[k] for r in runs)
    first.setdefault(start, row)
    row["vs_first"] = row["start_to_step"] / first[start]["start_to_step"]
    row["trace+compile_vs_first"] = (
        (row["trace"] + row["lower"] + row["compile"])
        / (first[start]["trace"] + first[start]["lower"]
           + first[start]["compile"]))
    row["device"], row["jax"] = runs[0]["device"], runs[0]["jax"]
    rows.append(row)
  return rows


COLS = ("config", "cache") + _PHASES + ("vs_first", "trace+compile_vs_first")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--child", help=argparse.SUPPRESS)
  p.add_argument("--preset", default="base")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--precisions", default="bf16,nvfp4")
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--profile", type=int, default=0, metavar="N",
                 help="profile the trace, the lowering and XLA's compile of "
                 "one cold process per configuration; print the N costliest "
                 "functions and compile events")
  a = p.parse_args(argv)
  if a.child:
    print(json.dumps(_child(StartConfig(**json.loads(a.child)))))
    return
  if a.profile:
    import subprocess  # pylint: disable=g-import-not-at-top
    for prec in a.precisions.split(","):
      c = StartConfig(a.preset, prec, a.batch, a.seq, profile=a.profile)
      subprocess.run([sys.executable, "-m", "benchmarks.bench_startup",
                      "--child", json.dumps(dataclasses.asdict(c))],
                     check=True, stdout=subprocess.DEVNULL)
    return
  from nvfp4_jax.tools import timing  # pylint: disable=g-import-not-at-top
  configs = [StartConfig(a.preset, prec, a.batch, a.seq)
             for prec in a.precisions.split(",")]
  rows = run(configs, a.repeats)
  print(f"device: {rows[0]['device']}; jax {rows[0]['jax']}; {a.repeats} "
        f"rounds, a fresh process per row; seconds (medians)")
  print(timing.table(rows, COLS))


if __name__ == "__main__":
  main()
