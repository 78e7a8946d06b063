"""Helpers of every mesh check: the meshes, bit-for-bit comparison of
quantized tensors and the derived FP32 bound of a sharded GEMM.

Tolerances. A sharded GEMM sums some FP32 products across shards (Wgrad over
token shards; a row-parallel Fprop and a column-parallel Dgrad over `model`)
in another order than the single-device GEMM. Both compute
`alpha * sum_i a_i b_i` over n terms whose products `a_i b_i` are exact
(bf16 block values have at most 8 significant bits), so each result is within
`((n - 1) + 1) * u * alpha * sum_i |a_i b_i|` of the exact value (n - 1 FP32
additions in any order or grouping, one multiplication by alpha; u = 2^-24,
first order in u): the two differ by at most
`2 (n + 1) u * sum_i |a_i b_i|`, computed below element by element from the
dequantized operands (`gemm_bound`; +2 more terms absorb the FP32 rounding of
the dequantized values). Quantized operands (codes, scales, amax) must be
equal, bit for bit.
"""

from __future__ import annotations

import jax
import numpy as np

import nvfp4_jax as nv
from nvfp4_jax import sharding as shd

U = 2.0 ** -24
IMPLS = ("xla", "pallas")
DN = (((1,), (0,)), ((), ()))


def mesh(**sizes):
  return shd.make_mesh(**sizes)


def assert_same_q(a, b, what):
  """Codes, scale bytes and amax equal, bit for bit."""
  assert type(a) is type(b), (what, type(a), type(b))
  for field in ("codes", "scales", "amax"):
    u, v = np.asarray(getattr(a, field)), np.asarray(getattr(b, field))
    if u.dtype.itemsize == 1:
      u, v = u.view(np.uint8), v.view(np.uint8)
    assert u.shape == v.shape, (what, field, u.shape, v.shape)
    diff = int(np.sum(u != v)) if u.ndim else int(u.view(np.uint32) !=
                                                    v.view(np.uint32))
    assert diff == 0, f"{what}: {diff} {field} differ"


dequantize_pair = jax.jit(lambda a, b: (nv.dequantize(a), nv.dequantize(b)))


def gemm_bound(a, b, n):
  """Bound on |sharded - single| of `a @ b.T` (see the module docstring)."""
  da, db = dequantize_pair(a, b)
  da = np.abs(np.asarray(da, np.float64))
  db = np.abs(np.asarray(db, np.float64))
  return 2 * (n + 3) * U * (da @ db.T)


def check_within(got, want, bound, what):
  err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
  worst = float(np.max(err - bound))
  print(f"  {what}: max |diff| {err.max():.3g}, max bound "
        f"{bound.max():.3g}, exact: {bool(np.all(err == 0))}")
  assert worst <= 0, f"{what}: exceeds the derived bound by {worst:.3g}"

