"""`dequantize`, `block_dequantize` and the `block_values` op (the emulated GEMM's operand).

`block_dequantize(q)` is `(bf16 block values, FP32 tensor factor)`: exact, since
`fp4 * f32(block scale)` needs at most 6 significant bits; a GEMM on the values
with the factor applied to its FP32 output is the exact emulation of a
block-scaled GEMM. `BLOCK_VALUES` dispatches the values of an NVFP4Array to the
reference or the Pallas kernel (`pallas_triton.py`).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from nvfp4_jax.core import dispatch
from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import spmd
from nvfp4_jax.core.arrays import MXArray
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.arrays import NVFP4Values
from nvfp4_jax.core.arrays import QArray
from nvfp4_jax.core.arrays import check_nvfp4_array

from nvfp4_jax.ops.block_values.reference import block_dequantize_mx
from nvfp4_jax.ops.block_values.reference import block_dequantize_nvfp4
from nvfp4_jax.ops.block_values.reference import dequantize_mx
from nvfp4_jax.ops.block_values.reference import dequantize_nvfp4


def dequantize(q: QArray, dtype=jnp.float32) -> jax.Array:
  """Dequantizes an `NVFP4Array` or `MXArray` (FP32 arithmetic) to `dtype`.

  NVFP4: `e2m1 * f32(E4M3 block scale) * amax / 2688` (1536 for a
  Four-over-Six operand); MX: `e2m1 or e4m3 * 2^(E8M0 scale - 127)`.

  Args:
    q: an `NVFP4Array`, `NVFP4Values` or `MXArray`.
    dtype: the result's dtype; the arithmetic is FP32, then cast.

  Returns:
    The dequantized array, shaped as the tensor `q` quantized.

  Raises:
    ValueError: `q` is an `NVFP4Array` whose codes, scales or amax do not
      describe one tensor (built by hand).
    TypeError: `q` is not a quantized array.
  """
  check_nvfp4_array(q, "dequantize")
  if isinstance(q, (NVFP4Array, NVFP4Values)):
    return dequantize_nvfp4(q, dtype)
  if isinstance(q, MXArray):
    return dequantize_mx(q, dtype)
  raise TypeError(f"dequantize needs an NVFP4Array, NVFP4Values or MXArray, "
                  f"got {type(q)}.")


def block_dequantize(q: QArray) -> tuple[jax.Array, jax.Array]:
  """`(bf16 block-scaled values, FP32 tensor factor)`, exact (see NVFP4 docs).

  The product of the two is `dequantize(q)`; a GEMM on the bf16 values with the
  factors applied to its FP32 output is the exact emulation of a block-scaled
  GEMM on hardware without FP4 tensor cores.

  Args:
    q: an `NVFP4Array`, `MXArray` or `NVFP4Values`.

  Returns:
    `(values, tensor_factor)`: the bf16 block values (codes times block
    scales) of `q`'s shape and the FP32 scalar tensor factor (1 for MX).

  Raises:
    TypeError: `q` is not one of the quantized arrays.
  """
  check_nvfp4_array(q, "block_dequantize")
  if isinstance(q, NVFP4Array):
    return block_dequantize_nvfp4(q)
  if isinstance(q, MXArray):
    return block_dequantize_mx(q)
  if isinstance(q, NVFP4Values):
    return q.values, q.tensor_scale
  raise TypeError(
      f"block_dequantize needs an NVFP4Array, NVFP4Values or MXArray, got "
      f"{type(q)}.")


# The bf16 block values of an NVFP4Array: the emulated GEMM's operand.
def _per_shard(kernel, q):
  """The kernel on each shard of a 2-D `NVFP4Array` split under `jax.jit`
  shardings (`spmd.blockwise`): values are per block, so a shard's are the
  whole array's. A split of K that would cut a 16-element block leaves K
  gathered."""
  if not isinstance(q, NVFP4Array) or q.ndim != 2:
    return kernel(q)
  return spmd.blockwise(kernel, q, grid=(q.shape[0], q.shape[1] // nm.NVFP4_BLOCK))


BLOCK_VALUES = dispatch.Op("block_values", {
    "xla": lambda q: block_dequantize(q)[0],
    "pallas": "nvfp4_jax.ops.block_values.pallas_triton:block_values",
}, per_shard=_per_shard)
