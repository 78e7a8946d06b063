"""An independent NumPy model of TransformerEngine's NVFP4 arithmetic.

This file is the test oracle. It deliberately does NOT import `nvfp4_jax`: it is
a second, plain float32 NumPy transcription of NVFP4_SPEC sections 1-4, written
in the order of operations of TE's kernels (`core_nvfp4.cuh`):

    amax   = max |x|                           (after the RHT for Wgrad operands)
    S_enc  = min(2688 / amax, FLT_MAX); 1 if amax == 0 or S_enc == 0
    d      = e4m3_rtne(min(block_amax * (S_enc * f32(1/6)), 448))
    e      = min(1 / (f32(d) * (1 / S_enc)), FLT_MAX)
    y      = x * e
    code   = e2m1_rtne_satfinite(y)            (sign bit of y kept: -0.1 -> 8)
    x_hat  = fp4 * f32(d) * (amax / 2688)

Every product above is a NumPy float32 operation (correctly rounded, like the
GPU's `mul.rn.f32`/`div.rn.f32`); E4M3 rounding is `ml_dtypes.float8_e4m3fn`'s
round-to-nearest-even cast.

FP32 subnormals. XLA:CPU runs with flush-to-zero/denormals-are-zero, XLA:GPU does
not; the library therefore flushes explicitly (so both backends agree) at the
steps where a subnormal can appear. This model flushes at the same points:

  * the input elements (after widening to float32),
  * `1 / S_enc`               (subnormal only when amax < 3.2e-35),
  * `f32(d) * (1 / S_enc)`,
  * the dequantization factor `amax / 2688` and the dequantized values,
  * the RHT's input and its FP32 result (before the bf16 rounding).

NumPy itself never flushes, so all other steps are exactly TE's FP32 arithmetic.
Outside those tiny ranges (|x| < 1.2e-38, or amax < 3.2e-35) flushing changes
nothing.

E2M1 has no NaN. A NaN element gets the code of a zero of its sign; the NaN is
carried by the block scale (E4M3 NaN) and the tensor amax, which is what makes
the dequantized tensor non-finite. Codes of NaN elements are not part of the
contract.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
FLT_TINY = F32(np.finfo(np.float32).tiny)
E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
BLOCK = 16

# The E2M1 grid by magnitude code, and the rounding midpoints between
# neighbours. A value exactly on a midpoint goes to the even code (RTNE):
# 0.25->0, 0.75->2(1.0), 1.25->2(1.0), 1.75->4(2.0), 2.5->4(2.0), 3.5->6(4.0),
# 5->6(4.0). Above 6: saturate (code 7).
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
MIDPOINTS = (GRID[:-1] + GRID[1:]) / F32(2)  # [.25 .75 1.25 1.75 2.5 3.5 5]

TE_SIGN_VECTOR_16 = np.array(
    [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float32)


def ftz(v) -> np.ndarray:
  """Flushes FP32 subnormals to signed zero (what XLA:CPU does implicitly)."""
  v = np.asarray(v, np.float32)
  return np.where(np.abs(v) < FLT_TINY, v * F32(0.0), v).astype(np.float32)


def to_f32(x) -> np.ndarray:
  """Widens f16/bf16/f32 input to float32 exactly, then flushes subnormals."""
  return ftz(np.asarray(x).astype(np.float32))


# ----------------------------------------------------------------------------
# E2M1 elements.
# ----------------------------------------------------------------------------


def e2m1_rtne(y) -> np.ndarray:
  """FP32 values -> E2M1 codes (uint8), round to nearest even, saturating.

  Written differently from the library on purpose: a binary search over the
  midpoint table, then ties resolved to the even code.
  """
  y = np.asarray(y, np.float32)
  a = np.abs(y)
  a = np.where(np.isnan(a), F32(0.0), a)
  below = np.searchsorted(MIDPOINTS, a, side="left")  # midpoints strictly < a
  on_mid = (below < MIDPOINTS.size) & (
      a == MIDPOINTS[np.minimum(below, MIDPOINTS.size - 1)])
  # On a midpoint the candidates are codes `below` and `below + 1`; keep the
  # even one.
  mag = np.where(on_mid & (below % 2 == 1), below + 1, below)
  sign = np.where(np.signbit(y), 8, 0)
  return (mag | sign).astype(np.uint8)


def e2m1_value(codes) -> np.ndarray:
  """E2M1 codes -> float32 values (table lookup; code 8 is -0.0)."""
  codes = np.asarray(codes, np.uint8)
  mag = GRID[codes & 7]
  return np.where(codes & 8, -mag, mag).astype(np.float32)


def e2m1_neighbours(y) -> tuple[np.ndarray, np.ndarray]:
  """The grid magnitudes `lo <= |y| <= hi` bracketing `|y|` (saturated at 6)."""
  a = np.minimum(np.abs(np.asarray(y, np.float32)), F32(6.0))
  hi_idx = np.searchsorted(GRID, a, side="left")
  lo_idx = np.where(GRID[hi_idx] == a, hi_idx, hi_idx - 1)
  return GRID[lo_idx], GRID[hi_idx]


def pack(codes) -> np.ndarray:
  """Codes [..., K] -> bytes [..., K/2]; element 2k in the low nibble."""
  codes = np.asarray(codes, np.uint8)
  return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack(packed) -> np.ndarray:
  packed = np.asarray(packed, np.uint8)
  out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
  out[..., 0::2] = packed & 0xF
  out[..., 1::2] = packed >> 4
  return out


# ----------------------------------------------------------------------------
# Scales.
# ----------------------------------------------------------------------------


def global_encode_scale(amax) -> np.float32:
  amax = F32(amax)
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    s = F32(F32(448.0 * 6.0) / amax)
  s = np.minimum(s, FLT_MAX)  # NaN stays NaN
  if amax == 0 or s == 0:
    return F32(1.0)
  return F32(s)


def block_decode_scale(block_amax, s_enc) -> np.ndarray:
  """E4M3 `d` from the block amax: `block_amax * (S_enc * (1/6))`, RTNE."""
  s_over_6 = F32(F32(s_enc) * F32(1.0 / 6.0))  # folded once, as TE does
  d = np.asarray(block_amax, np.float32) * s_over_6
  d = np.minimum(d, F32(448.0))  # no lower clamp
  return d.astype(E4M3)


def block_encode_scale(d_e4m3, s_enc) -> np.ndarray:
  inv_s_enc = ftz(F32(1.0) / F32(s_enc))
  denom = ftz(d_e4m3.astype(np.float32) * inv_s_enc)
  with np.errstate(divide="ignore", invalid="ignore"):
    e = F32(1.0) / denom
  return np.minimum(e, FLT_MAX).astype(np.float32)


# ----------------------------------------------------------------------------
# Quantize / dequantize.
# ----------------------------------------------------------------------------


def block_amax(xf: np.ndarray, block_2d: bool) -> np.ndarray:
  """Per-block amax `[..., M, K/16]`; 2D: per 16x16 tile, replicated per row."""
  a = np.abs(xf).reshape(*xf.shape[:-1], -1, BLOCK).max(axis=-1)  # NaN stays
  if not block_2d:
    return a
  *lead, m, kb = a.shape
  t = a.reshape(*lead, m // BLOCK, BLOCK, kb).max(axis=-2)
  return np.repeat(t, BLOCK, axis=-2)


def scaled_values(x, *, block_2d: bool = False, amax=None):
  """Steps 1-4 up to (not including) the E2M1 rounding.

  Returns:
    dict with `y` (FP32 scaled values, x's shape), `scales` (E4M3
    `[..., K/16]`), `amax` (FP32), `s_enc`, `enc` (FP32 block encode scales).
  """
  xf = to_f32(x)
  if amax is None:
    amax = np.max(np.abs(xf))  # NaN propagates
  amax = F32(amax)
  s_enc = global_encode_scale(amax)
  d = block_decode_scale(block_amax(xf, block_2d), s_enc)
  enc = block_encode_scale(d, s_enc)
  blocks = xf.reshape(*xf.shape[:-1], -1, BLOCK)
  with np.errstate(over="ignore", invalid="ignore"):
    y = (blocks * enc[..., None]).astype(np.float32).reshape(xf.shape)
  return dict(y=y, scales=d, amax=amax, s_enc=s_enc, enc=enc)


def quantize(x, *, block_2d: bool = False, amax=None):
  """TE's NVFP4 quantization with RTNE.

  Returns:
    `(packed_codes uint8 [..., K/2], scales float8_e4m3fn [..., K/16],
    amax float32)`.
  """
  s = scaled_values(x, block_2d=block_2d, amax=amax)
  return pack(e2m1_rtne(s["y"])), s["scales"], s["amax"]


def dequantize(packed, scales, amax) -> np.ndarray:
  """`fp4 * f32(d) * (amax / 2688)`, left to right, in FP32."""
  vals = e2m1_value(unpack(packed))
  vals = vals.reshape(*vals.shape[:-1], -1, BLOCK)
  g = ftz(F32(amax) / F32(2688.0))
  with np.errstate(over="ignore", invalid="ignore"):
    out = (vals * np.asarray(scales).astype(np.float32)[..., None]) * g
  return ftz(out.reshape(*out.shape[:-2], -1))


# ----------------------------------------------------------------------------
# Random Hadamard transform (Wgrad operands).
# ----------------------------------------------------------------------------


def hadamard(size: int) -> np.ndarray:
  """Sylvester Hadamard matrix by repeated Kronecker products (float64)."""
  h = np.ones((1, 1))
  while h.shape[0] < size:
    h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
  assert h.shape == (size, size), size
  return h


def rht(x, sign_vector=TE_SIGN_VECTOR_16) -> np.ndarray:
  """`bf16((x reshaped to [-1, n]) @ diag(s) H_n / sqrt(n))` along the last axis.

  The FP32 accumulation is modelled as the exact sum rounded once to FP32
  (computed in float64: 16 products of FP32 values by +-1/4 sum exactly unless
  their exponents span more than ~29 binades), then rounded to bf16 (RTNE).
  Any FP32 summation order gives the same result whenever the FP32 sum is
  exact, which is the case for bf16 inputs of ordinary dynamic range (bf16 is
  the only input dtype TE's RHT accepts). For float32 inputs the last FP32 bit
  depends on the summation order of whoever computes it, and occasionally that
  flips the bf16 rounding by one ulp.
  """
  s = np.asarray(sign_vector, np.float64)
  n = s.size
  h = (s[:, None] * hadamard(n)) / np.sqrt(n)
  xf = to_f32(x).astype(np.float64)
  y = xf.reshape(-1, n) @ h
  y = ftz(y.astype(np.float32))
  return y.reshape(np.shape(x)).astype(BF16)


def wgrad_operand(x) -> np.ndarray:
  """TE's RHT Wgrad operand of `x: [tokens, features]`: `bf16(rht(x.T))`."""
  return rht(np.swapaxes(np.asarray(x), -1, -2))


# ----------------------------------------------------------------------------
# The stochastic-rounding stream of nvfp4_jax.core.prng, from its documented
# definition (so a GPU kernel can be checked against the same numbers).
# ----------------------------------------------------------------------------

_M1 = np.uint32(0x7FEB352D)
_M2 = np.uint32(0x846CA68B)


def _mix32(h: np.ndarray) -> np.ndarray:
  h = h.astype(np.uint32)
  h = h ^ (h >> np.uint32(16))
  h = (h.astype(np.uint64) * np.uint64(_M1) & np.uint64(0xFFFFFFFF)).astype(
      np.uint32)
  h = h ^ (h >> np.uint32(15))
  h = (h.astype(np.uint64) * np.uint64(_M2) & np.uint64(0xFFFFFFFF)).astype(
      np.uint32)
  return h ^ (h >> np.uint32(16))


def sr_bytes(seed0: int, seed1: int, n: int) -> np.ndarray:
  """byte(i) = (mix32(mix32((i//4) ^ seed0) + seed1) >> 8*(i%4)) & 0xFF."""
  i = np.arange(n, dtype=np.uint64)
  w = (i // 4).astype(np.uint32)
  s0, s1 = np.uint32(seed0), np.uint32(seed1)
  h1 = _mix32(w ^ s0)
  h = _mix32(((h1.astype(np.uint64) + np.uint64(s1)) & np.uint64(0xFFFFFFFF))
             .astype(np.uint32))
  return ((h >> (np.uint32(8) * (i % 4).astype(np.uint32))) & np.uint32(0xFF)
          ).astype(np.uint8)


def e2m1_stochastic(y, rbytes) -> np.ndarray:
  """SR as documented: with `lo <= |y| < hi`, `t = (|y| - lo) / (hi - lo)`,
  round the magnitude up iff `256 t > r + 1/2` (`r` the element's byte).
  Saturates at 6; values on the grid never move."""
  y = np.asarray(y, np.float32)
  a = np.abs(y).astype(np.float64)
  a = np.where(np.isnan(a), 0.0, a)
  lo, hi = e2m1_neighbours(a.astype(np.float32))
  lo, hi = lo.astype(np.float64), hi.astype(np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    t = np.where(hi > lo, (np.minimum(a, 6.0) - lo) / (hi - lo), 0.0)
  up = 256.0 * t > np.asarray(rbytes, np.float64) + 0.5
  mag = np.where(up, hi, lo)
  code = np.searchsorted(GRID, mag.astype(np.float32))
  return (code | np.where(np.signbit(y), 8, 0)).astype(np.uint8)


def quantize_stochastic(x, seeds, *, block_2d: bool = False, amax=None):
  """NVFP4 with the library's documented SR stream (row-major element order)."""
  s = scaled_values(x, block_2d=block_2d, amax=amax)
  rb = sr_bytes(int(seeds[0]), int(seeds[1]), s["y"].size).reshape(s["y"].shape)
  return pack(e2m1_stochastic(s["y"], rb)), s["scales"], s["amax"]


# ----------------------------------------------------------------------------
# MX formats: UE8M0 scale 2^ceil(log2(block_amax / elem_max)).
# ----------------------------------------------------------------------------


def mx_scale_exponent(block_amax, elem_max: float) -> np.ndarray:
  """Unbiased exponent e = ceil(log2(block_amax / elem_max)), exactly (float64)
  as the smallest e with block_amax <= elem_max * 2^e; clamped to [-127, 127].
  Zero blocks get -127."""
  a = np.asarray(block_amax, np.float64)
  safe = np.where(a > 0, a, 1.0)
  e = np.ceil(np.log2(safe / elem_max)).astype(np.int64)
  # Correct log2's last-bit errors: enforce the defining inequalities exactly.
  e = np.where(safe > elem_max * np.exp2(e.astype(np.float64)), e + 1, e)
  e = np.where(safe <= elem_max * np.exp2((e - 1).astype(np.float64)), e - 1, e)
  e = np.where(a > 0, e, -127)
  return np.clip(e, -127, 127)


def quantize_mx(x, fmt: str):
  """Returns `(elements as float32 values, unbiased scale exponents)`."""
  xf = to_f32(x)
  elem_max = 6.0 if fmt == "mxfp4" else 448.0
  blocks = xf.reshape(*xf.shape[:-1], -1, 32)
  e = mx_scale_exponent(np.abs(blocks).max(axis=-1), elem_max)
  y = (blocks.astype(np.float64) * np.exp2(-e.astype(np.float64))[..., None])
  y = ftz(y.astype(np.float32))  # exact unless it falls below FP32's normals
  if fmt == "mxfp4":
    vals = e2m1_value(e2m1_rtne(y))
  else:
    vals = np.clip(y, -448, 448).astype(E4M3).astype(np.float32)
  return vals.reshape(xf.shape), e
