"""The GPU encoder (`pallas_kernels.e2m1_encode.block_encoder`) equals the
reference.

`e2m1_encode._ENCODE_ASM` rounds to E2M1 with FP32 fused multiply-adds: three
candidate codes, one per grid regime, and their minimum (see the comment
above `e2m1_encode._code_asm`). Two checks:

- On every machine, a NumPy model of that arithmetic (each FFMA's FP32
  rounding, to nearest or up, and the minimum of bit patterns written out)
  equals
  `numerics.e2m1_encode_nearest` / `e2m1_encode_stochastic` on every FP32
  boundary that matters: each grid value, tie and stochastic threshold and
  its FP32 neighbours, a dense sweep of every binade the codes depend on,
  random values, all 256 random bytes, and the special values.
- On the GPU, the assembly itself: codes and block values bit for bit equal to
  the reference's (`tile.encode_blocks` without an encoder) on the same
  inputs, in a kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng
from nvfp4_jax.core import tile
from nvfp4_jax.ops.quantize_pair import api as pair_api
from nvfp4_jax.core.recipe import Operand
from pallas_kernels import e2m1_encode
from pallas_kernels import launch
from nvfp4_jax.ops.quantize import pallas_triton as pallas_quantize
from nvfp4_jax.ops.quantize_pair import pallas_triton as pallas_pair
from nvfp4_jax.ops.quantize_rht_t import pallas_triton as pallas_rht

ON_GPU = jax.default_backend() == "gpu"

# The grid values, the RTNE ties and the regime edges of |y|.
_POINTS = np.array([0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4,
                    5, 6, 7, 8, 12, 16], np.float32)


def _neighbours(points: np.ndarray, n: int = 4) -> np.ndarray:
  """`points` and their `n` FP32 neighbours on each side."""
  out = [points]
  lo = hi = points.astype(np.float32)
  for _ in range(n):
    lo = np.nextafter(lo, np.float32(-np.inf))
    hi = np.nextafter(hi, np.float32(np.inf))
    out += [lo, hi]
  return np.concatenate(out)


def _magnitudes(seed: int = 0) -> np.ndarray:
  """Non-negative FP32 test magnitudes (see the module docstring)."""
  rng = np.random.default_rng(seed)
  # Every 2^-11 of the significand in each binade from 2^-12 to 2^4: every
  # value of an E2M1 step that SR's 1/512 resolves, and more.
  sig = 1 + np.arange(2**11, dtype=np.float64) / 2**11
  sweep = np.concatenate([sig * 2.0**e for e in range(-12, 5)])
  # SR's thresholds: lo + (r + 1/2) / 256 steps, for every grid interval.
  grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, 8])
  steps = np.diff(grid)
  frac = (np.arange(256) + 0.5) / 256
  thresholds = (grid[:-1, None] + steps[:, None] * frac[None]).ravel()
  rand = np.concatenate([rng.uniform(0, 9, 20000),
                         np.exp(rng.uniform(-60, 60, 5000))])
  mags = np.concatenate([_neighbours(_POINTS), _neighbours(
      thresholds.astype(np.float32), 2), sweep, rand,
                         [1e-30, 2.0**-126, 3e38, np.inf]])
  return mags.astype(np.float32)


def _with_signs(mags: np.ndarray) -> np.ndarray:
  return np.concatenate([mags, -mags, np.float32([np.nan, -np.nan])])


def _round_f32(t: np.ndarray, up: bool) -> np.ndarray:
  """FP32 rounding of float64 `t`: to nearest even, or up (toward +inf)."""
  f = t.astype(np.float32)
  if up:
    f = np.where(f.astype(np.float64) < t, np.nextafter(f, np.float32(np.inf)),
                 f)
  return f


def _round_f32_magic(n: np.ndarray, w: np.ndarray, up: bool) -> np.ndarray:
  """FP32 rounding of `n + w` (n an integer in [2^22, 2^24), w a float64 in
  (-1, 16]), exactly: the integer and fractional parts are kept apart (the
  sum itself would need more than 53 bits). Below 2^23 the FP32 ulp is 1/2,
  from 2^23 on it is 1; ties go to the even multiple."""
  fl = np.floor(w)
  i, frac = n + fl.astype(np.int64), w - fl  # Both exact.
  ulp = np.where(i < 2**23, 0.5, 1.0)
  k, rem = np.floor(frac / ulp), frac / ulp - np.floor(frac / ulp)
  if up:
    k = k + (rem > 0)
  else:
    odd = ((i / ulp + k) % 2) == 1
    k = k + ((rem > 0.5) | ((rem == 0.5) & odd))
  return (i + k * ulp).astype(np.float32)


def _model(y: np.ndarray, r: np.ndarray | None) -> np.ndarray:
  """The assembly's arithmetic, each FP32 rounding written out.

  `u = sat(ftz(|y| * 0.125))` (NaN -> 0). To nearest: `C_j = RN(u * K_j +
  2^23 + off_j)`, K = 16, 8, 4. Stochastic: `q = -(2r + 1)`, `v_j = RP(u *
  K_j + q)`, `C_j = RP(v_j * 2^-9 + 2^23 + 1 + off_j)`, K = 8192, 4096, 2048.
  Offsets 0, 2, 4. The minimum of the candidates' bit patterns and the
  saturation's, minus the base pattern, is the code's low nibble; the sign is
  bit 31 of `y`. (`v_j` is rounded from its float64 sum: where that is
  inexact, `u * K_j` is below 2^-40 and no rounding of `v_j` moves
  `v_j / 512` across the integer or half-integer that decides `C_j`.)
  """
  u = (np.abs(y) * np.float32(0.125)).astype(np.float64)
  u = np.where(np.isnan(u) | (u < 2.0**-126), 0.0, np.minimum(u, 1.0))
  offs = np.array([0, 2, 4], np.int64)
  if r is None:
    base = 0x4B000000
    c = _round_f32_magic(2**23 + offs, u[..., None] * np.array([16., 8., 4.]),
                         up=False)
  else:
    base = 0x4B000001
    q = -(2 * r.astype(np.float64) + 1)[..., None]
    v = _round_f32(u[..., None] * np.array([8192., 4096., 2048.]) + q,
                   up=True).astype(np.float64)
    c = _round_f32_magic(2**23 + 1 + offs, v * 2.0**-9, up=True)
  m = np.minimum(c.view(np.uint32).min(-1), np.uint32(base + 7))
  code = ((m - np.uint32(base)) & np.uint32(0xF)).astype(np.uint8)
  sign = (y.view(np.uint32) >> 28) & 8
  return code | sign.astype(np.uint8)


def test_model_rounds_to_nearest_as_numerics():
  y = _with_signs(_magnitudes())
  want = np.asarray(nm.e2m1_encode_nearest(jnp.asarray(y)))
  np.testing.assert_array_equal(_model(y, None), want)


def test_model_rounds_stochastically_as_numerics():
  y = _with_signs(_magnitudes(1))
  for r in range(256):  # Every random byte, on every value.
    rb = np.full(y.shape, r, np.uint8)
    want = np.asarray(nm.e2m1_encode_stochastic(jnp.asarray(y),
                                                jnp.asarray(rb)))
    np.testing.assert_array_equal(_model(y, rb), want, err_msg=f"r={r}")


def test_model_catches_candidates_below_2_23():
  """The check has teeth: stochastic candidates based at 2^23 itself (not
  2^23 + 1) round `2^23 + v/512` for `v/512` in (-1, -1/2) to 2^23 - 1/2,
  whose pattern is below every code's; the model reproduces that error."""
  y = _magnitudes(1)
  rb = np.full(y.shape, 255, np.uint8)
  u = np.minimum(np.abs(y.astype(np.float64)) / 8, 1.0)
  q = -(2 * rb.astype(np.float64) + 1)
  v = _round_f32(u * 8192 + q, up=True).astype(np.float64)
  c1 = _round_f32_magic(np.full(y.shape, 2**23, np.int64), v * 2.0**-9, up=True)
  assert (c1.view(np.uint32) < 0x4B000000).any()


def test_model_regime_minimum_is_needed():
  """The check has teeth: with one regime's candidate left out, the model
  disagrees with numerics."""
  y = _magnitudes()
  want = np.asarray(nm.e2m1_encode_nearest(jnp.asarray(y)))
  a = np.minimum(np.abs(y.astype(np.float64)) / 8, 1)
  two = np.minimum(np.minimum(np.rint(16 * a), np.rint(8 * a) + 2), 7)
  assert (two.astype(np.uint8) != want).any()


def test_cvt_model_equals_reference():
  """Blackwell's signed conversion (`e2m1_encode.e2m1x2_cvt_model`, written from
  the PTX ISA's `cvt.rn.satfinite.e2m1x2.f32`) gives the reference's codes
  on every boundary and special value above (both signs, zeros, 3e38, inf);
  NaN gets code 0, one of the reference's two (`e2m1_encode_nearest`: 0 or
  8), the one the other GPU encoders write for the kernels' canonical NaN."""
  y = _with_signs(_magnitudes(4))
  got = e2m1_encode.e2m1x2_cvt_model(y)
  want = np.asarray(nm.e2m1_encode_nearest(jnp.asarray(y)))
  finite = ~np.isnan(y)
  np.testing.assert_array_equal(got[finite], want[finite])
  assert (got[~finite] == 0).all() and ((want[~finite] & 7) == 0).all()
  # Ties to the even code, both signs, and -0 as E2M1's -0 (0x8).
  ties = np.float32([.25, .75, 1.25, 1.75, 2.5, 3.5, 5, 0])
  np.testing.assert_array_equal(e2m1_encode.e2m1x2_cvt_model(ties),
                                [0, 2, 2, 4, 4, 6, 6, 0])
  np.testing.assert_array_equal(e2m1_encode.e2m1x2_cvt_model(-ties),
                                [8, 10, 10, 12, 12, 14, 14, 8])


def test_cvt_model_has_teeth():
  """Ties away from zero instead of to even: the comparison fails."""
  y = _with_signs(_magnitudes(4))
  y = y[~np.isnan(y)]
  mag = np.abs(y)
  away = ((mag[:, None] >= e2m1_encode._E2M1_THRESHOLDS).sum(-1).astype(np.uint8)  # pylint: disable=protected-access
          | np.where(np.signbit(y), np.uint8(8), np.uint8(0)))
  assert (away != np.asarray(nm.e2m1_encode_nearest(jnp.asarray(y)))).any()


def _encode_kernel(y_ref, w_ref, d_ref, codes_ref, pairs_ref, *,
                   stochastic: bool, block_nan: bool = False):
  rwords = w_ref[...] if stochastic else None
  packed, pairs = e2m1_encode.block_encoder(False, block_nan)(
      y_ref[...], rwords, d_ref[...], codes=True, values=True)
  codes_ref[...], pairs_ref[...] = packed, pairs


def _reference(y, words, d, stochastic):
  rbits = prng.word_bytes(words) if stochastic else None
  codes = (nm.e2m1_encode_stochastic(y, rbits) if stochastic
           else nm.e2m1_encode_nearest(y))
  values = (nm.e2m1_decode(codes) * d[..., None]).astype(jnp.bfloat16)
  return nm.pack_e2m1(codes), tile.value_pairs(values)


@pytest.mark.skipif(not ON_GPU, reason="the assembly runs on the GPU")
@pytest.mark.parametrize("stochastic", [False, True],
                         ids=["nearest", "stochastic"])
def test_assembly_equals_reference(stochastic):
  rng = np.random.default_rng(3)
  y = _with_signs(_magnitudes(2))
  y = np.concatenate([y, np.zeros((-y.size) % (16 * 64 * 16), np.float32)])
  rows = y.size // (64 * 16)  # A multiple of the 16-row block.
  y = jnp.asarray(rng.permutation(y).reshape(rows, 64, 16))
  words = jnp.asarray(rng.integers(0, 2**32, (rows, 64, 4), np.uint32))
  # Every E4M3 scale: zero, subnormal, 448, NaN.
  d = jax.lax.bitcast_convert_type(
      jnp.asarray(rng.integers(0, 256, (rows, 64), np.uint8)),
      jnp.float8_e4m3fn).astype(jnp.float32)
  spec = lambda *s: pl.BlockSpec((16, *s), lambda i: (i,) + (0,) * len(s))
  codes, pairs = jax.jit(launch.pallas_call(
      functools.partial(_encode_kernel, stochastic=stochastic),
      interpret=False, num_warps=4, num_stages=1, name="test_encoder",
      grid=(rows // 16,), in_specs=[spec(64, 16), spec(64, 4), spec(64)],
      out_specs=[spec(64, 8), spec(64, 8)],
      out_shape=[jax.ShapeDtypeStruct((rows, 64, 8), jnp.uint8),
                 jax.ShapeDtypeStruct((rows, 64, 8), jnp.uint32)]))(
                     y, words, d)
  want_codes, want_pairs = jax.jit(_reference, static_argnums=3)(
      y, words, d, stochastic)
  np.testing.assert_array_equal(np.asarray(codes), np.asarray(want_codes))
  # Values: bit for bit, except that a NaN scale's NaN has the GPU's payload.
  got_v = tile.values_from_pairs(pairs)
  want_v = tile.values_from_pairs(want_pairs)
  nan = np.isnan(np.asarray(want_v, np.float32))
  assert nan.any() and np.isnan(np.asarray(got_v, np.float32)[nan]).all()
  bits = lambda v: np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint16))
  np.testing.assert_array_equal(bits(got_v)[~nan], bits(want_v)[~nan])


@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernels are compiled for real")
@pytest.mark.parametrize("asm", [True, False], ids=["encoder", "switched_off"])
def test_kernels_lower_with_the_encoder(claim_sm90, monkeypatch, asm):
  """Every quantize kernel, lowered for CUDA, carries the encoder's assembly
  (its rounding to nearest and, with stochastic rounding, rounding up); with
  `ASM_ENCODE` off, none does."""
  monkeypatch.setattr(e2m1_encode, "ASM_ENCODE", asm)
  x = jax.ShapeDtypeStruct((80, 400), jnp.bfloat16)
  key = jax.random.key(0)
  kx, kt = pair_api.split_key(key)
  sr = Operand(rounding="stochastic")
  fns = {
      "1x16 RTNE": lambda x: pallas_quantize.quantize(x),
      "16x16 RTNE": lambda x: pallas_quantize.quantize(x, block_2d=True),
      "1x16 SR values": lambda x: pallas_quantize.quantize(
          x, rounding="stochastic", key=key, with_codes=False),
      "rht_t SR values": lambda x: pallas_rht.quantize_rht_t(
          x, rounding="stochastic", key=key, values=True),
      "X pair": lambda x: pair_api.QUANTIZE_PAIR("pallas", 
          x, Operand(), Operand(rht=True), key_row=None, key_t=None,
          values=(True, False)),
      "dY pair": lambda x: pair_api.QUANTIZE_PAIR("pallas", 
          x, sr, Operand(rounding="stochastic", rht=True), key_row=kx,
          key_t=kt, values=(True, True)),
  }
  for name, fn in fns.items():
    text = jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text, name
    assert ("mul.rn.ftz.sat.f32" in text) == asm, name
    if "SR" in name or "dY" in name:
      assert ("fma.rp.f32" in text) == asm, name


@pytest.mark.skipif(not ON_GPU, reason="the assembly runs on the GPU")
def test_block_nan_encoder_equals_reference():
  """The quantize kernels' encoder (`block_encoder(..., block_nan=True)`;
  on Blackwell the signed E2M1 conversion) on inputs that keep its
  contract: a block is NaN as a whole (the kernels' canonical NaN, code 0)
  or not at all. Codes bit for bit the reference's."""
  rng = np.random.default_rng(5)
  y = _with_signs(_magnitudes(6))
  y = y[~np.isnan(y)]
  y = np.concatenate([y, np.zeros((-y.size) % (16 * 64 * 16), np.float32)])
  rows = y.size // (64 * 16)
  y = rng.permutation(y).reshape(rows, 64, 16)
  nan_block = rng.random((rows, 64)) < 0.05
  y = jnp.asarray(np.where(nan_block[..., None], np.float32(np.nan), y))
  d = jnp.ones((rows, 64), jnp.float32)
  words = jnp.zeros((rows, 64, 4), jnp.uint32)
  spec = lambda *s: pl.BlockSpec((16, *s), lambda i: (i,) + (0,) * len(s))
  codes, _ = jax.jit(launch.pallas_call(
      functools.partial(_encode_kernel, stochastic=False, block_nan=True),
      interpret=False, num_warps=4, num_stages=1, name="test_encoder_nan",
      grid=(rows // 16,), in_specs=[spec(64, 16), spec(64, 4), spec(64)],
      out_specs=[spec(64, 8), spec(64, 8)],
      out_shape=[jax.ShapeDtypeStruct((rows, 64, 8), jnp.uint8),
                 jax.ShapeDtypeStruct((rows, 64, 8), jnp.uint32)]))(
                     y, words, d)
  want, _ = jax.jit(_reference, static_argnums=3)(y, words, d, False)
  want = np.where(nan_block[..., None], 0, np.asarray(want))  # +NaN: code 0.
  np.testing.assert_array_equal(np.asarray(codes), want)
