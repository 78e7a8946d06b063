"""Pallas-Triton kernel of the grouped row quantizer (`api.quantize_rows`).

The rows of `x [M, C]` are split into groups (experts); each row is quantized
along `C` (1x16 blocks) as a row of its group's own tensor: the block math of
`nvfp4_jax.ops.quantize.pallas_triton`'s kernel (`quantize_kernel` with
`grouped=True`), with the per-tensor constants computed per row from its
group's amax, and the stochastic-rounding stream of its group's key at the
row's index within the group. The group amaxes are one XLA reduction before
the kernel (a segment max: every block needs its group's complete amax).
One pass reads each element once and writes the codes and scales and/or the
exact bf16 block values the grouped GEMM consumes. Interpreted on CPU (the
tests check it against `api`'s pure-jnp path bit for bit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import tile
from nvfp4_jax.ops.quantize.config import default_config
from nvfp4_jax.ops.quantize.pallas_triton import quantize_kernel
from pallas_kernels import common

B = nm.NVFP4_BLOCK


def quantize_rows(x: jax.Array, row_amax: jax.Array, *,
                  row_seeds: tuple[jax.Array, jax.Array] | None = None,
                  row_index: jax.Array | None = None,
                  four_over_six: bool = False, with_codes: bool = True,
                  with_values: bool = True, config=None):
  """NVFP4 1x16 codes/scales/values of `x [M, C]`, row `r` with the tensor
  amax `row_amax[r]` (its group's).

  Args:
    x: `[M, C]` float, `C` a multiple of 16.
    row_amax: FP32 `[M]`, each row's tensor amax.
    row_seeds: stochastic rounding: `(seed0, seed1)`, uint32 `[M]` each, the
      stream seeds of each row's tensor; None rounds to nearest even.
    row_index: with `row_seeds`, each row's index within its tensor, `[M]`.
    four_over_six: Four-over-Six (the amaxes' constants use 1536).
    with_codes, with_values: which outputs to write.
    config: tiles (`nvfp4_jax.ops.quantize.config.QuantizeConfig`).

  Returns:
    `(packed uint8 [M, C // 2] or None, scales e4m3 [M, C // 16] or None,
    bf16 values [M, C] or None)`.

  Raises:
    NotImplementedError: on a backend the kernels do not support.
  """
  interpret = common.check_backend("quantize_rows")
  m, c = x.shape
  nb_total = c // B
  stochastic = row_seeds is not None
  cfg = config or default_config(m, c)
  br, bnb = cfg.block_rows, max(1, cfg.block_cols // B)
  grid = (common.cdiv(m, br), common.cdiv(nb_total, bnb))
  rows_padded = grid[0] * br

  def per_row(v, dtype):
    # Whole row tiles (no masked 1-D loads); the padding rows are not stored.
    v = v.astype(dtype)
    return jnp.pad(v, (0, rows_padded - m))

  row_spec = pl.BlockSpec((br,), lambda i, j: (i,))
  in_specs = [row_spec]
  args = [per_row(row_amax, jnp.float32)]
  if stochastic:
    in_specs += [row_spec] * 3
    args += [per_row(row_seeds[0], jnp.uint32),
             per_row(row_seeds[1], jnp.uint32),
             per_row(row_index, jnp.uint32)]
  in_specs.append(pl.BlockSpec((br, bnb, B), lambda i, j: (i, j, 0)))
  args.append(x.reshape(m, nb_total, B))
  out_shape, out_specs = [], []
  if with_codes:
    out_shape += [jax.ShapeDtypeStruct((m, nb_total, B // 2), jnp.uint8),
                  jax.ShapeDtypeStruct((m, nb_total), jnp.float8_e4m3fn)]
    out_specs += [pl.BlockSpec((br, bnb, B // 2), lambda i, j: (i, j, 0)),
                  pl.BlockSpec((br, bnb), lambda i, j: (i, j))]
  if with_values:
    out_shape.append(jax.ShapeDtypeStruct((m, nb_total, B // 2), jnp.uint32))
    out_specs.append(pl.BlockSpec((br, bnb, B // 2), lambda i, j: (i, j, 0)))
  kernel = functools.partial(
      quantize_kernel, block_2d=False, stochastic=stochastic,
      with_codes=with_codes, with_values=with_values, interpret=interpret,
      m=m, nb_total=nb_total, four_over_six=four_over_six,
      words_per_row=c // 4, grouped=True)
  outs = list(common.pallas_call(
      kernel, interpret=interpret, num_warps=cfg.num_warps, num_stages=1,
      name="nvfp4_quantize_rows", grid=grid, in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape)(*args))
  packed = scales = values = None
  if with_codes:
    packed = outs.pop(0).reshape(m, c // 2)
    scales = outs.pop(0)
  if with_values:
    values = tile.values_from_pairs(outs.pop(0)).reshape(m, c)
  return packed, scales, values
