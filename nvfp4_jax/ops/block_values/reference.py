"""Block dequantization, the reference: exact bf16 block values and the FP32 tensor factor.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import tile
from nvfp4_jax.core.arrays import MXArray
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.arrays import NVFP4Values


B = nm.NVFP4_BLOCK


def _blocks(q: NVFP4Array, dtype) -> jax.Array:
  k = q.shape[-1]
  vals = tile.block_values(q.codes.reshape(-1, k // B, B // 2),
                           q.scales.reshape(-1, k // B), dtype)
  return vals.reshape(q.shape)


def block_dequantize_nvfp4(q: NVFP4Array) -> tuple[jax.Array, jax.Array]:
  """The exact bf16 block-dequantized values and the FP32 tensor factor.

  `fp4 * f32(block_scale)` needs at most 6 significant bits and lies in
  [2^-10, 2688], so it is exact in bfloat16: this is what a Hopper GEMM
  consumes, with the tensor factors applied to its FP32 output.

  Returns:
    `(values, tensor_scale)`: bfloat16 `[..., K]` and a float32 scalar
    (`amax / 2688`), with `dequantize_nvfp4(q) == values * tensor_scale`.
  """
  return _blocks(q, jnp.bfloat16), q.tensor_scale


def dequantize_nvfp4(q: NVFP4Array | NVFP4Values, dtype=jnp.float32
                     ) -> jax.Array:
  """`fp4 * f32(d) * (amax / 2688)` in FP32 (TE's form), cast to `dtype`
  (`amax / 1536` for Four-over-Six); of `NVFP4Values`, from the block values
  it holds (the same numbers)."""
  values = (q.values.astype(jnp.float32) if isinstance(q, NVFP4Values)
            else _blocks(q, jnp.float32))
  return nm.ftz(values * q.tensor_scale).astype(dtype)


def block_dequantize_mx(q: MXArray) -> tuple[jax.Array, jax.Array]:
  """Elements times their power-of-two block scale (exact in bfloat16), and a
  tensor factor of 1 (MX formats have no tensor scale)."""
  return dequantize_mx(q, jnp.bfloat16), jnp.float32(1.0)


def dequantize_mx(q: MXArray, dtype=jnp.float32) -> jax.Array:
  """`element * 2^(scale exponent)` in FP32, cast to `dtype`."""
  if q.fmt == "mxfp4":
    vals = nm.e2m1_decode(nm.unpack_e2m1(q.data))
  else:
    vals = q.data.astype(jnp.float32)
  shape = vals.shape
  biased = jax.lax.bitcast_convert_type(q.scales, jnp.uint8)
  vals = vals.reshape(*shape[:-1], -1, nm.MX_BLOCK)
  # 2^-127 (biased 0) is an FP32 subnormal that would flush to 0; apply it as
  # 0.5 * 2^-126 so that its block's normal results survive.
  half = jnp.where(biased == 0, jnp.float32(0.5), jnp.float32(1.0))
  scale = nm.e8m0_to_f32(jnp.maximum(biased, 1))
  out = nm.ftz((vals * half[..., None]) * scale[..., None])
  return out.reshape(shape).astype(dtype)
