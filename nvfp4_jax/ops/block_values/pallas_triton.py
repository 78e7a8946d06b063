"""Pallas-Triton kernel of the block values of `nvfp4_jax.block_dequantize`.

One read of the packed codes and E4M3 scales, one write of the exact bf16
block values `fp4 * f32(scale)` that a Hopper GEMM consumes (the tensor factor
is applied to the GEMM's FP32 output). The tile math is
`nvfp4_jax.core.tile.block_values`, the reference's (on the GPU through
`e2m1_decode.block_values`, its byte-permutation lowering).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core.arrays import NVFP4Array
from pallas_kernels import e2m1_decode
from pallas_kernels import launch
from nvfp4_jax.ops.quantize.pallas_triton import QuantizeConfig
from nvfp4_jax.ops.quantize.pallas_triton import default_config
from nvfp4_jax.ops.quantize.pallas_triton import tile_masks

B = nm.NVFP4_BLOCK


def _kernel(codes_ref, scales_ref, values_ref, *, m: int, nb_total: int,
            interpret: bool):
  rows, nb, _ = codes_ref.shape
  mask = tile_masks(rows, nb, m, nb_total)
  values = e2m1_decode.block_values(launch.load(codes_ref, mask[B // 2]),
                                    launch.load(scales_ref, mask[0]), interpret)
  launch.store(values_ref, values, mask[B])


def block_values(q: NVFP4Array, *, config: QuantizeConfig | None = None
                 ) -> jax.Array:
  """The exact bf16 block-dequantized values of `q` (`fp4 * f32(scale)`).

  Equals `nvfp4_jax.block_dequantize(q)[0]`.

  Raises:
    NotImplementedError: `q` is not an NVFP4Array, or the backend has no
      Pallas-Triton.
  """
  if not isinstance(q, NVFP4Array):
    raise NotImplementedError(
        f"the Pallas dequantize kernel takes NVFP4Arrays, got {type(q)}.")
  interpret = launch.check_backend("block_values")
  shape = q.shape
  k = shape[-1]
  m = q.codes.size * 2 // k
  nb_total = k // B
  cfg = config or default_config(m, k)
  br, bnb = cfg.block_rows, max(1, cfg.block_cols // B)
  grid = (launch.cdiv(m, br), launch.cdiv(nb_total, bnb))
  out = launch.pallas_call(
      functools.partial(_kernel, m=m, nb_total=nb_total, interpret=interpret),
      interpret=interpret, num_warps=cfg.num_warps,
      num_stages=1, name="nvfp4_block_values", grid=grid,
      in_specs=[pl.BlockSpec((br, bnb, B // 2), lambda i, j: (i, j, 0)),
                pl.BlockSpec((br, bnb), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((br, bnb, B), lambda i, j: (i, j, 0)),
      out_shape=jax.ShapeDtypeStruct((m, nb_total, B), jnp.bfloat16),
  )(q.codes.reshape(m, nb_total, B // 2), q.scales.reshape(m, nb_total))
  return out.reshape(shape)
