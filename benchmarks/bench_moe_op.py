"""`nvfp4_jax.ragged_dot` forward + backward against a dense bf16 GEMM.

    python -m benchmarks.bench_moe_op            # the MoE shapes, GPU
    python -m benchmarks.bench_moe_op --smoke    # tiny shapes, any device

For each shape (the grouped GEMMs of `bench_moe`: Mixtral-, DeepSeek- and
Qwen-like experts, balanced and skewed routing) it times, in one process,
the forward and backward pass (`jax.vjp` and its pullback, one jit) of:

- `dense`: a bf16 `x @ w` of the same FLOPs (`[T * k, K] @ [K, N]`), XLA's
  GEMM: the ceiling;
- `bf16`: `nv.ragged_dot(..., recipe="bf16")`, the library's bf16 grouped
  GEMM (three Mosaic GPU kernels on Hopper);
- `nvfp4`: `nv.ragged_dot(..., recipe="nvfp4")`, the paper's recipe with
  every quantization pass included (per-expert amax, RHT, SR, 16x16 expert
  weights, the Wgrad token layout);

and prints TFLOP/s (6 M K N per forward + backward) and the ratio to dense.
`--aligned` pads each expert's rows to 16 with zero rows, as the MoE layer's
dispatch does, and calls the op with `align="assume"` (no copy inside it);
M then counts the padding rows, for every row of the table.
Also the bytes the forward pass saves for the backward pass (the expert
residuals) for both recipes.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4_jax as nv
from benchmarks.bench_moe import MODELS
from benchmarks.bench_moe import group_sizes
from nvfp4_jax.tools import timing

BF16 = jnp.bfloat16
ALIGNED = 16  # `nvfp4_jax.training.moe_routing.GROUP_ALIGN`.


def _fwd_bwd(f):
  def run(x, w, dy):
    y, vjp = jax.vjp(f, x, w)
    return y, *vjp(dy)
  return jax.jit(run)


def compiled(f, *args):
  """`f` compiled for `args`, and the seconds the compile took (kernels
  are compiled by XLA's compile of the program that calls them)."""
  t0 = time.perf_counter()
  c = f.lower(*args).compile()
  return c, time.perf_counter() - t0


def residual_bytes(f, x, w) -> int:
  """Bytes of what `jax.vjp(f, x, w)` keeps for the backward pass beyond the
  FP32 master weight `w` (alive anyway): the activation `x` or its codes,
  the weight's bf16 copy or its codes. From shapes alone (`eval_shape`):
  nothing is computed."""
  leaves = jax.tree.leaves(jax.eval_shape(lambda x, w: jax.vjp(f, x, w)[1],
                                          x, w))
  leaves = [l for l in leaves if hasattr(l, "dtype")
            and not jax.dtypes.issubdtype(l.dtype, jax.dtypes.prng_key)
            and not (l.shape == w.shape and l.dtype == w.dtype)]
  return int(sum(np.prod(l.shape) * jnp.dtype(l.dtype).itemsize
                 for l in leaves))


def residuals(model, tokens: int, routing: str) -> dict:
  """The residual bytes of both recipes at a shape (`--residuals-only`)."""
  name, e, k, n, topk = model
  m = tokens * topk
  gs = jnp.asarray(group_sizes(m, e, routing))
  x = jax.ShapeDtypeStruct((m, k), BF16)
  w = jax.ShapeDtypeStruct((e, k, n), jnp.float32)
  key = jax.random.key(0)
  rb = residual_bytes(lambda x, w: nv.ragged_dot(
      x, w.astype(BF16), gs, recipe="bf16"), x, w)
  rq = residual_bytes(lambda x, w: nv.ragged_dot(
      x, w, gs, preferred_element_type=BF16, recipe="nvfp4", key=key), x, w)
  return dict(model=name, E=e, K=k, N=n, tokens=tokens, routing=routing,
              bf16_residual_mib=rb / 2**20, nvfp4_residual_mib=rq / 2**20,
              residual_ratio=rq / rb)


def measure(model, tokens: int, routing: str, *, calls: int, reps: int,
            aligned: bool = False) -> dict:
  name, e, k, n, topk = model
  m = tokens * topk
  sizes = group_sizes(m, e, routing)
  align = "pad"
  if aligned:  # As the MoE layer's dispatch writes them (zero rows).
    sizes = -(-sizes // ALIGNED) * ALIGNED
    m, align = int(sizes.sum()), "assume"
  gs = jnp.asarray(sizes)
  keys = jax.random.split(jax.random.key(tokens + e), 4)
  x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(BF16)
  w = (jax.random.normal(keys[1], (e, k, n), jnp.float32) / np.sqrt(k))
  dy = jax.random.normal(keys[2], (m, n), jnp.float32).astype(BF16)
  wd = w[0].astype(BF16)
  sr = keys[3]
  flop = 6.0 * m * k * n
  t = functools.partial(timing.bench, calls=calls, reps=reps)
  dense = _fwd_bwd(lambda x, w: x @ w)
  bf16 = _fwd_bwd(lambda x, w: nv.ragged_dot(x, w, gs, recipe="bf16"))
  # NVFP4 reads the FP32 master weight and writes bf16, as the layer does.
  nvfp4 = _fwd_bwd(lambda x, w: nv.ragged_dot(
      x, w, gs, preferred_element_type=BF16, recipe="nvfp4", key=sr,
      align=align))
  row = dict(model=name, E=e, K=k, N=n, tokens=tokens,
             routing=routing + (" aligned" if aligned else ""))
  wb = w.astype(BF16)
  bf16, row["bf16_compile_s"] = compiled(bf16, x, wb, dy)
  print(f"{name} {routing}: bf16 compiled in {row['bf16_compile_s']:.1f} s",
        flush=True)
  nvfp4, row["nvfp4_compile_s"] = compiled(nvfp4, x, w, dy)
  print(f"{name} {routing}: nvfp4 compiled in {row['nvfp4_compile_s']:.1f} s",
        flush=True)
  td = t(dense, [(x, wd, dy)])
  tb = t(bf16, [(x, wb, dy)])
  tq = t(nvfp4, [(x, w, dy)])
  row.update(
      dense_tflops=flop / td / 1e12, bf16_tflops=flop / tb / 1e12,
      nvfp4_tflops=flop / tq / 1e12, bf16_ratio=td / tb, nvfp4_ratio=td / tq,
      nvfp4_over_bf16=tq / tb)
  # As the MoE layer runs them: bf16 casts the FP32 master weight to the
  # activations' dtype, NVFP4 quantizes it directly.
  rb = residual_bytes(lambda x, w: nv.ragged_dot(
      x, w.astype(BF16), gs, recipe="bf16"), x, w)
  rq = residual_bytes(lambda x, w: nv.ragged_dot(
      x, w, gs, preferred_element_type=BF16, recipe="nvfp4", key=sr), x, w)
  row.update(residual_ratio=rq / rb)
  return row


COLS = ("model", "E", "tokens", "routing", "dense_tflops", "bf16_tflops",
        "nvfp4_tflops", "bf16_ratio", "nvfp4_ratio", "nvfp4_over_bf16",
        "residual_ratio", "bf16_compile_s", "nvfp4_compile_s")


RESIDUAL_COLS = ("model", "E", "K", "N", "tokens", "routing",
                 "bf16_residual_mib", "nvfp4_residual_mib", "residual_ratio")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes (any device, the reference path)")
  p.add_argument("--tokens", default="16384")
  p.add_argument("--models", default="")
  p.add_argument("--routings", default="balanced,skewed")
  p.add_argument("--aligned", action="store_true",
                 help="each expert's rows padded to 16 (the MoE layer's "
                      "dispatch) and the op told so (align='assume')")
  p.add_argument("--residuals-only", action="store_true",
                 help="only the residual bytes (from shapes; any device)")
  a = p.parse_args(argv)
  wanted = [w for w in a.models.split(",") if w]
  models = [mm for mm in MODELS
            if not wanted or any(mm[0].startswith(w) for w in wanted)]
  if not models:
    p.error(f"--models {a.models!r} names none of "
            f"{[mm[0] for mm in MODELS]} (prefixes, comma-separated).")
  tokens = [int(v) for v in a.tokens.split(",")]
  calls, reps = (1, 1) if a.smoke else (5, 5)
  if a.smoke:
    models, tokens = [("smoke", 4, 64, 64, 2)], [64]
  if a.residuals_only:
    rows = [residuals(mm, tk, r) for mm in models for tk in tokens
            for r in a.routings.split(",")]
    print(timing.table(rows, RESIDUAL_COLS))
    return rows
  rows = []
  for mm in models:
    for tk in tokens:
      for r in a.routings.split(","):
        rows.append(measure(mm, tk, r, calls=calls, reps=reps,
                            aligned=a.aligned))
        print(timing.table(rows[-1:], COLS), flush=True)
  print(timing.table(rows, COLS))
  return rows


if __name__ == "__main__":
  main()
