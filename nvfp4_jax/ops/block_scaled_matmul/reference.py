"""The block-scaled GEMM's reference: block-dequantize, `lax.dot_general`, alpha.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.arrays import NVFP4Values
from nvfp4_jax.core.arrays import QArray

from nvfp4_jax.ops.block_values.api import block_dequantize


def gemm_alpha(a: QArray, b: QArray) -> jax.Array:
  """The FP32 output factor of `a @ b.T`.

  NVFP4 x NVFP4: `amax_a * amax_b / 2688^2` (1536 for a Four-over-Six
  operand), computed as TE's
  `compute_nvfp4_per_tensor_scale_kernel` does: `(amax_a * amax_b) *
  f32(1 / 2688^2)`. (Written as a division, XLA would silently make the same
  rewrite; writing it out keeps it when that rewrite changes.) MX operands have
  no tensor scale (factor 1).

  Args:
    a: the left operand, an `NVFP4Array`, `NVFP4Values` or `MXArray`.
    b: the right operand, likewise (`[N, K]`: the GEMM is `a @ b.T`).

  Returns:
    A float32 scalar: the factor that turns the GEMM of the block values
    (`block_dequantize`'s first output) into the dequantized product.
    Subnormal results are flushed to zero, as on every backend.
  """
  def amax_over(q):
    if isinstance(q, (NVFP4Array, NVFP4Values)):
      return q.amax, q.tensor_denominator
    return jnp.float32(1.0), 1.0
  amax_a, den_a = amax_over(a)
  amax_b, den_b = amax_over(b)
  return nm.ftz((amax_a * amax_b) * jnp.float32(1.0 / (den_a * den_b)))


def _values_matmul_xla(va, vb, alpha, *, out_dtype, vb_kn):
  acc = jax.lax.dot_general(
      va, vb, (((1,), (0 if vb_kn else 1,)), ((), ())),
      preferred_element_type=jnp.float32)
  return (acc * alpha).astype(out_dtype)


def _matmul_xla(a, b, *, out_dtype):
  va, _ = block_dequantize(a)
  vb, _ = block_dequantize(b)
  return _values_matmul_xla(va, vb, gemm_alpha(a, b), out_dtype=out_dtype,
                            vb_kn=False)
