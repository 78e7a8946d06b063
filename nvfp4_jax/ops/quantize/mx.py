"""OCP microscaling formats for comparison: MXFP4 and MXFP8 (reference only).

Both use blocks of 32 along the last axis with a power-of-two UE8M0 scale and no
tensor scale. The scale is `2^ceil(log2(block_amax / elem_max))` (rounded up,
as TE's MX casts do), so the block maximum never saturates.

- MXFP4: E2M1 elements (packed two per byte like NVFP4), RTNE or stochastic.
- MXFP8: E4M3 elements (`float8_e4m3fn`), RTNE.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng
from nvfp4_jax.core import tile
from nvfp4_jax.core.arrays import MX_FORMATS
from nvfp4_jax.core.arrays import MXArray
from nvfp4_jax.core.arrays import check_input
from nvfp4_jax.core.arrays import check_rounding


_ELEM_MAX = {"mxfp4": nm.E2M1_MAX, "mxfp8": nm.E4M3_MAX}


def quantize_mx(x: jax.Array, fmt: str = "mxfp4", *,
                rounding: str = "nearest",
                key: jax.Array | None = None,
                placement: prng.Placement | None = None) -> MXArray:
  """Quantizes `x` to MXFP4 or MXFP8 along its last axis (blocks of 32).

  Args:
    x: float32/bfloat16/float16 array `[..., K]`, `K` a multiple of 32.
    fmt: "mxfp4" or "mxfp8".
    rounding: "nearest", or "stochastic" (MXFP4 only; same random stream as
      NVFP4, see `nvfp4_jax.core.prng`).
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
