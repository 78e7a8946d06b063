"""MXFP4 / MXFP8: UE8M0 power-of-two scales rounded up, blocks of 32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import nvfp4_jax as nf
from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
import te_reference as ref
from conftest import make_heavy_tailed

F32 = np.float32
ELEM_MAX = {"mxfp4": 6.0, "mxfp8": 448.0}

quantize_mx_jit = jax.jit(nf.quantize_mx, static_argnums=1,
                          static_argnames=("rounding",))
dequantize_jit = jax.jit(nf.dequantize, static_argnames=("dtype",))


def exponents(q) -> np.ndarray:
  return np.asarray(q.scales).view(np.uint8).astype(np.int64) - 127


def element_values(q) -> np.ndarray:
  if q.fmt == "mxfp4":
    return ref.e2m1_value(np.asarray(nf.unpack_e2m1(q.data)))
  return np.asarray(q.data).astype(F32)


def ref_dequantize(vals, e) -> np.ndarray:
  v = vals.reshape(*vals.shape[:-1], -1, 32).astype(np.float64)
  out = v * np.exp2(e.astype(np.float64))[..., None]
  return ref.ftz(out.reshape(vals.shape).astype(F32))


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(16, 64), (2, 8, 96)])
def test_mx_matches_reference(fmt, dtype, shape):
  x = make_heavy_tailed(shape, dtype, seed=len(fmt) + len(dtype) + shape[-1],
                        sigma=2.0)
  q = quantize_mx_jit(jnp.asarray(x), fmt)
  assert q.fmt == fmt and q.shape == shape
  assert q.scales.dtype == jnp.float8_e8m0fnu
  assert q.scales.shape == (*shape[:-1], shape[-1] // 32)
  if fmt == "mxfp4":
    assert q.data.dtype == jnp.uint8 and q.data.shape == (*shape[:-1], shape[-1] // 2)
  else:
    assert q.data.dtype == jnp.float8_e4m3fn and q.data.shape == shape
  want_vals, want_e = ref.quantize_mx(x, fmt)
  np.testing.assert_array_equal(exponents(q), want_e)
  np.testing.assert_array_equal(element_values(q), want_vals)
  if fmt == "mxfp8":
    np.testing.assert_array_equal(
        np.asarray(q.data).view(np.uint8),
        want_vals.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
  out = np.asarray(dequantize_jit(q))
  np.testing.assert_array_equal(out, ref_dequantize(want_vals, want_e))
  assert np.unique(want_e).size > 6  # the data exercise many scales


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_scales_are_powers_of_two_rounded_up(fmt):
  x = make_heavy_tailed((32, 128), seed=1, sigma=2.0).astype(F32)
  q = quantize_mx_jit(jnp.asarray(x), fmt)
  e = exponents(q).astype(np.float64)
  bmax = np.abs(x.reshape(32, 4, 32)).max(-1).astype(np.float64)
  m = ELEM_MAX[fmt]
  # The smallest power of two that does not saturate the block maximum.
  assert np.all(bmax <= m * np.exp2(e))
  assert np.all(bmax > m * np.exp2(e - 1))
  # The block maximum is represented without saturation: within half a step.
  out = np.asarray(dequantize_jit(q)).reshape(32, 4, 32).astype(np.float64)
  xb = x.reshape(32, 4, 32).astype(np.float64)
  i = np.abs(xb).argmax(-1)[..., None]
  got_max = np.take_along_axis(out, i, -1)[..., 0]
  x_max = np.take_along_axis(xb, i, -1)[..., 0]
  rel = 0.25 if fmt == "mxfp4" else 2.0**-4  # half step / value at the top
  assert np.all(np.abs(got_max - x_max) <= rel * np.abs(x_max))


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_exact_powers_of_two_and_just_above(fmt):
  """block amax == elem_max * 2^k keeps scale 2^k; one ulp more takes 2^(k+1)."""
  m = F32(ELEM_MAX[fmt])
  ks = np.arange(-20, 21)
  at = (m * np.exp2(ks)).astype(F32)
  above = np.nextafter(at, F32(np.inf))
  below = np.nextafter(at, F32(0))
  x = np.zeros((3 * ks.size, 32), F32)
  x[:, 0] = np.concatenate([at, above, below])
  q = quantize_mx_jit(jnp.asarray(x), fmt)
  e = exponents(q)[:, 0]
  np.testing.assert_array_equal(e, np.concatenate([ks, ks + 1, ks]))
  np.testing.assert_array_equal(e, ref.quantize_mx(x, fmt)[1][:, 0])


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_tiny_blocks_do_not_saturate(fmt):
  """Blocks with amax in [2^-126, elem_max * 2^-126): the scale exponent must
  come out exact even though amax / elem_max is an FP32 subnormal (dividing
  first and flushing gave the scale 2^-127 and saturated these blocks)."""
  amaxes = np.array([1.2e-38, 2e-38, 5e-38, 1e-37, 1e-36, 4e-36, 1e-35], F32)
  x = np.zeros((amaxes.size, 32), F32)
  x[:, 0] = amaxes
  x[:, 1] = -amaxes / 3
  q = quantize_mx_jit(jnp.asarray(x), fmt)
  want_vals, want_e = ref.quantize_mx(x, fmt)
  np.testing.assert_array_equal(exponents(q), want_e)
  np.testing.assert_array_equal(element_values(q), want_vals)
  e = exponents(q)[:, 0].astype(np.float64)
  assert np.all(amaxes <= ELEM_MAX[fmt] * np.exp2(e))
  out = np.asarray(dequantize_jit(q))
  np.testing.assert_allclose(out[:, 0], amaxes, rtol=0.25)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_zero_tensor_and_zero_blocks(fmt):
  x = np.zeros((4, 64), F32)
  x[1, 40] = 3.0
  q = quantize_mx_jit(jnp.asarray(x), fmt)
  e = exponents(q)
  assert np.all(e[[0, 2, 3]] == -127) and e[1, 0] == -127
  assert e[1, 1] == (-1 if fmt == "mxfp4" else -7)
  out = np.asarray(dequantize_jit(q))
  np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_block_dequantizes_non_finite(fmt, bad):
  x = make_heavy_tailed((4, 64), seed=2)
  x[2, 37] = bad
  q = quantize_mx_jit(jnp.asarray(x), fmt)
  out = np.asarray(dequantize_jit(q))
  assert np.all(np.isnan(out[2, 32:])), "finite garbage from a non-finite block"
  assert exponents(q)[2, 1] == 255 - 127  # the E8M0 NaN
  np.testing.assert_array_equal(np.isfinite(out[2, :32]), True)
  assert np.all(np.isfinite(np.delete(out, 2, axis=0)))


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_block_dequantize_is_exact_bf16(fmt):
  x = make_heavy_tailed((16, 64), seed=3, sigma=2.0)
  q = quantize_mx_jit(jnp.asarray(x), fmt)
  vals, factor = jax.jit(nf.block_dequantize)(q)
  assert vals.dtype == jnp.bfloat16 and float(factor) == 1.0
  np.testing.assert_array_equal(np.asarray(vals).astype(F32),
                                np.asarray(dequantize_jit(q)))


@pytest.mark.parametrize("fa,fb", [("mxfp4", "mxfp4"), ("mxfp8", "mxfp8"),
                                   ("mxfp4", "nvfp4")])
def test_block_scaled_matmul(fa, fb):
  a = make_heavy_tailed((32, 96), seed=4)
  b = make_heavy_tailed((16, 96), seed=5)
  q = lambda v, f: (jax.jit(nf.quantize)(jnp.asarray(v)) if f == "nvfp4"
                    else quantize_mx_jit(jnp.asarray(v), f))
  qa, qb = q(a, fa), q(b, fb)
  got = np.asarray(jax.jit(gemm_api.block_scaled_matmul)(qa, qb)).astype(np.float64)
  da = np.asarray(dequantize_jit(qa)).astype(np.float64)
  db = np.asarray(dequantize_jit(qb)).astype(np.float64)
  tol = 1e-5 * (np.abs(da) @ np.abs(db).T) + 1e-30
  assert np.all(np.abs(got - da @ db.T) <= tol)


def test_mx_under_vmap_and_pytree():
  xs = make_heavy_tailed((3, 8, 64), seed=6)
  for fmt in ("mxfp4", "mxfp8"):
    qv = jax.jit(jax.vmap(lambda v: nf.quantize_mx(v, fmt)))(jnp.asarray(xs))
    qb = quantize_mx_jit(jnp.asarray(xs), fmt)  # MX has no tensor scale
    np.testing.assert_array_equal(np.asarray(qv.scales).view(np.uint8),
                                  np.asarray(qb.scales).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(qv.data).view(np.uint8),
                                  np.asarray(qb.data).view(np.uint8))
    leaves, treedef = jax.tree.flatten(qb)
    assert len(leaves) == 2
    assert jax.tree.unflatten(treedef, leaves).fmt == fmt
    assert qb.ndim == 3
