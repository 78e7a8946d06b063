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

The largest model on a device mesh (`--search model`):

    python -m benchmarks.bench_memory --search model --mesh fsdp=4 \\
        --remat quantized --precisions bf16,nvfp4 --seq 1024 --batch 4

`--batch` is then the micro-batch per batch shard (per device on `data`
and `fsdp`), and the model grows along `--ladder`, GPT shapes `d_model x
layers` (`LADDER`: the presets small, base, large, then GPT-3-like shapes
up to 8192x48). Each rung is the trainer's own sharded step (`Trainer` on
the mesh: `MeshRules` shardings, bf16 parameters, FP32 master weights and
Adam state split over `fsdp`), compiled from shapes (nothing allocated),
its peak per device by XLA as above, under the allocator limit a process
like the run's has (read once by a probe process; `--limit-gib` instead).
The search runs in rounds, each compile its own process: the guess (the
largest rung under the limit by a line in the parameter count: the
state's bytes a parameter before any compile, then through the compiled
rungs; `next_rung`) and its neighbor side by side (both neighbors in the
first round), until the rung that fits sits below one that does not. Then that rung is built,
initialized and run for two steps on all mesh devices in a fresh process
(the rung below if it runs out of memory), one run at a time; the
precisions' compiles run side by side (`--jobs` at once, compiles only,
`XLA_PYTHON_CLIENT_PREALLOCATE=false`). `--budget-s`: no compile or run
starts after it, and children still busy `--grace-s` later are stopped;
the table shows what is done, and the state (after every compile and run)
lets the same command go on. `--smoke`: the same on 8 CPU devices, a tiny
ladder and a limit inside it.
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
from train import mesh_flags

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


# The largest model on a device mesh (`--search model`).

# GPT shapes, `d_model x layers`, in increasing size: the presets small,
# base and large, then GPT-3-like shapes (heads of 128, SwiGLU's d_ff ~
# 8/3 d_model; `shape_fields`): 25.6M to 38.6B parameters, past what
# 4 H200s hold at the default allocator limit.
LADDER = ("512x8,768x18,1024x28,1536x24,2048x24,2560x32,3072x32,3584x32,"
          "4096x32,4608x36,5120x40,5120x48,6144x48,7168x48,8192x48")
# `--smoke`: 8 CPU devices, shapes that compile in seconds, and a limit
# that the ladder's top is over (its peaks: tests/benchmarks/test_bench_memory.py).
SMOKE = {"ladder": "128x1,128x2,256x2,256x4,384x4,512x4", "mesh": "fsdp=8",
         "seq": 32, "batch": 1, "limit_gib": 0.03, "precisions": "bf16,nvfp4"}
MESH_AXES = mesh_flags.MESH_AXES
MAX_MODEL_RUNS = 3  # The search's answer, then at most two rungs down.
# The first guess, before any peak is known: bytes per parameter of the
# train state (bf16 parameters and gradients, the FP32 master copy and
# Adam's two moments: about 2 + 2 + 4 + 8), split over the axes that split
# parameters, plus a layer's bf16 weights gathered whole on every device
# (2 bytes a parameter less its own shard). On one H100 GPT base's state
# measured ~16 (BENCHMARKS.md, the batch search's line at batch 0).
STATE_BYTES_PER_PARAM = 16
GATHERED_BYTES_PER_PARAM = 2


def prior_bytes_per_param(shards: int) -> float:
  return (STATE_BYTES_PER_PARAM / shards
          + GATHERED_BYTES_PER_PARAM * (1 - 1 / shards))


def parse_mesh(text: str) -> dict[str, int]:
  """`"fsdp=4"` or `"data=2,fsdp=2"` as `{axis: size}` (`mesh_flags`'
  parser), or a SystemExit naming the bad part."""
  try:
    return mesh_flags.parse_mesh(text or "")
  except mesh_flags.MeshSpecError as e:
    if e.axis is not None:
      raise SystemExit(f"--mesh {text!r} names {e.axis!r} twice.") from None
    raise SystemExit(
        f"--mesh {text!r}: {e.part!r} is not AXIS=SIZE; use comma-separated "
        f"axes of {MESH_AXES} with positive sizes, e.g. --mesh fsdp=4 or "
        f"--mesh data=2,fsdp=2.") from None


def shape_fields(d_model: int, layers: int) -> dict[str, int]:
  """`GPTConfig` fields of the rung `d_model x layers`: a preset's heads and
  d_ff where its width matches (small, base, large), else heads of 128
  (at least one) and d_ff = 8/3 d_model rounded to a multiple of 256."""
  from models import presets  # pylint: disable=g-import-not-at-top
  for cfg in presets.PRESETS.values():
    if cfg.d_model == d_model and not cfg.num_experts:
      heads, d_ff = cfg.num_heads, cfg.d_ff
      break
  else:
    heads = max(1, d_model // 128)
    d_ff = max(256, round(8 * d_model / 3 / 256) * 256)
  return {"d_model": d_model, "num_layers": layers, "num_heads": heads,
          "d_ff": d_ff}


def approx_params(rung: str, vocab: int = 256) -> int:
  """Parameters of the rung "DxL" from its shape (attention 4 d^2, SwiGLU
  3 d d_ff, two norms a block; embedding and head; no biases)."""
  f = shape_fields(*parse_rung(rung))
  d = f["d_model"]
  return (f["num_layers"] * (4 * d * d + 3 * d * f["d_ff"] + 2 * d)
          + 2 * vocab * d + d)


def parse_rung(rung: str) -> tuple[int, int]:
  d, x, layers = rung.strip().partition("x")
  if not x or not d.isdigit() or not layers.isdigit() or int(d) % 32 or (
      int(layers) < 1):
    raise SystemExit(f"ladder rung {rung!r} is not DxL (d_model, a multiple "
                     f"of 32, x layers), e.g. 2048x24.")
  return int(d), int(layers)


def parse_ladder(text: str) -> tuple[str, ...]:
  """The ladder's rungs, checked to grow in parameters."""
  rungs = tuple(r.strip() for r in text.split(",") if r.strip())
  sizes = [approx_params(r) for r in rungs]
  if not rungs or any(a >= b for a, b in zip(sizes, sizes[1:])):
    raise SystemExit(f"--ladder {text!r}: give DxL rungs in increasing "
                     f"parameter count, e.g. {LADDER[:29]!r}.")
  return rungs


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """One precision's search: the model grows, the rest is fixed."""
  precision: str
  remat: str
  seq: int
  batch: int  # Sequences per batch shard (per device for data/fsdp).
  mesh: str
  ladder: tuple[str, ...]
  attention: str = "fused"
  wgrad_sums: str = "float32"  # `MeshRules.wgrad_sums`.

  @property
  def label(self) -> str:
    sums = ("" if self.wgrad_sums == "float32"
            else f" wgrad_sums={self.wgrad_sums}")
    return (f"{self.precision} remat={self.remat} {self.mesh} "
            f"{self.batch}x{self.seq}{sums}")


def next_rung(peaks: dict[str, float], ladder, limit: float,
              shards: int = 1) -> int | None:
  """The ladder index to compile next in the search for the largest rung
  whose peak is within `limit`, or None once the bracket is closed (the
  largest known to fit is the one below the smallest known not to, or the
  ladder's end).

  The guess is the largest rung strictly inside the bracket whose peak,
  read off a line in the parameter count, is within the limit: before any
  compile, the state's bytes (`prior_bytes_per_param`); after
  one, the line through it and the origin; after more, the line through
  the compiled rungs nearest the limit (one each side once both are
  known). A guess outside the bracket takes the rung next to the side it
  fell off, so every compile shrinks the bracket.
  """
  n = len(ladder)
  params = [approx_params(r) for r in ladder]
  idx = {r: i for i, r in enumerate(ladder)}
  done = {idx[r]: p for r, p in peaks.items() if r in idx}
  fit = [i for i, p in done.items() if p is not None and p <= limit]
  over = [i for i, p in done.items() if p is None or p > limit]
  lo, hi = max(fit, default=-1), min(over, default=n)
  if hi - lo <= 1:
    return None
  known = sorted(i for i, p in done.items() if p is not None)
  if not known:
    line = (0.0, prior_bytes_per_param(shards))
  elif len(known) == 1:
    line = (0.0, done[known[0]] / params[known[0]])
  else:
    a, b = ((lo, hi) if lo in known and hi in known else
            sorted(known, key=lambda i: abs(done[i] - limit))[:2])
    a, b = sorted((a, b))
    slope = (done[b] - done[a]) / (params[b] - params[a])
    line = (done[a] - slope * params[a], slope)
  if line[1] <= 0:
    return (lo + hi) // 2  # The peak does not grow: bisect.
  guess = max((i for i in range(n) if line[0] + line[1] * params[i]
               <= limit), default=lo + 1)
  return min(max(guess, lo + 1), hi - 1)


def bracket(peaks: dict[str, float | None], ladder, limit: float):
  """(largest index known to fit or -1, smallest known not to or len)."""
  done = {ladder.index(r): p for r, p in peaks.items() if r in ladder}
  fit = [i for i, p in done.items() if p is not None and p <= limit]
  over = [i for i, p in done.items() if p is None or p > limit]
  return max(fit, default=-1), min(over, default=len(ladder))


def next_model_run(peaks: dict[str, float | None], ladder, limit: float,
                   runs: list[dict]) -> int | None:
  """The ladder index to run next, or None when done: once the search is
  over, its answer; after a run out of memory, the rung below it; done once
  a run succeeds or fails otherwise, at the ladder's foot, or after
  `MAX_MODEL_RUNS` runs."""
  if next_rung(peaks, ladder, limit) is not None:
    return None  # Still searching.
  lo, _ = bracket(peaks, ladder, limit)
  if lo < 0 or len(runs) >= MAX_MODEL_RUNS or any(
      r["ok"] or r.get("error") for r in runs):
    return None
  if not runs:
    return lo
  i = min(ladder.index(r["rung"]) for r in runs) - 1
  return i if i >= 0 else None


def _model_log(c: MeshConfig, msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {c.label}: {msg}", file=sys.stderr,
        flush=True)


def _model_trainer(c: MeshConfig, rung: str):
  """The trainer of rung `rung` on the mesh `c.mesh` (the trainer's own
  sharded step: `MeshRules` shardings of the FP32 master weights and Adam
  state, the batch split over the mesh's batch axes)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from nvfp4_jax import sharding  # pylint: disable=g-import-not-at-top
  from train import data  # pylint: disable=g-import-not-at-top
  from train.config import TrainConfig  # pylint: disable=g-import-not-at-top
  from train.loop import Trainer  # pylint: disable=g-import-not-at-top
  from train.loop import model_config  # pylint: disable=g-import-not-at-top

  sizes = parse_mesh(c.mesh)
  n = math.prod(sizes.values())
  if len(jax.devices()) < n:
    raise SystemExit(f"--mesh {c.mesh} needs {n} devices; this process sees "
                     f"{len(jax.devices())} ({jax.devices()[0].device_kind}).")
  mesh = sharding.make_mesh(jax.devices()[:n], **sizes)
  import nvfp4_jax  # pylint: disable=g-import-not-at-top
  batch = c.batch * nvfp4_jax.MeshRules(mesh=mesh).data_parallel
  rng = np.random.default_rng(0)
  tokens = batch * (c.seq + 1) * 4
  corpus = data.Corpus(train=rng.integers(0, 256, tokens).astype(np.uint8),
                       val=rng.integers(0, 256, tokens).astype(np.uint8),
                       vocab_size=256, source="random")
  # The `large` preset's optimizer settings (peak learning rate 3e-4,
  # warmup over 5% of the steps) at every rung, one micro-batch a step.
  tc = TrainConfig.for_preset(
      "large", precision=c.precision, steps=1000, batch_size=batch,
      grad_accum=1, seq_len=c.seq, diagnostics=False, eval_batches=1,
      attention=c.attention, remat=c.remat, wgrad_sums=c.wgrad_sums)
  mc = model_config(tc, 256).replace(**shape_fields(*parse_rung(rung)))
  return Trainer(tc, corpus, mc, mesh=mesh), batch


def _is_oom(e: Exception) -> bool:
  msg = str(e).lower()
  return "resource_exhausted" in msg or "out of memory" in msg


def _model_compile(c: MeshConfig, rung: str, built=None):
  """The compiled step of `rung`, its per-device XLA peak, parameters and
  seconds: from shapes alone (nothing allocated), or for `built`, a
  (trainer, state, tokens) of the rung's own."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  t = time.perf_counter()
  if built is None:
    trainer, batch = _model_trainer(c, rung)
    state = trainer.abstract_state()
    tokens = jax.ShapeDtypeStruct((1, batch, c.seq + 1), jnp.int32,
                                  sharding=trainer.batch_sharding)
  else:
    trainer, state, tokens = built
  params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
  compiled = trainer.train_step.lower(state, tokens).compile()
  peak = peak_bytes(compiled.memory_analysis())
  return compiled, peak, params, time.perf_counter() - t


def plan_compiles(peaks: dict[str, float | None], ladder, limit: float,
                  shards: int = 1, pair: bool = True) -> list[int]:
  """The ladder indices to compile side by side in the next round (empty
  once the bracket is closed): `next_rung`'s guess and, with `pair`, its
  neighbor inside the bracket, so a right guess closes the bracket in one
  round (above it, or below where the guess is the bracket's top); before
  any peak is known, both neighbors (the first guess is the roughest)."""
  i = next_rung(peaks, ladder, limit, shards)
  if i is None:
    return []
  if not pair:
    return [i]
  lo, hi = bracket(peaks, ladder, limit)
  if not any(p is not None for p in peaks.values()):
    return [j for j in (i - 1, i, i + 1) if lo < j < hi]
  if i + 1 < hi:
    return [i, i + 1]
  return [i - 1, i] if i - 1 > lo else [i]


def _model_compile_child(c: MeshConfig, rung: str,
                         limit_gib: float | None) -> dict:
  """One rung compiled from shapes (nothing allocated): its peak per
  device (None: out of memory while compiling), parameters, seconds, and
  the allocator limit of this process."""
  limit = _limit(limit_gib)
  try:
    _, peak, params, secs = _model_compile(c, rung)
    note = ""
  except Exception as e:  # pylint: disable=broad-except
    if not _is_oom(e):
      raise
    peak, params, secs, note = None, approx_params(rung), 0.0, str(e)[:200]
  _model_log(c, f"{rung} ({params / 1e6:.4g}M): peak "
             + (f"{peak / 2**30:.3g} GiB per device" if peak is not None
                else "out of memory compiling")
             + f" (limit {limit / 2**30:.3g}; compiled in {secs:.0f} s)")
  return {"rung": rung, "peak": peak, "params": params, "s": secs,
          "note": note, "limit": limit}


def _limit_child(limit_gib: float | None) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  return {"limit": _limit(limit_gib),
          "device": f"{len(jax.devices())} x {jax.devices()[0].device_kind}"}


def _model_run(c: MeshConfig, rung: str) -> dict:
  """`rung` initialized, compiled and run for two steps on the mesh, in a
  fresh process; the second step timed."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  out = {"rung": rung, "ok": False, "jax": jax.__version__,
         "device": f"{len(jax.devices())} x {jax.devices()[0].device_kind}"}
  try:
    trainer, batch = _model_trainer(c, rung)
    state = trainer.init_state()
    tokens = trainer.put_batch(np.random.default_rng(0).integers(
        0, 256, (1, batch, c.seq + 1)).astype(np.int32))
    compiled, peak, params, _ = _model_compile(c, rung,
                                               (trainer, state, tokens))
    out.update(peak=peak, params=params)
    state, m = compiled(state, tokens)
    jax.block_until_ready(m)
    t = time.perf_counter()
    state, m = compiled(state, tokens)
    jax.block_until_ready(m)
    out.update(ok=True, step_s=time.perf_counter() - t,
               loss=float(m["loss"]))
  except Exception as e:  # pylint: disable=broad-except
    if not _is_oom(e):
      raise
    out["oom"] = str(e)[:200]
  out["s"] = time.perf_counter() - t0
  _model_log(c, f"{rung}: " + ("two steps ran" if out["ok"] else
                               "out of memory when run")
             + f" ({out['s']:.0f} s)")
  return out


def _g(b) -> str:
  """Bytes as GiB to three figures (tiny CPU peaks included)."""
  return "" if b is None else f"{b / 2**30:.3g}"


def model_rows(configs, states) -> list[dict]:
  """One row per configuration: the largest rung that ran, its peak, the
  next rung up and why it does not fit."""
  rows = []
  for c in configs:
    st = states[c.label]
    rungs = st.get("rungs", {})
    peaks = {r: v["peak"] for r, v in rungs.items()}
    limit = st.get("limit", float("nan"))
    runs = st.get("runs", [])
    ok = [r for r in runs if r["ok"]]
    lo, hi = (bracket(peaks, c.ladder, limit) if rungs else
              (-1, len(c.ladder)))
    searched = bool(rungs) and next_rung(peaks, c.ladder, limit) is None
    prec = c.precision + ("" if c.wgrad_sums == "float32"
                          else f" (wgrad sums {c.wgrad_sums})")
    row = {"precision": prec, "remat": c.remat, "mesh": c.mesh,
           "per_device": f"{c.batch}x{c.seq}",
           "limit_gib": _g(st.get("limit")),
           "compiles": len(rungs),
           "compile_s": round(sum(v["s"] for v in rungs.values())),
           "fits_by_xla": c.ladder[lo] if lo >= 0 else
                          ("none" if searched else "")}
    if ok:
      r = ok[0]
      i = c.ladder.index(r["rung"])
      row.update(largest_ran=r["rung"], params_m=f"{r['params'] / 1e6:.4g}",
                 peak_gib=_g(r["peak"]), run_s=round(r["s"]),
                 step_s=round(r["step_s"], 2), loss=r.get("loss"))
    else:
      i = None
      errors = [r["error"] for r in runs if r.get("error")]
      row["largest_ran"] = (f"run failed (exit {errors[0]})" if errors else
                            "none ran" if runs else
                            "not run" + ("" if searched else
                                         " (search unfinished)"))
    up = None if i is None else i + 1
    if up is not None:
      failed = [r for r in runs if not r["ok"] and
                c.ladder.index(r["rung"]) == up]
      if up >= len(c.ladder):
        row["next_up"] = "ladder ends"
      else:
        rung = c.ladder[up]
        p = rungs.get(rung, {})
        params = p.get("params") or approx_params(rung)
        row["next_up"] = f"{rung} ({params / 1e6:.4g}M)"
        row["next_peak_gib"] = (
            f"{_g(failed[0].get('peak', p.get('peak')))}, out of memory "
            "when run" if failed else
            f"compile failed (exit {p['error']}), not a memory answer"
            if p.get("error") else
            "out of memory compiling" if rung in rungs and p["peak"] is None
            else _g(p["peak"]) if rung in rungs else "not compiled")
    rows.append(row)
  return rows


MODEL_COLS = ("precision", "remat", "mesh", "per_device", "largest_ran",
              "params_m", "peak_gib", "next_up", "next_peak_gib", "limit_gib",
              "fits_by_xla", "compiles", "compile_s", "run_s", "step_s",
              "loss")


def model_env(environ, state_dir: str, compile_only: bool,
              smoke: bool = False) -> dict[str, str]:
  """`child_env`, but a compile-only child leaves the allocator unfilled
  (`XLA_PYTHON_CLIENT_PREALLOCATE=false`: it allocates nothing, and
  searches run side by side with each other and with a run, which needs
  its arena). `smoke`: 8 CPU devices."""
  env = child_env(environ, state_dir)
  if compile_only:
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  if smoke:
    env["JAX_PLATFORMS"] = "cpu"
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
      env["XLA_FLAGS"] = (flags +
                          " --xla_force_host_platform_device_count=8").strip()
  return env


def model_main(a) -> list[dict]:
  """`--search model`: rounds of compiles per precision (a process per
  compile, up to `--jobs` at once), then its runs (one at a time: a run
  holds every device of the mesh), within `--budget-s`; prints the table
  and returns its rows."""
  from nvfp4_jax.tools import timing  # pylint: disable=g-import-not-at-top
  t_start = time.time()
  stop_new = t_start + a.budget_s
  stop_all = stop_new + a.grace_s
  ladder = parse_ladder(a.ladder)
  sizes = parse_mesh(a.mesh)
  shards = math.prod(sizes.get(k, 1) for k in ("fsdp", "model"))
  mesh = ",".join(f"{k}={v}" for k, v in sizes.items())
  # The weight gradients' sums change only quantized layers: BF16 is
  # searched once.
  configs = [MeshConfig(p, r, a.seq, a.batch, mesh, ladder, a.attention, s)
             for r in a.remat.split(",") for p in a.precisions.split(",")
             for s in a.wgrad_sums.split(",")
             if p != "bf16" or s == "float32"]
  os.makedirs(a.state_dir, exist_ok=True)
  files = {c.label: os.path.join(a.state_dir, "model_" + _slug(c.label)
                                 + ".json") for c in configs}
  limit_arg = [] if a.limit_gib is None else ["--limit-gib",
                                               str(a.limit_gib)]

  def launch(c, args, compile_only):
    env = model_env(os.environ, a.state_dir, compile_only, a.smoke)
    cmd = [sys.executable, "-m", "benchmarks.bench_memory", "--search",
           "model", "--model-child",
           json.dumps(dataclasses.asdict(c)) if c else "{}", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)

  # The allocator limit the compiles are searched under, from a process
  # like theirs.
  probe = launch(None, ["--limit-probe", *limit_arg], True)
  out, _ = probe.communicate()
  if probe.returncode:
    raise SystemExit(f"reading the device's memory limit failed (exit "
                     f"{probe.returncode}); its log is above.")
  probed = json.loads(out.strip().splitlines()[-1])
  limit = probed["limit"]
  states = {}
  for c in configs:
    st = _load_state(files[c.label])
    st.setdefault("rungs", {})
    st["limit"] = same_limit(st, limit, files[c.label])
    states[c.label] = st
    _save_state(files[c.label], st)
  done, running = set(), []  # running: (config, rung, "compile" | "run", Popen)
  while True:
    now = time.time()
    if now > stop_all:
      for c, rung, kind, proc in running:
        proc.kill()
        proc.wait()
        _model_log(c, f"{kind} of {rung} stopped: past --budget-s + "
                   "--grace-s")
      break
    busy = {c.label for c, _, _, _ in running}
    for c in configs:
      if now > stop_new or c.label in busy or c.label in done:
        continue
      st = states[c.label]
      peaks = {r: v["peak"] for r, v in st["rungs"].items()}
      todo = plan_compiles(peaks, ladder, limit, shards, a.pair)
      if todo:
        free = a.jobs - sum(k == "compile" for _, _, k, _ in running)
        for i in todo[:max(0, free)]:
          running.append((c, ladder[i], "compile", launch(
              c, ["--try-rung", ladder[i], "--compile-only", *limit_arg],
              True)))
        continue
      i = next_model_run(peaks, ladder, limit, st.get("runs", []))
      if i is None or a.no_run:
        done.add(c.label)
        continue
      if any(k == "run" for _, _, k, _ in running):
        continue  # A run holds every device of the mesh.
      est = st["rungs"].get(ladder[i], {}).get("s", 0)
      if now + est > stop_all:
        _model_log(c, f"{ladder[i]} not run: its compile alone took "
                   f"{est:.0f} s, past --budget-s + --grace-s")
        done.add(c.label)
        continue
      running.append((c, ladder[i], "run", launch(
          c, ["--try-rung", ladder[i]], False)))
    if not running:
      if all(c.label in done for c in configs) or now > stop_new:
        break
      time.sleep(0.2)
      continue
    time.sleep(0.2)
    for c, rung, kind, proc in [r for r in running if r[3].poll() is not None]:
      running.remove((c, rung, kind, proc))
      st = states[c.label]
      out = proc.stdout.read()
      if proc.returncode:
        _model_log(c, f"{kind} of {rung} failed (exit {proc.returncode}); "
                   "its log is above")
        if kind == "run":
          st.setdefault("runs", []).append(
              {"rung": rung, "ok": False, "error": proc.returncode})
        else:  # Counted as over the limit, and said so in the table.
          st["rungs"][rung] = {"peak": None, "params": approx_params(rung),
                               "s": 0.0, "note": "", "error": proc.returncode}
      else:
        r = json.loads(out.strip().splitlines()[-1])
        if kind == "run":
          st.setdefault("runs", []).append(r)
        else:
          same_limit(st, r.pop("limit"), files[c.label])
          st["rungs"][rung] = r
      _save_state(files[c.label], st)
    # Compiles the finished ones made pointless (outside the bracket now)
    # are stopped: the round's answer need not wait for them.
    for c, rung, kind, proc in list(running):
      st = states[c.label]
      lo, hi = bracket({r: v["peak"] for r, v in st["rungs"].items()},
                       ladder, limit)
      if kind == "compile" and not lo < ladder.index(rung) < hi:
        running.remove((c, rung, kind, proc))
        proc.kill()
        proc.wait()
        _model_log(c, f"compile of {rung} stopped: not needed any more")
  rows = model_rows(configs, states)
  runs = [r for s in states.values() for r in s.get("runs", [])
          if "device" in r]
  where = (f"{runs[0]['device']}, jax {runs[0]['jax']}; " if runs else
           f"{probed['device']}; ")
  print(f"{where}largest GPT of the ladder that trains two steps on "
        f"{mesh} (per-device micro-batch {a.batch} x {a.seq}); peaks per "
        f"device by XLA's memory analysis; {time.time() - t_start:.0f} s")
  print(timing.table(rows, [k for k in MODEL_COLS
                            if any(k in r for r in rows)]))
  def unfinished(c):
    st = states[c.label]
    peaks = {r: v["peak"] for r, v in st["rungs"].items()}
    return bool(plan_compiles(peaks, ladder, limit, shards)) or (
        not a.no_run and next_model_run(peaks, ladder, limit,
                                        st.get("runs", [])) is not None)

  if any(unfinished(c) for c in configs):
    print(f"Unfinished within --budget-s: the same command with --state-dir "
          f"{a.state_dir} goes on from here.")
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--child", help=argparse.SUPPRESS)
  p.add_argument("--state-file", help=argparse.SUPPRESS)
  p.add_argument("--try-batch", type=int, help=argparse.SUPPRESS)
  p.add_argument("--model-child", help=argparse.SUPPRESS)
  p.add_argument("--try-rung", help=argparse.SUPPRESS)
  p.add_argument("--compile-only", action="store_true",
                 help=argparse.SUPPRESS)
  p.add_argument("--limit-probe", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--search", choices=("batch", "model"), default="batch",
                 help="batch: the largest micro-batch of each preset on one "
                 "device; model: the largest GPT of --ladder on --mesh")
  p.add_argument("--presets", default="base,large")
  p.add_argument("--batch", type=int, default=None,
                 help="batch search: micro-batch of the first compile (the "
                 "second is 2x; default 8). Model search: sequences per "
                 "batch shard, i.e. per device on data/fsdp (default 4)")
  p.add_argument("--seq", type=int, default=None, help="default 1024")
  p.add_argument("--precisions", default=None, help="default bf16,nvfp4")
  p.add_argument("--remat", default=None,
                 help="default none,quantized (batch search), quantized "
                 "(model search)")
  p.add_argument("--mesh", default=None,
                 help="model search: the device mesh, AXIS=SIZE,... of "
                 f"{MESH_AXES}, e.g. fsdp=4")
  p.add_argument("--ladder", default=None,
                 help="model search: GPT shapes d_model x layers in "
                 f"increasing size (default {LADDER})")
  p.add_argument("--budget-s", type=float, default=math.inf,
                 help="model search: no compile or run starts after this "
                 "many seconds; the table is printed with what is done")
  p.add_argument("--grace-s", type=float, default=45.0,
                 help="model search: children still busy this long after "
                 "--budget-s are stopped (their finished compiles are kept)")
  p.add_argument("--no-pair", dest="pair", action="store_false",
                 help="model search: one compile per precision per round "
                 "(default: the guess and its neighbor side by side)")
  p.add_argument("--smoke", action="store_true",
                 help="model search on 8 CPU devices: a tiny ladder, "
                 f"{SMOKE['mesh']}, a {SMOKE['limit_gib']} GiB limit")
  p.add_argument("--attention", default="fused")
  mesh_flags.add_mesh_flags(p, mesh=False, sweep=True, knobs=("wgrad_sums",))
  p.add_argument("--limit-gib", type=float, default=None,
                 help="memory budget instead of the device's allocator limit")
  p.add_argument("--compiles", type=int, default=8,
                 help="compiles per configuration in the search, the "
                 "line's two included")
  p.add_argument("--jobs", type=int, default=None,
                 help="configurations at once, each its own process within "
                 "its own allocator limit (keep jobs x the memory fraction "
                 "below 1); model search: compiles at once, default 6 "
                 "(runs go one at a time)")
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
  if a.smoke:
    a.search = "model"
    for k in ("ladder", "mesh", "seq", "batch", "limit_gib", "precisions"):
      if getattr(a, k) is None:
        setattr(a, k, SMOKE[k])
  model = a.search == "model"
  a.batch = a.batch or (4 if model else 8)
  a.seq = a.seq or 1024
  a.precisions = a.precisions or "bf16,nvfp4"
  a.remat = a.remat or ("quantized" if model else "none,quantized")
  a.jobs = a.jobs or (6 if model else 3)
  if a.model_child:
    if a.limit_probe:
      r = _limit_child(a.limit_gib)
    else:
      c = json.loads(a.model_child)
      c = MeshConfig(**{**c, "ladder": tuple(c["ladder"])})
      r = (_model_compile_child(c, a.try_rung, a.limit_gib)
           if a.compile_only else _model_run(c, a.try_rung))
    print(json.dumps(r))
    return
  if model:
    if not a.mesh:
      raise SystemExit("--search model needs --mesh, e.g. --mesh fsdp=4 "
                       "(a mesh of one device: --mesh data=1).")
    a.ladder = a.ladder or LADDER
    return model_main(a)
  if a.mesh or a.ladder:
    raise SystemExit("--mesh and --ladder belong to --search model; the "
                     "batch search runs on one device.")
  run = not a.no_run
  if a.child:
    c = bench_step.StepConfig(**json.loads(a.child))
    r = (_run_once(c, a.try_batch) if a.try_batch else
         _search(c, a.limit_gib, a.compiles, a.state_file))
    print(json.dumps(r))
    return
  from nvfp4_jax.tools import timing  # pylint: disable=g-import-not-at-top
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
