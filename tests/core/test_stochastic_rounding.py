"""Stochastic rounding: unbiased, neighbours only, a reproducible random stream."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nf
from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng
import te_reference as ref
from conftest import make_heavy_tailed

F32 = np.float32

sr_quantize = jax.jit(
    functools.partial(nf.quantize, rounding="stochastic"),
    static_argnames=("block_2d",))


def codes_of(q) -> np.ndarray:
  return np.asarray(nf.unpack_e2m1(q.codes))


def unit_scale_tensor(vals: np.ndarray) -> np.ndarray:
  """Rows `[2688, 0.., | 6, v0..v14]`: amax 2688 gives S_enc = 1 and block
  amax 6 gives d = 1, so the second block's scaled values equal its inputs
  and dequantization is `fp4 * 1 * 1`: SR is observed with no scale noise."""
  rows = -(-vals.size // 15)
  x = np.zeros((rows, 2, 16), F32)
  x[:, 0, 0] = 2688.0
  x[:, 1, 0] = 6.0
  body = np.zeros(rows * 15, F32)
  body[: vals.size] = vals
  x[:, 1, 1:] = body.reshape(rows, 15)
  return x.reshape(rows, 32)


def second_block(a: np.ndarray, n: int) -> np.ndarray:
  a = np.asarray(a)
  return a.reshape(*a.shape[:-2], -1, 2, 16)[..., 1, 1:].reshape(
      *a.shape[:-2], -1)[..., :n]


# ----------------------------------------------------------------------------
# The random stream.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("seeds", [(0, 0), (1, 2), (0xFFFFFFFF, 0x80000001),
                                   (0xDEADBEEF, 12345)])
def test_stream_matches_documented_definition(seeds):
  shape = (3, 40, 64)
  got = jax.jit(prng.random_bytes, static_argnums=1)(
      jnp.asarray(seeds, jnp.uint32), shape)
  assert got.dtype == jnp.uint8 and got.shape == shape
  want = ref.sr_bytes(*seeds, int(np.prod(shape))).reshape(shape)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_stream_bytes_look_uniform():
  b = np.asarray(prng.random_bytes(jnp.asarray([7, 9], jnp.uint32), (1 << 18,)))
  counts = np.bincount(b, minlength=256)
  expected = b.size / 256
  chi2 = np.sum((counts - expected) ** 2 / expected)
  assert chi2 < 400, chi2  # 255 dof: mean 255, sd ~23
  # Consecutive bytes (same 32-bit word) are uncorrelated.
  c = np.corrcoef(b[0::4].astype(float), b[1::4].astype(float))[0, 1]
  assert abs(c) < 0.01


def test_seeds_from_key():
  for key in (jax.random.key(3), jax.random.PRNGKey(3)):
    np.testing.assert_array_equal(
        np.asarray(prng.seeds_from_key(key)),
        np.asarray(jax.random.bits(key, (2,), jnp.uint32)))


@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_quantize_stochastic_reproduced_by_numpy(block_2d):
  """The whole SR path (scales, the stream in row-major order, the rounding
  rule) from the documented definitions: what a GPU kernel must match."""
  x = make_heavy_tailed((48, 64), seed=1)
  key = jax.random.key(42)
  q = sr_quantize(jnp.asarray(x), block_2d=block_2d, key=key)
  seeds = np.asarray(prng.seeds_from_key(key))
  packed, scales, amax = ref.quantize_stochastic(x, seeds, block_2d=block_2d)
  np.testing.assert_array_equal(np.asarray(q.codes), packed)
  np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8),
                                scales.view(np.uint8))
  assert float(q.amax) == float(amax)
  # The scales are those of round-to-nearest: only the elements change.
  qn = jax.jit(nf.quantize, static_argnames="block_2d")(
      jnp.asarray(x), block_2d=block_2d)
  np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8),
                                np.asarray(qn.scales).view(np.uint8))


# ----------------------------------------------------------------------------
# The rounding rule, exhaustively over the 256 random bytes.
# ----------------------------------------------------------------------------


def test_rounding_rule_exhaustive_over_bytes():
  rng = np.random.default_rng(0)
  y = np.concatenate([rng.uniform(-6.5, 6.5, 3000), nf.E2M1_VALUES,
                      np.arange(-6, 6, 1 / 256), [7.0, -1e9, np.inf]]).astype(F32)
  r = np.arange(256, dtype=np.uint8)
  yy, rr = np.broadcast_arrays(y[:, None], r[None, :])
  codes = np.asarray(jax.jit(nm.e2m1_encode_stochastic)(yy, rr))
  np.testing.assert_array_equal(codes, ref.e2m1_stochastic(yy, rr))
  lo, hi = ref.e2m1_neighbours(y)
  vals = np.abs(ref.e2m1_value(codes))
  # Only the two neighbours, and the sign of y.
  assert np.all((vals == lo[:, None]) | (vals == hi[:, None]))
  sign = np.signbit(ref.e2m1_value(codes))
  assert np.all(sign == np.signbit(y)[:, None])
  # Over all 256 bytes, P(up) is t rounded to a multiple of 1/256: the mean
  # is within 1/512 of a step of |y| (saturated at 6).
  a = np.minimum(np.abs(y).astype(np.float64), 6.0)
  step = np.where(hi > lo, hi - lo, 1.0)
  bias = (vals.mean(axis=1) - a) / step
  assert np.max(np.abs(bias)) <= 1 / 512 + 1e-9
  # Values on the grid never move.
  on_grid = lo == a
  assert np.all(vals[on_grid] == lo[on_grid, None])


# ----------------------------------------------------------------------------
# Statistics through `quantize`.
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def many_draws():
  """4096 SR draws of 150 values in unit scale (one compilation, vmapped)."""
  rng = np.random.default_rng(1)
  vals = rng.uniform(-6, 6, 150).astype(F32)
  x = jnp.asarray(unit_scale_tensor(vals))
  keys = jax.random.split(jax.random.key(0), 4096)
  deq = jax.jit(jax.vmap(lambda k: nf.dequantize(
      nf.quantize(x, rounding="stochastic", key=k))))(keys)
  return vals, second_block(deq, vals.size)


def test_rounding_rule_every_binade():
  """The product-and-ceil rounding against the documented rule in float64,
  on random bit patterns of every FP32 exponent (subnormals, huge values,
  infinities and NaNs included) with random bytes."""
  rng = np.random.default_rng(3)
  bits = rng.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32)
  bits[:512] = np.arange(512, dtype=np.uint32) << 23  # +-2^e, +-0, +-inf
  y = bits.view(F32)
  r = rng.integers(0, 256, y.size).astype(np.uint8)
  got = np.asarray(jax.jit(nm.e2m1_encode_stochastic)(y, r))
  with np.errstate(invalid="ignore"):  # NaN payloads in the reference.
    want = ref.e2m1_stochastic(y, r)
  nan = np.isnan(y)
  assert nan.any() and np.isinf(y).any()
  np.testing.assert_array_equal(got[~nan], want[~nan])
  np.testing.assert_array_equal(got[nan] & 7, 0)  # NaN: the scales carry it.


def test_sr_mean_converges_to_input(many_draws):
  vals, deq = many_draws
  n = deq.shape[0]
  lo, hi = ref.e2m1_neighbours(vals)
  step = (hi - lo).astype(np.float64)
  err = deq.astype(np.float64).mean(axis=0) - vals
  # |bias| <= step/512 (8 random bits); sd of the mean <= step / (2 sqrt(n)).
  bound = step / 512 + 5 * step / (2 * np.sqrt(n))
  assert np.all(np.abs(err) <= bound)
  # And the aggregate bias (in steps) is tiny; RTNE would fail this badly.
  assert abs(np.mean(err / step)) < 0.01


def test_sr_only_neighbours_through_quantize(many_draws):
  vals, deq = many_draws
  lo, hi = ref.e2m1_neighbours(vals)
  sgn = np.where(np.signbit(vals), -1, 1)
  ok = (deq == sgn * lo) | (deq == sgn * hi)
  assert np.all(ok)
  # Both neighbours do occur for values strictly between grid points.
  between = (hi > lo) & ((vals * sgn - lo) / (hi - lo) > 0.05) & (
      (vals * sgn - lo) / (hi - lo) < 0.95)
  assert np.all((deq == sgn * lo).any(axis=0)[between])
  assert np.all((deq == sgn * hi).any(axis=0)[between])


def test_sr_neighbours_heavy_tailed():
  """Neighbours of the scaled value y (not of x) on general data."""
  x = make_heavy_tailed((32, 64), seed=2)
  s = ref.scaled_values(x)
  lo, hi = ref.e2m1_neighbours(s["y"])
  for seed in range(3):
    q = sr_quantize(jnp.asarray(x), key=jax.random.key(seed))
    mag = np.abs(ref.e2m1_value(codes_of(q)))
    assert np.all((mag == lo) | (mag == hi))
    nz = x != 0
    assert np.all(np.signbit(ref.e2m1_value(codes_of(q)))[nz] == np.signbit(x)[nz])


def test_sr_mean_heavy_tailed():
  """Unbiased in the dequantized domain, with the real block scales."""
  x = make_heavy_tailed((16, 32), seed=3, outlier_frac=0.0)
  keys = jax.random.split(jax.random.key(5), 2048)
  deq = np.asarray(jax.jit(jax.vmap(lambda k: nf.dequantize(
      nf.quantize(jnp.asarray(x), rounding="stochastic", key=k))))(keys))
  q = jax.jit(nf.quantize)(jnp.asarray(x))
  d = np.repeat(np.asarray(q.scales.astype(jnp.float32)), 16, axis=-1)
  unit = d.astype(np.float64) * float(q.amax) / 2688  # dequant per grid unit
  s = ref.scaled_values(x)
  lo, hi = ref.e2m1_neighbours(s["y"])
  step = np.where(hi > lo, hi - lo, 0) * unit
  err = deq.astype(np.float64).mean(axis=0) - x.astype(np.float64)
  # SR bias + noise, plus the (tiny) mismatch between the encode and decode
  # scales, and saturation where the E4M3 scale rounded down (|y| > 6).
  live = unit > 0  # blocks whose E4M3 scale underflowed dequantize to 0
  assert np.all(deq[:, ~live] == 0)
  sat = np.where(live, np.maximum(np.abs(s["y"]) - 6, 0), 0) * unit
  bound = step / 512 + 5 * step / (2 * np.sqrt(keys.shape[0])) + sat + 1e-5 * np.abs(x)
  assert np.all((np.abs(err) <= bound)[live])


def test_rtne_error_below_sr_error():
  x = make_heavy_tailed((32, 64), seed=4)
  xs = jnp.asarray(x)
  qd = jax.jit(lambda v: nf.dequantize(nf.quantize(v)))
  rtne = np.asarray(qd(xs)).astype(np.float64)
  sr = np.asarray(jax.jit(nf.dequantize)(sr_quantize(xs, key=jax.random.key(0))))
  sr = sr.astype(np.float64)
  e_rtne, e_sr = np.abs(rtne - x), np.abs(sr - x)
  assert np.sum(e_rtne**2) < np.sum(e_sr**2)
  # Elementwise too: RTNE picks the nearest neighbour (up to the FP32 rounding
  # of the dequantized value).
  assert np.all(e_rtne <= e_sr * (1 + 1e-6) + 1e-30)


def test_same_key_same_bits_different_keys_differ():
  x = jnp.asarray(make_heavy_tailed((32, 64), seed=5))
  k = jax.random.key(11)
  a = sr_quantize(x, key=k)
  b = sr_quantize(x, key=jax.random.key(11))
  c = nf.quantize(x, rounding="stochastic", key=k)  # eager
  np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
  np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(c.codes))
  d = sr_quantize(x, key=jax.random.key(12))
  frac = np.mean(codes_of(a) != codes_of(d))
  assert frac > 0.1, frac
  # Raw uint32[2] keys work as well.
  e = sr_quantize(x, key=jax.random.PRNGKey(11))
  assert np.asarray(e.codes).shape == np.asarray(a.codes).shape


def test_sr_under_vmap_over_data_and_keys():
  xs = make_heavy_tailed((3, 16, 32), seed=6)
  keys = jax.random.split(jax.random.key(1), 3)
  q = jax.jit(jax.vmap(lambda v, k: nf.quantize(v, rounding="stochastic", key=k)))(
      jnp.asarray(xs), keys)
  for i in range(3):
    qi = sr_quantize(jnp.asarray(xs[i]), key=keys[i])
    np.testing.assert_array_equal(np.asarray(q.codes[i]), np.asarray(qi.codes))


def test_mxfp4_stochastic_neighbours():
  x = make_heavy_tailed((8, 64), seed=7)
  qn = jax.jit(lambda v: nf.quantize_mx(v, "mxfp4"))(jnp.asarray(x))
  qs = jax.jit(lambda v, k: nf.quantize_mx(v, "mxfp4", rounding="stochastic",
                                           key=k))(jnp.asarray(x), jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(qn.scales).view(np.uint8),
                                np.asarray(qs.scales).view(np.uint8))
  e = np.asarray(qn.scales).view(np.uint8).astype(np.int64) - 127
  y = x.reshape(8, 2, 32) * np.exp2(-e.astype(np.float64))[..., None]
  lo, hi = ref.e2m1_neighbours(y.astype(F32).reshape(8, 64))
  mag = np.abs(ref.e2m1_value(np.asarray(nf.unpack_e2m1(qs.data))))
  assert np.all((mag == lo) | (mag == hi))
  assert np.any(np.asarray(qs.data) != np.asarray(qn.data))


def test_block_words_are_tile_words():
  """The words a kernel holding one array per word of a block draws
  (`block_words`) are `tile_words`' for the same blocks."""
  s0, s1 = jnp.uint32(0xDEADBEEF), jnp.uint32(12345)
  want = prng.tile_words(3, 5, 7, 6, 40, s0, s1)  # [5 rows, 6 blocks, 4]
  row = 3 + jax.lax.broadcasted_iota(jnp.int32, (5, 6), 0)
  blk = 7 + jax.lax.broadcasted_iota(jnp.int32, (5, 6), 1)
  got = prng.block_words(prng.block_word_base(row, blk, 40), s0, s1)
  np.testing.assert_array_equal(np.stack([np.asarray(w) for w in got], -1),
                                np.asarray(want))


def _barrier_operands(jaxpr) -> list:
  from jaxprs import eqns  # pylint: disable=g-import-not-at-top
  return [str(v.aval) for e in eqns(jaxpr)
          if e.primitive.name == "optimization_barrier" for v in e.invars]


def test_layer_key_and_seed_words_are_computed_once():
  # Without the barriers XLA's GPU fusion copies the threefry chain into
  # every consumer (BENCHMARKS.md, start-up); on CPU the jaxpr shows them.
  x = jnp.ones((32, 64), jnp.bfloat16)
  w = jnp.ones((64, 32), jnp.float32)
  key = jax.random.fold_in(jax.random.key(1), 7)

  def loss(x, w, key):
    return nf.dot_general(x, w, (((1,), (0,)), ((), ())), key=key,
                          recipe=nf.Recipe.nvfp4()).astype(
        jnp.float32).sum()

  got = _barrier_operands(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w, key))
  assert any("key<fry>[]" in a for a in got), got  # The layer's key.
  assert any(a == "uint32[6,2]" for a in got), got  # Its operands' words.


def test_operand_seeds_are_the_draw():
  key = jax.random.key(3)
  words = jax.random.bits(key, (6, 2), jnp.uint32)
  got = jax.jit(lambda k: jnp.stack([prng.seeds_from_key(s) for s in
                                     prng.operand_seeds(k, 6)]))(key)
  np.testing.assert_array_equal(got, words)


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="the threefry kernel lowering exists on GPU only")
def test_threefry_kernel_lowering_draws_the_same_seeds_and_rounding():
  # The trainer lowers threefry to JAX's GPU kernel (train.loop.
  # threefry_kernels) to halve the compile; every bit must stay the same.
  x = make_heavy_tailed((256, 512), seed=5)
  keys = jax.random.split(jax.random.key(11), 4)

  def draw(keys):
    seeds = jax.vmap(lambda k: jnp.stack(
        [prng.seeds_from_key(s) for s in prng.operand_seeds(k, 6)]))(keys)
    q = nf.quantize(x, rounding="stochastic", key=jax.random.fold_in(
        keys[0], 3))
    return seeds, q.codes, q.scales

  flag = "jax_threefry_gpu_kernel_lowering"
  before = getattr(jax.config, flag)
  try:
    outs = []
    for on in (False, True):
      jax.config.update(flag, on)
      outs.append(jax.jit(lambda k: draw(k))(keys))
  finally:
    jax.config.update(flag, before)
  for a, b in zip(*outs):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
