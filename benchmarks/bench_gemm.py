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
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from nvfp4_jax import fused
from nvfp4_jax import gemm

TRANSFORMER_DIMS = (2048, 4096, 8192, 14336)


def _rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def run_shape(m: int, n: int, k: int, *, full: bool) -> list[dict]:
  flops = 2.0 * m * n * k
  ka, kb = jax.random.split(jax.random.key(m + n + k))
  a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(kb, (n, k), jnp.float32).astype(jnp.bfloat16)
  qa, va = fused.quantize_with_values(a)
  qb, vb = fused.quantize_with_values(b, block_2d=True)
  alpha = gemm.gemm_alpha(qa, qb)
  bf16 = jnp.bfloat16
  shape = f"{m}x{n}x{k}"
  rows = []
  t_cublas = timing.bench(timing.bf16_matmul(m, n, k), [(a, b)], calls=5,
                          reps=5)

  def add(name, fn, args, check=True):
    try:
      f = jax.jit(fn)
      out = f(*args)
      err = _rel_err(out, ref) if check else float("nan")
      t = timing.bench(f, [args], calls=5, reps=5)
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(shape=shape, gemm=name,
                       note=f"failed: {type(e).__name__}: {str(e)[:120]}"))
      return
    rows.append(dict(shape=shape, gemm=name, ms=t * 1e3,
                     tflops=flops / t / 1e12, of_cublas=t_cublas / t,
                     rel_err=err))

  ref = jax.jit(functools.partial(gemm.block_scaled_matmul, out_dtype=bf16,
                                  implementation="xla"))(qa, qb)
  rows.append(dict(shape=shape, gemm="cuBLAS bf16", ms=t_cublas * 1e3,
                   tflops=flops / t_cublas / 1e12, of_cublas=1.0))
  add("pallas excl. prep", functools.partial(gemm.block_values_matmul,
                                             out_dtype=bf16), (va, vb, alpha))
  add("pallas incl. prep", functools.partial(
      gemm.block_scaled_matmul, out_dtype=bf16, implementation="pallas"),
      (qa, qb))
  add("xla", functools.partial(gemm.block_scaled_matmul, out_dtype=bf16,
                               implementation="xla"), (qa, qb))
  if full:
    add("triton", functools.partial(
        gemm.block_scaled_matmul, out_dtype=bf16, implementation="triton"),
        (qa, qb))
    add("scaled_matmul", functools.partial(
        gemm.block_scaled_matmul, out_dtype=bf16,
        implementation="scaled_matmul"), (qa, qb))

    def e2e(x, w):
      qx, vx = fused.quantize_with_values(x)
      qw, vw = fused.quantize_with_values(w, block_2d=True)
      return gemm.block_values_matmul(vx, vw, gemm.gemm_alpha(qx, qw),
                                      out_dtype=bf16)
    add("quantize+GEMM (from bf16)", e2e, (a, b))
  return rows


def run(shapes=None) -> list[dict]:
  if shapes is None:
    shapes = [(8192, 8192, 8192, True)]
    shapes += [(8192, n, k, False) for k in TRANSFORMER_DIMS
               for n in TRANSFORMER_DIMS if (n, k) != (8192, 8192)]
  rows = []
  for m, n, k, full in shapes:
    rows += run_shape(m, n, k, full=full)
  return rows


COLS = ("shape", "gemm", "ms", "tflops", "of_cublas", "rel_err", "note")

# Decode shapes (tokens, out, in): a packed NVFP4 weight times bf16 activations.
DECODE_SHAPES = ((1, 4096, 4096), (16, 4096, 4096), (16, 14336, 4096),
                 (128, 4096, 14336))


def _decode_case(m: int, n: int, k: int):
  """Random bf16 `x [m, k]`, `w [n, k]`, `w` quantized (16x16), and the
  cuBLAS `x @ w.T` time on the bf16 weight."""
  kx, kw = jax.random.split(jax.random.key(m + n + k))
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (n, k), jnp.float32).astype(jnp.bfloat16)
  t_cublas = timing.bench(jax.jit(lambda x, w: x @ w.T), [(x, w)], calls=10,
                          reps=5)
  return x, w, fused.quantize(w, block_2d=True), t_cublas


def run_weight_only(shapes=DECODE_SHAPES) -> list[dict]:
  """`weight_only_matmul` (packed weight) against cuBLAS on the bf16 weight.

  Decode is memory-bound: the columns give the time, the ratio to cuBLAS
  bf16 (> 1: faster) and the weight bytes read per second (0.5625 bytes per
  weight packed, 2 for bf16).
  """
  rows = []
  for m, n, k in shapes:
    x, _, qw, t_cublas = _decode_case(m, n, k)
    shape = f"{m}x{n}x{k}"
    ref = jax.jit(functools.partial(gemm.weight_only_matmul,
                                    implementation="xla"))(x, qw)
    rows.append(dict(shape=shape, gemm="cuBLAS bf16 weight",
                     ms=t_cublas * 1e3, of_cublas=1.0,
                     weight_tbps=2 * n * k / t_cublas / 1e12))
    for impl in ("pallas", "xla"):
      try:
        f = jax.jit(functools.partial(gemm.weight_only_matmul,
                                      implementation=impl))
        out = f(x, qw)
        t = timing.bench(f, [(x, qw)], calls=10, reps=5)
      except Exception as e:  # pylint: disable=broad-except
        rows.append(dict(shape=shape, gemm=f"weight-only {impl}",
                         note=f"failed: {type(e).__name__}: {str(e)[:120]}"))
        continue
      rows.append(dict(shape=shape, gemm=f"weight-only {impl}", ms=t * 1e3,
                       of_cublas=t_cublas / t,
                       weight_tbps=0.5625 * n * k / t / 1e12,
                       rel_err=_rel_err(out, ref)))
  return rows


WEIGHT_ONLY_COLS = ("shape", "gemm", "ms", "of_cublas", "weight_tbps",
                    "rel_err", "note")


def sweep_weight_only(shapes=DECODE_SHAPES, top: int = 3) -> list[dict]:
  """Tile configurations of the weight-only kernel per decode shape: the
  default's row and the `top` fastest (for tuning `default_config`)."""
  import itertools  # pylint: disable=g-import-not-at-top
  from pallas_kernels import weight_only_matmul as wo  # pylint: disable=g-import-not-at-top
  rows = []
  for m, n, k in shapes:
    x, _, qw, t_cublas = _decode_case(m, n, k)
    default = wo.default_config(m, n, k)
    found = []
    for bn, split, bk, warps in itertools.product((32, 64, 128), (1, 4, 8, 16),
                                                  (256, 512), (4,)):
      cfg = wo.WeightOnlyConfig(block_m=default.block_m, block_n=bn,
                                block_k=bk, split_k=split, num_warps=warps)
      if k % (bk * split):
        continue
      f = jax.jit(functools.partial(wo.weight_only_matmul, config=cfg))
      found.append((timing.bench(f, [(x, qw)], calls=10, reps=3), cfg))
    f = jax.jit(functools.partial(wo.weight_only_matmul, config=default))
    t_default = timing.bench(f, [(x, qw)], calls=10, reps=3)
    found.sort(key=lambda r: r[0])
    for label, (t, cfg) in [("default", (t_default, default))] + [
        (f"#{i + 1}", r) for i, r in enumerate(found[:top])]:
      rows.append(dict(shape=f"{m}x{n}x{k}", rank=label, us=t * 1e6,
                       of_cublas=t_cublas / t,
                       weight_tbps=0.5625 * n * k / t / 1e12,
                       config=f"bn={cfg.block_n} bk={cfg.block_k} "
                       f"split={cfg.split_k} warps={cfg.num_warps}"))
  return rows

if __name__ == "__main__":
  p = argparse.ArgumentParser()
  p.add_argument("--size", type=int, default=0,
                 help="only one square size (e.g. 1024 for a smoke run)")
  p.add_argument("--weight-only-sweep", action="store_true",
                 help="tile sweep of the weight-only kernel at decode shapes")
  args = p.parse_args()
  if args.weight_only_sweep:
    print(timing.table(sweep_weight_only(), (
        "shape", "rank", "us", "of_cublas", "weight_tbps", "config")))
    raise SystemExit(0)
  shapes = [(args.size,) * 3 + (True,)] if args.size else None
  print(timing.table(run(shapes), COLS))
