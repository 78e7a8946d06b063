"""Bad input gets a clear error that names the offending value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nf
from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
from nvfp4_jax.core import prng


@pytest.mark.parametrize("k", [8, 100, 24, 31])
def test_nvfp4_k_not_multiple_of_16(k):
  pad = -(-k // 16) * 16
  with pytest.raises(ValueError, match=rf"size {k}, not a multiple of 16.*pad it to {pad}"):
    nf.quantize(jnp.ones((4, k)))


@pytest.mark.parametrize("k", [16, 48, 100])
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_k_not_multiple_of_32(k, fmt):
  with pytest.raises(ValueError, match=rf"{fmt}.*size {k}, not a multiple of 32"):
    nf.quantize_mx(jnp.ones((4, k)), fmt)


@pytest.mark.parametrize("shape", [(20, 32), (8, 16), (2, 24, 16)])
def test_2d_rows_not_multiple_of_16(shape):
  with pytest.raises(ValueError, match=rf"16x16.*got shape {re_shape(shape)}"):
    nf.quantize(jnp.ones(shape), block_2d=True)
  jax.jit(nf.quantize)(jnp.ones(shape))  # fine with 1x16 scaling


def test_2d_needs_two_axes():
  with pytest.raises(ValueError, match=r"got shape \(32,\)"):
    nf.quantize(jnp.ones((32,)), block_2d=True)


def re_shape(shape):
  return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize("fn", ["nvfp4", "mxfp4", "mxfp8"])
def test_zero_d(fn):
  with pytest.raises(ValueError, match=r"non-empty array with at least one axis; got shape \(\)"):
    _quantize(fn, jnp.float32(1.0))


@pytest.mark.parametrize("shape", [(0, 16), (0,), (4, 0)])
@pytest.mark.parametrize("fn", ["nvfp4", "mxfp4"])
def test_empty(fn, shape):
  with pytest.raises(ValueError, match=rf"non-empty.*got shape {re_shape(shape)}"):
    _quantize(fn, jnp.ones(shape))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_, jnp.int8])
@pytest.mark.parametrize("fn", ["nvfp4", "mxfp4", "mxfp8"])
def test_integer_dtype(fn, dtype):
  name = jnp.dtype(dtype).name
  with pytest.raises(TypeError, match=rf"got dtype {name}\. Cast it first"):
    _quantize(fn, jnp.ones((4, 32), dtype))


def test_numpy_and_list_inputs_accepted():
  q = jax.jit(nf.quantize)(np.ones((2, 16), np.float32))
  assert q.shape == (2, 16)
  with pytest.raises(TypeError, match="int"):
    nf.quantize([[1] * 16])


@pytest.mark.parametrize("rounding", ["up", "RTNE", "Nearest", ""])
def test_unknown_rounding(rounding):
  with pytest.raises(ValueError, match=rf"unknown rounding {rounding!r}; use one of"):
    nf.quantize(jnp.ones((4, 32)), rounding=rounding)
  with pytest.raises(ValueError, match=rf"unknown rounding {rounding!r}"):
    nf.quantize_mx(jnp.ones((4, 32)), "mxfp4", rounding=rounding)


def test_stochastic_without_key():
  with pytest.raises(ValueError, match=r"rounding='stochastic' needs a key"):
    nf.quantize(jnp.ones((4, 32)), rounding="stochastic")
  with pytest.raises(ValueError, match=r"rounding='stochastic' needs a key"):
    nf.quantize_mx(jnp.ones((4, 32)), "mxfp4", rounding="stochastic")
  with pytest.raises(ValueError, match=r"jax.random.key"):
    jax.jit(lambda x: nf.quantize(x, rounding="stochastic"))(jnp.ones((4, 32)))


def test_mx_unknown_format_and_sr_for_mxfp8():
  with pytest.raises(ValueError, match=r"unknown MX format 'mxfp6'"):
    nf.quantize_mx(jnp.ones((4, 32)), "mxfp6")
  with pytest.raises(ValueError, match=r"stochastic rounding.*mxfp8"):
    nf.quantize_mx(jnp.ones((4, 32)), "mxfp8", rounding="stochastic",
                   key=jax.random.key(0))


def test_amax_must_be_scalar():
  with pytest.raises(ValueError, match=r"amax must be a scalar, got shape \(2,\)"):
    nf.quantize(jnp.ones((4, 32)), amax=jnp.ones((2,)))


def test_errors_are_raised_under_jit_at_trace_time():
  with pytest.raises(ValueError, match="size 40"):
    jax.jit(nf.quantize)(jnp.ones((4, 40)))
  with pytest.raises(ValueError, match=r"16x16.*\(20, 32\)"):
    jax.jit(lambda x: nf.quantize(x, block_2d=True))(jnp.ones((20, 32)))


def test_transpose_needs_2d_scaling():
  q = jax.jit(nf.quantize)(jnp.ones((16, 32)))
  with pytest.raises(ValueError, match=r"block_2d.*quantize x\.T instead"):
    _ = q.T


def test_pack_odd_axis():
  with pytest.raises(ValueError, match=r"even last axis, got shape \(3, 5\)"):
    nf.pack_e2m1(jnp.zeros((3, 5), jnp.uint8))


def test_random_bytes_bad_sizes():
  seeds = jnp.zeros((2,), jnp.uint32)
  with pytest.raises(ValueError, match=r"divisible by 4, got \(3, 5\)"):
    prng.random_bytes(seeds, (3, 5))
  with pytest.raises(ValueError, match=r"at most 2\^34 elements; got 17179869200"):
    prng.random_bytes(seeds, (17179869200,))


def test_block_scaled_matmul_errors():
  quantize = jax.jit(nf.quantize)
  a = quantize(jnp.ones((4, 32)))
  b = quantize(jnp.ones((8, 64)))
  with pytest.raises(ValueError, match=r"contraction sizes differ, a \(4, 32\) vs b \(8, 64\)"):
    gemm_api.block_scaled_matmul(a, b)
  with pytest.raises(TypeError, match=r"b must be an NVFP4Array, NVFP4Values or MXArray, got ndarray"):
    gemm_api.block_scaled_matmul(a, np.ones((4, 32)))
  c = quantize(jnp.ones((2, 4, 32)))
  with pytest.raises(ValueError, match=r"a must be 2-D \[rows, K\], got shape \(2, 4, 32\)"):
    gemm_api.block_scaled_matmul(c, a)


def test_dequantize_wrong_type():
  with pytest.raises(TypeError, match="NVFP4Array, NVFP4Values or MXArray"):
    nf.dequantize(jnp.ones((4, 32)))
  with pytest.raises(TypeError, match="NVFP4Array, NVFP4Values or MXArray"):
    nf.block_dequantize(jnp.ones((4, 32)))


def _quantize(fn, x):
  if fn == "nvfp4":
    return nf.quantize(x)
  return nf.quantize_mx(x, fn)
