"""One test base for every implementation of the quantizers and the GEMM.

Each `*Base` class holds the cases; a subclass per implementation runs them
(tokamax's `test_base.py` pattern). The truth is the pure-jnp reference
(`implementation="xla"`): kernels must give the same codes, E4M3 scale bytes
and amax bit for bit, also with stochastic rounding given the key, on
heavy-tailed inputs, edge cases and shapes with partial tiles and several grid
steps. On CPU the Pallas kernels run in interpret mode (small shapes); on a GPU
the same file runs them compiled, plus the GPU-only GEMM routes.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import numpy as np
import pytest

import nvfp4_jax as nf
from nvfp4_jax.ops.quantize import api as quantize_api
from nvfp4_jax.ops.quantize_pair import api as pair_api
from nvfp4_jax.ops.quantize_rht_t import api as rht_t_api
from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
from nvfp4_jax.ops.block_scaled_matmul import reference as gemm_ref
from nvfp4_jax.ops.quantize import reference as quantize_ref
from nvfp4_jax.core import hadamard
from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import tile
from nvfp4_jax.ops.block_values import pallas_triton as pallas_block_dequantize
from nvfp4_jax.ops.block_scaled_matmul import triton as pallas_gemm
from pallas_kernels import choose_four
from pallas_kernels import e2m1_decode
from pallas_kernels import e2m1_encode
from pallas_kernels import fp32
from pallas_kernels import launch
from pallas_kernels import paired_words
from nvfp4_jax.ops.quantize import pallas_triton as pallas_quantize
from nvfp4_jax.ops.quantize_pair import pallas_triton as pallas_pair
from nvfp4_jax.ops.quantize_rht_t import pallas_triton as pallas_rht
from nvfp4_jax.core.recipe import Operand
from quantizer_checks import (KEY, assert_same, bf16_bits, block_values, f32_bits,
                              heavy, jit_ref, jit_xla, on_cpu, rht_input,
                              truth)

ON_GPU = jax.default_backend() == "gpu"
# The word path's assembly has software twins only where the kernel is
# interpreted; compiled, it is Blackwell's (`check_device --target`).
WORDS_ON_GPU = ("the word path runs interpreted here, with its assembly's "
                "software twins; on a GPU it is compiled for Blackwell only")
GPU_ONLY = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


def _has_jax_triton() -> bool:
  try:
    import jax_triton  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True



# (shape, dtype, block_2d, rounding): partial row/column tiles and several
# grid steps with the default tile sizes (16 rows x 256 columns).
QUANTIZE_CASES = [
    ((40, 272), jnp.bfloat16, False, "nearest"),
    ((40, 272), jnp.bfloat16, False, "stochastic"),
    ((3, 40, 48), jnp.float32, False, "nearest"),
    ((48, 288), jnp.float32, True, "nearest"),
    ((80, 48), jnp.bfloat16, True, "stochastic"),
    ((16, 16), jnp.float16, False, "nearest"),
]


class QuantizeBase:
  """`nvfp4_jax.quantize(..., implementation=impl)` against the reference."""

  impl: str

  def quantize(self, x, **kw):
    return jax.jit(functools.partial(nf.quantize, implementation=self.impl,
                                     **kw))(x)

  @pytest.mark.parametrize("shape,dtype,block_2d,rounding", QUANTIZE_CASES)
  def test_matches_reference(self, shape, dtype, block_2d, rounding):
    x = heavy(shape, dtype, seed=len(shape) + shape[-1])
    key = KEY if rounding == "stochastic" else None
    got = self.quantize(x, block_2d=block_2d, rounding=rounding, key=key)
    want = jit_ref(block_2d=block_2d, rounding=rounding, key=key)(x)
    assert_same(got, want)
    scale_bytes = np.unique(np.asarray(want.scales).view(np.uint8))
    assert scale_bytes.size >= 8, "test data too uniform to test the scales"

  def test_given_amax(self):
    x = heavy((32, 64), jnp.bfloat16, seed=3)
    amax = jnp.float32(1e4)
    assert_same(self.quantize(x, amax=amax), jit_ref(amax=amax)(x))

  @pytest.mark.parametrize("case", [
      "zeros", "zero_blocks", "inf", "huge", "tiny", "subnormal", "neg_zero",
  ])
  def test_edge_cases(self, case):
    x = np.array(heavy((32, 64), jnp.float32, seed=5))
    if case == "zeros":
      x = np.zeros_like(x)
    elif case == "zero_blocks":
      x[:, 16:32] = 0.0
      x[5, :] = 0.0
    elif case == "inf":
      x[3, 7] = np.inf
      x[9, 40] = -np.inf
    elif case == "huge":
      x = x / np.abs(x).max() * np.float32(3.0e38)
    elif case == "tiny":
      x = x / np.abs(x).max() * np.float32(1e-36)
    elif case == "subnormal":
      x[:, :16] = np.float32(3e-39)
    elif case == "neg_zero":
      x[:, 32:48] = -0.0
    x = jnp.asarray(x)
    for block_2d in (False, True):
      got = self.quantize(x, block_2d=block_2d)
      assert_same(got, jit_ref(block_2d=block_2d)(x), f"{case} 2d={block_2d}")
    if case == "zeros":
      assert not np.asarray(got.codes).any()
      assert not np.asarray(got.scales.astype(jnp.float32)).any()

  @pytest.mark.parametrize("block_2d", [False, True])
  def test_nan_gives_non_finite(self, block_2d):
    x = np.array(heavy((32, 64), jnp.bfloat16, seed=6))
    x[17, 33] = np.nan
    q = self.quantize(jnp.asarray(x), block_2d=block_2d)
    assert np.isnan(float(q.amax))
    assert np.isnan(np.asarray(q.scales.astype(jnp.float32))).all()
    assert not np.isfinite(np.asarray(truth(nf.dequantize)(q))).any()

  def test_stochastic_depends_on_key_only(self):
    x = heavy((32, 64), jnp.bfloat16, seed=7)
    a = self.quantize(x, rounding="stochastic", key=jax.random.key(1))
    b = self.quantize(x, rounding="stochastic", key=jax.random.key(1))
    c = self.quantize(x, rounding="stochastic", key=jax.random.key(2))
    assert_same(a, b)
    assert (np.asarray(a.codes) != np.asarray(c.codes)).any()

  def test_vmap(self):
    x = heavy((3, 32, 48), jnp.bfloat16, seed=8)
    keys = jax.random.split(KEY, 3)
    f = functools.partial(nf.quantize, rounding="stochastic",
                          implementation=self.impl)
    got = jax.jit(jax.vmap(lambda x, k: f(x, key=k)))(x, keys)
    for i in range(3):
      want = jit_ref(rounding="stochastic", key=keys[i])(x[i])
      assert_same(jax.tree.map(lambda a, i=i: a[i], got), want, f"vmap {i}")

  def test_2d_codes_transpose(self):
    w = heavy((48, 64), jnp.float32, seed=9)
    q = self.quantize(w, block_2d=True)
    qt = self.quantize(w.T, block_2d=True)
    assert_same(jax.jit(lambda q: q.T)(q), qt)


class TestQuantizeXla(QuantizeBase):
  impl = "xla"


class TestQuantizePallas(QuantizeBase):
  impl = "pallas"


# ----------------------------------------------------------------------------
# Fused operand quantizers (nvfp4_jax.ops.quantize_rht_t, quantize_pair).
# ----------------------------------------------------------------------------

RHT_CASES = [  # (tokens, features), dtype, rounding
    ((80, 48), jnp.bfloat16, "nearest"),
    ((80, 40), jnp.bfloat16, "stochastic"),
    ((64, 96), jnp.float32, "nearest"),
    ((96, 80), jnp.bfloat16, "stochastic"),
]


class FusedBase:
  """The fused quantizers (`implementation=impl`) against their references."""

  impl: str

  @pytest.mark.parametrize("shape,dtype,rounding", RHT_CASES)
  def test_quantize_rht_t(self, shape, dtype, rounding):
    x = rht_input(shape, dtype, seed=shape[1])
    key = KEY if rounding == "stochastic" else None
    f = lambda impl: jax.jit(functools.partial(
        rht_t_api.quantize_rht_t, rounding=rounding, key=key,
        implementation=impl))(x)
    got, want = f(self.impl), f("xla")
    assert got.shape == (shape[1], shape[0])
    assert_same(got, want)
    ref = jit_ref(rounding=rounding, key=key)(truth(nf.rht)(x.T))
    assert_same(want, ref, "xla vs quantize(rht(x.T))")

  def test_quantize_rht_t_given_amax_and_signs(self):
    x = rht_input((64, 32), jnp.bfloat16, seed=11)
    signs = tuple(int(s) for s in np.random.default_rng(0).choice([-1, 1], 16))
    f = lambda impl: jax.jit(functools.partial(
        rht_t_api.quantize_rht_t, amax=jnp.float32(500.0), sign_vector=signs,
        implementation=impl))(x)
    assert_same(f(self.impl), f("xla"))

  @pytest.mark.parametrize("stochastic", [False, True])
  def test_quantize_x_and_rht_t(self, stochastic):
    x = rht_input((96, 80), jnp.bfloat16, seed=12)
    key = KEY if stochastic else None
    f = lambda impl: jax.jit(functools.partial(
        pair_api.quantize_x_and_rht_t, key=key, implementation=impl))(x)
    (gx, gt), (wx, wt) = f(self.impl), f("xla")
    assert_same(gx, wx, "q_x")
    assert_same(gt, wt, "q_rht_xt")
    rounding = "stochastic" if stochastic else "nearest"
    kx = pair_api.split_key(key)[0] if stochastic else None
    assert_same(wx, jit_ref(rounding=rounding, key=kx)(x), "q_x vs quantize")

  def test_quantize_x_and_rht_t_nan(self):
    x = np.array(rht_input((32, 32), jnp.bfloat16, seed=13))
    x[4, 5] = np.nan
    qx, qt = jax.jit(functools.partial(pair_api.quantize_x_and_rht_t,
                                       implementation=self.impl))(x)
    for q in (qx, qt):
      assert np.isnan(float(q.amax))
      assert not np.isfinite(np.asarray(truth(nf.dequantize)(q))).any()

  @pytest.mark.parametrize("block_2d", [False, True])
  def test_quantize_with_values(self, block_2d):
    x = heavy((48, 96), jnp.bfloat16, seed=14)
    q, v = jax.jit(functools.partial(quantize_api.quantize_with_values,
                                     block_2d=block_2d,
                                     implementation=self.impl))(x)
    assert_same(q, jit_ref(block_2d=block_2d)(x))
    assert v.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bf16_bits(v), bf16_bits(block_values(q)))

  def test_vmap(self):
    x = jnp.stack([rht_input((32, 48), jnp.bfloat16, seed=s) for s in (1, 2)])
    f = functools.partial(rht_t_api.quantize_rht_t, implementation=self.impl)
    got = jax.jit(jax.vmap(f))(x)
    for i in range(2):
      assert_same(jax.tree.map(lambda a, i=i: a[i], got),
                  jit_xla(rht_t_api.quantize_rht_t)(x[i]))


class TestFusedXla(FusedBase):
  impl = "xla"


class TestFusedPallas(FusedBase):
  impl = "pallas"


class TestFusedPallasTensorCores(FusedBase):
  """The tensor-core RHT kernels, which the Wgrad operand alone no longer
  uses by default (`COLUMNS`), on the same cases: they still run Four-over-
  Six, 64-point RHT and the fused X pair."""
  impl = "pallas"

  @pytest.fixture(autouse=True)
  def _tensor_cores(self, monkeypatch):
    monkeypatch.setattr(pallas_rht, "COLUMNS", False)


# ----------------------------------------------------------------------------
# Block-scaled GEMM (nvfp4_jax.ops.block_scaled_matmul).
# ----------------------------------------------------------------------------


def _gemm_bound(a, b):
  """|error| bound of an FP32-accumulated sum in another order."""
  va = np.abs(np.asarray(block_values(a), np.float64))
  vb = np.abs(np.asarray(block_values(b), np.float64))
  alpha = float(gemm_ref.gemm_alpha(a, b))
  return (va @ vb.T) * alpha * a.shape[1] * 2.0**-23


class GemmBase:
  """`block_scaled_matmul(..., implementation=impl)` against the reference.

  Summation order may differ from the reference's (cuBLAS, Triton and XLA:CPU
  all sum differently), so results agree to FP32 rounding of the sums;
  where every partial sum is exact they agree bit for bit.
  """

  impl: str

  def matmul(self, a, b, **kw):
    a, b = jax.device_put((a, b), jax.devices()[0])  # Operands from `truth`.
    return jax.jit(functools.partial(gemm_api.block_scaled_matmul,
                                     implementation=self.impl, **kw))(a, b)

  @pytest.mark.parametrize("m,n,k", [(64, 48, 128), (40, 80, 256)])
  def test_matches_reference(self, m, n, k):
    a = jit_ref()(heavy((m, k), jnp.bfloat16, seed=m))
    b = jit_ref(block_2d=n % 16 == 0)(heavy((n, k), jnp.bfloat16, seed=n))
    got = np.asarray(self.matmul(a, b), np.float64)
    want = np.asarray(jit_xla(gemm_api.block_scaled_matmul)(a, b), np.float64)
    assert np.all(np.abs(got - want) <= _gemm_bound(a, b))

  def test_exact_when_sums_are_exact(self):
    rng = np.random.default_rng(0)
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
    xa = rng.choice(grid, (32, 64)) * rng.choice([-1, 1], (32, 64))
    xb = rng.choice(grid, (48, 64)) * rng.choice([-1, 1], (48, 64))
    xa[:, ::16] = 6.0  # Every block hits the amax: one common scale.
    xb[:, ::16] = -6.0
    a, b = jit_ref()(jnp.asarray(xa)), jit_ref()(jnp.asarray(xb))
    got = self.matmul(a, b)
    # The reference on the same device: alpha's FP32 division is XLA's there.
    a, b = jax.device_put((a, b), jax.devices()[0])
    want = jax.jit(functools.partial(gemm_api.block_scaled_matmul,
                                     implementation="xla"))(a, b)
    np.testing.assert_array_equal(f32_bits(got), f32_bits(want))

  def test_bf16_output(self):
    a = jit_ref()(heavy((32, 64), jnp.bfloat16, seed=1))
    b = jit_ref()(heavy((32, 64), jnp.bfloat16, seed=2))
    got = self.matmul(a, b, out_dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    want = jit_xla(gemm_api.block_scaled_matmul)(a, b)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2,
                               atol=1e-2 * float(jnp.abs(want).max()))


class TestGemmXla(GemmBase):
  impl = "xla"


class TestGemmPallas(GemmBase):
  impl = "pallas"


@GPU_ONLY
@pytest.mark.skipif(not _has_jax_triton(), reason="needs jax-triton")
@pytest.mark.skipif(not pallas_gemm.has_fp4_mma(),
                    reason="tl.dot_scaled needs FP4 tensor cores (cc >= 10)")
class TestGemmTriton(GemmBase):
  impl = "triton"


@GPU_ONLY
class TestGemmScaledMatmul(GemmBase):
  impl = "scaled_matmul"


# ----------------------------------------------------------------------------
# Kernel-specific checks: the kernel really runs, tiles, dispatch, lowering.
# ----------------------------------------------------------------------------


def _uses_pallas(fn, x) -> bool:
  """Whether the jaxpr of `fn(x)` (nested jaxprs included) has a pallas_call."""
  return "pallas_call" in str(jax.make_jaxpr(fn)(x))


@pytest.mark.parametrize("fn", [
    lambda x, impl: nf.quantize(x, implementation=impl),
    lambda x, impl: rht_t_api.quantize_rht_t(x, implementation=impl),
    lambda x, impl: pair_api.quantize_x_and_rht_t(x, implementation=impl),
    lambda x, impl: gemm_api.block_scaled_matmul(
        quantize_ref.quantize_reference(x), quantize_ref.quantize_reference(x),
        implementation=impl),
])
def test_pallas_call_is_used(fn):
  x = jnp.ones((32, 32), jnp.bfloat16)
  assert _uses_pallas(lambda x: fn(x, "pallas"), x)
  assert not _uses_pallas(lambda x: fn(x, "xla"), x)
  default = _uses_pallas(lambda x: fn(x, None), x)
  assert default == ON_GPU  # None: kernels on GPU, the reference on CPU.


def test_dispatch_errors_and_fallback():
  x = rht_input((32, 32), jnp.bfloat16, seed=0)
  with pytest.raises(ValueError, match="unknown implementation"):
    nf.quantize(x, implementation="cuda")
  with pytest.raises(NotImplementedError):  # 4-point RHT: no kernel.
    rht_t_api.quantize_rht_t(x, size=4, implementation="pallas")
  f = functools.partial(rht_t_api.quantize_rht_t, size=4)
  assert_same(jax.jit(f)(x), jit_xla(f)(x))  # The default falls back.
  if not ON_GPU:
    q = jit_ref()(x)
    with pytest.raises(NotImplementedError):
      gemm_api.block_scaled_matmul(q, q, implementation="triton")


def test_block_values_every_code_byte_and_scale():
  """The kernels' decode (`e2m1_decode.block_values`: byte permutation on the
  GPU) equals the reference's for all 256 code bytes under all 256 E4M3
  scale bytes (negative, subnormal and NaN scales included), bit for bit;
  NaN scales give NaN (the GPU's NaN has its own payload)."""
  codes = jnp.tile(jnp.arange(256, dtype=jnp.uint8), (256, 1))  # [256, 256]
  scales = jax.lax.bitcast_convert_type(
      jnp.broadcast_to(jnp.arange(256, dtype=jnp.uint8)[:, None], (256, 32)),
      jnp.float8_e4m3fn)
  q = nf.NVFP4Array(codes=codes, scales=scales, amax=jnp.float32(1.0))
  got = bf16_bits(jax.jit(pallas_block_dequantize.block_values)(q))
  want = bf16_bits(block_values(q))
  nan = np.isnan(np.asarray(block_values(q), np.float32))
  assert nan.sum() == 2 * 512  # The two NaN scale bytes, 0x7F and 0xFF.
  assert np.isnan(got.view(jnp.bfloat16).astype(np.float32))[nan].all()
  np.testing.assert_array_equal(got[~nan], want[~nan])


def test_block_value_pairs_every_code_byte_and_scale():
  """`e2m1_decode.block_value_pairs` (the weight-only kernel's decode: byte
  permutation of packed bytes on the GPU) equals `tile.block_value_pairs`
  for all 256 code bytes under all 256 E4M3 scale bytes, bit for bit."""
  interpret = launch.check_backend("test")
  codes = jnp.broadcast_to(jnp.arange(256, dtype=jnp.uint8).reshape(32, 8),
                           (256, 32, 8))
  scales = jax.lax.bitcast_convert_type(
      jnp.broadcast_to(jnp.arange(256, dtype=jnp.uint8)[:, None], (256, 32)),
      jnp.float8_e4m3fn)

  def kernel(c_ref, s_ref, even_ref, odd_ref):
    even_ref[...], odd_ref[...] = e2m1_decode.block_value_pairs(
        c_ref[...], s_ref[...], interpret)

  shape = jax.ShapeDtypeStruct(codes.shape, jnp.bfloat16)
  got = jax.jit(launch.pallas_call(
      kernel, interpret=interpret, num_warps=4, num_stages=1,
      name="test_block_value_pairs", grid=(16,),
      in_specs=[pl.BlockSpec((16, 32, 8), lambda i: (i, 0, 0)),
                pl.BlockSpec((16, 32), lambda i: (i, 0))],
      out_specs=[pl.BlockSpec((16, 32, 8), lambda i: (i, 0, 0))] * 2,
      out_shape=[shape, shape]))(codes, scales)
  want = tile.block_value_pairs(codes, scales)
  for g, w in zip(got, want):
    nan = np.isnan(np.asarray(w, np.float32))
    assert nan.sum() == 2 * 256  # The NaN scale bytes 0x7F and 0xFF.
    assert np.isnan(np.asarray(g, np.float32))[nan].all()
    np.testing.assert_array_equal(bf16_bits(g)[~nan], bf16_bits(w)[~nan])
  # The two halves interleaved are the block values.
  np.testing.assert_array_equal(
      bf16_bits(jnp.stack(want, -1).reshape(256, 32, 16)),
      bf16_bits(tile.block_values(codes, scales)))


@pytest.mark.parametrize("block_2d,rounding", [(False, "stochastic"),
                                               (True, "nearest")])
def test_quantize_small_tiles_many_grid_steps(block_2d, rounding):
  x = heavy((48, 144), jnp.bfloat16, seed=21)
  key = KEY if rounding == "stochastic" else None
  cfg = pallas_quantize.QuantizeConfig(block_rows=16, block_cols=32)
  got, vals = jax.jit(lambda x: pallas_quantize.quantize(
      x, block_2d=block_2d, rounding=rounding, key=key, with_values=True,
      config=cfg))(x)
  assert_same(got, jit_ref(block_2d=block_2d, rounding=rounding, key=key)(x))
  back = jax.jit(lambda q: pallas_block_dequantize.block_values(
      q, config=cfg))(got)
  np.testing.assert_array_equal(bf16_bits(back), bf16_bits(vals))
  np.testing.assert_array_equal(bf16_bits(vals), bf16_bits(block_values(got)))


def word_codes_outside_nan_blocks(got, want):
  """The word paths' check against the reference: the same scale bytes, the
  same codes outside NaN blocks. Returns the NaN blocks' element mask and
  both codes (inside NaN blocks the reference's are 0 or 8, the word
  path's 0: the GPU's canonical NaN)."""
  s_got, s_want = (np.asarray(jax.lax.bitcast_convert_type(q.scales,
                                                           jnp.uint8))
                   for q in (got, want))
  np.testing.assert_array_equal(s_got, s_want)
  nan = np.repeat(np.isnan(np.asarray(want.scales, np.float32)), 8, axis=1)
  c_got, c_want = np.asarray(got.codes), np.asarray(want.codes)
  np.testing.assert_array_equal(c_got[~nan], c_want[~nan])
  return nan, c_got, c_want


@pytest.mark.parametrize("block_2d, words", [(False, False), (False, True),
                                             (True, True)])
def test_quantize_wide_tiles(block_2d, words, monkeypatch):
  """Blackwell's round-to-nearest tiles (`default_config(wide=True)`,
  16 x 512), the last tile along K partial: the reference's bits. `words`:
  the kernel's word path (bf16 pairs as uint32, as on Blackwell), its
  assembly replaced by the software twins: NaN, Inf, subnormal and zero
  blocks included; a NaN block's codes are 0 there (the GPU's canonical
  NaN), one of the reference's two."""
  if words and ON_GPU:
    pytest.skip(WORDS_ON_GPU)
  monkeypatch.setattr(pallas_quantize, "WORDS_INTERPRETED", words)
  x = np.asarray(heavy((32, 544), jnp.bfloat16, seed=23), np.float32)
  x[3, 20] = np.nan            # A NaN block (1x16), a NaN tile (16x16).
  x[5, 40:56] = 0              # A zero block.
  x[7, 70] = -np.inf           # Saturates its block's scale.
  x[9, 96:112] = 1e-39         # Subnormals: flushed.
  x = jnp.asarray(x, jnp.bfloat16)
  cfg = pallas_quantize.default_config(32, 544, block_2d, wide=True)
  assert (cfg.block_rows, cfg.block_cols) == (16, 512)
  fn = lambda x: pallas_quantize.quantize(x, block_2d=block_2d, config=cfg,
                                          amax=jnp.float32(9.0))
  if words:  # The word path is the one that runs.
    assert "u32[32,34,8]" in str(jax.make_jaxpr(fn)(x))
  got = jax.jit(fn)(x)
  want = jax.jit(lambda x: quantize_ref.quantize_reference(
      x, block_2d=block_2d, amax=jnp.float32(9.0)))(x)
  nan, c_got, c_want = word_codes_outside_nan_blocks(got, want)
  assert nan.any()
  assert ((c_want[nan] & 0x77) == 0).all()
  if words:
    assert (c_got[nan] == 0).all()


def _fos_input(rows: int) -> jax.Array:
  """bf16 `[rows, 544]` (the last tile partial along K) with the
  special blocks of Four-over-Six's word path: NaN, Inf, zero, subnormal,
  blocks where both candidates are exact (4 and 6 tie: 6 kept) and tiny
  blocks (scales that underflow under a large amax)."""
  x = np.asarray(heavy((rows, 544), jnp.bfloat16, seed=29), np.float32)
  x[5, 40:56] = 0              # A zero block (a tie at 0).
  x[7, 70] = -np.inf           # Saturates its block's scale.
  x[9, 96:112] = 1e-39         # Subnormals: flushed.
  x[11, 0:16] = 3.0            # Exact in both candidates: a tie.
  x[12, 16:32] = np.tile([-1.5, 0.0], 8)  # Also exact in both.
  x[13, 128:144] = 1e-4        # Underflowing scales under amax 1e4.
  return jnp.asarray(x, jnp.bfloat16)


def _ftz_f32(x):
  return nm.ftz(jnp.asarray(x, jnp.float32))


def _check_fos_words(x, block_2d, amaxes, monkeypatch, with_values=False):
  """The word path's Four-over-Six (`WORDS_INTERPRETED`) against the
  reference under each tensor amax (a jit argument: XLA folds a constant
  amax's scale products in another order); returns how many blocks took
  the 4-candidate."""
  calls = []
  choose = choose_four.words_choose_four
  monkeypatch.setattr(choose_four, "words_choose_four",
                      lambda *a: calls.append(1) or choose(*a))
  run = jax.jit(lambda x, a: pallas_quantize.quantize(
      x, block_2d=block_2d, four_over_six=True, amax=a,
      with_values=with_values))
  rows, k = x.shape

  @jax.jit
  def ref(x, a):
    """The reference, and the 6-candidate's scales as numbers."""
    bam = tile.block_amax(_ftz_f32(x).reshape(rows, k // 16, 16), block_2d)
    s6, _ = nm.nvfp4_scale_constants(a, four_over_six=True)
    return (quantize_ref.quantize_reference(
        x, block_2d=block_2d, four_over_six=True, amax=a,
        with_values=with_values),
            nm.nvfp4_block_decode_scale(bam, s6).astype(jnp.float32))

  fours = 0
  for amax in amaxes:
    got, (want, six) = run(x, amax), ref(x, amax)
    assert calls  # The word path ran.
    if with_values:
      (got, v_got), (want, v_want) = got, want
      ok = ~np.isnan(np.asarray(v_want, np.float32))
      np.testing.assert_array_equal(np.isnan(np.asarray(v_got, np.float32)),
                                    ~ok)
      np.testing.assert_array_equal(bf16_bits(v_got)[ok],
                                    bf16_bits(v_want)[ok])
    nan, c_got, _ = word_codes_outside_nan_blocks(got, want)
    assert (c_got[nan] == 0).all()
    # Blocks that took the 4-candidate: scales above the 6-candidate's.
    fours += int(np.sum(np.asarray(want.scales, np.float32)
                        > np.asarray(six)))
  return fours


def test_quantize_four_over_six_words(monkeypatch):
  """Four-over-Six on the 1x16 word path (Blackwell's E2M1 conversion for
  both candidates, error terms of the decoded codes: `choose_four.
  words_choose_four`), its assembly replaced by the software twins: the
  reference's scales and codes, with tensor amaxes that saturate (9),
  keep (the data's) and underflow (1e4) block scales; both candidates
  occur."""
  if ON_GPU:
    pytest.skip(WORDS_ON_GPU)
  monkeypatch.setattr(pallas_quantize, "WORDS_INTERPRETED", True)
  x = _fos_input(16)
  amax = jnp.float32(np.nanmax(np.abs(np.asarray(x, np.float32))))
  assert _check_fos_words(x, False, [jnp.float32(9.0), amax,
                                     jnp.float32(1e4)], monkeypatch) > 0


@pytest.mark.slow
def test_quantize_four_over_six_words_2d_nan_and_values(monkeypatch):
  """`test_quantize_four_over_six_words` for 16x16 tiles, for codes with
  block values and for the values alone, with a NaN block (a NaN tile:
  code 0 there, NaN values)."""
  if ON_GPU:
    pytest.skip(WORDS_ON_GPU)
  monkeypatch.setattr(pallas_quantize, "WORDS_INTERPRETED", True)
  x = np.asarray(_fos_input(32), np.float32)
  x[3, 20] = np.nan
  x = jnp.asarray(x, jnp.bfloat16)
  amaxes = [jnp.float32(9.0), jnp.float32(1e4)]
  assert _check_fos_words(x, True, amaxes, monkeypatch) > 0
  assert _check_fos_words(x, False, amaxes, monkeypatch,
                          with_values=True) > 0
  # The values alone (`with_codes=False`): the same block values.
  only = jax.jit(lambda x, a: pallas_quantize.quantize(
      x, four_over_six=True, amax=a, with_codes=False))
  ref = jax.jit(lambda x, a: quantize_ref.quantize_reference(
      x, four_over_six=True, amax=a, with_values=True)[1])
  assert "u32[32,34,8] = bitcast_convert_type" in str(  # The word path.
      jax.make_jaxpr(only)(x, amaxes[0]))
  for amax in amaxes:
    got, want = only(x, amax), np.asarray(ref(x, amax), np.float32)
    assert got.four_over_six
    ok = ~np.isnan(want)
    assert not ok.all()
    np.testing.assert_array_equal(
        np.isnan(np.asarray(got.values, np.float32)), ~ok)
    np.testing.assert_array_equal(bf16_bits(got.values)[ok],
                                  bf16_bits(ref(x, amax))[ok])


def _blackwell_rtne_pair(monkeypatch, four_over_six=False):
  if ON_GPU:
    pytest.skip(WORDS_ON_GPU)
  monkeypatch.setattr(e2m1_encode, "hardware_e2m1", lambda: True)
  monkeypatch.setattr(pallas_quantize, "WORDS_INTERPRETED", True)
  monkeypatch.setattr(pallas_rht, "COLUMNS_WORDS_INTERPRETED", True)
  x = rht_input((48, 64), jnp.bfloat16, seed=26)
  fos = dict(four_over_six=four_over_six)
  fn = lambda x: pair_api.QUANTIZE_PAIR(
      "pallas", x, Operand(rounding="nearest", **fos),
      Operand(rounding="nearest", rht=True, **fos), key_row=None, key_t=None)
  return fn, x


def test_four_over_six_pair_splits_on_blackwell(monkeypatch):
  """A Four-over-Six round-to-nearest pair splits as the plain one
  (`test_rtne_pair_splits_on_blackwell`): the 1x16 word path and the
  columns kernel's word path both take Four-over-Six. (Traced only; the
  pair against the reference: the slow test below.)"""
  fn, x = _blackwell_rtne_pair(monkeypatch, four_over_six=True)
  jaxpr = str(jax.make_jaxpr(fn)(x))
  assert "nvfp4_quantize_x_and_rht_t" not in jaxpr
  assert "nvfp4_quantize_rht_t_columns" in jaxpr and "u32[48,4,8]" in jaxpr


@pytest.mark.slow
def test_four_over_six_pair_split_on_blackwell_equals_reference(monkeypatch):
  """The split Four-over-Six pair, both kernels interpreted with their
  assembly's software twins: the reference's scales and codes."""
  fn, x = _blackwell_rtne_pair(monkeypatch, four_over_six=True)
  gx, gt = jax.jit(fn)(x)
  wx, wt = jit_xla(lambda x, **kw: pair_api.quantize_pair(
      x, Operand(rounding="nearest", four_over_six=True),
      Operand(rounding="nearest", rht=True, four_over_six=True), **kw))(x)
  assert gx.four_over_six and gt.four_over_six
  assert_same(gx, wx)
  assert_same(gt, wt)


def test_rtne_pair_splits_on_blackwell(monkeypatch):
  """Where the E2M1 conversion exists (mocked here) a round-to-nearest
  pair runs as the 1x16 word path (bf16 pairs as uint32 words) and the
  columns kernel (`pallas_pair.splits_on_blackwell`): no fused kernel.
  (Traced only: each kernel's path is checked against the reference by
  test_quantize_wide_tiles and test_rht_columns_words_path; the pair as a
  whole by the slow test below.)"""
  fn, x = _blackwell_rtne_pair(monkeypatch)
  jaxpr = str(jax.make_jaxpr(fn)(x))
  assert "nvfp4_quantize_x_and_rht_t" not in jaxpr
  assert "nvfp4_quantize_rht_t_columns" in jaxpr and "u32[48,4,8]" in jaxpr
  # X as block values (Hopper's GEMM operand) splits too.
  jaxpr = str(jax.make_jaxpr(lambda x: pair_api.QUANTIZE_PAIR(
      "pallas", x, Operand(rounding="nearest"),
      Operand(rounding="nearest", rht=True), key_row=None, key_t=None,
      values=(True, False)))(x))
  assert "nvfp4_quantize_x_and_rht_t" not in jaxpr
  assert "nvfp4_quantize_values" in jaxpr and "u32[48,4,8]" in jaxpr


@pytest.mark.slow
def test_rtne_pair_split_on_blackwell_equals_reference(monkeypatch):
  """The split pair of `test_rtne_pair_splits_on_blackwell`, both kernels
  interpreted with their assembly's software twins: the reference's
  scales and codes."""
  fn, x = _blackwell_rtne_pair(monkeypatch)
  gx, gt = jax.jit(fn)(x)
  wx, wt = jit_xla(pair_api.quantize_x_and_rht_t)(x)
  assert_same(gx, wx)
  assert_same(gt, wt)


@pytest.mark.slow
def test_quantize_words_values(monkeypatch):
  """The word path writing codes and bf16 block values (values decoded from
  the codes: `paired_words.words_values`), and the values alone, interpreted
  with the assembly's software twins: the reference's scales and codes
  outside NaN blocks, and the block values of the reference's codes
  (NaN in NaN blocks)."""
  if ON_GPU:
    pytest.skip(WORDS_ON_GPU)
  monkeypatch.setattr(pallas_quantize, "WORDS_INTERPRETED", True)
  x = np.asarray(heavy((16, 160), jnp.bfloat16, seed=27), np.float32)
  x[3, 20] = np.nan
  x[5, 40:56] = 0
  x[7, 70] = -np.inf
  x[9, 96:112] = 1e-39
  x = jnp.asarray(x, jnp.bfloat16)
  amax = jnp.float32(9.0)
  fn = lambda x: pallas_quantize.quantize(x, amax=amax, with_values=True)
  assert "u32[16,10,8]" in str(jax.make_jaxpr(fn)(x))  # The word path.
  got, vals = jax.jit(fn)(x)
  want = jit_ref(amax=amax)(x)
  word_codes_outside_nan_blocks(got, want)
  v_want = np.asarray(block_values(want), np.float32)
  v_got = np.asarray(vals, np.float32)
  assert np.isnan(v_want).any()
  np.testing.assert_array_equal(np.isnan(v_got), np.isnan(v_want))
  ok = ~np.isnan(v_want)
  np.testing.assert_array_equal(bf16_bits(vals)[ok],
                                bf16_bits(block_values(want))[ok])
  # Values alone: converted and decoded in one assembly
  # (`paired_words.scale_encode_values`), the same values.
  fn = lambda x: pallas_quantize.quantize(x, amax=amax, with_codes=False)
  # The word path: x read as uint32 pairs.
  assert "u32[16,10,8] = bitcast_convert_type" in str(jax.make_jaxpr(fn)(x))
  only = jax.jit(fn)(x).values
  np.testing.assert_array_equal(np.isnan(np.asarray(only, np.float32)),
                                np.isnan(v_want))
  np.testing.assert_array_equal(bf16_bits(only)[ok],
                                bf16_bits(block_values(want))[ok])


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="the E2M1 assembly runs on the GPU")
def test_words_values_and_split_pair_on_blackwell():
  """On a Blackwell GPU with the E2M1 conversion: the word path's block
  values (`paired_words.words_values`' hardware decoding; values alone:
  `paired_words.scale_encode_values`) are the block values of the reference's
  codes (NaN in NaN blocks), and the round-to-nearest
  pair (run as two kernels there) equals the reference."""
  if not e2m1_encode.hardware_e2m1():
    pytest.skip("needs a GPU with the E2M1 conversion (cc 10.0 / 10.3)")
  x = np.asarray(heavy((256, 1024), jnp.bfloat16, seed=28), np.float32)
  x[3, 20] = np.nan
  x[5, 40:56] = 0
  x[7, 70] = -np.inf
  x[9, 96:112] = 1e-39
  x = jnp.asarray(x, jnp.bfloat16)
  amax = jnp.float32(9.0)
  _, vals = jax.jit(lambda x: pallas_quantize.quantize(
      x, amax=amax, with_values=True))(x)
  want = block_values(jit_ref(amax=amax)(x))
  v_want = np.asarray(want, np.float32)
  np.testing.assert_array_equal(np.isnan(np.asarray(vals, np.float32)),
                                np.isnan(v_want))
  ok = ~np.isnan(v_want)
  np.testing.assert_array_equal(bf16_bits(vals)[ok], bf16_bits(want)[ok])
  only = jax.jit(lambda x: pallas_quantize.quantize(
      x, amax=amax, with_codes=False))(x).values  # `scale_encode_values`.
  np.testing.assert_array_equal(np.isnan(np.asarray(only, np.float32)),
                                np.isnan(v_want))
  np.testing.assert_array_equal(bf16_bits(only)[ok], bf16_bits(want)[ok])
  y = rht_input((512, 384), jnp.bfloat16, seed=29)
  gx, gt = jax.jit(lambda y: pair_api.quantize_x_and_rht_t(
      y, implementation="pallas"))(y)
  wx, wt = jit_xla(pair_api.quantize_x_and_rht_t)(y)
  assert_same(gx, wx)
  assert_same(gt, wt)


def test_rht_small_tiles_many_grid_steps():
  x = rht_input((96, 72), jnp.bfloat16, seed=22)
  cfg = pallas_rht.RHTConfig(block_tokens=32, block_features=16)
  kx, kt = pair_api.split_key(KEY)
  gx, gt = jax.jit(lambda x: pair_api.QUANTIZE_PAIR("pallas", 
      x[:, :64], Operand(rounding="stochastic"),
      Operand(rounding="stochastic", rht=True), key_row=kx, key_t=kt,
      config=cfg))(x)
  wx, wt = jit_xla(pair_api.quantize_x_and_rht_t, key=KEY)(x[:, :64])
  assert_same(gx, wx)
  assert_same(gt, wt)
  got = jax.jit(lambda x: pallas_rht.quantize_rht_t(x, config=cfg))(x)
  assert_same(got, jit_xla(rht_t_api.quantize_rht_t)(x))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_rht_columns_small_tiles_many_grid_steps(rounding):
  """The columns kernel on one 16-token block x 16 features per program
  (partial tiles along both axes), codes and block values."""
  x = rht_input((112, 72), jnp.bfloat16, seed=23)
  key = KEY if rounding == "stochastic" else None
  cfg = pallas_rht.ColumnsConfig(blocks=2, block_features=16)
  f = lambda values: jax.jit(lambda x: pallas_rht.quantize_rht_t(
      x, rounding=rounding, key=key, config=cfg, values=values))(x)
  got, vals = f(False), f(True)
  assert_same(got, jit_xla(rht_t_api.quantize_rht_t, rounding=rounding,
                           key=key)(x))
  np.testing.assert_array_equal(bf16_bits(vals.values),
                                bf16_bits(block_values(got)))
  assert f32_bits(vals.amax) == f32_bits(got.amax)


def _amax_sweep() -> np.ndarray:
  """Positive FP32 amaxes over every exponent (zero, subnormals, the
  saturating and overflowing ends, infinity, NaN), 4 significands each."""
  bits = (np.arange(256, dtype=np.uint32)[:, None] << 23) | np.array(
      [0, 1, 0x2AAAAA, 0x7FFFFF], np.uint32)
  return bits.reshape(-1).view(np.float32)


def _ieee(fn):
  """`fn` in NumPy FP32 arithmetic (IEEE, subnormals kept: the GPU's
  `div.rn`, `rcp.rn`, `mul.rn` without `.ftz`), warnings off."""
  with np.errstate(all="ignore"):
    return fn()


def _ftz(x: np.ndarray) -> np.ndarray:
  return np.where(np.abs(x) < np.float32(nm.F32_TINY), x * np.float32(0), x)


def _same_bits(a, b) -> bool:
  """Equal bit patterns, NaNs as one (the kernel only tests for NaN)."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  nan = np.isnan(a)
  return bool((nan == np.isnan(b)).all()
              and (a.view(np.uint32) == b.view(np.uint32))[~nan].all())


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="a claim about XLA:CPU's arithmetic (pinned to the CPU), which "
    "the CPU suite checks; on the GPU machines it took 150-230 s (0.3-0.5 s "
    "with jax 0.11.2 on a CPU-only machine)")
@pytest.mark.parametrize("four_over_six", [False, True])
def test_rht_columns_words_constants_are_the_kernels(four_over_six):
  """The columns word path's tensor constant `S_enc / 6` and encode-scale
  table, computed by the wrapper (`_columns_call`: `numerics.
  nvfp4_scale_constants`, `paired_words.encode_scale_table`), are bit for bit
  what the kernel computed before from the amax, for amaxes over every
  exponent and all 256 E4M3 codes:

  - interpreted (XLA:CPU): its software twins, `paired_words.
    words_scale_constants` and `words_block_scales`;
  - on the GPU: `div.rn`, `rcp.rn` (IEEE, subnormals kept; modelled in
    NumPy FP32), the flush, then per block `rcp.rn.ftz` of the decoded
    scale times `1 / S_enc`, clamped to F32_MAX; against the wrapper's GPU
    branch (`div_rn`), run here on the CPU. Subnormal amaxes are left out
    of this one: XLA:CPU reads them as zero in `amax == 0` (S_enc 1),
    XLA:GPU and the kernel do not (2688 / amax overflows: both F32_MAX).
  """
  with on_cpu():
    amax = _amax_sweep()
    run = lambda divide: jax.jit(lambda a: nm.nvfp4_scale_constants(
        a, divide=divide, four_over_six=four_over_six))(amax)
    twin = jax.jit(lambda a: paired_words.words_scale_constants(
        a, True, four_over_six))(amax)
    for got, want in zip(run(nm.divide), twin):
      assert _same_bits(got, want)
    num = np.float32(nm.FOUR_OVER_SIX_NUMERATOR if four_over_six
                     else nm.E4M3_MAX_X_E2M1_MAX)
    f32_max = np.float32(nm.F32_MAX)

    def kernel_constants():
      s = num / amax
      s = np.where(s > f32_max, f32_max, s)
      s = np.where((amax == 0) | (s == 0), np.float32(1), s)
      return s * np.float32(1.0 / nm.E2M1_MAX), _ftz(np.float32(1) / s)
    normal = ~((amax > 0) & (amax < np.float32(nm.F32_TINY)))
    for got, want in zip(run(nm.div_rn), _ieee(kernel_constants)):
      assert _same_bits(np.asarray(got)[normal], want[normal])
    # The table, one row per tensor constant (entry k: E4M3 bits k).
    inv = np.asarray(twin[1])[::7]
    code = jnp.arange(256, dtype=jnp.uint8)
    d = np.asarray(code.view(jnp.float8_e4m3fn).astype(jnp.float32))

    def kernel_table():
      e = np.float32(1) / _ftz(d[None, :] * inv[:, None])
      return np.where(e > f32_max, f32_max, e)
    table = jax.jit(jax.vmap(paired_words.encode_scale_table))(inv)
    assert np.isnan(np.asarray(table)[:, [0x7F, 0xFF]]).all()
    # The interpreted kernel's own reciprocal path, per code (the codes of
    # positive scales: its block amaxes are magnitudes).
    _, enc = jax.jit(jax.vmap(lambda c: paired_words.words_block_scales(
        jnp.asarray(d), jnp.float32(1), c, True)))(inv)
    positive = ~np.signbit(d) & ~np.isnan(d)
    assert _same_bits(np.asarray(table)[:, positive],
                      np.asarray(enc)[:, positive])
    # The GPU: IEEE products, of which XLA:CPU flushes those whose exact
    # value lies below 2^-126 and rounds up to it (left out here; the GPU's
    # `mul.rn.f32` and XLA:GPU keep them, as NumPy).
    exact = d[None, :].astype(np.float64) * inv[:, None]
    edge = (np.abs(exact) < nm.F32_TINY) & (
        np.abs(exact.astype(np.float32)) == np.float32(nm.F32_TINY))
    want = _ieee(kernel_table)
    gpu_branch = jax.jit(lambda c: nm.nvfp4_block_encode_scale(
        jnp.asarray(d)[None, :], c[:, None], divide=nm.div_rn))(inv)
    assert _same_bits(np.asarray(gpu_branch)[~edge], want[~edge])
    assert _same_bits(np.asarray(table)[~edge], want[~edge])


@pytest.mark.parametrize("expansion", [None, 1.5])
def test_e4m3_codes_are_the_decode_scales_bits(expansion):
  """`paired_words.e4m3_codes` (the word path's scale bytes, the table's index)
  interpreted: the bits of `numerics.nvfp4_block_decode_scale`, for block
  amaxes over every exponent (zero, subnormal, saturating, infinite, NaN)
  under a tensor constant that keeps, rounds and saturates them; the
  GPU's assembly converts with the instruction the cast lowers to."""
  bamax = jnp.asarray(np.abs(_amax_sweep()))
  s6 = jnp.float32(0.37)
  got = paired_words.e4m3_codes(bamax * s6, expansion, True)
  want = nm.nvfp4_block_decode_scale(bamax, s6, expansion=expansion)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(
      np.asarray(got), np.asarray(want.view(jnp.uint8)).astype(np.int32))


def test_rht_columns_words_bounded_index_maps_are_the_index_maps():
  """`_bounded` (the word path's BlockSpec index maps) changes no block
  index of a program id inside its grid."""
  fn = lambda i, j: (j, i, 0)
  grid = (5, 3)
  for i in range(grid[0]):
    for j in range(grid[1]):
      got = pallas_rht._bounded(grid)(fn)(jnp.int32(i), jnp.int32(j))
      assert tuple(int(v) for v in got) == fn(i, j)


def test_rht_columns_words_path(monkeypatch):
  """The columns kernel's path of Blackwell's round-to-nearest codes
  (`_columns_words`: packed FP32 butterfly, bf16-pair rounding and block
  amax, the word encoder), interpreted with its assembly's software twins,
  partial tiles along both axes: the reference's scales, and its codes
  outside NaN blocks (there 0, the GPU's canonical NaN; the reference's
  are 0 or 8). NaN, Inf, zero and subnormal blocks included."""
  if ON_GPU:
    pytest.skip(WORDS_ON_GPU)
  calls = []
  words = pallas_rht._columns_words
  monkeypatch.setattr(pallas_rht, "COLUMNS_WORDS_INTERPRETED", True)
  monkeypatch.setattr(pallas_rht, "_columns_words",
                      lambda *a: calls.append(1) or words(*a))
  x = np.asarray(rht_input((48, 24), jnp.bfloat16, seed=24), np.float32)
  x[3, 5] = np.nan       # Feature 5's first 16-token block: NaN.
  x[16:32, 9] = 0        # A zero block.
  x[40, 11] = np.inf     # Its block saturates.
  x[0:16, 13] = 1e-39    # Subnormal inputs: flushed.
  x[32:48, 17] = 2.0**-125  # Normal bf16, products by 1/4 flushed.
  x = jnp.asarray(x, jnp.bfloat16)
  cfg = pallas_rht.ColumnsConfig(blocks=2, block_features=16)
  amax = jnp.float32(11.0)
  got = jax.jit(lambda x: pallas_rht.quantize_rht_t(x, config=cfg,
                                                    amax=amax))(x)
  assert calls  # The path ran.
  want = jit_xla(rht_t_api.quantize_rht_t, amax=amax)(x)
  nan, c_got, _ = word_codes_outside_nan_blocks(got, want)
  assert nan.any() and not nan.all()
  assert (c_got[nan] == 0).all()


@pytest.mark.slow
def test_rht_columns_words_four_over_six(monkeypatch):
  """Four-over-Six's Wgrad operand in the columns kernel's word path
  (where that path runs: Blackwell; interpreted here with its assembly's
  software twins; elsewhere it stays in the tensor-core kernel): the
  reference's scales and codes (0 in NaN blocks) under tensor amaxes that
  saturate, keep and underflow block scales; both candidates occur."""
  if ON_GPU:
    pytest.skip(WORDS_ON_GPU)
  monkeypatch.setattr(pallas_rht, "COLUMNS_WORDS_INTERPRETED", True)
  x = np.asarray(rht_input((48, 24), jnp.bfloat16, seed=30), np.float32)
  x[3, 5] = np.nan       # Feature 5's first 16-token block: NaN.
  x[16:32, 9] = 0        # A zero block (a tie).
  x[40, 11] = np.inf     # Its block saturates.
  x[0:16, 13] = 1e-39    # Subnormal inputs: flushed.
  x[32:48, 15] = 2.0     # The RHT of a constant: exact in both, a tie.
  x = jnp.asarray(x, jnp.bfloat16)
  cfg = pallas_rht.ColumnsConfig(blocks=2, block_features=16)
  fn = lambda x, a: pallas_rht.quantize_rht_t(x, config=cfg, amax=a,
                                               four_over_six=True)
  assert "nvfp4_quantize_rht_t_columns" in _kernel_names(
      lambda x: fn(x, jnp.float32(1)), x)
  run = jax.jit(fn)
  def reference(x, a):
    """The reference, and the 6-candidate's scales as numbers."""
    y = hadamard.rht(x.T, size=16)
    bam = tile.block_amax(_ftz_f32(y).reshape(24, 3, 16), False)
    s6, _ = nm.nvfp4_scale_constants(a, four_over_six=True)
    return (quantize_ref.quantize_reference(y, four_over_six=True, amax=a),
            nm.nvfp4_block_decode_scale(bam, s6).astype(jnp.float32))

  ref = truth(reference)
  fours = 0
  for amax in (jnp.float32(11.0), jnp.float32(60.0), jnp.float32(1e5)):
    got, (want, six) = run(x, amax), ref(x, amax)
    assert got.four_over_six
    nan, c_got, _ = word_codes_outside_nan_blocks(got, want)
    assert nan.any() and not nan.all()
    assert (c_got[nan] == 0).all()
    # Blocks that took the 4-candidate: scales above the 6-candidate's.
    fours += int(np.sum(np.asarray(want.scales, np.float32)
                        > np.asarray(six)))
  assert fours > 0


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="the packed FP32 and E2M1 assembly runs on the GPU")
def test_rht_columns_words_path_on_blackwell():
  """On a Blackwell GPU with the E2M1 conversion (`e2m1_encode.hardware_e2m1`)
  the columns kernel's round-to-nearest codes take `_columns_words`'
  assembly (`add/sub/mul.f32x2`, `add.ftz.f32x2` + `cvt.rn.bf16x2.f32`,
  `max.NaN.xorsign.abs.bf16x2`, the word encoder): the reference's scales,
  and its codes outside NaN blocks (0 there), at the default tiles, with
  NaN, Inf, zero and tiny blocks."""
  if not e2m1_encode.hardware_e2m1():
    pytest.skip("needs a GPU with the E2M1 conversion (cc 10.0 / 10.3)")
  x = np.asarray(rht_input((1024, 640), jnp.bfloat16, seed=25), np.float32)
  x[3, 5] = np.nan
  x[16:32, 9] = 0
  x[40, 11] = np.inf
  x[48:64, 13] = 1e-39
  x[64:80, 17] = 2.0**-125
  x[80:96, 19] = 2.0**-120
  x = jnp.asarray(x, jnp.bfloat16)
  amax = jnp.float32(13.0)
  got = jax.jit(lambda x: pallas_rht.quantize_rht_t(x, amax=amax))(x)
  want = jit_xla(rht_t_api.quantize_rht_t, amax=amax)(x)
  nan, c_got, _ = word_codes_outside_nan_blocks(got, want)
  assert (c_got[nan] == 0).all()


@pytest.mark.parametrize("value,nonzero", [(2.0**-125, False),
                                           (-1.5 * 2.0**-124, True)])
def test_rht_columns_flushes_products_as_the_reference(value, nonzero):
  """Tokens of 2^-125 (normal in bf16) times 1/4 are subnormal products,
  which the reference flushes (`tile.flushed_product`, on every backend and
  CPU): a tensor of them transforms to zeros (amax 0), not to 2^-123, and
  to +0s, the butterfly's (a dot's `fma` chain left zeros of the last
  product's sign: codes 8 and 128 where the kernels gave 0, on AVX2 hosts,
  `tests/core/test_isa.py`). The columns kernels flush them in the product
  (`mul.ftz`). Products of 1.5 x 2^-126 are normal and kept."""
  x = jnp.full((32, 48), value, jnp.bfloat16)
  want = jit_xla(rht_t_api.quantize_rht_t)(x)
  assert (float(want.amax) > 0) == nonzero
  assert f32_bits(jax.jit(pallas_rht.rht_amax)(x)) == f32_bits(want.amax)
  assert_same(jax.jit(pallas_rht.quantize_rht_t)(x), want)


@pytest.mark.parametrize("kernel,size", [("columns", 16),
                                         ("tensor_cores", 16),
                                         ("tensor_cores", 64)])
def test_rht_of_tiny_tokens_decodes_as_the_reference(kernel, size):
  """Tokens below 2^-124 (2^-123 for 64 points) have subnormal RHT products.
  The reference defines what becomes of them (`tile.hadamard_rows`: every
  product and partial sum flushed, the butterfly's order), and the columns
  kernels run the same operations: their codes, scales and amax are the
  reference's, bit for bit. The tensor cores keep subnormal products and
  partial sums and sum in their own order, so which partial sums flush
  there, and the signs of zeros, differ, as a sum's rounding does
  (`rht_input`). What is comparable with them, in a tensor whose other sums
  are exact and whose amax is normal-sized: the amax, every scale byte and
  every decoded value (codes may differ only in the sign of a zero code, 0
  against 8, which decode alike: NVFP4_SPEC section 1). Blocks of tiny
  tokens get zero scales, whatever their codes; tiny tokens beside normal
  ones vanish in the sums, or, where the normal ones cancel exactly, leave
  an output that encodes to a zero of either sign."""
  rng = np.random.default_rng(29)
  x = np.array(rht_input((128, 96), jnp.float32, seed=29))
  tiny = rng.choice([-1.0, 1.0], x.shape) * np.exp2(
      rng.uniform(-133.0, -122.0, x.shape))
  x[:32, :48] = tiny[:32, :48]  # Whole 16- and 64-token blocks of them.
  mixed = rng.random(x.shape) < 0.3
  x[64:] = np.where(mixed[64:], tiny[64:], x[64:])  # Beside normal tokens.
  x = jnp.asarray(x, jnp.bfloat16)
  cfg = (pallas_rht.ColumnsConfig() if kernel == "columns"
         else pallas_rht.RHTConfig(block_tokens=64, block_features=32))
  want = jit_xla(rht_t_api.quantize_rht_t, size=size)(x)
  gots = [jax.jit(lambda x: pallas_rht.quantize_rht_t(x, size=size,
                                                      config=cfg))(x)]
  if kernel == "tensor_cores":
    gots.append(jax.jit(lambda x: pair_api.quantize_x_and_rht_t(
        x, size=size, implementation="pallas"))(x)[1])
  if kernel == "columns":
    assert_same(gots[0], want)
  for got in gots:
    assert f32_bits(got.amax) == f32_bits(want.amax)
    np.testing.assert_array_equal(np.asarray(got.scales).view(np.uint8),
                                  np.asarray(want.scales).view(np.uint8))
    np.testing.assert_array_equal(  # As numbers: -0 == +0.
        np.asarray(block_values(got), np.float32),
        np.asarray(block_values(want), np.float32))


def _kernel_names(fn, x):
  # A new function each time: tracing caches by function, not by the
  # module switches the tests flip.
  jaxpr = jax.make_jaxpr(lambda x: fn(x))(x).jaxpr  # pylint: disable=unnecessary-lambda
  return [e.params["name"] for e in jaxpr.eqns
          if e.primitive.name == "pallas_call"]


@pytest.mark.parametrize("columns", [True, False], ids=["on", "switched_off"])
def test_rht_columns_kernel_is_the_default_where_it_applies(columns,
                                                            monkeypatch):
  """The Wgrad operand alone with 16-point RHT, and every amax pass of it,
  run the columns kernels; the fused X pair, Four-over-Six (off the word
  path, which runs on Blackwell only), other Hadamard sizes and an
  `RHTConfig` run the tensor-core ones (as does everything with `COLUMNS`
  off)."""
  monkeypatch.setattr(pallas_rht, "COLUMNS", columns)
  x = jnp.ones((64, 64), jnp.bfloat16)
  col = lambda n: n + "_columns" if columns else n
  names = lambda fn: _kernel_names(fn, x)
  assert names(pallas_rht.quantize_rht_t) == [
      col("nvfp4_rht_amax"), col("nvfp4_quantize_rht_t")]
  assert names(functools.partial(pallas_rht.quantize_rht_t, values=True,
                                 rounding="stochastic", key=KEY)) == [
      col("nvfp4_rht_amax"), col("nvfp4_quantize_rht_t") + "_values"]
  assert names(functools.partial(pallas_rht.quantize_rht_t,
                                 four_over_six=True)) == [
      col("nvfp4_rht_amax"), "nvfp4_quantize_rht_t"]
  assert names(functools.partial(pallas_rht.quantize_rht_t, size=64)) == [
      "nvfp4_rht_amax", "nvfp4_quantize_rht_t"]
  assert names(functools.partial(
      pallas_rht.quantize_rht_t, config=pallas_rht.RHTConfig())) == [
          "nvfp4_rht_amax", "nvfp4_quantize_rht_t"]
  assert names(lambda x: pair_api.quantize_x_and_rht_t(
      x, implementation="pallas")) == [col("nvfp4_rht_amax"),
                                       "nvfp4_quantize_x_and_rht_t"]


def test_columns_config_where_the_columns_kernels_do_not_run():
  x = jnp.ones((64, 64), jnp.bfloat16)
  cfg = pallas_rht.ColumnsConfig()
  for call in (lambda: pallas_rht.quantize_rht_t(x, four_over_six=True,
                                                 config=cfg),
               lambda: pallas_rht.rht_amax(x, size=64, config=cfg),
               lambda: pallas_rht.quantize_call(
                   x, amax_t=1.0, key_t=None, amax_x=1.0, size=16,
                   sign_vector=None, fused_x=True, config=cfg)):
    with pytest.raises(ValueError, match="ColumnsConfig tiles the columns "
                       "kernels.*pass an RHTConfig or None"):
      call()


def test_rht_columns_kernel_has_no_dot():
  """The columns kernels transform with the butterfly's additions: their
  kernel bodies have no dot (the tensor-core kernels' transform) and no
  transpose of the input tile."""
  x = jnp.ones((64, 64), jnp.bfloat16)

  def walk(jaxpr, found):  # Every primitive, nested jaxprs included.
    for e in jaxpr.eqns:
      found.add(e.primitive.name)
      for v in e.params.values():
        for sub in v if isinstance(v, (tuple, list)) else (v,):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            walk(sub, found)
    return found

  def prims(fn):
    jaxpr = jax.make_jaxpr(lambda x: fn(x))(x).jaxpr  # pylint: disable=unnecessary-lambda
    return {e.params["name"]: walk(e.params["jaxpr"], set())
            for e in jaxpr.eqns if e.primitive.name == "pallas_call"}

  got = prims(functools.partial(pallas_rht.quantize_rht_t,
                                rounding="stochastic", key=KEY))
  assert set(got) == {"nvfp4_rht_amax_columns",
                      "nvfp4_quantize_rht_t_columns"}
  for name, p in got.items():
    assert "dot_general" not in p, name
  old = prims(functools.partial(pallas_rht.quantize_rht_t,
                                config=pallas_rht.RHTConfig()))
  assert all("dot_general" in p for p in old.values()), old


@pytest.mark.parametrize("shape,dtype,cfg", [
    # Several loop steps per program, the last tile partial, several programs.
    ((208, 48), jnp.bfloat16, dict(block_tokens=32, block_features=16,
                                   amax_steps=2)),
    ((96, 80), jnp.bfloat16, dict(block_tokens=16, block_features=32,
                                  amax_steps=4)),
    ((64, 96), jnp.float32, dict(block_tokens=16, block_features=32,
                                 amax_steps=2)),
    # The columns kernel (the default for 16-point RHT): the same loops.
    ((208, 48), jnp.bfloat16, dict(blocks=1, block_features=16,
                                   amax_steps=4)),
    ((96, 80), jnp.bfloat16, dict(blocks=2, block_features=32,
                                  amax_steps=2)),
    ((64, 96), jnp.float32, dict(blocks=1, block_features=32,
                                 amax_steps=2)),
    ((80, 48), jnp.bfloat16, {}),  # The default: one program, 2 steps.
])
@pytest.mark.parametrize("peak", ["first", "last"])
def test_rht_amax_over_its_loop(shape, dtype, cfg, peak, monkeypatch):
  """The amax pass's running maximum over its token tiles: the tensor's
  largest magnitude placed in the first or the last (partial) tile is found,
  for `rht(x.T)` and for `x`, bit for bit the reference's."""
  monkeypatch.setattr(pallas_rht, "AMAX_PROGRAMS", 1)  # Loops on small x.
  x = np.array(rht_input(shape, dtype, seed=shape[0]), np.float32)
  row = 0 if peak == "first" else shape[0] - 1
  x[row] *= 64.0  # Exact: a power of two (rht_input's sums stay exact).
  x = jnp.asarray(x, dtype)
  config = None
  if cfg:
    config = (pallas_rht.ColumnsConfig(**cfg) if "blocks" in cfg
              else pallas_rht.RHTConfig(**cfg))
  got_x, got_t = jax.jit(lambda x: pallas_rht.rht_amax(
      x, with_x=True, config=config))(x)
  want_t = truth(lambda x: tile.abs_max(nf.rht(x.T).astype(jnp.float32)))(x)
  want_x = truth(lambda x: nm.ftz(tile.abs_max(
      x.astype(jnp.float32))))(x)
  np.testing.assert_array_equal(f32_bits(got_t), f32_bits(want_t))
  np.testing.assert_array_equal(f32_bits(got_x), f32_bits(want_x))


@pytest.mark.parametrize("special", [np.nan, np.inf])
@pytest.mark.parametrize("cfg", [
    pallas_rht.RHTConfig(block_tokens=16, block_features=16, amax_steps=2),
    pallas_rht.ColumnsConfig(blocks=1, block_features=16, amax_steps=2)],
                         ids=["tensor_cores", "columns"])
def test_rht_amax_nan_and_inf(special, cfg, monkeypatch):
  monkeypatch.setattr(pallas_rht, "AMAX_PROGRAMS", 1)
  x = np.array(rht_input((96, 32), jnp.bfloat16, seed=5), np.float32)
  x[70, 3] = special  # In the second program's second step.
  got_x, got_t = jax.jit(lambda x: pallas_rht.rht_amax(
      x, with_x=True, config=cfg))(jnp.asarray(x, jnp.bfloat16))
  if np.isnan(special):
    assert np.isnan(float(got_t)) and np.isnan(float(got_x))
  else:  # An infinity plus or minus finite values stays infinite.
    assert float(got_t) == np.inf and float(got_x) == np.inf


@pytest.mark.parametrize("pair", ["x", "dy"])
def test_pair_amaxes_and_seeds_reach_the_encoders_whole(pair):
  """Each encode kernel takes each amax and its own seeds as separate
  inputs: between the kernels no stack, concatenate or padding runs (each
  was a GPU launch of its own, ~1-2 us, for tensors read in ~20-100 us)."""
  r = nf.Recipe.nvfp4()
  row, t = (r.fprop_x, r.wgrad_x) if pair == "x" else (r.dgrad_dy, r.wgrad_dy)
  keys = (jax.random.key(1), jax.random.key(2)) if pair == "dy" else (None,
                                                                      None)
  f = lambda x: pair_api.quantize_pair(
      x, row, t, key_row=keys[0], key_t=keys[1], values=(True, pair == "dy"),
      implementation="pallas")
  jaxpr = jax.make_jaxpr(f)(jnp.ones((64, 64), jnp.bfloat16)).jaxpr
  names = [e.params["name"] for e in jaxpr.eqns
           if e.primitive.name == "pallas_call"]
  assert names[0].startswith("nvfp4_rht_amax") and len(names) == (
      2 if pair == "x" else 3), names
  for e in jaxpr.eqns:
    assert e.primitive.name not in ("stack", "concatenate", "pad"), e


def _explicit_mesh():
  # What flax's NNX examples do to annotate parameters: one device, an
  # Explicit axis. The kernels' blocks then carry the mesh's sharding.
  return jax.set_mesh(jax.make_mesh((1,), ("data",),
                                    axis_types=(jax.sharding.AxisType.Explicit,)))


@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernels are compiled for real")
@pytest.mark.parametrize("mesh", [contextlib.nullcontext, _explicit_mesh],
                         ids=["no_mesh", "explicit_mesh"])
def test_kernels_lower_to_triton(claim_sm90, mesh):
  """Off-GPU, lower every kernel for CUDA: no missing Pallas-Triton rule, and
  none that rejects an Explicit mesh in context."""
  x = jax.ShapeDtypeStruct((80, 400), jnp.bfloat16)  # Partial tiles: masks.
  fns = [
      lambda x: pallas_quantize.quantize(x, with_values=True),
      lambda x: pallas_quantize.quantize(x, block_2d=True,
                                         rounding="stochastic", key=KEY),
      lambda x: pallas_block_dequantize.block_values(
          pallas_quantize.quantize(x)),
      lambda x: pallas_rht.quantize_rht_t(x.astype(jnp.float32)),
      lambda x: pair_api.QUANTIZE_PAIR("pallas", 
          x, Operand(rounding="stochastic"),
          Operand(rounding="stochastic", rht=True), key_row=KEY,
          key_t=jax.random.key(1)),
      lambda x: pair_api.QUANTIZE_PAIR("pallas", 
          x, Operand(four_over_six=True),
          Operand(rounding="stochastic", rht=True, four_over_six=True),
          key_row=None, key_t=jax.random.key(1)),
  ]
  for fn in fns:
    with mesh():
      text = jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text


@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernels are compiled for real")
def test_amax_pass_reduces_its_partials_in_one_reduction(claim_sm90):
  """The RHT amax pass with `x`'s amax writes two arrays of per-program
  partials; one variadic reduction folds both (one XLA kernel per pass, not
  one per amax)."""
  x = jax.ShapeDtypeStruct((4096, 768), jnp.bfloat16)
  text = jax.jit(functools.partial(pallas_rht.rht_amax, with_x=True)).trace(
      x).lower(lowering_platforms=("cuda",)).as_text()
  assert "xla.gpu.triton" in text
  reduces = [l for l in text.splitlines() if "stablehlo.reduce" in l]
  assert len(reduces) == 1 and ":2 = stablehlo.reduce" in reduces[0], reduces


def test_combine_partial_amax_orders_bits_as_floats_and_keeps_nan():
  bits = lambda v: jax.lax.bitcast_convert_type(
      jnp.asarray(v, jnp.float32), jnp.uint32)
  a = bits([[0.0, 3.5], [2.0**-126, 1e30]])
  b = bits([[np.inf, 1.0], [0.5, 2.0]])
  c = bits([[np.nan, 1.0], [np.inf, 2.0]])  # abs_max_bits of a NaN max.
  got = fp32.combine_partial_amax(a, b, c)
  assert [float(g) for g in got[:2]] == [float(np.float32(1e30)), np.inf]
  assert np.isnan(float(got[2]))
  (one,) = fp32.combine_partial_amax(a)
  assert float(one) == float(np.float32(1e30))
