"""The kernels' elementwise assembly helpers equal the reference steps.

`pallas_kernels.fp32` replaces three of the reference's jnp steps inside GPU
kernels with inline PTX (interpreted kernels keep the jnp steps):

- `flush_bf16`: `numerics.ftz` of bf16 values, kept in bf16 (pairs at a time);
- `round_hadamard`: `tile.round_hadamard` (flush, round to bf16, widen);
- `max_magnitude`: a running maximum of magnitudes (`max.NaN.xorsign.abs`).

On the GPU each runs in a kernel on every bf16 bit pattern, or on the FP32
values where flushing and rounding change (every subnormal binade edge, the
bf16 ties and their FP32 neighbours in several binades, random bit patterns,
the special values), and is compared bit for bit with the jnp step. A NaN in
is a NaN out, with whatever payload the hardware gives. Off the GPU, the
kernels are lowered for CUDA and must carry the assembly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from nvfp4_jax.core import tile
from pallas_kernels import fp32
from pallas_kernels import launch
from nvfp4_jax.ops.quantize_rht_t import pallas_triton as pallas_rht

ON_GPU = jax.default_backend() == "gpu"
COLS = 256


def _in_kernel(fn, *arrays: np.ndarray, out_dtype) -> np.ndarray:
  """`fn(*blocks)` in a Pallas kernel compiled for the GPU, over `[rows,
  256]` arrays (rows a multiple of 16)."""
  rows = arrays[0].shape[0]

  def kernel(*refs):
    *ins, out = refs
    out[...] = fn(*(r[...] for r in ins))

  spec = pl.BlockSpec((16, COLS), lambda i: (i, 0))
  call = launch.pallas_call(
      kernel, interpret=False, num_warps=4, num_stages=1, name="test_asm",
      grid=(rows // 16,), in_specs=[spec] * len(arrays), out_specs=spec,
      out_shape=jax.ShapeDtypeStruct((rows, COLS), out_dtype))
  return np.asarray(jax.jit(call)(*arrays))


def _on_cpu(fn, *arrays: np.ndarray) -> np.ndarray:
  """The jnp step, jitted on the CPU: the reference bytes (see
  tests/support/quantizer_checks.py's `truth`)."""
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    return np.asarray(jax.jit(fn)(*jax.device_put(arrays, cpu)))


def _rows(x: np.ndarray) -> np.ndarray:
  """`x` flattened and zero-padded to `[rows, 256]`, rows a multiple of 16."""
  x = x.ravel()
  pad = (-x.size) % (16 * COLS)
  return np.concatenate([x, np.zeros(pad, x.dtype)]).reshape(-1, COLS)


def _assert_bits_equal(got: np.ndarray, want: np.ndarray, uint) -> None:
  nan = np.isnan(want.astype(np.float32))
  assert np.isnan(got.astype(np.float32)[nan]).all(), "NaN lost"
  np.testing.assert_array_equal(got.view(uint)[~nan], want.view(uint)[~nan])


def _f32_edges(seed: int = 0) -> np.ndarray:
  """FP32 values where `round_hadamard` changes: around the smallest normal
  (flushing, and rounding up into it), bf16 ties and their neighbours in
  several binades, random patterns, the special values."""
  rng = np.random.default_rng(seed)
  tiny = np.float32(2.0**-126)
  pts = [np.float32(0), tiny, np.nextafter(tiny, np.float32(0)),
         np.float32(2.0**-127), np.float32(2.0**-149), np.float32(np.inf),
         np.float32(np.nan), np.float32(3.0e38), np.float32(3.4028235e38)]
  # The ties between consecutive bf16 values (bit 15 set, bits 0-14 clear).
  for e in (-126, -125, -100, -3, 0, 1, 7, 60, 127):
    base = np.float32(2.0**e).view(np.uint32) + rng.integers(
        0, 2**7, 64, dtype=np.uint32) * np.uint32(1 << 16)
    pts.append((base + np.uint32(1 << 15)).view(np.float32))
  pts = np.concatenate([np.atleast_1d(p) for p in pts]).astype(np.float32)
  out = [pts]
  lo = hi = pts
  with np.errstate(over="ignore"):  # Past the largest finite: inf.
    for _ in range(3):
      lo = np.nextafter(lo, np.float32(-np.inf))
      hi = np.nextafter(hi, np.float32(np.inf))
      out += [lo, hi]
  out.append(rng.integers(0, 2**32, 1 << 16, dtype=np.uint32).view(
      np.float32))
  # Every pattern in the top of the subnormal range (rounds into 2^-126).
  out.append((np.uint32(0x007F0000) + np.arange(1 << 16, dtype=np.uint32))
             .view(np.float32))
  v = np.concatenate(out)
  return np.concatenate([v, -v])


@pytest.mark.skipif(not ON_GPU, reason="the assembly runs on the GPU")
def test_flush_bf16_on_every_bf16():
  x = _rows(np.arange(1 << 16, dtype=np.uint16).view(jnp.bfloat16))
  got = _in_kernel(fp32.flush_bf16(False), x, out_dtype=jnp.bfloat16)
  want = _on_cpu(fp32.flush_bf16(True), x)
  nan = np.isnan(x.astype(np.float32))
  assert (want.view(np.uint16) != x.view(np.uint16))[~nan].sum() == 2 * 127
  _assert_bits_equal(got, want, np.uint16)


@pytest.mark.skipif(not ON_GPU, reason="the assembly runs on the GPU")
def test_round_hadamard_on_edges():
  y = _rows(_f32_edges())
  got = _in_kernel(fp32.round_hadamard(False), y, out_dtype=jnp.float32)
  want = _on_cpu(tile.round_hadamard, y)
  _assert_bits_equal(got, want, np.uint32)


@pytest.mark.skipif(not ON_GPU, reason="the assembly runs on the GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_max_magnitude(dtype):
  rng = np.random.default_rng(1)
  v = _f32_edges(2)
  m, x = _rows(rng.permutation(v)), _rows(rng.permutation(v))
  m, x = (np.asarray(jnp.asarray(a).astype(dtype)) for a in (m, x))
  got = _in_kernel(fp32.max_magnitude(False), m, x, out_dtype=dtype)
  # In NumPy: XLA:CPU treats subnormal inputs as zero (DAZ), so its maximum
  # of two subnormals is not IEEE's. (Where the kernels use this, a flush
  # follows, so either gives the same bytes.)
  m32, x32 = m.astype(np.float32), x.astype(np.float32)
  want = np.where(np.isnan(m32) | np.isnan(x32), np.float32(np.nan),
                  np.maximum(np.abs(m32), np.abs(x32))).astype(dtype)
  # Only the magnitude is defined: compare absolute values.
  _assert_bits_equal(np.abs(got), np.abs(want),
                     np.uint32 if dtype == jnp.float32 else np.uint16)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernels are compiled for real")
@pytest.mark.parametrize("columns", [True, False],
                         ids=["columns", "tensor_cores"])
def test_rht_kernels_lower_with_the_assembly(claim_sm90, monkeypatch,
                                             columns):
  """The amax pass and the rht_t quantizer, lowered for CUDA, use the
  helpers (the running maximum, the flush of bf16 pairs or the flushing
  product, the rounding)."""
  monkeypatch.setattr(pallas_rht, "COLUMNS", columns)
  x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  lower = lambda fn: jax.jit(fn).trace(x).lower(
      lowering_platforms=("cuda",)).as_text()
  amax = lower(lambda x: pallas_rht.rht_amax(x, with_x=True))
  assert ("nvfp4_rht_amax_columns" in amax) == columns
  assert "max.NaN.xorsign.abs.f32" in amax
  assert "max.NaN.xorsign.abs.bf16x2" in amax
  if columns:  # The sign and 1/4 in one flushing product per element.
    assert "mul.ftz.f32" in amax
  else:
    assert "prmt.b32" in amax and "cvt.ftz.f32.f32" in amax
  quant = lower(lambda x: pallas_rht.quantize_rht_t(x, amax=jnp.float32(1)))
  assert ("nvfp4_quantize_rht_t_columns" in quant) == columns
  assert "cvt.rn.bf16x2.f32" in quant  # The sums' rounding.
  if columns:
    assert "mul.ftz.f32" in quant
  else:  # The bf16 tile's flush.
    assert "prmt.b32" in quant
