"""The grouped GEMMs' Mosaic GPU kernels (`ops/ragged_dot/pallas_mosaic_gpu`).

On the CPU: the kernels lower for CUDA (layouts, wgmma shapes, TMA and
shared memory are checked there), the tile-to-group map covers every row
once with its group, and the kernels refuse what they do not run. On a
Hopper GPU: compiled results equal a per-group reference on uneven, empty
and skewed groups with boundaries inside tiles, both layouts, both outputs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax.core import dispatch
from nvfp4_jax.ops.ragged_dot import pallas_mosaic_gpu as rk

ON_HOPPER = (jax.default_backend() == "gpu"
             and dispatch.compute_capability() is not None
             and dispatch.compute_capability()[0] == 9)
HOPPER_ONLY = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def _lower(f, *args):
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("vb_layout,out_dtype,alpha", [
    ("kn", jnp.float32, True), ("nk", BF16, False)])
def test_fprop_lowers_for_hopper(vb_layout, out_dtype, alpha):
  """M off the 128-row tile, N off the 256-column CTA tile (both masked /
  clipped), with and without alpha."""
  m, k, n, e = 1000, 256, 320, 5
  vb = S((e, k, n) if vb_layout == "kn" else (e, n, k), BF16)
  args = (S((m, k), BF16), vb, S((e,), jnp.int32))
  args += (S((e,), jnp.float32),) if alpha else ()
  _lower(functools.partial(rk.ragged_values_matmul, out_dtype=out_dtype,
                           vb_layout=vb_layout, num_sms=132), *args)


@pytest.mark.parametrize("tokens_last,out_dtype", [(True, jnp.float32),
                                                   (False, BF16)])
def test_wgrad_lowers_for_hopper(tokens_last, out_dtype):
  m, k, n, e = 1000, 320, 384, 5
  va = S((k, m) if tokens_last else (m, k), BF16)
  vb = S((n, m) if tokens_last else (m, n), BF16)
  _lower(functools.partial(rk.ragged_values_matmul_t, out_dtype=out_dtype,
                           tokens_last=tokens_last, num_sms=132),
         va, vb, S((e,), jnp.int32), S((e,), jnp.float32))


@pytest.mark.parametrize("sizes,m", [
    ([0, 37, 300, 0, 129, 400], 1000),    # Empty groups, rows past the sum.
    ([128, 256, 0, 128], 512),            # Boundaries on tiles.
    ([995, 0, 0, 3, 0, 2], 1000),         # Skewed.
    ([0, 0, 0], 256),                     # No rows at all.
    ([700, 700], 1000)])                  # Sum past M: clipped to M.
def test_tile_map_covers_each_row_once_with_its_group(sizes, m):
  """Every row is stored by exactly one map entry: its group's (rows past
  the sum: segment E, stored as zeros); entries never span two M tiles."""
  tile = 128
  seg, row0, lo, hi = map(np.asarray, jax.jit(
      rk._tile_map, static_argnums=(1, 2))(jnp.asarray(sizes, jnp.int32), m,
                                           tile))
  want = np.full(m, len(sizes))
  ends = np.minimum(np.cumsum(sizes), m)
  starts = np.concatenate([[0], ends[:-1]])
  for g, (s, e) in enumerate(zip(starts, ends)):
    want[s:e] = g
  covered = np.zeros(m, int)
  got = np.full(m, -1)
  for t in range(len(seg)):
    if hi[t] <= lo[t]:
      continue
    assert row0[t] % tile == 0 and row0[t] <= lo[t] and hi[t] <= row0[t] + tile
    covered[lo[t]:hi[t]] += 1
    got[lo[t]:hi[t]] = seg[t]
  np.testing.assert_array_equal(covered, 1)
  np.testing.assert_array_equal(got, want)


def test_refuses_what_it_does_not_run(monkeypatch):
  a = jnp.ones((256, 128), BF16)
  b = jnp.ones((2, 128, 128), BF16)
  gs = jnp.asarray([100, 156], jnp.int32)
  if not ON_HOPPER:
    with pytest.raises(NotImplementedError, match="implementation='xla'"):
      rk.ragged_values_matmul(a, b, gs)
    with pytest.raises(NotImplementedError, match="implementation='xla'"):
      rk.ragged_values_matmul_t(a, a, gs, tokens_last=False)
    monkeypatch.setattr(dispatch, "platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "compute_capability", lambda: (10, 0))
    with pytest.raises(NotImplementedError, match="compute capability 9"):
      rk.ragged_values_matmul(a, b, gs)
  kw = dict(num_sms=132)
  with pytest.raises(NotImplementedError, match="bf16 operands only"):
    rk.ragged_values_matmul(a.astype(jnp.float32), b, gs, **kw)
  with pytest.raises(NotImplementedError, match="out_dtype"):
    rk.ragged_values_matmul(a, b, gs, out_dtype=jnp.float16, **kw)
  with pytest.raises(NotImplementedError, match="K=96 must be a multiple"):
    rk.ragged_values_matmul(a[:, :96], b[:, :96], gs, **kw)
  with pytest.raises(NotImplementedError, match="M=252 of 8"):
    rk.ragged_values_matmul(a[:252], b, gs, **kw)
  with pytest.raises(NotImplementedError, match="N=96"):
    rk.ragged_values_matmul_t(a, a[:, :96], gs, tokens_last=False, **kw)


# --- On a Hopper GPU: compiled results against a per-group reference. ---

def _bounds(group_sizes, m):
  ends = np.minimum(np.cumsum(group_sizes), m)
  return list(zip(np.concatenate([[0], ends[:-1]]), ends))


def _tolerance(mag, alpha, k, out_dtype):
  """Both sides sum k products exact in FP32 (bf16 x bf16), in different
  orders: each order's error is at most (k - 1) u sum|a b| (u = 2^-24,
  first-order bound of recursive summation), so they differ by at most twice
  that, times |alpha| (the FP32 multiply by alpha rounds both the same way
  up to half an ulp, inside that bound's slack); a bf16 output may round to
  a neighbour: one bf16 ulp (2^-7 relative) more."""
  tol = 2 * max(k - 1, 1) * 2.0**-24 * mag * np.abs(alpha)
  return tol, (2.0**-7 if out_dtype == BF16 else 0.0)


def _ref_fprop(va, vb, group_sizes, alpha, out_dtype, vb_layout):
  m, n = va.shape[0], vb.shape[2] if vb_layout == "kn" else vb.shape[1]
  out = jnp.zeros((m, n), jnp.float32)
  contract = 0 if vb_layout == "kn" else 1
  for g, (s, e) in enumerate(_bounds(group_sizes, m)):
    if e > s:
      y = jax.lax.dot_general(va[s:e], vb[g], (((1,), (contract,)), ((), ())),
                              preferred_element_type=jnp.float32)
      out = out.at[s:e].set(y * (1.0 if alpha is None else alpha[g]))
  return out.astype(out_dtype)


def _operands(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(
      BF16)


FPROP_CASES = [
    # (sizes, m): boundaries inside tiles, empty groups, rows past the sum.
    ([0, 37, 300, 0, 129, 400], 1000),
    ([995, 0, 0, 3, 0, 2], 1000),          # Skewed; M off the 128 tile.
    ([128, 256, 0, 128, 512], 1024),       # Boundaries on tiles, sum == M.
]


@HOPPER_ONLY
@pytest.mark.parametrize("sizes,m", FPROP_CASES)
@pytest.mark.parametrize("vb_layout,out_dtype,with_alpha", [
    ("kn", jnp.float32, True), ("nk", BF16, True), ("kn", BF16, False),
    ("nk", jnp.float32, False)])
def test_fprop_equals_the_reference_on_hopper(sizes, m, vb_layout, out_dtype,
                                              with_alpha):
  k, n, e = 512, 320, len(sizes)
  va = _operands((m, k), 1)
  total = min(sum(sizes), m)
  # Rows past the groups' sum are not read into any stored row.
  va = va.at[total:].set(jnp.nan)
  vb = _operands((e, k, n) if vb_layout == "kn" else (e, n, k), 2)
  gs = jnp.asarray(sizes, jnp.int32)
  alpha = (jnp.linspace(0.5, 2.0, e).astype(jnp.float32) if with_alpha
           else None)
  got = np.asarray(rk.ragged_values_matmul(va, vb, gs, alpha,
                                           out_dtype=out_dtype,
                                           vb_layout=vb_layout), np.float32)
  want = np.asarray(_ref_fprop(va, vb, sizes, alpha, out_dtype, vb_layout),
                    np.float32)
  assert not np.isnan(got).any()
  np.testing.assert_array_equal(got[total:], 0)
  a = np.abs(np.asarray(va, np.float32))
  b = np.abs(np.asarray(vb, np.float32))
  for g, (s, end) in enumerate(_bounds(sizes, m)):
    if end <= s:
      continue
    mag = a[s:end] @ (b[g] if vb_layout == "kn" else b[g].T)
    tol, rel = _tolerance(mag, 1.0 if alpha is None else float(alpha[g]), k,
                          out_dtype)
    diff = np.abs(got[s:end] - want[s:end])
    assert np.all(diff <= tol + rel * np.abs(want[s:end])), (g, diff.max())


WGRAD_CASES = [
    ([0, 37, 300, 0, 129, 400], 1000),     # M off 64: tokens padded.
    ([1017, 0, 0, 3, 0, 4], 1024),          # Skewed, tiny groups.
    ([64, 192, 0, 256, 512], 1024),         # Boundaries on steps.
]


@HOPPER_ONLY
@pytest.mark.parametrize("sizes,m", WGRAD_CASES)
@pytest.mark.parametrize("tokens_last,out_dtype,with_alpha", [
    (True, jnp.float32, True), (False, BF16, True), (True, BF16, False),
    (False, jnp.float32, False)])
def test_wgrad_equals_the_reference_on_hopper(sizes, m, tokens_last,
                                              out_dtype, with_alpha):
  k, n, e = 320, 384, len(sizes)
  x = _operands((m, k), 3)
  dy = _operands((m, n), 4)
  gs = jnp.asarray(sizes, jnp.int32)
  alpha = (jnp.linspace(0.5, 2.0, e).astype(jnp.float32) if with_alpha
           else None)
  va, vb = (x.T, dy.T) if tokens_last else (x, dy)
  got = np.asarray(rk.ragged_values_matmul_t(
      va, vb, gs, alpha, out_dtype=out_dtype, tokens_last=tokens_last),
                   np.float32)
  assert got.shape == (e, k, n) and not np.isnan(got).any()
  a = np.abs(np.asarray(x, np.float32))
  b = np.abs(np.asarray(dy, np.float32))
  for g, (s, end) in enumerate(_bounds(sizes, m)):
    if end <= s:
      np.testing.assert_array_equal(got[g], 0)
      continue
    y = jax.lax.dot_general(x[s:end], dy[s:end], (((0,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    ag = 1.0 if alpha is None else float(alpha[g])
    want = np.asarray((y * ag).astype(out_dtype), np.float32)
    tol, rel = _tolerance(a[s:end].T @ b[s:end], ag, end - s, out_dtype)
    diff = np.abs(got[g] - want)
    assert np.all(diff <= tol + rel * np.abs(want)), (g, diff.max())


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="the smoke run's exact checks are XLA:CPU's "
                    "(an FP32 einsum on a GPU may use TF32)")
def test_bench_moe_smoke_runs_on_cpu():
  """`python -m benchmarks.bench_moe --smoke`: tiny shapes, the reference in
  place of the kernels; the table's checks come out exact."""
  from benchmarks import bench_moe  # pylint: disable=g-import-not-at-top
  rows = bench_moe.main(["--smoke"])
  assert len(rows) == 2
  assert all(r["fwd err"] < 1e-6 and r["wgrad err"] == 0 for r in rows)
  assert all(r["tokamax fwd"] == "not timed" for r in rows)
