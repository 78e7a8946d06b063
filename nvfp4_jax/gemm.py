"""Block-scaled GEMM on quantized operands: the exact emulation.

`block_scaled_matmul(a, b)` computes `a @ b.T` for two arrays quantized along
their shared last axis K (the TN layout of Blackwell's block-scaled GEMM). On
hardware without FP4 tensor cores the exact emulation is: block-dequantize each
operand to bf16 (exact: see `block_dequantize`), a bf16 GEMM with FP32
accumulation, then the tensor scales as one FP32 factor
`alpha = amax_a * amax_b / 2688^2`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax import numerics as nm
from nvfp4_jax.mx import MXArray
from nvfp4_jax.nvfp4 import NVFP4Array
from nvfp4_jax.quant import QArray, block_dequantize


def gemm_alpha(a: QArray, b: QArray) -> jax.Array:
  """The FP32 output factor of `a @ b.T`.

  NVFP4 x NVFP4: `amax_a * amax_b / 2688^2`, as TE's GEMM applies it. MX
  operands have no tensor scale (factor 1).
  """
  def amax_over(q):
    if isinstance(q, NVFP4Array):
      return q.amax, nm.E4M3_MAX_X_E2M1_MAX
    return jnp.float32(1.0), 1.0
  amax_a, den_a = amax_over(a)
  amax_b, den_b = amax_over(b)
  return nm.ftz((amax_a * amax_b) / jnp.float32(den_a * den_b))


def block_scaled_matmul(a: QArray, b: QArray, *,
                        out_dtype=jnp.float32) -> jax.Array:
  """`a @ b.T` over the quantized last axis, FP32 accumulation.

  Args:
    a: quantized `[M, K]` (an `NVFP4Array` or `MXArray`).
    b: quantized `[N, K]`.
    out_dtype: dtype of the result; the FP32 product is scaled by `alpha` in
      FP32 and then cast.

  Returns:
    `[M, N]` in `out_dtype`.
  """
  for name, q in (("a", a), ("b", b)):
    if not isinstance(q, (NVFP4Array, MXArray)):
      raise TypeError(
          f"block_scaled_matmul: {name} must be an NVFP4Array or MXArray, got "
          f"{type(q).__name__}.")
    if q.ndim != 2:
      raise ValueError(
          f"block_scaled_matmul: {name} must be 2-D [rows, K], got shape "
          f"{q.shape}.")
  if a.shape[1] != b.shape[1]:
    raise ValueError(
        f"block_scaled_matmul: contraction sizes differ, a {a.shape} vs b "
        f"{b.shape} (both are quantized along their last axis: a @ b.T).")
  va, _ = block_dequantize(a)
  vb, _ = block_dequantize(b)
  acc = jax.lax.dot_general(
      va, vb, (((1,), (1,)), ((), ())),
      preferred_element_type=jnp.float32)
  return (acc * gemm_alpha(a, b)).astype(out_dtype)
