"""Tile math of the block-scaled formats: one definition of every numeric step.

Everything here is a pure `jax.numpy` function on arrays of any shape, written
with elementwise operations, comparisons and selects only (no table lookups, no
closed-over arrays), so the Pallas kernels in `pallas_kernels/` apply the very
same functions to their tiles. The order of operations follows
TransformerEngine's NVFP4 arithmetic (NVFP4_SPEC section 2); changing it changes
bytes.

FP32 subnormals: XLA:CPU flushes subnormal FP32 values to zero, XLA:GPU and
Triton keep them. So that every backend computes the same bytes, the steps where a
subnormal can appear flush it explicitly (`ftz`). This only touches elements
below 1.2e-38 and tensors whose amax is below 3.2e-35.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# Format constants.
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MAX_X_E2M1_MAX = 2688.0  # 448 * 6: the global encode numerator.
# Four-over-Six (Cook et al. 2025) bounds the 6-candidate's block scales by
# 256, so that the 4-candidate's (x 1.5, <= 384) stays inside E4M3: the global
# encode numerator is 256 * 6.
FOUR_OVER_SIX_E4M3_MAX = 256.0
FOUR_OVER_SIX_NUMERATOR = 1536.0  # 256 * 6.
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)  # Smallest normal FP32.
NVFP4_BLOCK = 16
MX_BLOCK = 32
E8M0_BIAS = 127

# Magnitude by 3-bit code; bit 3 is the sign (code 8 is -0).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)

_SIGN_BIT = 8


def ftz(v: jax.Array) -> jax.Array:
  """Flushes FP32 subnormals to (signed) zero, as XLA:CPU does implicitly."""
  v = jnp.asarray(v)
  if not jnp.issubdtype(v.dtype, jnp.floating):
    return jnp.where(jnp.abs(v) < F32_TINY, v * 0.0, v)
  # `jnp.where(jnp.abs(v) < F32_TINY, v * 0.0, v)` in `lax` ops (the
  # constants in `v`'s dtype, as `jnp` takes Python scalars): called for
  # every operand of the exact arithmetic, its `jnp` wrappers were 1,702 of
  # the 9,254 traced in the tiny GPT's NVFP4 train step.
  tiny, zero = np.asarray(F32_TINY, v.dtype), np.asarray(0.0, v.dtype)
  return jax.lax.select(jax.lax.lt(jax.lax.abs(v), tiny),
                        jax.lax.mul(v, zero), v)


@jax.jit  # One compiled op in eager code, instead of ~150 dispatches.
def div_rn(a: jax.Array, b: jax.Array) -> jax.Array:
  """FP32 `a / b`, correctly rounded (RTNE), the same bits on every backend.

  TE divides with IEEE `div.rn.f32`. XLA does not guarantee that: XLA:GPU
  lowers an FP32 divide to PTX `div.full.f32` (up to 2 ulp off; 13-30% of
  quotients differ on an H100), and XLA's simplifier turns a division by a
  constant into a multiplication by the rounded reciprocal. Here the
  significands are divided by restoring long division in uint32 (24 quotient
  bits, then round to nearest even on the remainder), which no compiler
  rewrites. Subnormal inputs and results are flushed to (signed) zero, as
  everywhere in this module. Zero, infinite and NaN operands take the plain
  division, whose special values are exact on every backend.
  """
  a = ftz(jnp.asarray(a, jnp.float32))
  b = ftz(jnp.asarray(b, jnp.float32))
  a, b = jnp.broadcast_arrays(a, b)
  ba = jax.lax.bitcast_convert_type(a, jnp.uint32)
  bb = jax.lax.bitcast_convert_type(b, jnp.uint32)
  ea = ((ba >> 23) & 0xFF).astype(jnp.int32)
  eb = ((bb >> 23) & 0xFF).astype(jnp.int32)
  ma = (ba & 0x7FFFFF) | 0x800000
  mb = (bb & 0x7FFFFF) | 0x800000
  small = ma < mb  # Normalise so that the quotient of significands is in [1, 2).
  r = jnp.where(small, ma << 1, ma)
  e = ea - eb + 127 - small.astype(jnp.int32)
  q = jnp.zeros_like(ma)
  # The 24 steps in `lax` ops (the same operations as the `jnp` ones, on
  # arrays of one shape and dtype), without `jnp`'s promotion and `jit`
  # wrappers: 144 wrapper calls fewer per traced division.
  one = np.uint32(1)
  for _ in range(24):
    bit = jax.lax.ge(r, mb)
    q = jax.lax.bitwise_or(jax.lax.shift_left(q, one),
                           jax.lax.convert_element_type(bit, jnp.uint32))
    r = jax.lax.shift_left(jax.lax.select(bit, jax.lax.sub(r, mb), r),
                           one)  # r = 2 * remainder
  up = (r > mb) | ((r == mb) & ((q & 1) == 1))
  q = q + up.astype(jnp.uint32)
  carry = q >> 24  # Rounded up to 2^24: renormalise.
  q = q >> carry
  e = e + carry.astype(jnp.int32)
  sign = (ba ^ bb) & jnp.uint32(0x80000000)
  bits = sign | (jnp.clip(e, 0, 255).astype(jnp.uint32) << 23) | (q & 0x7FFFFF)
  bits = jnp.where(e > 254, sign | jnp.uint32(0x7F800000), bits)  # +-inf.
  bits = jnp.where(e < 1, sign, bits)  # Underflow: flushed to +-0.
  exact = jax.lax.bitcast_convert_type(bits, jnp.float32)
  regular = (ea > 0) & (ea < 255) & (eb > 0) & (eb < 255)
  return jnp.where(regular, exact, a / b)


def divide(a: jax.Array, b: jax.Array) -> jax.Array:
  """FP32 `a / b` correctly rounded, at the lowest cost on each backend.

  XLA:CPU's division by a non-constant is IEEE `divss` already, and `div_rn`
  costs ~100 integer operations that XLA:CPU duplicates into every consumer
  element; so CPU takes the plain division and other backends `div_rn`. Same
  bits everywhere. (A division by a constant must call `div_rn` directly:
  XLA rewrites it into a multiplication by the rounded reciprocal.)
  """
  return jax.lax.platform_dependent(a, b, cpu=jnp.divide, default=div_rn)


# ----------------------------------------------------------------------------
# NVFP4 scale factors (NVFP4_SPEC section 2, steps 1-3 and 5).
# ----------------------------------------------------------------------------


def global_encode_scale(amax: jax.Array, *, divide=divide,
                        numerator: float = E4M3_MAX_X_E2M1_MAX) -> jax.Array:
  """`S_enc = min(2688 / amax, FLT_MAX)`, and 1 where amax or S_enc is 0.

  A NaN amax gives a NaN scale, so NaN inputs poison every scale of the tensor
  instead of being rounded to finite codes. `divide`: see
  `nvfp4_block_encode_scale`. `numerator`: 2688 (448 * 6), or 1536 for
  Four-over-Six.
  """
  amax = amax.astype(jnp.float32)
  s = divide(jnp.float32(numerator), amax)
  s = jnp.where(s > F32_MAX, jnp.float32(F32_MAX), s)
  return jnp.where((amax == 0.0) | (s == 0.0), jnp.float32(1.0), s)


def global_decode_scale(amax: jax.Array, *,
                        denominator: float = E4M3_MAX_X_E2M1_MAX) -> jax.Array:
  """The FP32 tensor factor of dequantization: `amax / 2688`, correctly rounded
  (`amax / 1536` for Four-over-Six).

  A plain `amax / 2688` is not: XLA's algebraic simplifier rewrites a division
  by a constant into `amax * fl(1/2688)` (one ulp off for about one amax in
  five; an `optimization_barrier` on the constant does not stop it), and
  XLA:GPU divides approximately anyway. `div_rn` is exact everywhere; on CPU,
  where XLA would recompute its ~100 operations for every element of a
  dequantized tensor, the divisor is made a non-constant (`2688 + 0 * amax`,
  which XLA does not fold for floats) and IEEE `divss` divides.
  """
  amax = amax.astype(jnp.float32)
  c = jnp.float32(denominator)

  def cpu(amax):
    q = ftz(amax / (c + 0.0 * amax))
    return jnp.where(jnp.isinf(amax), amax, q)
  return jax.lax.platform_dependent(
      amax, cpu=cpu, default=functools.partial(global_decode_scale_div_rn,
                                               denominator=denominator))


def global_decode_scale_div_rn(amax: jax.Array, *,
                               denominator: float = E4M3_MAX_X_E2M1_MAX
                               ) -> jax.Array:
  """`global_decode_scale` by `div_rn` alone (its GPU branch; no
  `platform_dependent`, so a kernel can compute it from the amax)."""
  return div_rn(amax.astype(jnp.float32), jnp.float32(denominator))


def nvfp4_scale_constants(amax: jax.Array, *, divide=divide,
                          four_over_six: bool = False
                          ) -> tuple[jax.Array, jax.Array]:
  """The two per-tensor FP32 constants the block math needs.

  With `four_over_six` the global scale is `1536 / amax` (block scales of the
  6-candidate bounded by 256).

  Returns:
    `(s_enc_over_6, inv_s_enc)`: `S_enc * (1/6)` (folded once, as TE does) and
    `1 / S_enc`. Kernels receive these as inputs so that no division by a
    per-tensor value happens inside a kernel.
  """
  s_enc = global_encode_scale(
      amax, divide=divide, numerator=FOUR_OVER_SIX_NUMERATOR if four_over_six
      else E4M3_MAX_X_E2M1_MAX)
  s_enc_over_6 = s_enc * jnp.float32(1.0 / E2M1_MAX)
  inv_s_enc = ftz(divide(jnp.float32(1.0), s_enc))
  return s_enc_over_6, inv_s_enc


def nvfp4_block_decode_scale(block_amax: jax.Array,
                             s_enc_over_6: jax.Array, *,
                             expansion: float | None = None) -> jax.Array:
  """`d = block_amax * (S_enc * (1/6))`, clamped to 448, cast to E4M3 (RTNE).

  There is no lower clamp: a block whose scale underflows E4M3 gets scale 0.
  Under XLA, callers put `jax.lax.optimization_barrier` on the result: it keeps
  XLA:GPU from fusing the FP32->E4M3->FP32 round trip away ("excess
  precision"). Kernels need no barrier (the barrier does not lower there).

  `expansion`: Four-over-Six's 4-candidate multiplies the FP32 scale by 1.5
  (= 6/4, mapping the block max to 4) before the clamp and the cast.
  """
  d = block_amax.astype(jnp.float32) * s_enc_over_6
  if expansion is not None:
    d = d * jnp.float32(expansion)
  # A select rather than jnp.minimum: Pallas-Triton lowers min to `minnumf`,
  # which would turn a NaN block amax into a finite 448.
  d = jnp.where(d > E4M3_MAX, jnp.float32(E4M3_MAX), d)
  return d.astype(jnp.float8_e4m3fn)


def nvfp4_block_encode_scale(d_f32: jax.Array, inv_s_enc: jax.Array, *,
                             divide=divide) -> jax.Array:
  """`e = min(1 / (f32(d) * (1 / S_enc)), FLT_MAX)` from the decoded E4M3 scale.

  A zero `d` gives `e = FLT_MAX`; NaN stays NaN.

  Args:
    d_f32: the E4M3 block decode scales, widened to FP32.
    inv_s_enc: `1 / S_enc` (see `nvfp4_scale_constants`).
    divide: the FP32 division, correctly rounded. The default, `divide`, is
      exact on every backend. XLA:GPU and Pallas-Triton lower `/` to the
      approximate `div.full.f32` (XLA:GPU unless
      `XLA_FLAGS=--xla_backend_extra_options=-nvptx-prec-divf32=2`), so GPU
      kernels may pass an IEEE `div.rn.f32` here instead.
  """
  denom = ftz(d_f32 * inv_s_enc)
  e = divide(jnp.float32(1.0), denom)
  return jnp.where(e > F32_MAX, jnp.float32(F32_MAX), e)


# ----------------------------------------------------------------------------
# E2M1 rounding, decoding and packing.
# ----------------------------------------------------------------------------


def _sign_code(y: jax.Array) -> jax.Array:
  return jnp.where(jnp.signbit(y), jnp.uint8(_SIGN_BIT), jnp.uint8(0))


def e2m1_encode_nearest(y: jax.Array) -> jax.Array:
  """Rounds FP32 `y` to E2M1 codes, to nearest with ties to the even code.

  Saturates at +-6. Ties go to the even code, which alternates along the grid
  (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4). NaN gets code 0
  or 8 (E2M1 has no NaN): the NaN is carried by the scales, see
  `global_encode_scale`.

  Computed with one FP32 addition and a few integer operations (the GPU
  kernels are bound by instructions per element; the results are those of
  comparing against the 7 thresholds): the grid step around `|y|` is 0.5
  below 2, 1 in [2, 4) and 2 from 4, i.e. `2^(E-1)` with `E = max(exponent
  of |y|, 0)`. Adding `M = 2^(E+22)`, whose FP32 ulp is that step, rounds
  `|y|` to a multiple `k` of the step (the FPU's ties-to-even is the even
  multiple, which is the even code) and `k` is the difference of the bit
  patterns of `|y| + M` and `M`. The code is `k + 2E`, capped at 7 (for
  `E >= 3` it is at least 8: saturation; `M`'s pattern may wrap for huge
  `|y|`, still giving more than 7).

  Returns:
    uint8 codes in [0, 16).
  """
  b = jax.lax.bitcast_convert_type(y, jnp.uint32)
  e = jnp.maximum(b & jnp.uint32(0x7F800000), jnp.uint32(127 << 23))
  magic = e + jnp.uint32(22 << 23)
  f = jax.lax.bitcast_convert_type(
      jnp.abs(y) + jax.lax.bitcast_convert_type(magic, jnp.float32),
      jnp.uint32)
  mag = jnp.minimum(f - magic + (e >> 22) - jnp.uint32(254), jnp.uint32(7))
  mag = jnp.where(jnp.isnan(y), jnp.uint32(0), mag)
  return (mag | ((b >> 28) & jnp.uint32(_SIGN_BIT))).astype(jnp.uint8)


def e2m1_encode_stochastic(y: jax.Array, rbits: jax.Array) -> jax.Array:
  """Rounds FP32 `y` to one of its two neighbouring E2M1 values, stochastically.

  With `lo <= |y| < hi` the neighbouring grid values and `t = (|y|-lo)/(hi-lo)`
  (exact in FP32), the magnitude rounds up iff `256 t > r + 1/2`, `r` the
  element's 8 random bits. The probability of rounding up is `t` exactly when
  `t` is a multiple of 1/256 and within 1/512 of it otherwise. Values on the
  grid never move; `|y| >= 6` saturates to 6.

  Computed with one exact FP32 product and integer operations (the GPU
  kernels are bound by instructions per element): with the grid step
  `2^(E-1)` around `|y|` (`E = clip(exponent, 0, 3)`, `|y|` clamped to 16),
  `X = |y| * 2^(10-E)` is 512 times `|y|` in steps, so `floor(X / 512)` is
  the lower grid point's index and `X mod 512 = 512 t`. Since `2r + 1` is an
  integer, `512 t > 2r + 1` iff `ceil(512 t) >= 2r + 2`, and both parts
  together are `(ceil(X) + 510 - 2r) >> 9`; the code is that plus `2E`,
  capped at 7. (The same codes as comparing `t` in FP32: a randomized and
  a per-binade offline check, every `r`-boundary included.)

  Args:
    y: scaled values, FP32.
    rbits: uint8 (or any unsigned) random bits in [0, 256), same shape as `y`.

  Returns:
    uint8 codes in [0, 16).
  """
  b = jax.lax.bitcast_convert_type(y, jnp.uint32)
  a = jnp.minimum(b & jnp.uint32(0x7FFFFFFF), jnp.uint32(0x41800000))  # 16.
  s = jnp.clip(jnp.uint32(264) - (a >> 23), jnp.uint32(134),
               jnp.uint32(137))  # Exponent of 2^(10 - E).
  x = jax.lax.bitcast_convert_type(a, jnp.float32) * (
      jax.lax.bitcast_convert_type(s << 23, jnp.float32))
  up = (jnp.ceil(x).astype(jnp.uint32) + jnp.uint32(510)
        - rbits.astype(jnp.uint32) * 2) >> 9
  mag = jnp.minimum((jnp.uint32(137) - s) * 2 + up, jnp.uint32(7))
  mag = jnp.where(jnp.isnan(y), jnp.uint32(0), mag)
  return (mag | ((b >> 28) & jnp.uint32(_SIGN_BIT))).astype(jnp.uint8)


def e2m1_decode(codes: jax.Array, dtype=jnp.float32) -> jax.Array:
  """E2M1 codes to their values, without a table lookup.

  Code `c` decodes to `E2M1_VALUES[c]` (bit 3 the sign: code 8 is -0),
  computed arithmetically so that kernels can use it too.

  Args:
    codes: uint8 (or any integer) codes in [0, 16), one per element (unpack
      bytes with `unpack_e2m1` first).
    dtype: the result's dtype (the values are exact in every float dtype).

  Returns:
    The values, shaped as `codes`.
  """
  # In `lax` ops on int32 and FP32 (every value exact): traced once per
  # decoded operand, `jnp`'s wrappers cost more than the arithmetic.
  lax, f32 = jax.lax, np.float32
  c = lax.convert_element_type(codes, jnp.int32)
  m = lax.bitwise_and(c, np.int32(7))
  mf = lax.convert_element_type(m, jnp.float32)
  # 0, .5, 1, 1.5 step by 0.5; 2, 3 by 1; 4, 6 by 2.
  mag = lax.select(lax.lt(m, np.int32(4)), lax.mul(mf, f32(0.5)),
                   lax.select(lax.lt(m, np.int32(6)), lax.sub(mf, f32(2.0)),
                              lax.sub(lax.mul(mf, f32(2.0)), f32(8.0))))
  # Multiply rather than negate: Pallas-Triton lowers `-x` to `0 - x`, which
  # turns code 8 (-0) into +0.
  negative = lax.ne(lax.bitwise_and(c, np.int32(_SIGN_BIT)), np.int32(0))
  sign = lax.select(negative, lax.full_like(mf, -1.0), lax.full_like(mf, 1.0))
  return lax.convert_element_type(lax.mul(sign, mag), dtype)


def pack_e2m1(codes: jax.Array, *, split: bool = False) -> jax.Array:
  """Packs uint8 codes `[..., K]` into bytes `[..., K//2]`.

  Element `2k` goes in the low nibble, element `2k+1` in the high nibble.

  Args:
    codes: uint8 codes in [0, 16).
    split: take the pairs apart with `unstack` (lowers to Triton's split: the
      Pallas kernels' form) instead of a shift-and-sum over each pair. Same
      bytes; XLA:CPU runs the `unstack` form ~20x slower when it is fused
      after the encoder, so the reference uses the sum.

  Returns:
    uint8 bytes `[..., K//2]`.

  Raises:
    ValueError: an odd last axis.
  """
  if codes.shape[-1] % 2:
    raise ValueError(
        f"pack_e2m1 needs an even last axis, got shape {codes.shape}.")
  pairs = (codes.astype(jnp.uint8) & 0xF).reshape(*codes.shape[:-1], -1, 2)
  if split:
    lo, hi = jnp.unstack(pairs, axis=-1)
    return lo | (hi << 4)
  shift = jax.lax.broadcasted_iota(jnp.uint8, pairs.shape, pairs.ndim - 1) * 4
  return jnp.sum(pairs << shift, axis=-1, dtype=jnp.uint8)


def unpack_e2m1(packed: jax.Array) -> jax.Array:
  """Inverse of `pack_e2m1`: bytes `[..., K//2]` to codes `[..., K]`.

  Args:
    packed: bytes `[..., K//2]` (cast to uint8), element `2k` in the low
      nibble.

  Returns:
    uint8 codes `[..., K]` in [0, 16).
  """
  packed = packed.astype(jnp.uint8)
  lo = packed & 0xF
  hi = packed >> 4
  return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], -1)


# ----------------------------------------------------------------------------
# MX (OCP microscaling) scale factors: UE8M0, rounded up.
# ----------------------------------------------------------------------------


def e8m0_scale_exponent(block_amax: jax.Array, elem_max: float) -> jax.Array:
  """Biased UE8M0 exponent of `2^ceil(log2(block_amax / elem_max))`.

  Rounding the scale up (as TE's MXFP8 cast does) means the block max never
  saturates. Computed from the FP32 bits of `block_amax` and `elem_max` without
  a division, so it is exact everywhere: with `a = 2^Ea * ma`, `elem_max =
  2^Ee * me` (`ma, me` in [1, 2)), the exponent is `Ea - Ee + (ma > me)`.
  (Dividing first would flush `block_amax / elem_max` to zero below 2^-126 and
  give blocks with amax in [2^-126, elem_max * 2^-126) a scale that saturates
  them.) Clamped to the E8M0 range [2^-127, 2^127]; a zero block gets the
  smallest scale. A NaN or infinite block amax gives 255 (the E8M0 NaN), so the
  block dequantizes to NaN instead of finite garbage.

  Returns:
    int32 biased exponents in [0, 255].
  """
  a = block_amax.astype(jnp.float32)
  e_bits = int(np.float32(elem_max).view(np.uint32))
  elem_exp = ((e_bits >> 23) & 0xFF) - E8M0_BIAS  # Ee, unbiased.
  elem_man = e_bits & 0x7FFFFF
  bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
  biased_a = ((bits >> 23) & 0xFF).astype(jnp.int32)  # Ea + 127.
  up = ((bits & 0x7FFFFF) > elem_man).astype(jnp.int32)
  biased = jnp.clip(biased_a - elem_exp + up, 0, 254)
  biased = jnp.where(a == 0.0, 0, biased)  # Subnormals: 0 via the clip.
  return jnp.where(biased_a == 255, 255, biased)


def e8m0_to_f32(biased: jax.Array) -> jax.Array:
  """2^(biased - 127) as FP32, built from its bits (exact); 255 is NaN.

  Biased exponent 0 (2^-127, an FP32 subnormal) is flushed to zero.
  """
  b = biased.astype(jnp.uint32)
  val = jax.lax.bitcast_convert_type(b << 23, jnp.float32)
  return jnp.where(b == 255, jnp.float32(np.nan), val)


def e8m0_inverse_to_f32(biased: jax.Array) -> jax.Array:
  """2^(127 - biased) as FP32, exact; the encode factor of an MX block."""
  b = jnp.clip(254 - biased.astype(jnp.int32), 0, 254).astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(b << 23, jnp.float32)
