"""Format-generic entry points over NVFP4 and MX quantized arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax.mx import MXArray, block_dequantize_mx, dequantize_mx
from nvfp4_jax.nvfp4 import NVFP4Array, block_dequantize_nvfp4, dequantize_nvfp4
from nvfp4_jax.qarray import NVFP4Values

QArray = NVFP4Array | MXArray


def dequantize(q: QArray, dtype=jnp.float32) -> jax.Array:
  """Dequantizes an `NVFP4Array` or `MXArray` (FP32 arithmetic) to `dtype`."""
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
  """
  if isinstance(q, NVFP4Array):
    return block_dequantize_nvfp4(q)
  if isinstance(q, MXArray):
    return block_dequantize_mx(q)
  if isinstance(q, NVFP4Values):
    return q.values, q.tensor_scale
  raise TypeError(
      f"block_dequantize needs an NVFP4Array, NVFP4Values or MXArray, got "
      f"{type(q)}.")
