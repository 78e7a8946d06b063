"""The grouped NVFP4 / MXFP4 / MXFP8 GEMMs on codes (`ops/ragged_dot/triton.py`, Blackwell).

On the CPU: `nvfp4_jax.ragged_dot` taking the codes path (the quantizers
write codes, the GEMMs `RAGGED_CODES_MATMUL(_T)`, here their reference)
gives the values path's outputs and gradients bit for bit, and the dispatch
picks the Triton kernel on 10.0 / 10.3 only (MX recipes too). Ahead of
time (JAX's CUDA plugin and jax-triton installed, no GPU): the op's forward
and backward compile for a B200 to three Triton kernels on `tcgen05.mma
... kind::mxf4nvf4` (MXFP4 `kind::mxf4`, MXFP8 `kind::mxf8f6f4`). In
Triton's interpreter: both kernels, both forms, NVFP4 and MX, against the
reference. On a GPU: the kernel against the reference on uneven,
empty and skewed groups (on Hopper in its decode form, which shares the
kernel's map, pointers, masks and epilogue: Triton does not compile
`tl.dot_scaled` with E4M3 scales for sm_90; natively where it compiles).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nv
from nvfp4_jax.core import dispatch
from nvfp4_jax.core.recipe import Operand
from nvfp4_jax.ops.ragged_dot import api as rg
from nvfp4_jax.ops.ragged_dot import reference as ref
from nvfp4_jax.ops.ragged_quantize import api as rq
from nvfp4_jax.ops.ragged_quantize import reference as rqref
from nvfp4_jax.tools import aot
from quantizer_checks import on_cpu


def _step_operands(m, k, n, e):
  """Heavy-tailed `x [m, k]`, expert weights `w [e, k, n]` and `dy [m, n]`
  (seed 0) for `_step`."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_t(3, (m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_t(3, (e, k, n)) * .1, jnp.float32)
  dy = jnp.asarray(rng.standard_t(3, (m, n)), jnp.float32)
  return x, w, dy


def _step(recipe, gs):
  @jax.jit
  def f(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: nv.ragged_dot(
        x, w, gs, recipe=recipe, key=jax.random.key(3)), x, w)
    return (y, *vjp(dy))
  return f


@pytest.mark.parametrize("recipe", [
    nv.Recipe.nvfp4(),  # 16x16 weights: Fprop's codes transposed for Dgrad.
    pytest.param(nv.Recipe.nvfp4(rht=False, two_d_weights=False),
                 marks=pytest.mark.slow),
    # 16x16 with Four-over-Six: Fprop's `[E, N, K]` codes, transposed for
    # Dgrad.
    pytest.param(nv.Recipe.nvfp4(four_over_six="all"),
                 marks=pytest.mark.slow),
    # MX: E8M0 scales per 32, no tensor scale; Fprop's weight quantized
    # along K, Dgrad's along N (no 16x16 tiles to transpose).
    nv.Recipe.mxfp8(),
    pytest.param(nv.Recipe.mxfp4(), marks=pytest.mark.slow)])
def test_codes_path_equals_the_values_path(recipe, monkeypatch):
  """Under `default_implementation("triton")` (the CPU runs the codes
  GEMMs' reference) the three GEMMs multiply codes: the same block values,
  so the same outputs and gradients bit for bit as the values path; with
  the codes GEMMs switched off nothing would call them (the spy counts;
  each call's format is the recipe's). Run on the CPU on every machine: on
  a GPU the two paths' GEMMs are different XLA:GPU programs (the values on
  the library's grouped kernel, the codes' reference on cuBLAS), equal only
  up to FP32 accumulation order (1 ulp at 74 of 11520 MXFP8 outputs on the
  H100); the GPU's kernels are compared with the reference in
  `test_ragged_kernels.py`."""
  with on_cpu():
    gs = jnp.array([37, 0, 2, 37, 0, 2, 37], jnp.int32)
    x, w, dy = _step_operands(120, 64, 96, len(gs))
    want = _step(recipe, gs)(x, w, dy)
    calls = []
    for op in (rg.RAGGED_CODES_MATMUL, rg.RAGGED_CODES_MATMUL_T):
      impl = op.implementations["xla"]
      monkeypatch.setitem(op.implementations, "xla", functools.partial(
          lambda op, impl, *a, **kw: (calls.append((op, kw.get("fmt"))),
                                      impl(*a, **kw))[1], op.name, impl))
    jax.clear_caches()
    with nv.default_implementation("triton"):
      got = _step(recipe, gs)(x, w, dy)
    jax.clear_caches()
    # Fprop and Dgrad multiply with `ragged_codes_matmul`, Wgrad with its
    # transposed twin. The layer is one jitted program (`_layer`): its
    # primal trace and the forward pass autodiff traces both run Fprop.
    fmt = recipe.fprop_x.format
    assert set(calls) == {("ragged_codes_matmul", fmt),
                          ("ragged_codes_matmul_t", fmt)}, calls
    assert calls[-2:] == [("ragged_codes_matmul", fmt),  # Dgrad, Wgrad.
                          ("ragged_codes_matmul_t", fmt)], calls
    for g, h in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


@pytest.mark.parametrize("cc, want", [
    ((10, 0), ("triton", "xla")), ((10, 3), ("triton", "xla")),
    ((12, 0), ("triton", "xla")), ((12, 1), ("xla",)), ((11, 0), ("xla",)),
    ((9, 0), ("xla",))])
def test_codes_gemms_dispatch_per_capability(cc, want):
  """The codes GEMMs run natively where Triton compiles `tl.dot_scaled` to a
  block-scaled MMA (`has_fp4_mma`); elsewhere the op multiplies block
  values (Hopper: the Mosaic GPU kernels)."""
  with dispatch.target_device("gpu", cc):
    assert rg.RAGGED_CODES_MATMUL.order() == want
    assert rg.RAGGED_CODES_MATMUL_T.order() == want
    # Without jax-triton the op keeps the block-values GEMMs.
    assert rg.multiplies_codes() == (want[0] == "triton"
                                     and _has_jax_triton())


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_recipes_take_the_codes_path_on_blackwell(fmt, monkeypatch):
  """`nvfp4_jax.ragged_dot` with an MX recipe, fwd+bwd traced for a B200
  (cc 10.0, jax-triton installed) calls the grouped Triton kernel on MX
  codes in all three GEMMs (each call's `fmt` the recipe's) and no values
  GEMM; traced for an H100 (9.0) the values GEMMs, never the codes ones.
  The kernels are spies that decline (`NotImplementedError`: dispatch then
  traces the reference), so nothing compiles."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  calls = []

  def spy(kind):
    def fn(*args, **kwargs):
      del args
      calls.append((kind, kwargs.get("fmt")))
      raise NotImplementedError("spy")
    return fn
  for op in (rg.RAGGED_CODES_MATMUL, rg.RAGGED_CODES_MATMUL_T):
    monkeypatch.setitem(op.implementations, "triton", spy("codes"))
  for op in (rg.RAGGED_VALUES_MATMUL, rg.RAGGED_VALUES_MATMUL_T):
    monkeypatch.setitem(op.implementations, "pallas", spy("values"))
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
      object() if name == "jax_triton" else find_spec(name, *a)))
  x = jnp.zeros((96, 64), jnp.bfloat16)
  w = jnp.zeros((3, 64, 32), jnp.float32)
  gs = jnp.asarray([40, 0, 50], jnp.int32)

  def f(x, w):
    y, vjp = jax.vjp(lambda x, w: nv.ragged_dot(
        x, w, gs, recipe=fmt, key=jax.random.key(0)), x, w)
    return vjp(y)
  seen = {}
  for cc in ((10, 0), (9, 0)):
    calls.clear()
    jax.clear_caches()
    try:
      with dispatch.target_device("gpu", cc):
        jax.make_jaxpr(f)(x, w)
    finally:
      jax.clear_caches()
    seen[cc] = list(calls)
  # Fprop, Fprop, Dgrad, Wgrad: the layer is one jitted program
  # (`_layer`), whose primal trace and autodiff's forward trace both run
  # Fprop.
  assert seen[(10, 0)] == [("codes", fmt)] * 4, seen
  assert seen[(9, 0)] == [("values", None)] * 4, seen


def test_codes_gemms_refuse_operands_of_two_formats():
  """One GEMM multiplies codes of one format: NVFP4 with MXFP4 (or an
  operand without codes) is an error naming both, not a wrong product."""
  q = rq.Grouped(jnp.zeros((32, 16), jnp.uint8),
                 jnp.zeros((32, 2), jnp.float8_e4m3fn), None,
                 jnp.ones((1,), jnp.float32))
  mx = rq.Grouped(q.data, jnp.zeros((32, 1), jnp.float8_e8m0fnu), None,
                  None, fmt="mxfp4")
  gs = jnp.array([32], jnp.int32)
  with pytest.raises(ValueError, match="'nvfp4' and 'mxfp4'"):
    rg.ragged_codes_matmul_t(q, mx, gs)
  with pytest.raises(ValueError, match="holds no codes"):
    rg.ragged_codes_matmul_t(mx, dataclasses.replace(mx, data=None), gs)


def test_kernel_declines_off_gpu():
  from nvfp4_jax.ops.ragged_dot import triton as kernel  # pylint: disable=g-import-not-at-top
  codes = jnp.zeros((32, 32), jnp.uint8)
  scales = jnp.zeros((32, 4), jnp.float8_e4m3fn)
  gs = jnp.array([32], jnp.int32)
  if jax.default_backend() == "cpu":
    with pytest.raises(NotImplementedError, match="NVIDIA GPUs only"):
      kernel.ragged_codes_matmul(codes, scales, codes[None], scales[None], gs)
    with pytest.raises(NotImplementedError, match="NVIDIA GPUs only"):
      kernel.ragged_codes_matmul_t(codes, scales, codes, scales, gs)
  with dispatch.target_device("gpu", (9, 0)):
    with pytest.raises(NotImplementedError, match="compute capability"):
      kernel.ragged_codes_matmul(codes, scales, codes[None], scales[None], gs)


# --- Ahead of time: where JAX's CUDA plugin is installed ----------------------

_WHY = aot.unavailable_reason()


def _has_jax_triton() -> bool:
  try:
    import jax_triton  # pylint: disable=g-import-not-at-top,unused-import
    return True
  except ImportError:
    return False


@pytest.mark.skipif(_WHY is not None or not _has_jax_triton(),
                    reason=f"compiles for Blackwell ahead of time: {_WHY or ''}"
                    " (needs JAX's CUDA plugin and jax-triton)")
@pytest.mark.parametrize("recipe, kind", [
    ("nvfp4", "kind::mxf4nvf4.block_scale"),
    # MX: E8M0 scales per 32 (`scale_vec::2X` for E2M1, `1X` for E4M3).
    pytest.param("mxfp4", "kind::mxf4.block_scale.scale_vec::2X",
                 marks=pytest.mark.slow),
    pytest.param("mxfp8", "kind::mxf8f6f4.block_scale.scale_vec::1X",
                 marks=pytest.mark.slow)])
def test_b200_ragged_dot_runs_three_native_fp4_kernels(recipe, kind):
  """`nvfp4_jax.ragged_dot`'s forward and backward compiled for a B200
  (uneven K = 544: K padded to 64 in Fprop, MX to 128): three jax-triton
  kernels, each on `tcgen05.mma ... kind::mxf4nvf4.block_scale` (NVFP4;
  MXFP4 `kind::mxf4`, MXFP8 `kind::mxf8f6f4`), and no XLA dot (no
  decomposition, no values GEMM)."""
  s = jax.ShapeDtypeStruct
  e, m, k, n = 8, 1000, 544, 384

  def step(x, w, gs, dy):
    y, vjp = jax.vjp(lambda x, w: nv.ragged_dot(
        x, w, gs, recipe=recipe, key=jax.random.key(0)), x, w)
    return y, vjp(dy)
  args = (s((m, k), jnp.bfloat16), s((e, k, n), jnp.float32),
          s((e,), jnp.int32), s((m, n), jnp.float32))
  with aot.compiling_for("b200") as c:
    assert rg.multiplies_codes()
    hlo = c.compile(step, *args)
    kernels = list(c.triton_kernels)
  low = aot.lowering(hlo)
  assert low.triton_calls == 3, low
  assert not low.dots and not low.cublas, low
  names = sorted(kn.name for kn in kernels)
  assert names == ["grouped_kernel", "grouped_kernel", "grouped_t_kernel"], (
      names)
  for kn in kernels:
    mma = aot.ptx_mma(kn.ptx)
    assert any(i.startswith("tcgen05.mma") and kind in i for i in mma), (
        kn.name, mma)


@pytest.mark.skipif(_WHY is not None or not _has_jax_triton(),
                    reason=f"compiles for an H100 ahead of time: {_WHY or ''}"
                    " (needs JAX's CUDA plugin and jax-triton)")
@pytest.mark.parametrize("fmt", [
    "nvfp4", pytest.param("mxfp4", marks=pytest.mark.slow),
    pytest.param("mxfp8", marks=pytest.mark.slow)])
def test_h100_compiles_the_decode_form_only(fmt):
  """For an H100 (cc 9.0) the kernels' decode form compiles through
  jax-triton to bf16 `wgmma` (what the Hopper GPU tests run); the native
  form declines there (Triton cannot compile it for sm_90)."""
  from nvfp4_jax.ops.ragged_dot import triton as kernel  # pylint: disable=g-import-not-at-top
  h100 = aot.Target("h100", "NVIDIA H100 80GB HBM3", (9, 0), 132,
                    shared_memory_per_sm=233472, threads_per_sm=2048,
                    memory_bytes=80 << 30, bandwidth=3.35e12,
                    l2_bytes=50 << 20, clock_ghz=1.98)
  s = jax.ShapeDtypeStruct
  _, pack, block, sd, cd, _ = kernel.FORMATS[fmt]
  m, k, n, e, length = 1000, 544, 320, 6, 1056
  fprop = (s((m, k // pack), cd), s((m, k // block), sd),
           s((e, n, k // pack), cd), s((e, n, k // block), sd),
           s((e,), jnp.int32), s((e,), jnp.float32))
  wgrad = (s((k, length // pack), cd), s((k, length // block), sd),
           s((n, length // pack), cd), s((n, length // block), sd),
           s((e,), jnp.int32), s((e,), jnp.float32))
  with aot.compiling_for(h100) as c:
    for fn, args, name in ((kernel.ragged_codes_matmul, fprop,
                            "grouped_kernel"),
                           (kernel.ragged_codes_matmul_t, wgrad,
                            "grouped_t_kernel")):
      low = aot.lowering(c.compile(functools.partial(fn, native=False,
                                                     fmt=fmt), *args))
      assert low.triton_calls == 1 and not low.dots, low
      (kn,) = c.triton_kernels
      assert kn.name == name
      assert any(i.startswith("wgmma") and "bf16" in i
                 for i in aot.ptx_mma(kn.ptx)), aot.ptx_mma(kn.ptx)
      with pytest.raises(NotImplementedError, match="compute capability"):
        c.compile(functools.partial(fn, fmt=fmt), *args)


# --- In Triton's interpreter: where the triton package is installed ----------


def _has_triton() -> bool:
  try:
    import triton  # pylint: disable=g-import-not-at-top,unused-import
    return True
  except ImportError:
    return False


def _u8(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


@pytest.mark.slow
@pytest.mark.skipif(not _has_triton(), reason="needs the triton package")
@pytest.mark.parametrize("native", [True, False])
def test_kernels_in_tritons_interpreter(native, monkeypatch):
  """Both kernels, both forms, run by Triton's interpreter (NumPy; no GPU)
  with `tl.dot_scaled` as documented (`triton_interpreter.py`), against the
  reference: uneven, empty groups, rows past the sum, K padded (96 -> 128),
  Wgrad groups ending inside a block and inside a code byte. Exact sums
  in both (NumPy's FP64 / FP32 dot of exact products in one order here):
  compared with the summation bound all the same."""
  import triton  # pylint: disable=g-import-not-at-top
  import triton_interpreter as ti  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.block_scaled_matmul import triton as dense  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.ragged_dot import triton as kernel  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.ragged_dot.pallas_mosaic_gpu import _tile_map  # pylint: disable=g-import-not-at-top
  fk, tk = ti.kernels(monkeypatch)
  rng = np.random.default_rng(0)
  m, k, n, e = 300, 96, 80, 4
  gs = jnp.asarray([37, 0, 200, 50], jnp.int32)        # 287 of 300 rows.
  qa = _quantized_rows(rng, m, k, gs)
  w = jnp.asarray(rng.standard_t(3, (e, n, k)) * .1, jnp.float32)
  qb = rq.quantize_experts(w, Operand(block_2d=True), None, values=False)
  alpha = rg.group_alpha(qa, qb)
  want = np.asarray(ref.ragged_codes_matmul(qa.data, qa.scales, qb.data,
                                            qb.scales, gs, alpha))
  kp = dense.padded_k(k)
  ac, asc = kernel._pad_k(qa.data, qa.scales, kp)  # pylint: disable=protected-access
  bc, bsc = kernel._pad_k(qb.data, qb.scales, kp)  # pylint: disable=protected-access
  bm, bn, bk = 64, 32, 64
  tmap = [ti.Arr(np.asarray(t), "int32") for t in _tile_map(gs, m, bm)]
  out = ti.Arr(np.full((m, n), np.nan, np.float32), "float32")
  fk[(len(tmap[0].a) * triton.cdiv(n, bn),)](
      *tmap, ti.Arr(_u8(ac), "uint8"), ti.Arr(_u8(asc), "float8_e4m3fn"),
      ti.Arr(_u8(bc), "uint8"), ti.Arr(_u8(bsc), "float8_e4m3fn"),
      ti.Arr(np.asarray(alpha), "float32"), out, M=m, N=n, K=kp, E=e,
      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NATIVE=native, HAS_ALPHA=True)
  va = np.abs(np.asarray(ref.codes_values(qa.data, qa.scales), np.float64))
  vb = np.abs(np.asarray(ref.codes_values(qb.data, qb.scales), np.float64))
  rows = np.asarray(rqref.group_of(gs, m))
  for g in range(e):
    r = rows == g
    tol = _bound(va[r], vb[g].T, float(alpha[g]), k)
    assert np.all(np.abs(out.a[r] - want[r]) <= tol), g
  np.testing.assert_array_equal(out.a[287:], 0)

  kk, nn = 48, 40
  for sizes, length in (([32, 0, 160, 48], 256), ([37, 0, 150, 50], 240)):
    gs = jnp.asarray(sizes, jnp.int32)
    x = jnp.asarray(rng.standard_t(3, (length, kk)), jnp.float32)
    dy = jnp.asarray(rng.standard_t(3, (length, nn)), jnp.float32)
    qa = rq.quantize_tokens(x, gs, Operand(), None, values=False, codes=True)
    qb = rq.quantize_tokens(dy, gs, Operand(), None, values=False,
                            codes=True)
    alpha = rg.group_alpha(qa, qb)
    want = np.asarray(ref.ragged_codes_matmul_t(qa.data, qa.scales, qb.data,
                                                qb.scales, gs, alpha))
    ends = np.cumsum(sizes)
    starts = ends - np.asarray(sizes)
    out = ti.Arr(np.full((len(sizes), kk, nn), np.nan, np.float32), "float32")
    tk[(len(sizes) * triton.cdiv(kk, bn) * triton.cdiv(nn, bn),)](
        ti.Arr(starts.astype(np.int32), "int32"),
        ti.Arr(ends.astype(np.int32), "int32"),
        ti.Arr(_u8(qa.data), "uint8"), ti.Arr(_u8(qa.scales), "float8_e4m3fn"),
        ti.Arr(_u8(qb.data), "uint8"), ti.Arr(_u8(qb.scales), "float8_e4m3fn"),
        ti.Arr(np.asarray(alpha), "float32"), out, K=kk, N=nn, L=length,
        BLOCK_M=bn, BLOCK_N=bn, BLOCK_K=bk, NATIVE=native, HAS_ALPHA=True)
    va = np.abs(np.asarray(ref.codes_values(qa.data, qa.scales), np.float64))
    vb = np.abs(np.asarray(ref.codes_values(qb.data, qb.scales), np.float64))
    for g, (s0, s1) in enumerate(zip(starts, ends)):
      if s1 == s0:
        np.testing.assert_array_equal(out.a[g], 0)
        continue
      tol = _bound(va[:, s0:s1], vb[:, s0:s1].T, float(alpha[g]), s1 - s0)
      assert np.all(np.abs(out.a[g] - want[g]) <= tol), (sizes, g)


@pytest.mark.slow
@pytest.mark.skipif(not _has_triton(), reason="needs the triton package")
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_kernels_in_tritons_interpreter(fmt, native, monkeypatch):
  """Both kernels on MX codes (`tl.dot_scaled` "e2m1" / "e4m3" with E8M0
  scale bytes per 32, or the decode form), interpreted, against the
  reference (`ref.ragged_codes_matmul(_t)` with `fmt`: `dequantize_mx`'s
  values, no alpha): uneven and empty groups, rows past the sum, K padded
  (96 -> 128, scale bytes 127), Wgrad groups ending inside a 32-token
  block. The tolerance is the FP32 summation-order bound (`_bound`): both
  forms multiply the same exact products (E2M1 / E4M3 times a power of
  two is exact in bf16 and in the MMA) and differ only in the order of
  the FP32 sums."""
  import triton  # pylint: disable=g-import-not-at-top
  import triton_interpreter as ti  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.block_scaled_matmul import triton as dense  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.ragged_dot import triton as kernel  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.ragged_dot.pallas_mosaic_gpu import _tile_map  # pylint: disable=g-import-not-at-top
  fk, tk = ti.kernels(monkeypatch)
  elem, pack, block, *_ = kernel.FORMATS[fmt]
  consts = dict(NATIVE=native, HAS_ALPHA=False, FMT=elem, PACK=pack,
                SCALE_BLOCK=block)
  ones = ti.Arr(np.ones(4, np.float32), "float32")
  rng = np.random.default_rng(4)
  op = Operand(format=fmt)
  m, k, n, e = 200, 96, 48, 4
  gs = jnp.asarray([37, 0, 120, 30], jnp.int32)        # 187 of 200 rows.
  x = jnp.asarray(rng.standard_t(3, (m, k)), jnp.float32)
  qa = rq.quantize_rows(x, gs, op, None, values=False, codes=True)
  w = jnp.asarray(rng.standard_t(3, (e, n, k)) * .1, jnp.float32)
  qb = rq.quantize_experts(w, op, None, values=False)
  want = np.asarray(ref.ragged_codes_matmul(qa.data, qa.scales, qb.data,
                                            qb.scales, gs, fmt=fmt))
  kp = dense.padded_k(k, mx=True)
  ac, asc = kernel._pad_k(*kernel._operand(qa.data, qa.scales, fmt), kp, fmt)  # pylint: disable=protected-access
  bc, bsc = kernel._pad_k(*kernel._operand(qb.data, qb.scales, fmt), kp, fmt)  # pylint: disable=protected-access
  bm, bn, bk = 64, 32, 64
  tmap = [ti.Arr(np.asarray(t), "int32") for t in _tile_map(gs, m, bm)]
  out = ti.Arr(np.full((m, n), np.nan, np.float32), "float32")
  fk[(len(tmap[0].a) * triton.cdiv(n, bn),)](
      *tmap, ti.Arr(_u8(ac), "uint8"), ti.Arr(_u8(asc), "uint8"),
      ti.Arr(_u8(bc), "uint8"), ti.Arr(_u8(bsc), "uint8"), ones, out,
      M=m, N=n, K=kp, E=e, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **consts)
  va = np.abs(np.asarray(ref.codes_values(qa.data, qa.scales, fmt),
                         np.float64))
  vb = np.abs(np.asarray(ref.codes_values(qb.data, qb.scales, fmt),
                         np.float64))
  rows = np.asarray(rqref.group_of(gs, m))
  for g in range(e):
    r = rows == g
    tol = _bound(va[r], vb[g].T, 1.0, k)
    assert np.all(np.abs(out.a[r] - want[r]) <= tol), g
  np.testing.assert_array_equal(out.a[187:], 0)

  kk, nn, length = 48, 40, 256
  for sizes in ([32, 0, 160, 64], [37, 0, 150, 50]):
    gs = jnp.asarray(sizes, jnp.int32)
    x = jnp.asarray(rng.standard_t(3, (length, kk)), jnp.float32)
    dy = jnp.asarray(rng.standard_t(3, (length, nn)), jnp.float32)
    qa = rq.quantize_tokens(x, gs, op, None, values=False, codes=True)
    qb = rq.quantize_tokens(dy, gs, op, None, values=False, codes=True)
    want = np.asarray(ref.ragged_codes_matmul_t(
        qa.data, qa.scales, qb.data, qb.scales, gs, fmt=fmt))
    ends = np.cumsum(sizes)
    starts = ends - np.asarray(sizes)
    out = ti.Arr(np.full((len(sizes), kk, nn), np.nan, np.float32),
                 "float32")
    tk[(len(sizes) * triton.cdiv(kk, bn) * triton.cdiv(nn, bn),)](
        ti.Arr(starts.astype(np.int32), "int32"),
        ti.Arr(ends.astype(np.int32), "int32"),
        ti.Arr(_u8(qa.data), "uint8"), ti.Arr(_u8(qa.scales), "uint8"),
        ti.Arr(_u8(qb.data), "uint8"), ti.Arr(_u8(qb.scales), "uint8"),
        ones, out, K=kk, N=nn, L=length, BLOCK_M=bn, BLOCK_N=bn,
        BLOCK_K=bk, **consts)
    va = np.abs(np.asarray(ref.codes_values(qa.data, qa.scales, fmt),
                           np.float64))
    vb = np.abs(np.asarray(ref.codes_values(qb.data, qb.scales, fmt),
                           np.float64))
    for g, (s0, s1) in enumerate(zip(starts, ends)):
      if s1 == s0:
        np.testing.assert_array_equal(out.a[g], 0)
        continue
      tol = _bound(va[:, s0:s1], vb[:, s0:s1].T, 1.0, s1 - s0)
      assert np.all(np.abs(out.a[g] - want[g]) <= tol), (sizes, g)


# --- On a GPU: the kernel against the reference ------------------------------

ON_GPU = jax.default_backend() == "gpu"
GPU_ONLY = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


def _forms():
  """The kernel's forms this GPU runs: the decode form on any CUDA GPU from
  Hopper on, the native one where `has_fp4_mma`."""
  from nvfp4_jax.ops.block_scaled_matmul import triton as dense  # pylint: disable=g-import-not-at-top
  return [False] + ([None] if ON_GPU and dense.has_fp4_mma() else [])


def _quantized_rows(rng, m, k, gs, fmt="nvfp4"):
  x = jnp.asarray(rng.standard_t(3, (m, k)), jnp.float32)
  return rq.quantize_rows(x, gs, Operand(format=fmt), None, values=False,
                          codes=True)


def _alpha1(a, b, num_groups):
  """Each group's `group_alpha` for the bound: 1 for MX (no tensor scale)."""
  alpha = rg.group_alpha(a, b)
  return np.ones(num_groups) if alpha is None else np.asarray(alpha)


def _bound(va, vb, alpha, k):
  """Two FP32 summations of the same k exact products (bf16 block values,
  or the MMA's exact FP4 products) in different orders differ by at most
  2 (k - 1) u sum |a b| (u = 2^-24), times |alpha|."""
  return 2 * max(k - 1, 1) * 2.0**-24 * (va @ vb) * np.abs(alpha)


GROUPS = [
    ([0, 37, 300, 0, 129, 400], 1000),   # Uneven, empty, rows past the sum.
    ([995, 0, 0, 3, 0, 2], 1000),        # Skewed.
    ([128, 256, 0, 128, 512], 1024),     # Boundaries on tiles, sum == M.
]


@GPU_ONLY
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("sizes, m", GROUPS)
def test_fprop_kernel_equals_the_reference_on_gpu(sizes, m, fmt):
  from nvfp4_jax.ops.ragged_dot import triton as kernel  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  k, n, e = 544, 320, len(sizes)        # K padded to 576 (MX: 640).
  gs = jnp.asarray(sizes, jnp.int32)
  qa = _quantized_rows(rng, m, k, gs, fmt)
  w = jnp.asarray(rng.standard_t(3, (e, n, k)) * .1, jnp.float32)
  qb = rq.quantize_experts(w, Operand(format=fmt, block_2d=fmt == "nvfp4"),
                           None, values=False)
  alpha = rg.group_alpha(qa, qb)
  want = np.asarray(ref.ragged_codes_matmul(qa.data, qa.scales, qb.data,
                                            qb.scales, gs, alpha, fmt=fmt))
  va = np.abs(np.asarray(ref.codes_values(qa.data, qa.scales, fmt),
                         np.float64))
  vb = np.abs(np.asarray(ref.codes_values(qb.data, qb.scales, fmt),
                         np.float64))
  alpha1 = _alpha1(qa, qb, e)
  total = min(sum(sizes), m)
  for native in _forms():
    got = np.asarray(jax.jit(functools.partial(
        kernel.ragged_codes_matmul, native=native, fmt=fmt))(
            qa.data, qa.scales, qb.data, qb.scales, gs, alpha))
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[total:], 0)
    start = 0
    for g, size in enumerate(sizes):
      rows = slice(start, min(start + size, m))
      start += size
      tol = _bound(va[rows], vb[g].T, float(alpha1[g]), k)
      assert np.all(np.abs(got[rows] - want[rows]) <= tol), (native, g)


@GPU_ONLY
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("sizes, length", [
    ([32, 0, 160, 48, 0, 800], 1056),    # Aligned (the op pads), empty.
    ([37, 0, 150, 50], 256),             # Ends inside blocks and pairs.
    ([1008, 0, 0, 16, 0, 16], 1056),     # Skewed, tiny groups.
])
def test_wgrad_kernel_equals_the_reference_on_gpu(sizes, length, fmt):
  from nvfp4_jax.ops.ragged_dot import triton as kernel  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(2)
  k, n = 320, 384
  op = Operand(format=fmt)
  gs = jnp.asarray(sizes, jnp.int32)
  x = jnp.asarray(rng.standard_t(3, (length, k)), jnp.float32)
  dy = jnp.asarray(rng.standard_t(3, (length, n)), jnp.float32)
  qa = rq.quantize_tokens(x, gs, op, None, values=False, codes=True)
  qb = rq.quantize_tokens(dy, gs, op, None, values=False, codes=True)
  alpha = rg.group_alpha(qa, qb)
  want = np.asarray(ref.ragged_codes_matmul_t(
      qa.data, qa.scales, qb.data, qb.scales, gs, alpha, fmt=fmt))
  va = np.abs(np.asarray(ref.codes_values(qa.data, qa.scales, fmt),
                         np.float64))
  vb = np.abs(np.asarray(ref.codes_values(qb.data, qb.scales, fmt),
                         np.float64))
  alpha1 = _alpha1(qa, qb, len(sizes))
  for native in _forms():
    got = np.asarray(jax.jit(functools.partial(
        kernel.ragged_codes_matmul_t, native=native, fmt=fmt))(
            qa.data, qa.scales, qb.data, qb.scales, gs, alpha))
    assert got.shape == (len(sizes), k, n) and not np.isnan(got).any()
    start = 0
    for g, size in enumerate(sizes):
      toks = slice(start, start + size)
      start += size
      if not size:
        np.testing.assert_array_equal(got[g], 0)
        continue
      tol = _bound(va[:, toks], vb[:, toks].T, float(alpha1[g]), size)
      assert np.all(np.abs(got[g] - want[g]) <= tol), (native, g)


@GPU_ONLY
def test_op_on_the_codes_path_within_the_summation_bound_on_gpu(monkeypatch):
  """`nvfp4_jax.ragged_dot` on the codes path (`triton` named: the native
  kernel where `has_fp4_mma`, its decode form elsewhere; the reference may
  not run) against the reference on block values, forward and backward:
  the same block values, summed in other orders (test_ragged_dot.py's
  `check_gpu_gradients` bound). Uneven, empty and skewed groups."""
  from test_ragged_dot import U, check_gpu_gradients  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.block_scaled_matmul import triton as dense  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.ragged_dot import triton as kernel  # pylint: disable=g-import-not-at-top

  def unreachable(*_, **__):
    raise AssertionError("the grouped kernel declined; the reference ran")
  for op, fn in ((rg.RAGGED_CODES_MATMUL, kernel.ragged_codes_matmul),
                 (rg.RAGGED_CODES_MATMUL_T, kernel.ragged_codes_matmul_t)):
    if not dense.has_fp4_mma():
      monkeypatch.setitem(op.implementations, "triton",
                          functools.partial(fn, native=False))
    monkeypatch.setitem(op.implementations, "xla", unreachable)
  gs = jnp.array([300, 0, 3, 400, 0, 2, 200], jnp.int32)
  m, k, n = 1000, 256, 384
  x, w, dy = _step_operands(m, k, n, len(gs))
  recipe = nv.Recipe.nvfp4()
  jax.clear_caches()
  with nv.default_implementation("xla"):  # The values path's reference.
    ly, ldx, ldw = map(np.asarray, _step(recipe, gs)(x, w, dy))
  jax.clear_caches()
  with nv.default_implementation("triton"):
    y, dx, dw = map(np.asarray, _step(recipe, gs)(x, w, dy))
  jax.clear_caches()
  rows = np.repeat(np.arange(7), np.asarray(gs))
  wa = np.abs(np.asarray(w))[rows]
  total = len(rows)
  bound = 8 * k * U * np.einsum("rk,rkn->rn", np.abs(x[:total]), wa)
  assert np.all(np.abs(y[:total] - ly[:total]) <= bound)
  check_gpu_gradients(x, dy, wa, gs, (dx, dw), (ldx, ldw))
  assert not y[total:].any() and not dx[total:].any()
  assert not dw[[1, 4]].any()
