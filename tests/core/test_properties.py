"""Property tests (hypothesis): error bounds, signs, zeros, and agreement with
the TE model on arbitrary finite inputs."""

from __future__ import annotations

import functools

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import strategies as st  # pylint: disable=g-import-not-at-top
from hypothesis.extra import numpy as hnp  # pylint: disable=g-import-not-at-top
import jax
import jax.numpy as jnp
import numpy as np

import nvfp4_jax as nf
import te_reference as ref

F32 = np.float32
SHAPES = [(1, 16), (2, 48), (16, 32), (32, 16)]  # 2D needs rows % 16 == 0
SHAPES_2D = [(16, 32), (32, 16)]


@functools.cache
def _quantize_fn(block_2d: bool, rounding: str, rht: bool):
  def f(x, key):
    if rht:
      x = nf.rht(x)
    q = nf.quantize(x, block_2d=block_2d, rounding=rounding,
                    key=key if rounding == "stochastic" else None)
    return x, q, nf.dequantize(q)
  return jax.jit(f)


def run(x, *, block_2d=False, rounding="nearest", rht=False, seed=0):
  op, q, deq = _quantize_fn(block_2d, rounding, rht)(
      jnp.asarray(x), jax.random.key(seed))
  return np.asarray(op).astype(F32), q, np.asarray(deq)


_LIM = float(F32(1e30))


def _moderate(x: np.ndarray) -> np.ndarray:
  """Nonzero magnitudes in [1e-30, 1e30]: smaller ones become (signed) zeros.
  Outside that range the tensor scales leave FP32's normal range (covered by
  the unit tests and by `test_matches_te_reference_any_finite_float32`)."""
  return np.where(np.abs(x) < 1e-30, x * F32(0), x).astype(F32)


@st.composite
def _spread(draw, shapes):
  """Log-uniform magnitudes over a drawn number of binades, random signs, some
  zeros, mantissas cut to a drawn number of bits (which makes exact rounding
  ties likely): many distinct block scales per tensor."""
  shape = draw(st.sampled_from(shapes))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  center = draw(st.floats(-80, 80))
  binades = draw(st.floats(0, 40))
  bits = draw(st.integers(1, 24))
  zero_frac = draw(st.sampled_from([0.0, 0.2, 0.9]))
  mag = np.exp2(center + binades * rng.uniform(-0.5, 0.5, shape))
  m, e = np.frexp(mag)
  mag = np.ldexp(np.round(m * 2.0**bits) / 2.0**bits, e)
  x = np.where(rng.uniform(size=shape) < 0.5, -mag, mag)
  x = np.where(rng.uniform(size=shape) < zero_frac, 0.0, x)
  return _moderate(np.clip(x, -_LIM, _LIM).astype(F32))


def arrays(shapes=SHAPES, elements=None):
  """hypothesis' own float arrays (edge values, repeats) or spread tensors."""
  elements = elements or st.floats(-_LIM, _LIM, width=32, allow_subnormal=False)
  flat = st.sampled_from(shapes).flatmap(
      lambda s: hnp.arrays(np.float32, s, elements=elements)).map(_moderate)
  return st.one_of(flat, _spread(shapes))


def grid_units(x, q, deq):
  """(y, q_units, unit): x and x_hat in units of each block's dequant step."""
  d = np.repeat(np.asarray(q.scales.astype(jnp.float32)), 16, axis=-1)
  unit = d.astype(np.float64) * (np.float64(q.amax) / 2688.0)
  with np.errstate(divide="ignore", invalid="ignore"):
    y = np.where(unit > 0, x.astype(np.float64) / unit, np.inf)
    qv = np.where(unit > 0, deq.astype(np.float64) / unit, 0.0)
  return y, qv, unit


def half_step(a):
  return np.where(a < 2, 0.25, np.where(a < 4, 0.5, 1.0))


def assert_error_bound(x, q, deq, *, full_step=False):
  """Per element: |x_hat - x| <= half a grid step of the block's effective
  scale (a full step for SR), or the saturation error when the E4M3 rounding
  of the block scale pushed |y| above 6. Blocks whose scale underflowed to 0
  hold only values below 2^-10 / 448 of the amax, and dequantize to 0."""
  y, qv, unit = grid_units(x, q, deq)
  a = np.abs(y)
  live = unit > 0
  allowed = np.where(a > 6, a - 6, half_step(a) * (2 if full_step else 1))
  err = np.abs(qv - y)
  ok = err <= allowed + 1e-5 * np.maximum(a, 1)
  assert np.all(ok[live]), (y[live][~ok[live]], qv[live][~ok[live]])
  amax = np.float64(q.amax)
  assert np.all(deq[~live] == 0)
  assert np.all(np.abs(x[~live]) <= amax * 2.0**-10 / 448 * (1 + 1e-5))


def assert_signs_and_zeros(x, q, deq):
  codes = np.asarray(nf.unpack_e2m1(q.codes))
  nz = x != 0
  # Sign preserved: in the code's sign bit (even when the value rounds to 0,
  # like the hardware cvt) and in the dequantized value.
  np.testing.assert_array_equal((codes[nz] & 8) != 0, np.signbit(x[nz]))
  dz = nz & (deq != 0)
  np.testing.assert_array_equal(np.sign(deq[dz]), np.sign(x[dz]))
  # Zero stays zero.
  assert np.all(deq[~nz] == 0)
  assert np.all(codes[~nz] & 7 == 0)


@hypothesis.given(x=arrays())
def test_rtne_error_bound_signs_zeros_1x16(x):
  _, q, deq = run(x)
  assert_error_bound(x, q, deq)
  assert_signs_and_zeros(x, q, deq)


@hypothesis.given(x=arrays(SHAPES_2D))
def test_rtne_error_bound_signs_zeros_16x16(x):
  _, q, deq = run(x, block_2d=True)
  assert_error_bound(x, q, deq)
  assert_signs_and_zeros(x, q, deq)


@hypothesis.given(x=arrays(), seed=st.integers(0, 2**31 - 1))
def test_sr_within_one_step_signs_zeros(x, seed):
  _, q, deq = run(x, rounding="stochastic", seed=seed)
  assert_error_bound(x, q, deq, full_step=True)
  assert_signs_and_zeros(x, q, deq)


@hypothesis.given(x=arrays(SHAPES_2D))
def test_rht_operand_error_bound(x):
  op, q, deq = run(x, rht=True)
  assert_error_bound(op, q, deq)
  assert_signs_and_zeros(op, q, deq)


@hypothesis.given(x=arrays(), block_2d=st.booleans())
def test_matches_te_reference_moderate(x, block_2d):
  if block_2d and x.shape[0] % 16:
    block_2d = False
  _, q, _ = run(x, block_2d=block_2d)
  packed, scales, amax = ref.quantize(x, block_2d=block_2d)
  np.testing.assert_array_equal(np.asarray(q.codes), packed)
  np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8),
                                scales.view(np.uint8))
  assert np.asarray(q.amax).view(np.uint32) == np.asarray(amax).view(np.uint32)


@hypothesis.given(x=st.sampled_from(SHAPES[:2]).flatmap(lambda s: hnp.arrays(
    np.float32, s, elements=st.floats(width=32, allow_nan=False,
                                      allow_infinity=False))))
def test_matches_te_reference_any_finite_float32(x):
  """Whole FP32 range, subnormals included: the same bytes as the model."""
  _, q, deq = run(x)
  packed, scales, amax = ref.quantize(x)
  np.testing.assert_array_equal(np.asarray(q.codes), packed)
  np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8),
                                scales.view(np.uint8))
  assert np.asarray(q.amax).view(np.uint32) == np.asarray(amax).view(np.uint32)
  assert np.all(np.isfinite(deq))


@functools.cache
def _mx_fn(fmt):
  return jax.jit(lambda v: (lambda q: (q, nf.dequantize(q)))(nf.quantize_mx(v, fmt)))


@hypothesis.given(x=arrays([(1, 32), (4, 64)]),
                  fmt=st.sampled_from(["mxfp4", "mxfp8"]))
def test_mx_error_bound_no_saturation(x, fmt):
  q, deq = _mx_fn(fmt)(jnp.asarray(x))
  deq = np.asarray(deq).astype(np.float64)
  e = np.asarray(q.scales).view(np.uint8).astype(np.float64) - 127
  scale = np.repeat(np.exp2(e), 32, axis=-1)
  y = x.astype(np.float64) / scale
  elem_max = 6.0 if fmt == "mxfp4" else 448.0
  assert np.all(np.abs(y) <= elem_max)  # scale rounded up: no saturation
  if fmt == "mxfp4":
    allowed = half_step(np.abs(y)) * scale
  else:  # E4M3: half an ulp (3 mantissa bits), subnormal spacing 2^-9
    allowed = np.maximum(np.abs(y) * 2.0**-4, 2.0**-10) * scale
  assert np.all(np.abs(deq - x) <= allowed * (1 + 1e-6))
  vals, e_ref = ref.quantize_mx(x, fmt)
  np.testing.assert_array_equal(e, e_ref)
