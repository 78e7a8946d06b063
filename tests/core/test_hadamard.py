"""Random Hadamard Transform (NVFP4_SPEC section 4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import nvfp4_jax as nf
from nvfp4_jax.core import numerics
from nvfp4_jax.core import tile
import te_reference as ref
from conftest import JNP_DTYPES, make_heavy_tailed

F32 = np.float32
SPEC_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)

rht_jit = jax.jit(nf.rht, static_argnames=("sign_vector", "size"))
quantize_jit = jax.jit(nf.quantize, static_argnames=("block_2d", "rounding"))


def bf16_bits(a) -> np.ndarray:
  a = np.asarray(a)
  assert a.dtype == ml_dtypes.bfloat16, a.dtype
  return a.view(np.uint16)


def test_te_sign_vector_and_matrix():
  assert tuple(nf.TE_SIGN_VECTOR_16) == SPEC_SIGNS
  assert tuple(nf.default_sign_vector(16)) == SPEC_SIGNS
  h = nf.rht_matrix()
  want = np.diag(np.array(SPEC_SIGNS, np.float64)) @ ref.hadamard(16) / 4
  np.testing.assert_array_equal(h, want.astype(F32))
  # rht of the unit vectors gives back the rows of H: x @ H, signs on the rows.
  np.testing.assert_array_equal(
      np.asarray(rht_jit(jnp.eye(16))).astype(F32), want.astype(F32))


@pytest.mark.parametrize("size", [2, 4, 8, 16, 32, 64, 128])
def test_orthogonal(size):
  h = nf.rht_matrix(size=size).astype(np.float64)
  if size in (4, 16, 64):  # entries are powers of two: exactly orthogonal
    np.testing.assert_array_equal(h @ h.T, np.eye(size))
  else:
    np.testing.assert_allclose(h @ h.T, np.eye(size), atol=1e-6)
  assert np.all(np.abs(np.abs(h) * np.sqrt(size) - 1) < 1e-6)


def assert_rht_matches(got, want, dtype):
  """bf16 input (the only one TE's RHT accepts): bit-exact. Wider inputs: the
  FP32 sum of 16 terms is not always exact, so its last bit depends on the
  backend's summation order, and now and then that flips the bf16 rounding.
  For those, all but a handful of elements are bit-exact and the rest are one
  bf16 ulp away."""
  g, w = bf16_bits(got), bf16_bits(want)
  if dtype == "bfloat16":
    np.testing.assert_array_equal(g, w)
    return
  diff = g != w
  assert diff.sum() <= max(2, 1e-3 * diff.size), f"{diff.sum()} of {diff.size} differ"
  assert np.all(np.abs(g.astype(np.int32) - w.astype(np.int32))[diff] == 1)


@pytest.mark.parametrize("size", [4, 16, 64])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rht_matches_reference(size, dtype):
  x = make_heavy_tailed((2, 32, 128), dtype, seed=size, sigma=1.0)
  got = rht_jit(jnp.asarray(x), size=size)
  assert got.dtype == jnp.bfloat16 and got.shape == x.shape
  want = ref.rht(x, sign_vector=nf.default_sign_vector(size))
  assert_rht_matches(got, want, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(64, 48), (32, 16), (128, 32)])
def test_wgrad_operand_quantization_bit_exact(shape, dtype):
  """TE's Wgrad operand: quantize(bf16(rht(x.T))), amax after the transform."""
  x = make_heavy_tailed(shape, dtype, seed=sum(shape), sigma=1.5)
  op = jax.jit(lambda v: nf.rht(v.T))(jnp.asarray(x))
  want_op = ref.wgrad_operand(x)
  assert_rht_matches(op, want_op, dtype)
  if dtype != "bfloat16":
    want_op = np.asarray(op)  # quantization checked on the library's operand
  q = quantize_jit(op)
  packed, scales, amax = ref.quantize(want_op)
  np.testing.assert_array_equal(np.asarray(q.codes), packed)
  np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8),
                                scales.view(np.uint8))
  assert np.asarray(q.amax).view(np.uint32) == np.asarray(amax).view(np.uint32)
  # The amax is the transformed tensor's, not the input's.
  assert float(q.amax) == float(np.max(np.abs(want_op.astype(F32))))
  assert float(q.amax) != float(np.max(np.abs(x.astype(F32))))


def test_wgrad_gemm_unchanged_up_to_bf16():
  """rht(a) @ rht(b).T == a @ b.T (H orthogonal), up to the bf16 rounding."""
  rng = np.random.default_rng(0)
  tokens = 64
  dy = rng.standard_normal((tokens, 24)).astype(F32)
  x = (rng.standard_normal((tokens, 40)) * np.exp(rng.standard_normal(40))).astype(F32)
  a, b = dy.T, x.T  # Wgrad: dW = dy.T @ x, contraction over tokens
  ra, rb = (np.asarray(rht_jit(jnp.asarray(v))).astype(np.float64) for v in (a, b))
  got = ra @ rb.T
  want = a.astype(np.float64) @ b.astype(np.float64).T
  tol = 2.0**-7 * (np.abs(ra) @ np.abs(rb).T)
  assert np.all(np.abs(got - want) <= tol)
  assert np.max(np.abs(ra - a)) > 0.1  # the transform did something
  # The same with a size-4 and a size-64 transform and a custom sign vector.
  for kw in (dict(size=4), dict(size=64),
             dict(sign_vector=tuple([1, -1] * 8))):
    ra, rb = (np.asarray(rht_jit(jnp.asarray(v), **kw)).astype(np.float64)
              for v in (a, b))
    tol = 2.0**-7 * (np.abs(ra) @ np.abs(rb).T)
    assert np.all(np.abs(ra @ rb.T - want) <= tol), kw


def test_sign_vector_option():
  x = make_heavy_tailed((16, 64), "bfloat16", seed=1, sigma=1.0)
  s2 = (-1, 1) * 8
  got = rht_jit(jnp.asarray(x), sign_vector=s2)
  np.testing.assert_array_equal(bf16_bits(got), bf16_bits(ref.rht(x, s2)))
  default = rht_jit(jnp.asarray(x))
  assert np.any(bf16_bits(got) != bf16_bits(default))
  # A list is accepted too (not hashable: eager call).
  np.testing.assert_array_equal(
      bf16_bits(nf.rht(jnp.asarray(x), sign_vector=list(s2))), bf16_bits(got))


@pytest.mark.parametrize("size", [4, 64, 128])
def test_default_sign_vectors(size):
  s = nf.default_sign_vector(size)
  assert len(s) == size and set(s) <= {1, -1}
  assert s == nf.default_sign_vector(size)
  # Its documented definition (fixed once, stable across numpy versions).
  want = np.random.default_rng(size).choice([-1, 1], size=size)
  assert s == tuple(int(v) for v in want)


def test_rht_under_jit_and_vmap():
  x = make_heavy_tailed((3, 16, 32), "float32", seed=2, sigma=1.0)
  batched = rht_jit(jnp.asarray(x))
  mapped = jax.jit(jax.vmap(nf.rht))(jnp.asarray(x))
  eager = nf.rht(jnp.asarray(x))
  np.testing.assert_array_equal(bf16_bits(batched), bf16_bits(mapped))
  np.testing.assert_array_equal(bf16_bits(batched), bf16_bits(eager))


def test_rht_flushes_subnormals():
  """Subnormal inputs count as zero on every backend (XLA:CPU's dot does so
  implicitly, XLA:GPU's does not: the library flushes explicitly)."""
  x = np.zeros((2, 16), F32)
  x[0, 0], x[0, 1] = 1e-37, 1e-38  # 1e-38 is subnormal
  x[1, :] = 1e-39
  got = np.asarray(rht_jit(jnp.asarray(x)))
  np.testing.assert_array_equal(bf16_bits(got), bf16_bits(ref.rht(x)))
  assert np.all(got[1].astype(F32) == 0)
  want0 = ref.rht(np.where(np.abs(x) < 1.17549435e-38, 0, x).astype(F32))[0]
  np.testing.assert_array_equal(bf16_bits(got[0]), bf16_bits(want0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_rht_input_dtypes(dtype):
  x = jnp.asarray(make_heavy_tailed((16, 32), dtype, seed=3, sigma=1.0))
  assert x.dtype == JNP_DTYPES[dtype]
  assert_rht_matches(rht_jit(x), ref.rht(np.asarray(x)), dtype)


@pytest.mark.parametrize("size", [0, 1, 3, 12, 24, "16"])
def test_bad_size(size):
  with pytest.raises(ValueError, match=f"got {size!r}"):
    nf.rht(jnp.ones((4, 48)), size=size)


def test_bad_sign_vector():
  with pytest.raises(ValueError, match="16 entries"):
    nf.rht(jnp.ones((4, 16)), sign_vector=(1, -1, 1))
  with pytest.raises(ValueError, match=r"\+1/-1"):
    nf.rht(jnp.ones((4, 16)), sign_vector=(1, 0) * 8)
  with pytest.raises(ValueError, match="4 entries"):
    nf.rht(jnp.ones((4, 16)), sign_vector=SPEC_SIGNS, size=4)


def test_bad_shapes_and_dtypes():
  with pytest.raises(ValueError, match=r"\(4, 40\).*multiple of 16"):
    nf.rht(jnp.ones((4, 40)))
  with pytest.raises(ValueError, match=r"\(\)"):
    nf.rht(jnp.float32(1.0))
  with pytest.raises(TypeError, match="int32"):
    nf.rht(jnp.ones((4, 16), jnp.int32))


# ----------------------------------------------------------------------------
# The butterfly (the columns kernels' transform).
# ----------------------------------------------------------------------------


def exact_sum_blocks(n_rows: int, size: int, seed: int) -> np.ndarray:
  """Small integers times powers of two: every Hadamard sum is exact in
  FP32 (< 2^18 units), whatever the order of the additions."""
  rng = np.random.default_rng(seed)
  k = rng.integers(-127, 128, (n_rows, size)).astype(F32)
  return k * np.exp2(rng.integers(-20, 20, (n_rows, 1))).astype(F32)


@pytest.mark.parametrize("size", [4, 16, 64])
@pytest.mark.parametrize("signs", ["default", "random"])
def test_butterfly_equals_the_matrix_where_sums_are_exact(size, signs):
  """`hadamard_butterfly` on a block held as one array per element gives
  `v @ H` (the reference's `hadamard_sums`), in the Sylvester order."""
  v = exact_sum_blocks(48, size, seed=size)
  s = (nf.default_sign_vector(size) if signs == "default" else tuple(
      int(c) for c in np.random.default_rng(1).choice([-1, 1], size)))
  h = nf.rht_matrix(s, size)
  got = np.stack([np.asarray(a) for a in tile.hadamard_butterfly(
      [jnp.asarray(v[:, k]) for k in range(size)], s)], axis=-1)
  want = (v.astype(np.float64) @ h.astype(np.float64)).astype(F32)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got, np.asarray(tile.hadamard_sums(
      jnp.asarray(v), jnp.asarray(h), bf16_operands=False)))


def test_butterfly_products_flush_as_the_dot():
  """Element times `s/4` is flushed when subnormal (`tile.flushed_product`,
  the kernels' `mul.ftz`), on every backend: 16 x 2^-125 transforms to +0
  (not to 2^-123, nor to zeros whose signs follow some dot's `fma` chain)."""
  v = [jnp.full((3,), 2.0**-125, jnp.float32) for _ in range(16)]
  got = np.stack([np.asarray(a) for a in tile.hadamard_butterfly(
      v, nf.default_sign_vector(16))], -1)
  want = np.asarray(nf.rht(jnp.stack(v, -1).astype(jnp.bfloat16)), F32)
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
  assert not want.any() and not np.signbit(want).any()


def numpy_butterfly(x: np.ndarray, signs) -> np.ndarray:
  """An independent model of the reference's RHT arithmetic
  (`tile.hadamard_rows`), in NumPy's FP32 (IEEE operations, subnormals
  kept by the host: every flush explicit): bf16 bits of `rht(x)`."""
  def ftz(v):
    v = np.asarray(v, F32)
    return np.where(np.abs(v) < np.finfo(F32).tiny, v * F32(0), v)
  n = len(signs)
  t = ftz(np.asarray(x, F32).reshape(-1, n))
  with np.errstate(all="ignore"):
    y = [ftz(t[:, k] * (F32(signs[k]) / np.sqrt(F32(n)))) for k in range(n)]
    h = 1
    while h < n:
      for start in range(0, n, 2 * h):
        for k in range(start, start + h):
          y[k], y[k + h] = ftz(y[k] + y[k + h]), ftz(y[k] - y[k + h])
      h *= 2
    out = ftz(np.stack(y, -1)).astype(ml_dtypes.bfloat16)
  return out.reshape(np.shape(x))


def adversarial_rht_input(rows: int, size: int, seed: int) -> np.ndarray:
  """FP32 blocks where the RHT's arithmetic shows: inexact sums (values
  over 40 binades), tiny tokens (2^-133..2^-122: subnormal products and,
  beside each other, subnormal partial sums), zeros of both signs, one
  sign alone, NaN and Inf, and blocks of one value."""
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((rows, size)) * np.exp2(
      rng.integers(-20, 20, (rows, size)))).astype(F32)
  q = rows // 8
  tiny = rng.choice([-1.0, 1.0], (q, size)) * np.exp2(
      rng.uniform(-133.0, -122.0, (q, size)))
  x[:q] = tiny
  x[q:2 * q] = np.where(rng.random((q, size)) < 0.5, -0.0, 0.0)
  x[2 * q:3 * q] = np.where(rng.random((q, size)) < 0.5, tiny, -0.0)
  x[3 * q:4 * q] = np.abs(tiny) * rng.choice([1, 2, 3], (q, size))
  x[4 * q] = 2.0**-125
  x[4 * q + 1] = -1.5 * 2.0**-124
  x[4 * q + 2, 0] = np.nan
  x[4 * q + 3, 1] = -np.inf
  return x


@pytest.mark.parametrize("size", [2, 4, 16, 64, 128])
def test_rht_arithmetic_is_defined(size):
  """`rht` is the flushed butterfly (`tile.hadamard_rows`) bit for bit,
  zeros' signs included, also where sums are inexact and products or
  partial sums subnormal: the same bits on any CPU and on the GPU. (Its
  former FP32 dot was XLA:CPU's choice: YNNPACK on this AVX-512 host, the
  compiler's own loops on an AVX2 one, `tests/core/test_isa.py`, whose zeros
  carried the last product's sign.)"""
  s = nf.default_sign_vector(size)
  x = adversarial_rht_input(64, size, seed=size)
  got = bf16_bits(rht_jit(jnp.asarray(x), size=size))
  want = numpy_butterfly(x, s).view(np.uint16)
  nan = (want & 0x7FFF) > 0x7F80
  np.testing.assert_array_equal(nan, (got & 0x7FFF) > 0x7F80)
  assert nan.any()
  np.testing.assert_array_equal(got[~nan], want[~nan])
  assert (want[~nan] == 0x8000).any()  # A -0 output: signs are compared.
  # The bf16 input path (TE's only input dtype) too.
  xb = x.astype(ml_dtypes.bfloat16)
  got = bf16_bits(rht_jit(jnp.asarray(xb), size=size))
  want = numpy_butterfly(xb, s).view(np.uint16)
  np.testing.assert_array_equal(got[~nan], want[~nan])


@pytest.mark.parametrize("size", [4, 16])
def test_butterfly_layouts_agree(size):
  """The reference's butterfly on whole rows (`tile.hadamard_rows`) and the
  kernels' on one array per element (`tile.hadamard_butterfly`, eager):
  the same operations on the same pairs, the same bits."""
  x = adversarial_rht_input(64, size, seed=40 + size)
  s = nf.default_sign_vector(size)
  rows = np.asarray(tile.hadamard_rows(jnp.asarray(x), s), F32)
  cols = tile.hadamard_butterfly(
      [numerics.ftz(jnp.asarray(x[:, k])) for k in range(size)], s)
  cols = np.stack([np.asarray(tile.round_hadamard(c)) for c in cols], -1)
  np.testing.assert_array_equal(np.isnan(rows), np.isnan(cols))
  ok = ~np.isnan(rows)
  np.testing.assert_array_equal(rows.view(np.uint32)[ok],
                                cols.view(np.uint32)[ok])


def test_butterfly_weights_are_the_matrix():
  """The butterfly multiplies by `H`'s own entries (column 0 of
  `rht_matrix`: the same FP32 division), for every size."""
  for size in (2, 4, 8, 16, 32, 64, 128):
    s = nf.default_sign_vector(size)
    np.testing.assert_array_equal(
        np.asarray(tile.butterfly_weights(s), F32),
        nf.rht_matrix(s, size)[:, 0])


def test_butterfly_bad_blocks():
  with pytest.raises(ValueError, match="power-of-2 block.*6 arrays"):
    tile.hadamard_butterfly([jnp.ones(2)] * 6, (1,) * 6)
  with pytest.raises(ValueError, match="16 arrays, 4 signs"):
    tile.hadamard_butterfly([jnp.ones(2)] * 16, (1,) * 4)
