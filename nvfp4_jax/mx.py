"""OCP microscaling formats for comparison: MXFP4 and MXFP8.

Both use blocks of 32 along the last axis with a power-of-two UE8M0 scale and no
tensor scale. The scale is `2^ceil(log2(block_amax / elem_max))` (rounded up,
as TE's MX casts do), so the block maximum never saturates.

- MXFP4: E2M1 elements (packed two per byte like NVFP4), RTNE or stochastic.
- MXFP8: E4M3 elements (`float8_e4m3fn`), RTNE.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from nvfp4_jax import numerics as nm
from nvfp4_jax import prng
from nvfp4_jax import tile
from nvfp4_jax.qarray import check_input
from nvfp4_jax.qarray import check_rounding

MX_FORMATS = ("mxfp4", "mxfp8")
_ELEM_MAX = {"mxfp4": nm.E2M1_MAX, "mxfp8": nm.E4M3_MAX}


@dataclasses.dataclass(frozen=True)
class MXArray:
  """An MX-quantized tensor of logical shape `[..., K]`.

  Attributes:
    data: MXFP4: uint8 `[..., K // 2]` packed E2M1 codes (element `2k` in the
      low nibble); MXFP8: float8_e4m3fn `[..., K]`.
    scales: float8_e8m0fnu `[..., K // 32]`, the power-of-two block scales.
    fmt: static; "mxfp4" or "mxfp8".
  """

  data: jax.Array
  scales: jax.Array
  fmt: str = "mxfp4"

  @property
  def shape(self) -> tuple[int, ...]:
    k = self.data.shape[-1] * (2 if self.fmt == "mxfp4" else 1)
    return (*self.data.shape[:-1], k)

  @property
  def ndim(self) -> int:
    return self.data.ndim


jax.tree_util.register_dataclass(
    MXArray, data_fields=["data", "scales"], meta_fields=["fmt"])


def quantize_mx(x: jax.Array, fmt: str = "mxfp4", *,
                rounding: str = "nearest",
                key: jax.Array | None = None,
                placement: prng.Placement | None = None) -> MXArray:
  """Quantizes `x` to MXFP4 or MXFP8 along its last axis (blocks of 32).

  Args:
    x: float32/bfloat16/float16 array `[..., K]`, `K` a multiple of 32.
    fmt: "mxfp4" or "mxfp8".
    rounding: "nearest", or "stochastic" (MXFP4 only; same random stream as
      NVFP4, see `nvfp4_jax.prng`).
    key: PRNG key for stochastic rounding.
    placement: where a 2-D `x` sits when it is one shard of a larger tensor
      (see `nvfp4_jax.quantize`).

  Returns:
    An `MXArray`.
  """
  if fmt not in MX_FORMATS:
    raise ValueError(f"unknown MX format {fmt!r}; use one of {MX_FORMATS}.")
  what = f"quantize_mx({fmt})"
  x = check_input(x, block=nm.MX_BLOCK, block_2d=False, what=what)
  check_rounding(rounding, key, size=x.size, what=what)
  if rounding == "stochastic" and fmt != "mxfp4":
    raise ValueError(
        "stochastic rounding is implemented for E2M1 elements (mxfp4, nvfp4) "
        f"only; use rounding='nearest' for {fmt}.")
  xf = nm.ftz(x.astype(jnp.float32))
  blocks = xf.reshape(*xf.shape[:-1], -1, nm.MX_BLOCK)
  biased = nm.e8m0_scale_exponent(tile.abs_max(blocks, axis=-1),
                                  _ELEM_MAX[fmt])
  y = nm.ftz(blocks * nm.e8m0_inverse_to_f32(biased)[..., None])
  scales = jax.lax.bitcast_convert_type(biased.astype(jnp.uint8),
                                        jnp.float8_e8m0fnu)
  if fmt == "mxfp8":
    y = jnp.clip(y, -nm.E4M3_MAX, nm.E4M3_MAX)  # NaN passes through clip.
    data = jax.lax.optimization_barrier(
        y.reshape(x.shape).astype(jnp.float8_e4m3fn))
  elif rounding == "nearest":
    data = nm.pack_e2m1(nm.e2m1_encode_nearest(y)).reshape(
        *x.shape[:-1], -1)
  else:
    seeds = prng.seeds_from_key(key)
    nb = y.shape[-2]
    yb = y.reshape(-1, nb, nm.MX_BLOCK)
    origin, words_per_row = prng.stream_origin(placement, x.shape[-1],
                                               block=nm.MX_BLOCK)
    rbits = prng.tile_bytes(origin[0], yb.shape[0], origin[1], nb,
                            words_per_row, seeds[0], seeds[1],
                            block=nm.MX_BLOCK)
    data = nm.pack_e2m1(nm.e2m1_encode_stochastic(yb, rbits)).reshape(
        *x.shape[:-1], -1)
  return MXArray(data=data, scales=scales, fmt=fmt)


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
