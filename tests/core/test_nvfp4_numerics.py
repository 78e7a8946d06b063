"""NVFP4 quantization: bit-exactness with TE's arithmetic and the edge cases of
NVFP4_SPEC sections 1-3 (the RHT has its own file)."""

from __future__ import annotations

import functools
import zlib

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import nvfp4_jax as nf
from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
from nvfp4_jax.ops.block_scaled_matmul import reference as gemm_ref
from nvfp4_jax.core import numerics as nm
import te_reference as ref
from conftest import JNP_DTYPES, assert_scales_diverse, make_heavy_tailed

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max

quantize_jit = jax.jit(nf.quantize, static_argnames=("block_2d", "rounding"))
dequantize_jit = jax.jit(nf.dequantize, static_argnames=("dtype",))


def codes_of(q) -> np.ndarray:
  return np.asarray(nf.unpack_e2m1(q.codes))


def scale_bytes(scales) -> np.ndarray:
  return np.asarray(scales).view(np.uint8)


def f32_bits(a) -> np.ndarray:
  return np.asarray(a, np.float32).view(np.uint32)


def assert_matches_reference(q, packed, scales, amax, *, mask=None):
  """Codes, E4M3 scale bytes and amax identical to the reference."""
  got = np.asarray(q.codes)
  if mask is not None:  # Codes of NaN elements are not part of the contract.
    got, packed = ref.unpack(got)[~mask], ref.unpack(packed)[~mask]
  np.testing.assert_array_equal(got, packed, err_msg="E2M1 codes differ")
  np.testing.assert_array_equal(scale_bytes(q.scales), scale_bytes(scales),
                                err_msg="E4M3 scale bytes differ")
  np.testing.assert_array_equal(f32_bits(q.amax), f32_bits(amax),
                                err_msg="amax differs")


def _seed(*params) -> int:
  return zlib.crc32(repr(params).encode())


# ----------------------------------------------------------------------------
# Seed 000's worked example.
# ----------------------------------------------------------------------------

SEED000_X = [0.0, 0.25, 0.5, 0.75356, 1.251245, 3.2002, 4.5032, 15.011, 0.012,
             -0.312, -5.50055, 10.06, -1.2526, 3.025, 2.5114, 7.0162]
SEED000_SCALED = [0.0, 0.0999, 0.1999, 0.3012, 0.5001, 1.2791, 1.7998, 6.0,
                  0.0048, -0.1247, -2.1986, 4.0211, -0.5007, 1.2091, 1.0038,
                  2.8044]
SEED000_QUANTIZED = [0.0, 0.0, 0.0, 0.5, 0.5, 1.5, 2.0, 6.0, 0.0, -0.0, -2.0,
                     4.0, -0.5, 1.0, 1.0, 3.0]
SEED000_DEQUANTIZED = [0.0, 0.0, 0.0, 1.2509, 1.2509, 3.7528, 5.0037, 15.0110,
                       0.0, 0.0, -5.0037, 10.0073, -1.2509, 2.5018, 2.5018,
                       7.5055]


def test_seed000_worked_example():
  x = jnp.asarray([SEED000_X], jnp.float32)
  q = quantize_jit(x)
  # Scaled values, from the library's own tile math.
  s_enc_over_6, inv_s_enc = nm.nvfp4_scale_constants(q.amax)
  enc = nm.nvfp4_block_encode_scale(q.scales.astype(jnp.float32), inv_s_enc)
  scaled = np.asarray(x * enc)
  # The table prints 4 decimals; its 1.7998 for 4.5032 is off by 2e-4
  # (4.5032 * 6 / 15.011 = 1.79996), hence the tolerance.
  np.testing.assert_allclose(scaled[0], SEED000_SCALED, atol=2e-4)
  np.testing.assert_allclose(float(enc[0, 0]), 0.3997, atol=1e-4)
  np.testing.assert_allclose(float(q.amax), 15.011, rtol=1e-7)
  codes = codes_of(q)[0]
  np.testing.assert_array_equal(nf.E2M1_VALUES[codes], SEED000_QUANTIZED)
  # Sign kept on the negative value that rounds to zero (code 8 = -0).
  assert codes[9] == 8 and codes[0] == 0
  np.testing.assert_allclose(np.asarray(dequantize_jit(q))[0],
                             SEED000_DEQUANTIZED, atol=1.5e-4)
  np.testing.assert_array_equal(float(q.scales[0, 0].astype(jnp.float32)), 448.0)


# ----------------------------------------------------------------------------
# Bit-exact agreement with the independent TE model on heavy-tailed inputs.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(16, 16), (48, 64), (2, 32, 48)])
@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_bit_exact_vs_te_reference(block_2d, shape, dtype):
  x = make_heavy_tailed(shape, dtype, seed=_seed(block_2d, shape, dtype))
  q = quantize_jit(jnp.asarray(x), block_2d=block_2d)
  assert q.codes.dtype == jnp.uint8 and q.scales.dtype == jnp.float8_e4m3fn
  assert q.amax.dtype == jnp.float32
  chex.assert_shape([q.codes, q.scales, q.amax],
                    [(*shape[:-1], shape[-1] // 2),
                     (*shape[:-1], shape[-1] // 16), ()])
  assert_matches_reference(q, *ref.quantize(x, block_2d=block_2d))
  if x.size >= 1024:
    assert_scales_diverse(q.scales[..., :: 16 if block_2d else 1, :])


@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_bit_exact_many_tensors(block_2d):
  """64 independent tensors (vmap: one amax each) through one compilation."""
  xs = np.stack([make_heavy_tailed((32, 64), seed=s, sigma=2.0)
                 for s in range(64)])
  q = jax.jit(jax.vmap(functools.partial(nf.quantize, block_2d=block_2d)))(
      jnp.asarray(xs))
  for i in range(xs.shape[0]):
    qi = jax.tree.map(lambda a: a[i], q)
    assert_matches_reference(qi, *ref.quantize(xs[i], block_2d=block_2d))


def test_dequantize_bit_exact(heavy_tailed):
  x = heavy_tailed((32, 64), seed=3)
  q = quantize_jit(jnp.asarray(x))
  want = ref.dequantize(*ref.quantize(x))
  np.testing.assert_array_equal(f32_bits(dequantize_jit(q)), f32_bits(want))
  got16 = dequantize_jit(q, dtype=jnp.bfloat16)
  assert got16.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got16),
                                want.astype(ml_dtypes.bfloat16))


def test_dequantize_bit_exact_many_tensors():
  """The dequantization factor is the correctly rounded `amax / 2688` (XLA
  turns a division by a constant into a multiplication by its reciprocal,
  one ulp off for ~1 amax in 5: one tensor is not enough to see it)."""
  xs = np.stack([make_heavy_tailed((16, 32), seed=100 + s) for s in range(48)])
  q = jax.jit(jax.vmap(nf.quantize))(jnp.asarray(xs))
  deq = np.asarray(jax.jit(jax.vmap(nf.dequantize))(q))
  factor = np.asarray(jax.vmap(lambda a: nf.block_dequantize(a)[1])(q))
  for i in range(xs.shape[0]):
    packed, scales, amax = ref.quantize(xs[i])
    np.testing.assert_array_equal(f32_bits(deq[i]),
                                  f32_bits(ref.dequantize(packed, scales, amax)))
    assert f32_bits(factor[i]) == f32_bits(F32(amax) / F32(2688))


def test_div_rn_is_correctly_rounded():
  """The scales' divisions are IEEE round-to-nearest on every backend (XLA:GPU
  divides with the approximate `div.full.f32`; TE with `div.rn.f32`)."""
  rng = np.random.default_rng(2)
  n = 200000
  a = (rng.uniform(1, 2, n) * np.exp2(rng.integers(-126, 128, n))).astype(F32)
  a *= np.where(rng.uniform(size=n) < 0.5, -1, 1).astype(F32)
  b = (rng.uniform(1, 2, n) * np.exp2(rng.integers(-126, 128, n))).astype(F32)
  sp = np.array([0, -0.0, np.inf, -np.inf, np.nan, 1e-39, FLT_MAX, 1.2e-38, 1,
                 2688, 7], F32)
  sa, sb = np.meshgrid(sp, sp)
  a, b = np.concatenate([a, sa.ravel()]), np.concatenate([b, sb.ravel()])
  with np.errstate(all="ignore"):
    # Division in float64 rounded to float32 is correctly rounded (53 >= 2*24+2).
    want = ref.ftz((ref.ftz(a).astype(np.float64) / ref.ftz(b)).astype(F32))
  got = np.asarray(jax.jit(nm.div_rn)(a, b))
  same = (f32_bits(got) == f32_bits(want)) | (np.isnan(got) & np.isnan(want))
  assert np.all(same), (a[~same][:4], b[~same][:4], got[~same][:4])


def test_tensor_decode_factor_correctly_rounded():
  amax = np.random.default_rng(0).uniform(0, 1000, 4096).astype(F32)
  want = f32_bits(amax / F32(2688))
  np.testing.assert_array_equal(
      f32_bits(jax.jit(nm.global_decode_scale)(amax)), want)
  np.testing.assert_array_equal(f32_bits(nm.global_decode_scale(amax)), want)
  assert np.isposinf(float(nm.global_decode_scale(jnp.float32(np.inf))))
  assert np.isnan(float(nm.global_decode_scale(jnp.float32(np.nan))))


def test_gemm_alpha_is_tes_form():
  """TE's `compute_nvfp4_per_tensor_scale_kernel`: amax_A * amax_B *
  f32(1 / 2688^2)."""
  rng = np.random.default_rng(1)
  amax = rng.uniform(0, 1000, (512, 2)).astype(F32)
  mk = lambda a: nf.NVFP4Array(jnp.zeros((1, 8), jnp.uint8),
                               jnp.zeros((1, 1), jnp.float8_e4m3fn), a)
  got = jax.jit(jax.vmap(lambda a, b: gemm_ref.gemm_alpha(mk(a), mk(b))))(
      amax[:, 0], amax[:, 1])
  want = (amax[:, 0] * amax[:, 1]) * F32(1.0 / (2688.0 * 2688.0))
  np.testing.assert_array_equal(f32_bits(got), f32_bits(want))


def test_scale_uses_folded_one_sixth():
  """`block_amax * (S_enc * (1/6))` rounds once; `(block_amax / 6) * S_enc`
  rounds twice and gives another E4M3 byte on these blocks (found by search)."""
  rng = np.random.default_rng(0)
  e4m3 = np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                   .astype(np.float64))
  e4m3 = e4m3[np.isfinite(e4m3) & (e4m3 > 0.01)]
  mids = (e4m3[:-1] + e4m3[1:]) / 2
  amax = rng.uniform(1, 1000, 20000).astype(F32)
  s = F32(2688) / amax
  b = (rng.choice(mids, amax.size).astype(F32) / (s * F32(1 / 6))).astype(F32)
  b = np.nextafter(b, F32(np.inf))
  folded = np.minimum(b * (s * F32(1 / 6)), F32(448)).astype(ml_dtypes.float8_e4m3fn)
  twice = np.minimum((b / F32(6)) * s, F32(448)).astype(ml_dtypes.float8_e4m3fn)
  pick = np.nonzero(folded.astype(F32) != twice.astype(F32))[0][:32]
  assert pick.size >= 8
  x = np.zeros((pick.size, 1, 32), F32)
  x[:, 0, 0] = amax[pick]
  x[:, 0, 16] = b[pick]
  q = jax.jit(jax.vmap(nf.quantize))(jnp.asarray(x))
  got = scale_bytes(q.scales)[:, 0, 1]
  np.testing.assert_array_equal(got, scale_bytes(folded[pick]))
  assert np.all(got != scale_bytes(twice[pick]))


def test_e4m3_scale_cast_is_rtne():
  """Every E4M3 rounding midpoint and one FP32 ulp either side; a cast that
  went through float16 first (double rounding) fails on the `+1 ulp` side."""
  e4m3 = np.unique(np.arange(128, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                   .astype(np.float64))
  e4m3 = e4m3[np.isfinite(e4m3)]
  mids = ((e4m3[:-1] + e4m3[1:]) / 2).astype(F32)
  d = np.concatenate([mids, np.nextafter(mids, F32(0)),
                      np.nextafter(mids, F32(np.inf)), e4m3.astype(F32),
                      np.array([448.0, 449.0, 464.0, 1e30, 2.0**-10, 1e-5], F32)])
  got = jax.jit(nm.nvfp4_block_decode_scale)(jnp.asarray(d), jnp.float32(1.0))
  want = np.minimum(d, F32(448)).astype(ml_dtypes.float8_e4m3fn)
  np.testing.assert_array_equal(scale_bytes(got), scale_bytes(want))
  # Ties to even, clamp above, no clamp below.
  assert float(got[0]) == 0.0  # 2^-10: halfway between 0 and 2^-9 -> 0
  assert float(got[-6]) == 448.0 and float(got[-4]) == 448.0


# ----------------------------------------------------------------------------
# E2M1 rounding.
# ----------------------------------------------------------------------------

MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)
# (below, at, above) magnitude codes for each midpoint: ties to the even code.
MID_CODES = [(0, 0, 1), (1, 2, 2), (2, 2, 3), (3, 4, 4), (4, 4, 5), (5, 6, 6),
             (6, 6, 7)]


def _threshold_values():
  vals, codes = [], []
  for m, (lo, at, hi) in zip(MIDPOINTS, MID_CODES):
    for sign, sbit in ((1.0, 0), (-1.0, 8)):
      v = F32(sign * m)
      vals += [np.nextafter(v, F32(0)), v, np.nextafter(v, F32(sign * np.inf))]
      codes += [lo | sbit, at | sbit, hi | sbit]
  extra = {6.0: 7, np.nextafter(F32(6), F32(0)): 7, 6.5: 7, 1e30: 7,
           np.inf: 7, 0.0: 0, 1e-30: 0, 0.5: 1, 4.0: 6, 3.0: 5}
  for v, c in extra.items():
    vals += [F32(v), F32(-v)]
    codes += [c, c | 8]
  return np.array(vals, F32), np.array(codes, np.uint8)


def test_e2m1_rounding_thresholds_through_quantize():
  """±1 ulp around every E2M1 midpoint, both signs, through `quantize`.

  The tensor is built so that the block encode scale is exactly 1: amax 2688
  gives S_enc = 1, and a block amax of 6 gives d = fl(6 * fl(1/6)) = 1. Then
  y = x, and the codes are those of the rounding alone.
  """
  vals, want = _threshold_values()
  vals = np.clip(vals, -6, 6)  # keep block amax 6 (saturation tested below)
  want = np.where(np.abs(vals) == 6, (want & 8) | 7, want)
  rows = -(-vals.size // 15)
  x = np.zeros((rows, 2, 16), F32)
  x[:, 0, 0] = 2688.0
  x[:, 1, 0] = 6.0
  body = np.zeros(rows * 15, F32)
  body[: vals.size] = vals
  x[:, 1, 1:] = body.reshape(rows, 15)
  q = quantize_jit(jnp.asarray(x.reshape(rows, 32)))
  s = ref.scaled_values(x.reshape(rows, 32))
  assert np.all(s["enc"][:, 1] == 1.0)
  assert np.all(s["y"].reshape(rows, 2, 16)[:, 1] == x[:, 1])
  codes = codes_of(q).reshape(rows, 2, 16)[:, 1, 1:].reshape(-1)[: vals.size]
  np.testing.assert_array_equal(codes, want)


def test_e2m1_encode_nearest_table():
  vals, want = _threshold_values()
  np.testing.assert_array_equal(np.asarray(nm.e2m1_encode_nearest(vals)), want)
  np.testing.assert_array_equal(ref.e2m1_rtne(vals), want)
  # Dense sweep against the reference's (differently written) rounding.
  rng = np.random.default_rng(1)
  y = np.concatenate([rng.uniform(-7, 7, 100000).astype(F32),
                      (np.arange(-8 * 64, 8 * 64) / F32(64)).astype(F32)])
  np.testing.assert_array_equal(np.asarray(nm.e2m1_encode_nearest(y)),
                                ref.e2m1_rtne(y))


def test_e2m1_encode_nearest_every_binade():
  """The addition-based rounding against the threshold search, on random bit
  patterns of every FP32 exponent (subnormals, huge values, infinities and
  NaNs included; all 2^32 patterns were checked once offline against the
  former bit-cut implementation)."""
  rng = np.random.default_rng(7)
  bits = rng.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32)
  bits[:512] = (np.arange(512, dtype=np.uint32) << 23)  # +-2^e, +-0, +-inf
  y = bits.view(F32)
  got = np.asarray(nm.e2m1_encode_nearest(jnp.asarray(y)))
  want = ref.e2m1_rtne(y)
  nan = np.isnan(y)
  assert nan.any() and np.isinf(y).any()
  np.testing.assert_array_equal(got[~nan], want[~nan])
  np.testing.assert_array_equal(got[nan] & 7, 0)  # NaN: the scales carry it.


def test_e2m1_decode_table():
  codes = jnp.arange(16, dtype=jnp.uint8)
  got = np.asarray(nf.e2m1_decode(codes))
  np.testing.assert_array_equal(got, [0, .5, 1, 1.5, 2, 3, 4, 6,
                                      -0., -.5, -1, -1.5, -2, -3, -4, -6])
  np.testing.assert_array_equal(got, nf.E2M1_VALUES)
  assert np.signbit(got[8]) and not np.signbit(got[0])
  assert nf.e2m1_decode(codes, jnp.bfloat16).dtype == jnp.bfloat16
  # The codes are the E2M1 bit patterns of ml_dtypes' float4_e2m1fn.
  np.testing.assert_array_equal(
      np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(F32),
      got)


def test_pack_unpack_round_trip():
  rng = np.random.default_rng(2)
  codes = rng.integers(0, 16, (3, 5, 64), dtype=np.uint8)
  packed = nf.pack_e2m1(jnp.asarray(codes))
  assert packed.dtype == jnp.uint8 and packed.shape == (3, 5, 32)
  np.testing.assert_array_equal(np.asarray(packed), ref.pack(codes))
  np.testing.assert_array_equal(np.asarray(nf.unpack_e2m1(packed)), codes)
  # Even element in the low nibble.
  assert int(nf.pack_e2m1(jnp.array([1, 2], jnp.uint8))[0]) == 0x21
  np.testing.assert_array_equal(
      np.asarray(nf.unpack_e2m1(jnp.array([0xF0, 0x0A], jnp.uint8))),
      [0x0, 0xF, 0xA, 0x0])


# ----------------------------------------------------------------------------
# Zeros, underflow, extremes, subnormals, non-finite values.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zero_tensor(dtype):
  q = quantize_jit(jnp.zeros((16, 32), JNP_DTYPES[dtype]))
  assert float(q.amax) == 0.0
  assert not np.any(np.asarray(q.codes))
  assert not np.any(scale_bytes(q.scales))
  out = np.asarray(dequantize_jit(q))
  assert np.all(out == 0) and np.all(np.isfinite(out))
  q2 = quantize_jit(jnp.zeros((16, 32)), block_2d=True)
  assert np.all(np.asarray(dequantize_jit(q2)) == 0)


def test_zero_blocks(heavy_tailed):
  x = heavy_tailed((32, 64), seed=4)
  x[3, 16:32] = 0.0
  x[7, :16] = -0.0
  x[16:32, 32:48] = 0.0  # a whole 16x16 tile
  for block_2d in (False, True):
    q = quantize_jit(jnp.asarray(x), block_2d=block_2d)
    assert_matches_reference(q, *ref.quantize(x, block_2d=block_2d))
    codes, sb = codes_of(q), scale_bytes(q.scales)
    assert np.all(sb[16:32, 2] == 0) and np.all(codes[16:32, 32:48] == 0)
    out = np.asarray(dequantize_jit(q))
    assert np.all(out[16:32, 32:48] == 0) and np.all(out[3, 16:32] == 0)
    if not block_2d:
      assert sb[3, 1] == 0 and sb[7, 0] == 0
      np.testing.assert_array_equal(codes[7, :16], 8)  # -0.0 keeps its sign
    assert np.all(np.isfinite(out))


def test_underflowing_block_scales():
  """A block with block_amax / amax <= 2^-10 / 448 gets the E4M3 scale 0 (no
  lower clamp) and dequantizes to zeros. Its codes are what TE's arithmetic
  gives: e = min(1/0, FLT_MAX) = FLT_MAX, so nonzero values saturate to +-6
  (NVFP4_SPEC section 2, step 3). The next block, just above the threshold,
  gets the smallest subnormal scale 2^-9."""
  amax = F32(1e4)
  thresh = F32(2.0**-10) / (F32(2688) / amax * F32(1 / 6))
  x = np.zeros((1, 64), F32)
  x[0, 0] = amax
  x[0, 16:32] = np.linspace(-1, 1, 16, dtype=F32) * thresh * F32(0.99)
  x[0, 20] = 0.0
  x[0, 32:48] = np.linspace(-1, 1, 16, dtype=F32) * thresh * F32(1.01)
  q = quantize_jit(jnp.asarray(x))
  assert_matches_reference(q, *ref.quantize(x))
  sc = np.asarray(q.scales.astype(jnp.float32))[0]
  assert sc[1] == 0.0 and sc[2] == 2.0**-9
  codes = codes_of(q)[0]
  np.testing.assert_array_equal(codes[16:32] & 7, np.where(x[0, 16:32] == 0, 0, 7))
  out = np.asarray(dequantize_jit(q))[0]
  assert np.all(out[16:32] == 0) and np.all(np.isfinite(out))
  assert np.max(np.abs(out[32:48])) > 0


@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_values_near_float32_max(block_2d):
  rng = np.random.default_rng(5)
  x = (rng.uniform(-1, 1, (16, 32)) * FLT_MAX).astype(F32)
  x[0, 0] = FLT_MAX
  x[5, 17] = -FLT_MAX
  x[9, 3] = np.nextafter(FLT_MAX, F32(0))
  q = quantize_jit(jnp.asarray(x), block_2d=block_2d)
  assert_matches_reference(q, *ref.quantize(x, block_2d=block_2d))
  out = np.asarray(dequantize_jit(q))
  assert np.all(np.isfinite(out))
  assert out[0, 0] == FLT_MAX and out[5, 17] == -FLT_MAX
  # Within NVFP4's error: a quarter of the value, or half a step of the
  # smallest grid interval (block_amax / 24).
  x64 = x.astype(np.float64)
  bmax = np.repeat(ref.block_amax(x, block_2d).astype(np.float64), 16, axis=-1)
  assert np.all(np.abs(out - x64) <= 0.26 * np.abs(x64) + bmax / 23)


def test_f32_subnormals():
  rng = np.random.default_rng(6)
  x = rng.standard_normal((16, 64)).astype(F32)
  sub = np.array([1e-39, -1e-39, 1.1e-38, -1e-45, 5e-42], F32)
  x[2, :5] = sub
  x[4, 16:32] = np.resize(sub, 16)  # a block of subnormals only
  for block_2d in (False, True):
    q = quantize_jit(jnp.asarray(x), block_2d=block_2d)
    assert_matches_reference(q, *ref.quantize(x, block_2d=block_2d))
    codes = codes_of(q)
    np.testing.assert_array_equal(codes[2, :5], np.where(np.signbit(sub), 8, 0))
    assert np.all(codes[4, 16:32] & 7 == 0)
    assert np.all(np.asarray(dequantize_jit(q))[4, 16:32] == 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_all_subnormal_tensor_quantizes_to_zero(dtype):
  x = np.full((16, 16), 1e-39, F32)
  x[::2] *= -1
  xx = jnp.asarray(x).astype(JNP_DTYPES[dtype])
  q = quantize_jit(xx)
  assert_matches_reference(q, *ref.quantize(np.asarray(xx)))
  assert float(q.amax) == 0.0
  out = np.asarray(dequantize_jit(q))
  assert np.all(out == 0) and np.all(np.isfinite(out))


def test_float16_subnormals_are_kept():
  """float16 subnormals (>= 6e-8) are normal FP32 numbers: not flushed."""
  x = np.zeros((1, 64), np.float16)
  x[0, ::16] = [6e-8, -1e-6, 3e-5, 1e-7]
  q = quantize_jit(jnp.asarray(x))
  assert_matches_reference(q, *ref.quantize(x))
  assert float(q.amax) == F32(np.float16(3e-5))
  np.testing.assert_allclose(np.asarray(dequantize_jit(q))[0, ::16],
                             x[0, ::16].astype(F32), rtol=0.07)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("pos", [(0, 0), (7, 33), (15, 63)])
@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_non_finite_input_gives_non_finite_output(bad, pos, block_2d):
  x = make_heavy_tailed((16, 64), seed=7)
  x[pos] = bad
  q = quantize_jit(jnp.asarray(x), block_2d=block_2d)
  out = np.asarray(dequantize_jit(q))
  assert not np.any(np.isfinite(out)), "finite garbage from a non-finite input"
  vals, factor = nf.block_dequantize(q)
  assert not np.isfinite(float(factor)) or not np.any(np.isfinite(np.asarray(vals)))


def test_nan_with_supplied_amax_poisons_its_block():
  """With a caller-supplied (finite) amax, a NaN still reaches its block scale."""
  x = make_heavy_tailed((16, 64), seed=8)
  x[3, 20] = np.nan
  q = quantize_jit(jnp.asarray(x), amax=jnp.float32(np.nanmax(np.abs(x))))
  assert np.isnan(float(q.scales[3, 1].astype(jnp.float32)))
  out = np.asarray(dequantize_jit(q))
  assert np.all(np.isnan(out[3, 16:32]))
  mask = np.zeros(x.shape, bool)
  mask[3, 20] = True
  assert_matches_reference(q, *ref.quantize(x, amax=np.nanmax(np.abs(x))),
                           mask=mask)


def test_amax_argument(heavy_tailed):
  x = heavy_tailed((32, 64), seed=9)
  default = quantize_jit(jnp.asarray(x))
  explicit = quantize_jit(jnp.asarray(x), amax=jnp.max(jnp.abs(jnp.asarray(x))))
  assert_matches_reference(explicit, default.codes, default.scales, default.amax)
  # A larger amax (e.g. the pmax over shards) changes the scales, as TE would.
  big = F32(3.0 * np.max(np.abs(x)))
  q = quantize_jit(jnp.asarray(x), amax=big)
  assert float(q.amax) == big
  assert_matches_reference(q, *ref.quantize(x, amax=big))
  assert np.any(scale_bytes(q.scales) != scale_bytes(default.scales))
  np.testing.assert_array_equal(
      np.asarray(dequantize_jit(q)), ref.dequantize(*ref.quantize(x, amax=big)))
  # Traced amax, 2D.
  q2 = jax.jit(lambda v, a: nf.quantize(v, block_2d=True, amax=a))(
      jnp.asarray(x), big)
  assert_matches_reference(q2, *ref.quantize(x, block_2d=True, amax=big))
  # Python float amax.
  q3 = quantize_jit(jnp.asarray(x), amax=float(big))
  assert_matches_reference(q3, *ref.quantize(x, amax=big))


# ----------------------------------------------------------------------------
# 2D (16x16) scaling.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(48, 80), (64, 32), (3, 32, 48)])
def test_2d_codes_of_w_and_wt_are_transposes(shape):
  w = make_heavy_tailed(shape, seed=_seed("2d", shape), sigma=2.0)
  wt = np.swapaxes(w, -1, -2)
  q = quantize_jit(jnp.asarray(w), block_2d=True)
  qt = quantize_jit(jnp.asarray(wt), block_2d=True)
  np.testing.assert_array_equal(np.swapaxes(codes_of(q), -1, -2), codes_of(qt))
  assert float(q.amax) == float(qt.amax)
  # Scales: one per tile, replicated over its 16 rows, indexed by i // 16.
  sb, sbt = scale_bytes(q.scales), scale_bytes(qt.scales)
  rows = np.arange(shape[-2])
  np.testing.assert_array_equal(sb, sb[..., (rows // 16) * 16, :])
  tiles = sb[..., ::16, :]
  np.testing.assert_array_equal(np.swapaxes(tiles, -1, -2), sbt[..., ::16, :])
  assert_scales_diverse(tiles)
  # And the tile scale is the one of the tile's amax.
  assert_matches_reference(q, *ref.quantize(w, block_2d=True))
  # The same data with 1x16 scaling does NOT have this property: the check
  # above is not vacuous.
  q1 = quantize_jit(jnp.asarray(w))
  q1t = quantize_jit(jnp.asarray(wt))
  assert np.any(np.swapaxes(codes_of(q1), -1, -2) != codes_of(q1t))


def test_nvfp4_array_transpose(heavy_tailed):
  w = heavy_tailed((48, 64), seed=10, sigma=2.0)
  q = quantize_jit(jnp.asarray(w), block_2d=True)
  qt = quantize_jit(jnp.asarray(w.T), block_2d=True)
  t = jax.jit(lambda a: a.T)(q)
  assert t.block_2d and t.shape == (64, 48)
  assert_matches_reference(t, qt.codes, qt.scales, qt.amax)
  np.testing.assert_array_equal(np.asarray(dequantize_jit(t)),
                                np.asarray(dequantize_jit(q)).T)
  assert_matches_reference(t.T, q.codes, q.scales, q.amax)


# ----------------------------------------------------------------------------
# Block dequantization and the block-scaled GEMM.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_block_dequantize_bf16_is_exact(block_2d, heavy_tailed):
  x = heavy_tailed((32, 64), seed=11)
  q = quantize_jit(jnp.asarray(x), block_2d=block_2d)
  vals, factor = jax.jit(nf.block_dequantize)(q)
  assert vals.dtype == jnp.bfloat16 and factor.dtype == jnp.float32
  packed, scales, amax = ref.quantize(x, block_2d=block_2d)
  exact = (ref.e2m1_value(ref.unpack(packed)).reshape(32, 4, 16)
           * scales.astype(F32)[..., None]).reshape(32, 64)
  np.testing.assert_array_equal(np.asarray(vals).astype(F32), exact)
  assert float(factor) == F32(amax) / F32(2688)
  np.testing.assert_array_equal(
      np.asarray(vals.astype(jnp.float32) * factor),
      np.asarray(dequantize_jit(q)))


@pytest.mark.parametrize("w_2d", [False, True])
def test_block_scaled_matmul_equals_dequantize_then_matmul(w_2d, heavy_tailed):
  x = heavy_tailed((32, 64), seed=12)
  w = heavy_tailed((48, 64), seed=13)
  qx = quantize_jit(jnp.asarray(x))
  qw = quantize_jit(jnp.asarray(w), block_2d=w_2d)
  got = np.asarray(jax.jit(gemm_api.block_scaled_matmul)(qx, qw))
  dx = np.asarray(dequantize_jit(qx)).astype(np.float64)
  dw = np.asarray(dequantize_jit(qw)).astype(np.float64)
  want = dx @ dw.T
  tol = 1e-5 * (np.abs(dx) @ np.abs(dw).T) + 1e-30
  assert np.all(np.abs(got - want) <= tol)
  alpha = float(gemm_ref.gemm_alpha(qx, qw))
  assert alpha == F32(F32(qx.amax) * F32(qw.amax)) * F32(1 / (2688.0 * 2688.0))
  out16 = gemm_api.block_scaled_matmul(qx, qw, out_dtype=jnp.bfloat16)
  assert out16.dtype == jnp.bfloat16 and out16.shape == (32, 48)


# ----------------------------------------------------------------------------
# Transformations and pytree structure.
# ----------------------------------------------------------------------------


def test_vmap_matches_per_slice(heavy_tailed):
  xs = heavy_tailed((4, 16, 64), seed=14)
  qv = jax.jit(jax.vmap(nf.quantize))(jnp.asarray(xs))
  dv = jax.jit(jax.vmap(nf.dequantize))(qv)
  for i in range(4):
    qi = quantize_jit(jnp.asarray(xs[i]))
    assert_matches_reference(jax.tree.map(lambda a: a[i], qv),
                             qi.codes, qi.scales, qi.amax)
    np.testing.assert_array_equal(np.asarray(dv[i]), np.asarray(dequantize_jit(qi)))
  # vmap of a 2D quantization over a stack of weights.
  q2 = jax.jit(jax.vmap(functools.partial(nf.quantize, block_2d=True)))(
      jnp.asarray(xs))
  for i in range(4):
    assert_matches_reference(jax.tree.map(lambda a: a[i], q2),
                             *ref.quantize(xs[i], block_2d=True))


def test_eager_equals_jit(heavy_tailed):
  x = jnp.asarray(heavy_tailed((16, 32), seed=15))
  a, b = nf.quantize(x, block_2d=True), quantize_jit(x, block_2d=True)
  assert_matches_reference(a, b.codes, b.scales, b.amax)


def test_pytree_roundtrip(heavy_tailed):
  q = quantize_jit(jnp.asarray(heavy_tailed((16, 32), seed=16)), block_2d=True)
  leaves, treedef = jax.tree.flatten(q)
  assert len(leaves) == 3
  q2 = jax.tree.unflatten(treedef, leaves)
  assert isinstance(q2, nf.NVFP4Array) and q2.block_2d
  assert q2.shape == (16, 32) and q2.ndim == 2
  # block_2d is static: it is part of the tree structure.
  q1 = quantize_jit(jnp.zeros((16, 32)))
  assert jax.tree.structure(q1) != treedef


def test_reference_quantizer_is_traced_once_per_shape_and_setting():
  """The reference quantizer is a `jax.jit` of its own: a model's
  quantizers of one shape and setting share one trace (the same jaxpr
  object in each call), another shape or setting gets its own."""
  x = jnp.ones((32, 64), jnp.float32)

  def f(a, b, c):
    return (nf.quantize(a, implementation="xla").codes,
            nf.quantize(b, implementation="xla").codes,
            nf.quantize(c, block_2d=True, implementation="xla").codes)

  jaxpr = jax.make_jaxpr(f)(x, x + 1, x + 2).jaxpr
  calls = [e.params["jaxpr"] for e in jaxpr.eqns
           if e.primitive.name in ("pjit", "jit")
           and e.params.get("name") == "_quantize"]
  assert len(calls) == 3, jaxpr
  assert calls[0] is calls[1] and calls[2] is not calls[0]
