"""Weak scaling of the GPT train step over one host's GPUs, against a fair
one-GPU baseline, with where the communication time goes.

    python -m benchmarks.bench_scaling                   # 2 GPUs
    python -m benchmarks.bench_scaling --meshes "data=4 fsdp=4 data=2,model=2 data=2,fsdp=2"
    python -m benchmarks.bench_scaling --smoke           # 8 CPU devices, tiny

`--batch` sequences per device (weak scaling); "scaling" is tokens/s per
device over the same preset and precision on one device. The one-device
baseline is the trainer's own sharded step on a mesh of one device
(`data=1`: the same `MeshRules`, the same sharded NVFP4 layers and the same
device-resident batch as on the meshes); `--no-mesh-baseline` also times
the step jitted without a mesh (what `bench_step` took as one GPU).

Every configuration runs in its own process. In the first round,
`--jobs` processes compile at once (into a persistent compilation cache)
and then hold their executables: when all of them have compiled, each is
timed alone, in the process that compiled it, and exits; then the next
`--jobs` compile. Nothing runs on the GPUs while XLA compiles, so its
autotuning (timed GEMM candidates) is not disturbed, and no process pays
for loading an executable (an NVFP4 GPT base step takes ~40 s to load from
the cache on an H100, ~115 s to compile). Later rounds, while the next
round fits in `--budget-s`, time each configuration in a fresh process that
loads its executable from the cache (`compile_s` shows the load), the order
reversed every other round so that no configuration always runs first.
Each waiting process keeps its train state on its GPUs. Each process runs
`--warmup` steps, then `--steps` steps back to back with one wait at the
end (`ms`, the training loop's throughput) and `--steps` steps waiting on
each (`ms_sync`). A row prints as each process finishes; the table at the
end has the median over rounds and the spread of the per-round values.

XLA autotunes each GEMM fusion while it compiles, timing candidates on
the GPU beside whatever else runs there (the other compiles of the
batch), so two programs with the same GEMMs can run different kernels;
`--baselines-first` compiles the one-device baselines alone first, and the
meshes' compiles read their choices from the cache directory.

Other processes on the GPUs while this runs skew both the timings and
XLA's autotuning, whose choices the cache directory keeps (its
`xla_gpu_per_fusion_autotune_cache_dir`): a GPT base NVFP4 step compiled
beside another job ran at 89 ms instead of 51, one GEMM fusion taking 39
ms of it. The run warns when `nvidia-smi` lists other processes; give
`--cache-dir` a new directory after such a run (the default is a new
temporary directory).

`--profile` traces a few more steps (first round only) and splits the
first GPU's time per step: `nccl_ms` (NCCL kernels), `exposed_ms` (NCCL running while no other
kernel runs: communication that is not hidden), `compute_ms` (the other
kernels) and `idle_ms` (no kernel at all: waiting on the host or on the
other GPUs), and lists the kernels that take the most GPU time per step.
`--profile-baseline` traces the one-device configurations too.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from nvfp4_jax.tools import timing
from train import mesh_flags

SHAPES = {"small": (64, 512), "base": (16, 1024), "tiny": (4, 64),
          "moe-small": (64, 512)}


@dataclasses.dataclass(frozen=True)
class Config:
  preset: str
  precision: str
  batch: int  # Per device.
  seq: int
  mesh: str  # "" (no mesh) or `--mesh` syntax, e.g. "data=2,fsdp=2".
  warmup: int = 3
  steps: int = 20
  profile: int = 0  # Steps to trace (0: none).
  variant: str = ""  # A name from `--variant`: its XLA flags are added.
  tp_partial_sums: str = "float32"  # `MeshRules.partial_sums`.
  amax: str = "global"  # `MeshRules.amax`.
  wgrad_schedule: str = "layer"  # `MeshRules.wgrad_schedule`.
  wgrad_sums: str = "float32"  # `MeshRules.wgrad_sums`.
  # `MeshRules.sequence_parallel` and `collective_matmul`: "off", "on" or
  # "ring" (both).
  sequence_parallel: str = "off"
  # `nvfp4_jax.training.moe.EXCHANGE_SLACK` ("" the library's default;
  # "none": whole buffers, no fast path).
  exchange_slack: str = ""

  @property
  def mesh_sizes(self) -> dict[str, int]:
    """`mesh` as `{axis: size}` ({} without a mesh)."""
    return mesh_flags.parse_mesh(self.mesh) if self.mesh else {}

  @property
  def devices(self) -> int:
    n = 1
    for v in self.mesh_sizes.values():
      n *= v
    return n

  @property
  def label(self) -> str:
    v = f" [{self.variant}]" if self.variant else ""
    if self.tp_partial_sums != "float32":
      v += f" [sums={self.tp_partial_sums}]"
    if self.amax != "global":
      v += f" [amax={self.amax}]"
    if self.wgrad_schedule != "layer":
      v += f" [wgrad={self.wgrad_schedule}]"
    if self.wgrad_sums != "float32":
      v += f" [wgrad sums={self.wgrad_sums}]"
    if self.sequence_parallel != "off":
      v += {"on": " [sequence parallel]",
            "ring": " [sequence parallel, ring]"}[self.sequence_parallel]
    if self.exchange_slack:
      v += f" [slack={self.exchange_slack}]"
    return f"{self.preset} {self.precision} {self.mesh or 'no mesh'}{v}"


def _cache(cache_dir: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# Prefixes the lines a child process reports on (its stdout may carry
# other output).
MARK = "@bench_scaling "


def _child(cfg: Config, cache_dir: str, hold: bool = False) -> dict | None:
  """Compiles (or loads) and times `cfg` in this process. With `hold`, it
  reports the compile (a `MARK` line) and waits for a line on stdin: `go`
  times the step, anything else (or end of input) returns None."""
  import jax  # pylint: disable=g-import-not-at-top

  from benchmarks import bench_step  # pylint: disable=g-import-not-at-top
  if cache_dir:
    _cache(cache_dir)
  if cfg.exchange_slack:
    from nvfp4_jax.training import moe  # pylint: disable=g-import-not-at-top
    moe.EXCHANGE_SLACK = (None if cfg.exchange_slack == "none"
                          else float(cfg.exchange_slack))
  t0 = time.perf_counter()
  trainer, state, batch = bench_step.build(bench_step.StepConfig(
      cfg.preset, cfg.precision, cfg.batch * cfg.devices, cfg.seq,
      mesh=cfg.mesh, tp_partial_sums=cfg.tp_partial_sums, amax=cfg.amax,
      wgrad_schedule=cfg.wgrad_schedule, wgrad_sums=cfg.wgrad_sums,
      sequence_parallel=cfg.sequence_parallel != "off",
      collective_matmul=cfg.sequence_parallel == "ring"))
  if trainer.mesh_rules is None:  # The batch on the device, as on a mesh.
    batch = jax.device_put(batch, jax.devices()[0])
  compiled = trainer.train_step.lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  out = {"compile_s": compile_s, "device": jax.devices()[0].device_kind,
         "jax": jax.__version__}
  if hold:
    print(MARK + json.dumps(out), flush=True)
    if sys.stdin.readline().strip() != "go":
      return None
  for _ in range(cfg.warmup):
    state, m = compiled(state, batch)
  jax.block_until_ready(m)
  t0 = time.perf_counter()
  for _ in range(cfg.steps):
    state, m = compiled(state, batch)
  jax.block_until_ready(m)
  out["ms"] = (time.perf_counter() - t0) / cfg.steps * 1e3
  sync = []
  for _ in range(cfg.steps):
    t0 = time.perf_counter()
    state, m = compiled(state, batch)
    jax.block_until_ready(m)
    sync.append(time.perf_counter() - t0)
  out["ms_sync"] = statistics.median(sync) * 1e3
  if cfg.profile:
    try:
      out.update(_profile(compiled, state, batch, cfg.profile))
    except Exception as e:  # pylint: disable=broad-except
      print(f"profile failed: {type(e).__name__}: {e}", file=sys.stderr)
  return out


# Kernels listed per profiled configuration (`--profile`).
TOP_KERNELS = 25


def _profile(compiled, state, batch, steps: int) -> dict:
  """The first GPU's time per step from a trace of `steps` steps: NCCL
  kernels, NCCL with no other kernel running, other kernels, and no
  kernel (empty without a GPU)."""
  import glob  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  d = tempfile.mkdtemp()
  jax.profiler.start_trace(d)
  for _ in range(steps):
    state, m = compiled(state, batch)
  jax.block_until_ready(m)
  jax.profiler.stop_trace()
  files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
  if not files:
    return {}
  nccl, other = [], []
  by_name = collections.Counter()
  planes = sorted((p for p in ProfileData.from_file(files[0]).planes
                   if p.name.startswith("/device:GPU")),
                  key=lambda p: p.name)
  for plane in planes[:1]:  # The first GPU.
    lines = list(plane.lines)
    streams = [l for l in lines if "stream" in l.name.lower()] or [
        l for l in lines if "xla" not in l.name.lower()]
    for line in streams:
      for ev in line.events:
        iv = (ev.start_ns, ev.start_ns + ev.duration_ns)
        (nccl if "nccl" in ev.name.lower() else other).append(iv)
        by_name[ev.name] += ev.duration_ns
  if not nccl + other:
    return {}
  union = lambda ivs: busy_and_span(ivs)[0]
  busy_all, span = busy_and_span(nccl + other)
  busy_other = union(other)
  per = 1e6 * steps
  return {"nccl_ms": union(nccl) / per, "exposed_ms": (busy_all - busy_other)
          / per, "compute_ms": busy_other / per,
          "idle_ms": (span - busy_all) / per,
          # The kernels that take the most GPU time (ms per step, summed
          # over their launches; overlapping kernels both count).
          "top_kernels": [(n[:90], t / per)
                          for n, t in by_name.most_common(TOP_KERNELS)]}


def busy_and_span(intervals):
  from benchmarks.profile_step import busy_and_span as f  # pylint: disable=g-import-not-at-top
  return f(intervals)


CHILD_TIMEOUT_S = 600.0


def _env(cfg: Config, env: dict, variants: dict | None) -> dict:
  if cfg.variant:
    env = dict(env, XLA_FLAGS=(env.get("XLA_FLAGS", "") + " "
                               + (variants or {})[cfg.variant]).strip())
  return env


def _cmd(cfg: Config, cache_dir: str, hold: bool = False) -> list[str]:
  payload = {"cfg": dataclasses.asdict(cfg), "cache": cache_dir}
  if hold:
    payload["hold"] = True
  return [sys.executable, "-m", "benchmarks.bench_scaling", "--child",
          json.dumps(payload)]


def _report(stdout: str) -> dict | None:
  """The last `MARK` line of a child's output, parsed."""
  for line in reversed(stdout.splitlines()):
    if line.startswith(MARK):
      return json.loads(line[len(MARK):])
  return None


def _run(cfg: Config, cache_dir: str, env: dict,
         variants: dict | None = None) -> dict:
  """Times `cfg` in a fresh process (its executable from the cache)."""
  try:
    out = subprocess.run(_cmd(cfg, cache_dir), capture_output=True,
                         text=True, check=False, env=_env(cfg, env, variants),
                         timeout=CHILD_TIMEOUT_S)
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(f"{cfg.label} did not finish in {CHILD_TIMEOUT_S} s "
                       "(a hang?)") from e
  r = _report(out.stdout)
  if out.returncode or r is None:
    raise RuntimeError(f"{cfg.label} failed:\n{out.stderr[-3000:]}")
  return r


class _Held:
  """A process that compiles `cfg`, reports it, and holds the executable
  until `run` times it (in this same process: no load from the cache) or
  `stop` ends it."""

  def __init__(self, cfg: Config, cache_dir: str, env: dict,
               variants: dict | None = None):
    self.cfg = cfg
    self._err = tempfile.TemporaryFile(mode="w+")
    self.proc = subprocess.Popen(
        _cmd(cfg, cache_dir, hold=True), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=self._err, text=True,
        env=_env(cfg, env, variants))

  def _next(self, what: str) -> dict:
    """The child's next report; the child is killed after
    `CHILD_TIMEOUT_S`."""
    timer = threading.Timer(CHILD_TIMEOUT_S, self.proc.kill)
    timer.start()
    try:
      for line in self.proc.stdout:
        if line.startswith(MARK):
          return json.loads(line[len(MARK):])
    finally:
      timer.cancel()
    rc = self.proc.wait()
    self._err.seek(0)
    err = self._err.read()[-3000:]
    self._err.close()
    if rc == -9:
      raise RuntimeError(f"{self.cfg.label} did not {what} in "
                         f"{CHILD_TIMEOUT_S} s (a hang?)")
    raise RuntimeError(f"{self.cfg.label} failed:\n{err}")

  def compiled(self) -> dict:
    return self._next("compile")

  def run(self) -> dict:
    self.proc.stdin.write("go\n")
    self.proc.stdin.flush()
    out = self._next("run")
    self.proc.stdin.close()
    self.proc.wait()
    self._err.close()
    return out

  def stop(self) -> None:
    if self.proc.poll() is None:
      try:
        self.proc.stdin.close()  # End of input: the child returns.
        self.proc.wait(timeout=60)
      except (OSError, subprocess.TimeoutExpired):
        self.proc.kill()
        self.proc.wait()
    self._err.close()


def _gpu_processes() -> list[str]:
  """The processes `nvidia-smi` lists on the GPUs (none without it)."""
  import shutil  # pylint: disable=g-import-not-at-top
  if not shutil.which("nvidia-smi"):
    return []
  try:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
         "--format=csv,noheader"], capture_output=True, text=True,
        timeout=60, check=False)
  except (OSError, subprocess.TimeoutExpired):
    return []
  return [l.strip() for l in out.stdout.splitlines() if l.strip()]


def configs(a) -> list[Config]:
  shapes = dict(SHAPES)
  for item in a.shapes.split(",") if a.shapes else ():
    name, bs = item.split("=")
    b, s = bs.split("x")
    shapes[name] = (int(b), int(s))
  meshes = ["data=1", ""] + [m for m in a.meshes.split() if m]
  no_mesh = (a.no_mesh_baseline or "").split(",")
  knobs = {field: mesh_flags.sweep_values(a, field) for field, _ in KNOBS}
  out = []
  for preset in a.presets.split(","):
    if preset not in shapes:
      raise SystemExit(
          f"--presets {preset}: no per-device shape for it; add "
          f"--shapes {preset}=BATCHxSEQ (e.g. {preset}=64x512), or use one "
          f"of {', '.join(shapes)}.")
    b, s = shapes[preset]
    for prec in a.precisions.split(","):
      for mesh in meshes:
        if mesh == "" and not {"all", preset} & set(no_mesh):
          continue
        c = Config(preset, prec, b, s, mesh, a.warmup, a.steps,
                   a.profile if mesh not in ("", "data=1") or
                   a.profile_baseline else 0)
        if not (a.variants_only and a.variant
                and mesh not in ("", "data=1")):
          out.append(c)
        if mesh not in ("", "data=1"):
          out += [dataclasses.replace(c, variant=v) for v in variants(a)]
        if mesh in ("", "data=1"):
          continue
        if a.knob_product:
          out += knob_product(c, knobs)[1:]
          continue
        for field, applies in KNOBS:
          if applies(c):
            default = Config.__dataclass_fields__[field].default
            out += [dataclasses.replace(c, **{field: t})
                    for t in knobs[field] if t != default]
  return out


def knob_product(c: Config, knobs: dict[str, list[str]]) -> list[Config]:
  """`c` with every combination of the knobs' listed values that apply to
  it (`--knob-product`), `c` itself first."""
  combos = [c]
  for field, applies in KNOBS:
    if not applies(c):
      continue
    default = Config.__dataclass_fields__[field].default
    values = [t for t in knobs[field] if t != default]
    combos += [dataclasses.replace(x, **{field: t})
               for x in combos for t in values]
  return combos


# The library settings a mesh configuration is also timed with (the
# `Config` field, which is also the option's name; its default is the
# untagged row), and the configurations (meshes, precisions) each applies to:
# the sums' dtypes change only quantized layers, and sequence parallelism
# needs a `model` axis of more than one device (in either precision).
KNOBS = (("tp_partial_sums", lambda c: c.precision != "bf16"
          and "model=" in c.mesh),
         ("amax", lambda c: True),
         ("wgrad_schedule", lambda c: "fsdp=" in c.mesh),
         ("wgrad_sums", lambda c: c.precision != "bf16" and (
             "data=" in c.mesh or "fsdp=" in c.mesh)),
         ("sequence_parallel",
          lambda c: c.mesh_sizes.get("model", 1) > 1),
         ("exchange_slack", lambda c: "expert=" in c.mesh))

def baseline(c: Config, cfgs: list[Config]) -> Config:
  """The one-device configuration `c`'s scaling is measured against: a
  `data=1` mesh, no variant, every knob at its default."""
  return dataclasses.replace(
      c, mesh="data=1", variant="", profile=results_profile(cfgs, c),
      **{f: Config.__dataclass_fields__[f].default for f, _ in KNOBS})


def variants(a) -> dict[str, str]:
  """`--variant NAME=FLAGS` as `{NAME: FLAGS}`."""
  out = {}
  for item in a.variant:
    name, _, flags = item.partition("=")
    if not name or not flags:
      raise SystemExit(f"--variant {item!r}: write NAME=XLA_FLAGS, e.g. "
                       f"'lhs=--xla_gpu_enable_latency_hiding_scheduler="
                       f"true'.")
    out[name] = flags
  return out


def _fmt_row(cfg: Config, r: dict, base: dict | None) -> str:
  tok = cfg.batch * cfg.seq  # Per device.
  scaling = (base["ms"] / r["ms"]) if base else float("nan")
  prof = ""
  if "nccl_ms" in r:
    prof = (f", nccl {r['nccl_ms']:.2f} ms, exposed {r['exposed_ms']:.2f}, "
            f"compute {r['compute_ms']:.2f}, idle {r['idle_ms']:.2f}")
  return (f"{cfg.label}: {r['ms']:.2f} ms ({r['ms_sync']:.2f} synced), "
          f"{tok / r['ms'] * 1e3:.0f} tokens/s per device, scaling "
          f"{scaling:.3f}, compile {r['compile_s']:.0f} s{prof}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--child", help=argparse.SUPPRESS)
  p.add_argument("--presets", default="small,base")
  p.add_argument("--precisions", default="bf16,nvfp4")
  p.add_argument("--shapes", default="",
                 help="per-device batch x seq overrides, e.g. "
                 "'small=64x512,base=16x1024' (defaults: "
                 + ", ".join(f"{k}={b}x{s}" for k, (b, s) in SHAPES.items())
                 + ")")
  p.add_argument("--meshes", default="data=2 fsdp=2 model=2",
                 help="space-separated meshes besides the one-device "
                 "baseline (data=1)")
  p.add_argument("--no-mesh-baseline", nargs="?", const="all", default="",
                 help="also time one device without a mesh (what "
                 "bench_step took as one GPU): for every preset, or for "
                 "the comma-listed ones")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--profile", type=int, default=0,
                 help="trace this many steps of each mesh configuration "
                 "for the communication breakdown")
  p.add_argument("--profile-baseline", action="store_true",
                 help="also trace the one-device configurations")
  p.add_argument("--rounds", type=int, default=3, help="at most")
  p.add_argument("--budget-s", type=float, default=520,
                 help="start no process that would end after this")
  p.add_argument("--jobs", type=int, default=0,
                 help="processes compiling at once (default: CPUs / 4)")
  p.add_argument("--cache-dir", default="",
                 help="persistent compilation cache (default: a new "
                 "temporary directory)")
  p.add_argument("--xla-flags", default="",
                 help="appended to XLA_FLAGS in every process")
  mesh_flags.add_mesh_flags(
      p, mesh=False, sweep=True, knobs=("tp_partial_sums", "amax",
                                        "wgrad_schedule", "wgrad_sums",
                                        "sequence_parallel"))
  p.add_argument("--knob-product", action="store_true",
                 help="time every combination of the knobs' listed values "
                 "(e.g. --sequence-parallel off,on with --tp-partial-sums "
                 "float32,output: four rows), not each knob alone")
  p.add_argument("--exchange-slack", default="",
                 help="comma list: also time the meshes with an expert axis "
                 "with this moe.EXCHANGE_SLACK ('none': whole buffers, no "
                 "fast path; e.g. 'none,1.5')")
  p.add_argument("--variants-only", action="store_true",
                 help="time the meshes only with the --variant flags "
                      "(the baselines still run without them)")
  p.add_argument("--baselines-first", action="store_true",
                 help="compile and time the one-device baselines before "
                 "the meshes compile, so the meshes reuse the baselines' "
                 "GEMM autotuning (kept in --cache-dir) instead of drawing "
                 "their own")
  p.add_argument("--child-timeout-s", type=float, default=600,
                 help="stop a process that runs longer (a hang)")
  p.add_argument("--variant", action="append", default=[],
                 help="NAME=FLAGS (repeatable): also time every mesh "
                 "configuration with these XLA flags added (labelled "
                 "[NAME]); the baselines run once, without them")
  p.add_argument("--smoke", action="store_true",
                 help="8 CPU devices, the tiny preset, 1 round of 2 steps")
  a = p.parse_args(argv)
  if a.child:
    d = json.loads(a.child)
    out = _child(Config(**d["cfg"]), d["cache"], hold=d.get("hold", False))
    if out is not None:
      print(MARK + json.dumps(out), flush=True)
    return
  global CHILD_TIMEOUT_S
  CHILD_TIMEOUT_S = a.child_timeout_s
  start = time.perf_counter()
  env = dict(os.environ)
  # NVLink multicast stays off on the lent machines (shared GPUs).
  env.setdefault("NCCL_NVLS_ENABLE", "0")
  # Many processes share the GPUs while they compile.
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if a.smoke:
    a.presets, a.warmup, a.steps, a.rounds = "tiny", 1, 2, 1
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=8").strip()
  if a.xla_flags:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + a.xla_flags).strip()
  cache_dir = a.cache_dir or tempfile.mkdtemp(prefix="jax-cache-")
  cfgs = configs(a)
  jobs = a.jobs or max(1, (os.cpu_count() or 4) // 4)
  busy = _gpu_processes()
  if busy:
    print("WARNING: other processes are on the GPUs (" + "; ".join(busy)
          + "): the timings and XLA's autotuning (kept in --cache-dir) will "
          "be skewed; run alone, with a new --cache-dir.", flush=True)
  print(f"{len(cfgs)} configurations; compiling {jobs} at a time into "
        f"{cache_dir}", flush=True)
  results = collections.defaultdict(list)
  took = {}
  timed = []  # The configurations that compiled, in order.

  def record(c: Config, rnd: int, r: dict, t0: float) -> None:
    took[c] = time.perf_counter() - t0
    results[c].append(r)
    base = results.get(baseline(c, cfgs), [None])[-1]
    print(f"  round {rnd + 1}: {_fmt_row(c, r, base)} "
          f"[{took[c]:.0f} s]", flush=True)
    for name, ms in r.get("top_kernels", ()):
      print(f"      {ms:8.3f} ms  {name}", flush=True)

  def out_of_budget(c: Config, rnd: int) -> bool:
    left = a.budget_s - (time.perf_counter() - start)
    if took.get(c, 0.0) * 1.2 + 5 > left:
      print(f"  skipped {c.label} (round {rnd + 1}): {left:.0f} s left",
            flush=True)
      return True
    return False

  # Round 1: `jobs` processes compile at once, then each is timed alone in
  # the process that compiled it (the breakdown is traced in this round).
  for batch in batches(cfgs, jobs, a.baselines_first):
    left = a.budget_s - (time.perf_counter() - start)
    if left < 5:
      print(f"  skipped compiling {', '.join(c.label for c in batch)}: "
            f"{left:.0f} s left", flush=True)
      continue
    t_batch = time.perf_counter()
    held, procs = {}, {}
    try:
      with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        for c in batch:
          procs[c] = _Held(c, cache_dir, env, variants(a))
        futs = {pool.submit(h.compiled): c for c, h in procs.items()}
        for f in concurrent.futures.as_completed(futs):
          c = futs[f]
          try:
            r = f.result()
            held[c] = procs[c]
            print(f"  compiled {c.label} in {r['compile_s']:.0f} s",
                  flush=True)
          except RuntimeError as e:
            print(f"  {e}", flush=True)
      print(f"compile phase: {time.perf_counter() - t_batch:.0f} s",
            flush=True)
      for c in batch:
        if c not in held:
          continue
        timed.append(c)
        h = held[c]
        if a.rounds < 1 or out_of_budget(c, 0):
          h.stop()
          continue
        t0 = time.perf_counter()
        try:
          record(c, 0, h.run(), t0)
        except RuntimeError as e:
          print(f"  {e}", flush=True)
    finally:  # Ends the processes not timed (or still compiling).
      for h in procs.values():
        h.stop()
  done = set(timed)
  cfgs_timed = [c for c in cfgs if c in done]
  for rnd in range(1, a.rounds):
    order = cfgs_timed if rnd % 2 == 0 else cfgs_timed[::-1]
    for c in order:
      if out_of_budget(c, rnd):
        continue
      t0 = time.perf_counter()
      try:
        r = _run(dataclasses.replace(c, profile=0), cache_dir, env,
                 variants(a))
      except RuntimeError as e:
        print(f"  {e}", flush=True)
        continue
      record(c, rnd, r, t0)
  rows = []
  for c in cfgs:
    runs = results.get(c)
    if not runs:
      continue
    base_runs = results.get(baseline(c, cfgs), [])
    ms = statistics.median(r["ms"] for r in runs)
    base_ms = (statistics.median(r["ms"] for r in base_runs)
               if base_runs else float("nan"))
    row = {"config": c.label, "ms": ms,
           "spread_ms": f"{min(r['ms'] for r in runs):.2f}-"
                        f"{max(r['ms'] for r in runs):.2f}",
           "ms_sync": statistics.median(r["ms_sync"] for r in runs),
           "rounds": len(runs),
           "tokens_per_s_per_dev": c.batch * c.seq / ms * 1e3,
           "scaling": base_ms / ms}
    for k in ("nccl_ms", "exposed_ms", "compute_ms", "idle_ms"):
      vals = [r[k] for r in runs if k in r]
      if vals:
        row[k] = statistics.median(vals)
    rows.append(row)
  device = next(iter(results.values()))[0] if results else {}
  print(f"\ndevice: {device.get('device')}; jax {device.get('jax')}; "
        f"per device batch x seq as listed; {a.warmup} warm-up + {a.steps} "
        f"steps per process; wall {time.perf_counter() - start:.0f} s")
  cols = ("config", "ms", "spread_ms", "ms_sync", "rounds",
          "tokens_per_s_per_dev", "scaling")
  if any("nccl_ms" in r for r in rows):
    cols += ("nccl_ms", "exposed_ms", "compute_ms", "idle_ms")
  print(timing.table(rows, cols), flush=True)


def batches(cfgs: list[Config], jobs: int,
            baselines_first: bool = False) -> list[list[Config]]:
  """Round 1's batches: `jobs` configurations compile side by side, then
  each is timed. With `baselines_first`, the one-device baselines compile
  (and run) alone first, so that the per-fusion autotuning they write to
  the cache directory is what the meshes' compiles of the same GEMMs read:
  where the per-device shapes agree, every configuration runs the
  baseline's GEMM kernels, and the scaling compares programs, not two
  draws of XLA's autotuner."""
  first = []
  if baselines_first:
    first = [c for c in cfgs if c == baseline(c, cfgs)]
    cfgs = [c for c in cfgs if c not in first]
  out = [first] if first else []
  return out + [cfgs[i:i + jobs] for i in range(0, len(cfgs), jobs)]


def results_profile(cfgs: list[Config], c: Config) -> int:
  """The `profile` field of `c`'s one-device baseline in `cfgs`."""
  for b in cfgs:
    if (b.preset, b.precision, b.mesh) == (c.preset, c.precision, "data=1"):
      return b.profile
  return 0


if __name__ == "__main__":
  main()
