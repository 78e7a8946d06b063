"""Tile-level compositions of the reference numerics, used by every kernel.

Each function applies the functions of `nvfp4_jax.numerics`, `nvfp4_jax.prng`
and the RHT definition of `nvfp4_jax.hadamard` to one tile, in the order of
`nvfp4_jax.nvfp4.quantize`; nothing here defines a numeric step of its own.
Tiles are `[rows, blocks, 16]`: 16-element quantization blocks on the last axis.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from nvfp4_jax import numerics as nm
from nvfp4_jax import prng
from pallas_kernels.common import abs_max

B = nm.NVFP4_BLOCK


def block_amax_2d(block_amax: jax.Array) -> jax.Array:
  """Per-16x16-tile amax from per-row block amax `[rows, nb]` (rows % 16 == 0),
  replicated over each tile's 16 rows, as the reference reports it."""
  rows, nb = block_amax.shape
  t = abs_max(block_amax.reshape(rows // B, B, nb), axis=1)
  return jnp.broadcast_to(t[:, None, :], (rows // B, B, nb)).reshape(rows, nb)


def sr_bytes(row0: jax.Array, rows: int, blk0: jax.Array, nb: int,
             words_per_row: int, seed0: jax.Array, seed1: jax.Array
             ) -> jax.Array:
  """The SR stream's bytes for a `[rows, nb, 16]` tile of the quantized tensor.

  The tile starts at global row `row0` and block `blk0`; the tensor has
  `4 * words_per_row` elements per row. Element `(r, c)` has row-major index
  `n = r * 4 * words_per_row + c` and byte `n % 4` of hash word `n // 4`
  (see `nvfp4_jax.prng`): one hash per 4 elements.
  """
  shape = (rows, nb, B // 4)
  r = (row0 + jax.lax.broadcasted_iota(jnp.int32, shape, 0)).astype(jnp.uint32)
  blk = (blk0 + jax.lax.broadcasted_iota(jnp.int32, shape, 1)).astype(
      jnp.uint32)
  lane = jax.lax.broadcasted_iota(jnp.uint32, shape, 2)
  words = r * jnp.uint32(words_per_row) + blk * jnp.uint32(B // 4) + lane
  return prng.word_bytes(prng.sr_hash(words, seed0, seed1))


def encode_blocks(xf: jax.Array, block_amax: jax.Array,
                  s_enc_over_6: jax.Array, inv_s_enc: jax.Array, *,
                  divide: Callable = jnp.divide,
                  rbits: jax.Array | None = None,
                  with_values: bool = False):
  """NVFP4_SPEC section 2 steps 2-4 on a tile.

  Args:
    xf: flushed FP32 values `[rows, nb, 16]`.
    block_amax: `[rows, nb]` (per 16x16 tile for 2D scaling).
    s_enc_over_6, inv_s_enc: the per-tensor constants (FP32 scalars).
    divide: correctly rounded FP32 division (see `common.exact_divide`).
    rbits: uint8 `[rows, nb, 16]` for stochastic rounding, None for RTNE.
    with_values: also return the exact bf16 block-dequantized tile.

  Returns:
    `(packed uint8 [rows, nb, 8], scales e4m3 [rows, nb], values or None)`.
  """
  scales = nm.nvfp4_block_decode_scale(block_amax, s_enc_over_6)
  d = scales.astype(jnp.float32)
  enc = nm.nvfp4_block_encode_scale(d, inv_s_enc, divide=divide)
  y = xf * enc[..., None]
  if rbits is None:
    codes = nm.e2m1_encode_nearest(y)
  else:
    codes = nm.e2m1_encode_stochastic(y, rbits)
  values = None
  if with_values:
    values = (nm.e2m1_decode(codes) * d[..., None]).astype(jnp.bfloat16)
  return nm.pack_e2m1(codes, split=True), scales, values


def block_values(packed: jax.Array, scales: jax.Array) -> jax.Array:
  """Exact bf16 block values `[rows, nb, 16]` from packed codes and scales."""
  vals = nm.e2m1_decode(nm.unpack_e2m1(packed))
  return (vals * scales.astype(jnp.float32)[..., None]).astype(jnp.bfloat16)


def rht_transposed(x: jax.Array, h: jax.Array, size: int) -> jax.Array:
  """`rht(x.T)` of a `[tokens, features]` tile, as FP32 `[features, tokens]`.

  Follows `nvfp4_jax.hadamard.rht`: flush the input, multiply each run of
  `size` tokens by `H` with FP32 accumulation, flush, round to bf16. bf16
  inputs multiply on the tensor cores (the products by +-1/4 are exact); other
  dtypes use an FP32 (IEEE, not TF32) dot.
  """
  t, f = x.shape
  xt = nm.ftz(x.astype(jnp.float32)).T.reshape(f * t // size, size)
  if x.dtype == jnp.bfloat16:
    y = jnp.dot(xt.astype(jnp.bfloat16), h.astype(jnp.bfloat16),
                preferred_element_type=jnp.float32)
  else:
    y = jnp.dot(xt, h.astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32)
  y = nm.ftz(y).astype(jnp.bfloat16).astype(jnp.float32)
  return y.reshape(f, t)
