"""The speed tables `check_device` prints, and the benchmarks extend.

`gemm_speed`: the NVFP4 GEMM's implementations against cuBLAS bf16 at one
shape (`benchmarks.bench_gemm` runs it over the transformer shapes).
`layer_speed`: `NVFP4Dense` forward+backward against `nn.Dense` bf16, time
and XLA's peak memory (`benchmarks.bench_dense` also times it over many
shapes, each in a fresh process).
"""

from __future__ import annotations

import contextlib
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from nvfp4_jax.core.dispatch import default_implementation
from nvfp4_jax.flax.linen import NVFP4Dense
from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
from nvfp4_jax.ops.block_scaled_matmul import reference as gemm_ref
from nvfp4_jax.ops.quantize import api as quantize_api
from nvfp4_jax.tools import timing


def gemm_speed(m: int, n: int, k: int, *, full: bool) -> list[dict]:
  """`GEMM_COLS` rows of the NVFP4 GEMMs at M x N x K against cuBLAS bf16.

  Rows (M tokens, N out, K in; bf16 output): "cuBLAS bf16", the ceiling
  (`a @ b.T` on random bf16 operands); "pallas excl. prep", the GEMM on
  already block-dequantized bf16 operands (`block_values_matmul`; the values
  come fused out of the quantize kernel); "pallas incl. prep", from
  `NVFP4Array`s (Pallas dequantize kernel on both operands, then the bf16
  GEMM); "xla", the reference from `NVFP4Array`s. With `full` also "triton"
  (`tl.dot_scaled` via jax-triton), "scaled_matmul" (`jax.nn.scaled_matmul`)
  and "quantize+GEMM" from bf16 inputs (both operands quantized with values
  by the Pallas kernel, amax included). A GEMM that fails is a row with its
  error in `note`.
  """
  flops = 2.0 * m * n * k
  ka, kb = jax.random.split(jax.random.key(m + n + k))
  a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(kb, (n, k), jnp.float32).astype(jnp.bfloat16)
  qa, va = quantize_api.quantize_with_values(a)
  qb, vb = quantize_api.quantize_with_values(b, block_2d=True)
  alpha = gemm_ref.gemm_alpha(qa, qb)
  bf16 = jnp.bfloat16
  shape = f"{m}x{n}x{k}"
  rows = []
  t_cublas = timing.bench(timing.bf16_matmul(m, n, k), [(a, b)], calls=5,
                          reps=5)

  def add(name, fn, args, check=True):
    try:
      f = jax.jit(fn)
      out = f(*args)
      err = timing.max_rel_diff(out, ref) if check else float("nan")
      t = timing.bench(f, [args], calls=5, reps=5)
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(shape=shape, gemm=name,
                       note=f"failed: {type(e).__name__}: {str(e)[:120]}"))
      return
    rows.append(dict(shape=shape, gemm=name, ms=t * 1e3,
                     tflops=flops / t / 1e12, of_cublas=t_cublas / t,
                     rel_err=err))

  ref = jax.jit(functools.partial(gemm_api.block_scaled_matmul, out_dtype=bf16,
                                  implementation="xla"))(qa, qb)
  rows.append(dict(shape=shape, gemm="cuBLAS bf16", ms=t_cublas * 1e3,
                   tflops=flops / t_cublas / 1e12, of_cublas=1.0))
  add("pallas excl. prep", functools.partial(gemm_api.block_values_matmul,
                                             out_dtype=bf16), (va, vb, alpha))
  add("pallas incl. prep", functools.partial(
      gemm_api.block_scaled_matmul, out_dtype=bf16, implementation="pallas"),
      (qa, qb))
  add("xla", functools.partial(gemm_api.block_scaled_matmul, out_dtype=bf16,
                               implementation="xla"), (qa, qb))
  if full:
    add("triton", functools.partial(
        gemm_api.block_scaled_matmul, out_dtype=bf16, implementation="triton"),
        (qa, qb))
    add("scaled_matmul", functools.partial(
        gemm_api.block_scaled_matmul, out_dtype=bf16,
        implementation="scaled_matmul"), (qa, qb))

    def e2e(x, w):
      qx, vx = quantize_api.quantize_with_values(x)
      qw, vw = quantize_api.quantize_with_values(w, block_2d=True)
      return gemm_api.block_values_matmul(vx, vw, gemm_ref.gemm_alpha(qx, qw),
                                      out_dtype=bf16)
    add("quantize+GEMM (from bf16)", e2e, (a, b))
  return rows


GEMM_COLS = ("shape", "gemm", "ms", "tflops", "of_cublas", "rel_err",
             "note")


def layer_step(module):
  """`module`'s forward and backward (`jax.vjp` in params and x): the
  Fprop, Dgrad and Wgrad GEMMs of one training step."""
  def f(params, x, dy, key):
    def apply(p, x):
      return module.apply(p, x, rngs={"nvfp4": key})
    y, vjp = jax.vjp(apply, params, x)
    return y, vjp(dy)
  return f


def layer_inputs(tokens: int, d_in: int, d_out: int):
  """The step's bf16 `x`, its bf16 cotangent `dy` and the NVFP4 key."""
  x = jax.random.normal(jax.random.key(0), (tokens, d_in),
                        jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(1), (tokens, d_out),
                         jnp.float32).astype(jnp.bfloat16)
  return x, dy, jax.random.key(2)


def peak_bytes(compiled) -> float:
  """XLA's buffer assignment of `compiled`: arguments + outputs +
  temporaries, less aliased bytes (NaN where it reports none)."""
  m = compiled.memory_analysis()
  if m is None:
    return float("nan")
  return float(m.argument_size_in_bytes + m.output_size_in_bytes
               + m.temp_size_in_bytes - m.alias_size_in_bytes)


def layer_speed(tokens: int = 8192, d_in: int = 4096, d_out: int = 4096,
                kernels: list | None = None) -> list[dict]:
  """`LAYER_COLS` rows: `NVFP4Dense` fwd+bwd against `nn.Dense` bf16 on
  `tokens` x `d_in` -> `d_out`, time and peak memory.

  x is bf16, the params FP32 (mixed precision, as the recipe trains). Rows:
  nn.Dense bf16; NVFP4Dense with the default dispatch (Pallas kernels on
  GPU); NVFP4Dense with every op forced to the pure-XLA reference. With a
  `kernels` list, also appends the per-kernel GPU time of each case
  (`timing.gpu_kernels`) to it.
  """
  x, dy, key = layer_inputs(tokens, d_in, d_out)
  flops = 3 * 2.0 * tokens * d_in * d_out
  rows = []
  cases = [
      ("nn.Dense bf16", nn.Dense(d_out, dtype=jnp.bfloat16),
       contextlib.nullcontext()),
      ("NVFP4Dense (default: kernels)",
       NVFP4Dense(d_out, dtype=jnp.bfloat16), contextlib.nullcontext()),
      ("NVFP4Dense (pure XLA reference)",
       NVFP4Dense(d_out, dtype=jnp.bfloat16), default_implementation("xla")),
  ]
  base = None
  for name, module, ctx in cases:
    params = module.init(jax.random.key(3), x)
    with ctx:
      f = jax.jit(layer_step(module))
      compiled = f.lower(params, x, dy, key).compile()
      peak = peak_bytes(compiled)
      t = timing.bench(compiled, [(params, x, dy, key)], calls=5, reps=7)
      if kernels is not None:
        for kname, (n, g) in sorted(
            timing.gpu_kernels(compiled, [(params, x, dy, key)]).items(),
            key=lambda kv: -kv[1][1]):
          kernels.append(dict(layer=name, kernel=kname[:70], calls=n,
                              us=g * 1e6))
    base = base or (t, peak)
    rows.append(dict(layer=name, ms=t * 1e3, tflops=flops / t / 1e12,
                     vs_bf16=t / base[0], peak_mib=peak / 2**20,
                     peak_vs_bf16=peak / base[1]))
  return rows


LAYER_COLS = ("layer", "ms", "tflops", "vs_bf16", "peak_mib",
              "peak_vs_bf16", "note")
