"""NVFP4 GEMM: TFLOP/s vs cuBLAS bf16 at 8192^3 and transformer shapes.

Rows per shape (M tokens, N out, K in; bf16 output):
- "cuBLAS bf16": the ceiling, `a @ b.T` on random bf16 operands.
- "pallas excl. prep": the GEMM on already block-dequantized bf16 operands
  (`block_values_matmul`; the values come fused out of the quantize kernel).
- "pallas incl. prep": from `NVFP4Array`s: Pallas dequantize kernel on both
  operands, then the bf16 GEMM (`block_scaled_matmul(implementation="pallas")`).
- "xla": the reference from `NVFP4Array`s (dequantize in XLA + dot).
- at 8192^3 also "triton" (`tl.dot_scaled` via jax-triton), "scaled_matmul"
  (`jax.nn.scaled_matmul`) and "quantize+GEMM" from bf16 inputs (both
  operands quantized with values by the Pallas kernel, amax included).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax.ops.quantize import api as quantize_api
from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
from nvfp4_jax.ops.weight_only_matmul import api as weight_only_api
from nvfp4_jax.tools import speed
from nvfp4_jax.tools import timing
from pallas_kernels import e2m1_decode
from pallas_kernels import launch

TRANSFORMER_DIMS = (2048, 4096, 8192, 14336)


def run(shapes=None) -> list[dict]:
  if shapes is None:
    shapes = [(8192, 8192, 8192, True)]
    shapes += [(8192, n, k, False) for k in TRANSFORMER_DIMS
               for n in TRANSFORMER_DIMS if (n, k) != (8192, 8192)]
  rows = []
  for m, n, k, full in shapes:
    rows += speed.gemm_speed(m, n, k, full=full)
  return rows


COLS = speed.GEMM_COLS

# Decode shapes (tokens, out, in): a packed NVFP4 weight times bf16 activations.
DECODE_SHAPES = ((1, 4096, 4096), (16, 4096, 4096), (16, 14336, 4096),
                 (128, 4096, 14336))


# Distinct weights per timed call: a decode step runs one matmul per layer,
# each on its own weight, in one jitted program. Timing one small matmul per
# jit call measures Python dispatch (~60-90 us on the lent machine), not the
# GPU; timing `DECODE_LAYERS` of them in one program, on weights that
# together exceed the L2 cache, measures the kernels.
DECODE_LAYERS = 16


def _decode_case(m: int, n: int, k: int, layers: int = DECODE_LAYERS):
  """Random bf16 `x [m, k]`, `layers` weights `[n, k]` (bf16 and quantized
  16x16), and the cuBLAS time per matmul of `x @ w.T` on the bf16 weights."""
  keys = jax.random.split(jax.random.key(m + n + k), layers + 1)
  x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
  ws = [jax.random.normal(kw, (n, k), jnp.float32).astype(jnp.bfloat16)
        for kw in keys[1:]]
  qws = [quantize_api.quantize(w, block_2d=True) for w in ws]
  t_cublas = per_layer(lambda x, w: x @ w.T, x, ws)
  return x, ws, qws, t_cublas


def per_layer(fn, x, ws, reps: int = 7) -> float:
  """Seconds per call of `fn(x, w)`, over the list `ws` in one program."""
  f = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
  return timing.bench(f, [(x, ws)], calls=3, reps=reps) / len(ws)


def gpu_kernels_per_layer(fn, x, ws, reps: int = 5) -> dict[str, tuple]:
  """{kernel: (calls, GPU seconds)} per call of `fn(x, w)`, from a
  `jax.profiler` trace of `per_layer`'s program (empty without a GPU)."""
  f = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
  return {name: (n / len(ws), t / len(ws)) for name, (n, t) in
          timing.gpu_kernels(f, [(x, ws)], calls=reps).items()}


def run_weight_only(shapes=DECODE_SHAPES,
                    layers: int = DECODE_LAYERS) -> list[dict]:
  """`weight_only_matmul` (packed weight) against cuBLAS on the bf16 weight.

  Two times per matmul, each of `layers` matmuls in one program reading its
  own weight: `us`, the wall time per matmul (`per_layer`), and `gpu_us`,
  the GPU time of its kernels (a `jax.profiler` trace of the same program;
  the difference is idle GPU time between kernels: at decode shapes the
  kernels are shorter than XLA takes to launch them). Ratios to cuBLAS (> 1:
  faster) of both, the weight bytes read per GPU second (0.5625 bytes per
  weight packed, 2 for bf16) and that rate as a fraction of the copy
  bandwidth (`copy_bw`, measured in the same run).
  """
  rows = []
  copy_bw = timing.copy_bandwidth()
  for m, n, k in shapes:
    x, ws, qws, t_cublas = _decode_case(m, n, k, layers)
    g_cublas = sum(t for _, t in gpu_kernels_per_layer(
        lambda x, w: x @ w.T, x, ws).values()) or None
    shape = f"{m}x{n}x{k}"
    ref = jax.jit(functools.partial(weight_only_api.weight_only_matmul,
                                    implementation="xla"))(x, qws[0])

    def row(name, t, g, nbytes, **kw):
      return dict(shape=shape, gemm=name, us=t * 1e6, of_cublas=t_cublas / t,
                  gpu_us=g and g * 1e6,
                  gpu_of_cublas=g and g_cublas and g_cublas / g,
                  weight_tbps=g and nbytes * n * k / g / 1e12,
                  of_copy=g and nbytes * n * k / g / copy_bw, **kw)

    rows.append(row("cuBLAS bf16 weight", t_cublas, g_cublas, 2))
    for impl, asm in (("pallas", True), ("pallas", False), ("xla", True)):
      fn = functools.partial(weight_only_api.weight_only_matmul, implementation=impl)
      name = f"weight-only {impl}" + ("" if asm else " (jnp decode)")
      e2m1_decode.ASM_DECODE = asm
      try:
        out = jax.jit(fn)(x, qws[0])
        t = per_layer(fn, x, qws)
        g = sum(t for _, t in gpu_kernels_per_layer(fn, x, qws).values())
      except Exception as e:  # pylint: disable=broad-except
        rows.append(dict(shape=shape, gemm=name,
                         note=f"failed: {type(e).__name__}: {str(e)[:120]}"))
        continue
      finally:
        e2m1_decode.ASM_DECODE = True
      rows.append(row(name, t, g or None, 0.5625,
                      rel_err=timing.max_rel_diff(out, ref)))
  return rows


WEIGHT_ONLY_COLS = ("shape", "gemm", "us", "of_cublas", "gpu_us",
                    "gpu_of_cublas", "weight_tbps", "of_copy", "rel_err",
                    "note")


def sweep_weight_only(shapes=DECODE_SHAPES, top: int = 3) -> list[dict]:
  """Tile configurations of the weight-only kernel per decode shape: the
  default's row and the `top` fastest (for tuning `default_config`).

  Two stages: orientation (`swap_ab`), `block_n`, `block_k` and `split_k`
  at 4 warps and 3 stages; then warps and pipelining stages around the
  `top` of the first. Each shape's rows are printed as soon as it is done
  (a run cut short keeps them).
  """
  import itertools  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.weight_only_matmul import pallas_triton as wo  # pylint: disable=g-import-not-at-top
  rows = []
  for m, n, k in shapes:
    x, _, qws, t_cublas = _decode_case(m, n, k)
    default = wo.default_config(m, n, k)
    bm = max(16, min(128, launch.next_pow2(m)))
    tried, errors = {}, {}

    def time(cfg):
      if cfg in tried or k % (cfg.block_k * cfg.split_k):
        return
      fn = functools.partial(wo.weight_only_matmul, config=cfg,
                             out_dtype=jnp.bfloat16)
      try:
        tried[cfg] = per_layer(fn, x, qws, reps=3)
      except Exception as e:  # pylint: disable=broad-except
        tried[cfg] = float("inf")  # e.g. out of shared memory.
        errors.setdefault(type(e).__name__, f"{cfg}: {str(e)[:300]}")

    for swap, bn, split in itertools.product((False, True), (16, 32, 64, 128),
                                             (1, 4, 16)):
      time(wo.WeightOnlyConfig(block_m=bm, block_n=bn, block_k=256,
                               split_k=split, swap_ab=swap,
                               num_warps=8 if bm * bn > 4096 else 4))
    for cfg in sorted(tried, key=tried.get)[:top]:
      for change in (dict(num_warps=2), dict(num_warps=8), dict(num_stages=1),
                     dict(num_stages=4), dict(block_k=128), dict(block_k=512),
                     dict(split_k=cfg.split_k * 2),
                     dict(split_k=max(1, cfg.split_k // 2))):
        time(dataclasses.replace(cfg, **change))
    time(default)
    ranked = sorted(tried, key=tried.get)
    shape_rows = []
    for label, cfg in [("default", default)] + [
        (f"#{i + 1}", c) for i, c in enumerate(ranked[:top])]:
      t = tried[cfg]
      shape_rows.append(dict(
          shape=f"{m}x{n}x{k}", rank=label, us=t * 1e6,
          of_cublas=t_cublas / t, weight_tbps=0.5625 * n * k / t / 1e12,
          config=f"bm={cfg.block_m} bn={cfg.block_n} bk={cfg.block_k} "
          f"split={cfg.split_k} swap={int(cfg.swap_ab)} "
          f"warps={cfg.num_warps} stages={cfg.num_stages}"))
    print(timing.table(shape_rows, SWEEP_COLS), flush=True)
    for name, msg in errors.items():
      print(f"  failed configs ({name}), e.g. {msg}", flush=True)
    rows += shape_rows
  return rows


SWEEP_COLS = ("shape", "rank", "us", "of_cublas", "weight_tbps", "config")


def profile_weight_only(shapes=DECODE_SHAPES) -> list[dict]:
  """Where a decode matmul's time goes: each GPU kernel of the per-layer
  program (`gpu_kernels_per_layer`: calls and microseconds per matmul) for
  cuBLAS on the bf16 weight and the Pallas kernel at its default tiles,
  against the wall time per matmul; the difference is idle GPU time between
  kernels."""
  rows = []
  for m, n, k in shapes:
    x, ws, qws, _ = _decode_case(m, n, k)
    for name, fn, weights in (
        ("cuBLAS bf16", lambda x, w: x @ w.T, ws),
        ("pallas", functools.partial(weight_only_api.weight_only_matmul,
                                     implementation="pallas"), qws)):
      wall = per_layer(fn, x, weights)
      kernels = gpu_kernels_per_layer(fn, x, weights)
      these = [dict(shape=f"{m}x{n}x{k}", impl=name, kernel=kname[:60],
                    calls=calls, us=t * 1e6, wall_us=wall * 1e6)
               for kname, (calls, t) in sorted(kernels.items(),
                                                key=lambda kv: -kv[1][1])]
      print(timing.table(these, PROFILE_COLS), flush=True)
      rows += these
  return rows


PROFILE_COLS = ("shape", "impl", "kernel", "calls", "us", "wall_us")

# The emulated GEMMs as the layers call `block_values_matmul`: (gemm, M, K,
# N, vb_kn, out dtype). GPT base at 16 x 1024 tokens (Fprop: `x @ V`, bf16
# out; Dgrad: `dY @ W^T` from the weight's [in, out] values, dX in x's bf16;
# Wgrad: `q(rht(X^T)) @ q(rht(dY^T))^T`, FP32 out), then the layer
# benchmark's three (8192 tokens, 4096 x 4096).
VALUES_CASES = (
    ("qkv fprop", 16384, 768, 2304, True, "bf16"),
    ("out fprop", 16384, 768, 768, True, "bf16"),
    ("up fprop", 16384, 768, 4096, True, "bf16"),
    ("down fprop", 16384, 2048, 768, True, "bf16"),
    ("qkv dgrad", 16384, 2304, 768, False, "bf16"),
    ("out dgrad", 16384, 768, 768, False, "bf16"),
    ("up dgrad", 16384, 4096, 768, False, "bf16"),
    ("down dgrad", 16384, 768, 2048, False, "bf16"),
    ("qkv wgrad", 768, 16384, 2304, False, "f32"),
    ("down wgrad", 2048, 16384, 768, False, "f32"),
    ("layer fprop", 8192, 4096, 4096, True, "bf16"),
    ("layer dgrad", 8192, 4096, 4096, False, "bf16"),
    ("layer wgrad", 4096, 8192, 4096, False, "f32"),
)
VALUES_COLS = ("gemm", "shape", "xla_us", "pallas_us", "xla_over_pallas",
               "wgN_us", "wgM_us", "default", "max_diff", "note")


def run_values_matmul(cases=VALUES_CASES) -> list[dict]:
  """`block_values_matmul`: XLA's GEMM against the Mosaic GPU kernel
  (`nvfp4_jax.ops.block_scaled_matmul.pallas_mosaic_gpu`), by GPU time of the call's kernels, on
  the same block values.

  `wgN_us` and `wgM_us` time the two warpgroup splits, `pallas_us` the
  default config's (`default` names its split); `max_diff` is the largest
  difference relative to the output's largest magnitude, the worst of the
  two."""
  from nvfp4_jax.ops.block_scaled_matmul import pallas_mosaic_gpu as vm  # pylint: disable=g-import-not-at-top
  rows = []
  for name, m, k, n, vb_kn, out in cases:
    out_dtype = jnp.bfloat16 if out == "bf16" else jnp.float32
    sets = []
    for s in range(2):
      ka, kb = jax.random.split(jax.random.key(s))
      _, va = quantize_api.quantize_with_values(
          jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16))
      qb, vb = quantize_api.quantize_with_values(
          jax.random.normal(kb, (n, k), jnp.float32).astype(jnp.bfloat16),
          block_2d=True)
      sets.append((va, vb.T if vb_kn else vb, qb.amax * 1e-3))
    xla = jax.jit(functools.partial(gemm_api.block_values_matmul,
                                    out_dtype=out_dtype, vb_kn=vb_kn,
                                    implementation="xla"))
    want = np.asarray(xla(*sets[0]), np.float32)
    t_xla = timing.gpu_seconds(xla, sets)
    row = dict(gemm=name, shape=f"{m}x{k}x{n}" + (" kn" if vb_kn else " nk"),
               xla_us=round(t_xla * 1e6, 1))
    default = vm.Config()
    split = lambda cfg: "wgN" if cfg.wg_split_n else "wgM"
    for cfg in (vm.Config(wg_split_n=True), vm.Config(wg_split_n=False)):
      f = jax.jit(functools.partial(vm.values_matmul, out_dtype=out_dtype,
                                    vb_kn=vb_kn, config=cfg))
      try:
        got = np.asarray(f(*sets[0]), np.float32)
      except NotImplementedError as e:
        row["note"] = str(e)[:90]
        break
      t = round(timing.gpu_seconds(f, sets) * 1e6, 1)
      row[split(cfg) + "_us"] = t
      row["max_diff"] = max(row.get("max_diff", 0.0),
                            timing.max_rel_diff(got, want))
      if cfg == default:
        row.update(pallas_us=t, default=split(cfg),
                   xla_over_pallas=round(row["xla_us"] / t, 3))
    rows.append(row)
    print(row, flush=True)
  return rows


if __name__ == "__main__":
  p = argparse.ArgumentParser()
  p.add_argument("--size", type=int, default=0,
                 help="only one square size (e.g. 1024 for a smoke run)")
  p.add_argument("--weight-only", action="store_true",
                 help="the weight-only table (wall and GPU time vs cuBLAS)")
  p.add_argument("--weight-only-profile", action="store_true",
                 help="GPU kernel times vs wall time per decode matmul")
  p.add_argument("--decode-shapes", default=None,
                 help="decode shapes MxNxK,... for the sweep and the profile")
  p.add_argument("--weight-only-sweep", action="store_true",
                 help="tile sweep of the weight-only kernel at decode shapes")
  p.add_argument("--values-matmul", action="store_true",
                 help="block_values_matmul: XLA's GEMM against the Mosaic GPU "
                      "kernel at the layers' shapes and layouts")
  args = p.parse_args()
  if args.values_matmul:
    print(timing.table(run_values_matmul(), VALUES_COLS), flush=True)
    raise SystemExit(0)
  decode = (tuple(tuple(int(v) for v in s.split("x"))
                  for s in args.decode_shapes.split(","))
            if args.decode_shapes else DECODE_SHAPES)
  if args.weight_only:
    print(timing.table(run_weight_only(decode), WEIGHT_ONLY_COLS), flush=True)
  if args.weight_only_profile:
    profile_weight_only(decode)
  if args.weight_only_sweep:
    sweep_weight_only(decode)
  if args.weight_only or args.weight_only_profile or args.weight_only_sweep:
    raise SystemExit(0)
  shapes = [(args.size,) * 3 + (True,)] if args.size else None
  print(timing.table(run(shapes), COLS))
