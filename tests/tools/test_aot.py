"""Blackwell without the hardware: the GEMM dispatch per (capability, shape,
cuDNN), and the same choices compiled ahead of time for Blackwell targets.

The pure-logic tests run everywhere (cheap). The ahead-of-time tests compile
for a B200, an RTX PRO 6000, a GB10 and a Thor with JAX's CUDA plugin
(`nvfp4_jax.tools.aot`); they skip where it is not installed (CPU CI) and
run on the GPU machine's suite, or on a CPU machine with the `gpu` extra and
`JAX_PLATFORMS=cpu`. Each crash they guard was a compile error before the
dispatch learned to avoid it (issue 40): Triton's block-scaled MMA on GB10
(12.1) and 11.x, `BLOCK_K = 32` for K = 32 (mod 64) on 12.0, and cuDNN on
shapes it has no engine for (K = 48) on 10.0; below cuDNN 9.10 XLA
decomposed the block-scaled dot silently.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nv
from nvfp4_jax.core import dispatch
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
from nvfp4_jax.ops.block_scaled_matmul import cudnn
from nvfp4_jax.ops.block_scaled_matmul import reference as gemm_ref
from nvfp4_jax.ops.block_scaled_matmul import triton as triton_gemm
from nvfp4_jax.tools import aot
from pallas_kernels import e2m1_encode
from pallas_kernels import launch

# --- Pure logic: runs in CPU CI ----------------------------------------------


@pytest.mark.parametrize("cc, cudnn_v, want", [
    ((10, 0), (9, 14), ("scaled_matmul", "triton", "pallas")),
    ((10, 3), (9, 14), ("scaled_matmul", "triton", "pallas")),
    ((12, 0), (9, 14), ("triton", "scaled_matmul", "pallas")),
    # GB10 / DGX Spark and 11.x: Triton's block-scaled MMA does not compile.
    ((12, 1), (9, 14), ("scaled_matmul", "pallas")),
    ((11, 0), (9, 14), ("scaled_matmul", "pallas")),
    # cuDNN below 9.10: XLA would decompose the dot; not the default.
    ((10, 0), (9, 8), ("triton", "pallas")),
    ((12, 1), (9, 8), ("pallas",)),
    ((10, 0), None, ("scaled_matmul", "triton", "pallas")),  # Unknown.
    ((9, 0), (9, 14), ("pallas",)),
])
def test_gemm_preference_per_capability_and_cudnn(cc, cudnn_v, want):
  assert gemm_api.gemm_preference("gpu", cc, cudnn_v) == want


def test_target_device_answers_for_the_target_and_restores():
  before = (dispatch.platform(), dispatch.compute_capability(),
            launch.backend())
  with dispatch.target_device("gpu", (12, 1), (9, 14)):
    assert dispatch.platform() == "gpu" and launch.backend() == "gpu"
    assert dispatch.compute_capability() == (12, 1)
    assert dispatch.cudnn_version() == (9, 14)
    assert gemm_api.BLOCK_SCALED_MATMUL.order() == (
        "scaled_matmul", "pallas", "xla")
  assert (dispatch.platform(), dispatch.compute_capability(),
          launch.backend()) == before
  with pytest.raises(ValueError, match="platform 'cuda'"):
    with dispatch.target_device("cuda", (10, 0)):
      pass


@pytest.mark.parametrize("k, want", [(512, 512), (544, 576), (48, 64),
                                     (4000, 4032), (64, 64)])
def test_triton_pads_k_to_a_multiple_of_64(k, want):
  assert triton_gemm.padded_k(k) == want


def test_padding_k_with_zero_codes_and_scales_is_exact():
  """What the Triton path multiplies for K = 48 (padded to 64) gives the
  reference's bits: zero codes times zero scales add exact zeros."""
  a = _random_operand("nvfp4", 32, 48, 3)
  b = _random_operand("nvfp4", 16, 48, 4)
  pa, pb = triton_gemm.pad_k(a, 64), triton_gemm.pad_k(b, 64)
  assert pa.shape == (32, 64) and pb.scales.shape == (16, 4)
  gemm = jax.jit(functools.partial(gemm_ref._matmul_xla,  # pylint: disable=protected-access
                                   out_dtype=jnp.float32))
  np.testing.assert_array_equal(gemm(pa, pb), gemm(a, b))


def _random_operand(fmt, rows, k, seed):
  """Random code bytes and scale bytes (E4M3 0x00-0x7E: zero, subnormal, up
  to 448; UE8M0 2^-27..2^22), the bytes a quantizer may write."""
  rng = np.random.default_rng(seed)
  if fmt == "nvfp4":
    return NVFP4Array(
        codes=jnp.asarray(rng.integers(0, 256, (rows, k // 2), np.uint8)),
        scales=jax.lax.bitcast_convert_type(jnp.asarray(
            rng.integers(0, 0x7F, (rows, k // 16), np.uint8)),
                                            jnp.float8_e4m3fn),
        amax=jnp.float32(3.0))
  data = rng.integers(0, 256, (rows, k // 2 if fmt == "mxfp4" else k),
                      np.uint8)
  if fmt == "mxfp8":  # No NaN (0x7F, 0xFF) among the E4M3 elements.
    data[(data & 0x7F) == 0x7F] = 0
  data = jnp.asarray(data)
  return nv.MXArray(
      data=data if fmt == "mxfp4" else jax.lax.bitcast_convert_type(
          data, jnp.float8_e4m3fn),
      scales=jax.lax.bitcast_convert_type(jnp.asarray(
          rng.integers(100, 150, (rows, k // 32), np.uint8)),
                                          jnp.float8_e8m0fnu), fmt=fmt)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8", "nvfp4"])
def test_operands_as_cudnn_takes_them_are_the_reference_values(fmt):
  """What `jax.nn.scaled_matmul` receives (elements as float4_e2m1fn /
  float8_e4m3fn, the scales as they are) means the reference's block values
  bit for bit: elements x scales = `block_dequantize`'s values (both exact
  in FP32). The dot itself is cuDNN's (or XLA's), FP32 accumulation."""
  q = _random_operand(fmt, 8, 128, 1)
  block = 16 if fmt == "nvfp4" else 32

  @jax.jit
  def both(q):
    got = cudnn._elements(q)[0].astype(jnp.float32) * jnp.repeat(  # pylint: disable=protected-access
        q.scales.astype(jnp.float32), block, axis=-1)
    return got, nv.block_dequantize(q)[0].astype(jnp.float32)
  got, want = both(q)
  np.testing.assert_array_equal(got, want)


def test_mx_padding_is_exact():
  """Padded MX operands: the elements as they were, then zeros (which add
  zeros), under finite scales (127: 2^0)."""
  for fmt in ("mxfp4", "mxfp8"):
    q = _random_operand(fmt, 4, 96, 2)
    p = triton_gemm.pad_k(q, triton_gemm.padded_k(96, mx=True))
    assert p.shape == (4, 128) and p.scales.shape == (4, 4)
    data = lambda a: np.asarray(a).view(np.uint8)
    cols = data(q.data).shape[1]
    np.testing.assert_array_equal(data(p.data)[:, :cols], data(q.data))
    assert not data(p.data)[:, cols:].any()
    np.testing.assert_array_equal(data(p.scales)[:, :3], data(q.scales))
    assert (data(p.scales)[:, 3] == 127).all()


def test_mx_dispatch_on_blackwell():
  """MXFP8 takes cuDNN's block-scaled dot; MXFP4 not (XLA decomposes it)."""
  mx = lambda rows, fmt: nv.MXArray(
      data=jax.ShapeDtypeStruct((rows, 256 if fmt == "mxfp4" else 512),
                                jnp.uint8 if fmt == "mxfp4"
                                else jnp.float8_e4m3fn),
      scales=jax.ShapeDtypeStruct((rows, 16), jnp.float8_e8m0fnu), fmt=fmt)
  f = functools.partial(gemm_api.block_scaled_matmul,
                        implementation="scaled_matmul")
  with dispatch.target_device("gpu", (10, 0), (9, 14)):
    jax.eval_shape(f, mx(256, "mxfp8"), mx(384, "mxfp8"))
    with pytest.raises(NotImplementedError, match="MXFP4"):
      jax.eval_shape(f, mx(256, "mxfp4"), mx(384, "mxfp4"))
    with pytest.raises(NotImplementedError, match="one format"):
      jax.eval_shape(f, mx(256, "mxfp8"), mx(384, "mxfp4"))


@pytest.mark.parametrize("m, n, k, ok", [
    (256, 384, 512, True), (256, 384, 48, False), (40, 384, 512, False),
    (256, 384, 544, False), (128, 128, 64, True)])
def test_cudnn_shapes(m, n, k, ok):
  assert (cudnn.unsupported(m, n, k) is None) == ok


def _abstract(rows, k):
  s = jax.ShapeDtypeStruct
  return NVFP4Array(codes=s((rows, k // 2), jnp.uint8),
                    scales=s((rows, k // 16), jnp.float8_e4m3fn),
                    amax=s((), jnp.float32))


def test_cudnn_declines_shapes_with_no_engine_where_it_would_run():
  """K = 48 on a 10.0 with cuDNN 9.14: NotImplementedError (dispatch falls
  back) at trace time. Where XLA decomposes anyway (cuDNN 9.8) the named
  implementation still traces."""
  f = functools.partial(gemm_api.block_scaled_matmul,
                        implementation="scaled_matmul")
  with dispatch.target_device("gpu", (10, 0), (9, 14)):
    with pytest.raises(NotImplementedError, match="K=48"):
      jax.eval_shape(f, _abstract(256, 48), _abstract(384, 48))
    jax.eval_shape(f, _abstract(256, 512), _abstract(384, 512))
  with dispatch.target_device("gpu", (10, 0), (9, 8)):
    jax.eval_shape(f, _abstract(256, 48), _abstract(384, 48))


def test_triton_declines_capabilities_without_block_scaled_mma():
  f = functools.partial(gemm_api.block_scaled_matmul, implementation="triton")
  for cc in ((12, 1), (11, 0), (9, 0)):
    with dispatch.target_device("gpu", cc):
      with pytest.raises(NotImplementedError, match="compiles for compute"):
        jax.eval_shape(f, _abstract(256, 512), _abstract(384, 512))


# A multiply over the [M, N] GEMM output in lowered StableHLO.
_GEMM_OUT = re.compile(r"stablehlo\.multiply [^\n]*: tensor<(?:1x)?256x384xf32>")


def _scaled_dot_calls(text):
  """(target, operand count) of each block-scaled dot custom call in
  lowered StableHLO."""
  return [(t, len(ops.split(","))) for t, ops in re.findall(
      r"custom_call @(__op\$block_scaled_dot)\(([^)]*)\)", text)]


@pytest.mark.parametrize("cudnn_v, fused", [((9, 14), True), ((9, 13), True),
                                            ((9, 12), False), (None, True)])
def test_alpha_is_the_block_scaled_dots_global_scale(cudnn_v, fused):
  """From cuDNN 9.13 the NVFP4 GEMM hands alpha to XLA's block-scaled dot
  as its fifth operand (the global scale cuDNN applies in its graph): no
  multiply over the [M, N] output is left in the lowered program. Below,
  `jax.nn.scaled_matmul`'s four operands and `acc * alpha` after it.
  Lowered for CUDA here (nothing runs; the compile for a B200 is
  `test_b200_cudnn_dot_applies_alpha`)."""
  f = functools.partial(gemm_api.block_scaled_matmul,
                        implementation="scaled_matmul")
  jax.clear_caches()
  with dispatch.target_device("gpu", (10, 0), cudnn_v):
    text = jax.jit(f).trace(_abstract(256, 512), _abstract(384, 512)).lower(
        lowering_platforms=("cuda",)).as_text()
  jax.clear_caches()
  assert _scaled_dot_calls(text) == [
      ("__op$block_scaled_dot", 5 if fused else 4)], text
  assert bool(_GEMM_OUT.search(text)) != fused, text


def test_global_scaled_dot_vmaps():
  """vmap over the NVFP4 cuDNN GEMM: one call per batch element, each with
  its own alpha (a loop in the lowered program; nothing runs)."""
  s = jax.ShapeDtypeStruct
  ab = lambda rows: NVFP4Array(codes=s((3, rows, 256), jnp.uint8),
                               scales=s((3, rows, 32), jnp.float8_e4m3fn),
                               amax=s((3,), jnp.float32))
  f = jax.vmap(functools.partial(gemm_api.block_scaled_matmul,
                                 implementation="scaled_matmul"))
  jax.clear_caches()
  with dispatch.target_device("gpu", (10, 0), (9, 14)):
    text = jax.jit(f).trace(ab(256), ab(384)).lower(
        lowering_platforms=("cuda",)).as_text()
  jax.clear_caches()
  assert _scaled_dot_calls(text) == [("__op$block_scaled_dot", 5)], text
  assert "stablehlo.while" in text


def test_target_config_text():
  text = aot.target_config("gb10", cudnn=(9, 8))
  # As the GPU reports itself (XLA: sm_121a); `features=None`: plain sm_121.
  assert ("cuda_compute_capability{major:12 minor:1 feature_extension:"
          "ACCELERATED_FEATURES}") in text
  assert "cuda_compute_capability{major:12 minor:1}" in aot.target_config(
      aot.target("gb10", features=None))
  with pytest.raises(ValueError, match="feature extension 'SM_121A'"):
    aot.target("gb10", features="SM_121A")
  assert "dnn_version_info{major:9 minor:8}" in text
  assert 'device_description_str:"NVIDIA GB10"' in text
  with pytest.raises(ValueError, match="unknown target 'h300'.*b200"):
    aot.target("h300")


_PRE = 'stablehlo.custom_call @__op$block_scaled_dot(%a)'
_NATIVE = ('%c = (f32[1,256,384]) custom-call(%a), custom_call_target='
           '"__cudnn$blockScaledDot", metadata={op_name="jit(f)/'
           'nvfp4_layer[blk/mlp|fprop=nvfp4]/jit(nvfp4_fprop)/scaled_matmul"}')
_DECOMPOSED = ('%c = f32[256,384] custom-call(%a), custom_call_target='
               '"__cublas$lt$matmul", metadata={op_name="jit(f)/'
               'nvfp4_layer[blk/mlp|fprop=nvfp4]/jit(nvfp4_fprop)/x"}\n'
               '%d = f32[256,384]{1,0} dot(%a, %b), lhs_contracting_dims={1}')


def test_check_device_flags_a_decomposed_block_scaled_dot():
  from nvfp4_jax.tools import check_device  # pylint: disable=g-import-not-at-top
  what, problems = check_device._describe(_PRE, _NATIVE, [])  # pylint: disable=protected-access
  assert problems == [] and "cuDNN __cudnn$blockScaledDot x1" in what
  what, problems = check_device._describe(_PRE, _DECOMPOSED, [])  # pylint: disable=protected-access
  assert problems == ["1 block-scaled dot(s) decomposed by XLA"], what


def test_report_reads_the_compiled_program():
  gemm = nv.Gemm(layer="blk/mlp", gemm="fprop", precision="nvfp4",
                 implementation="native FP4: cuDNN scaled_matmul")
  rep = nv.Report((gemm,))
  assert rep.compiled(_NATIVE).gemms[0].implementation == (
      "native FP4: cuDNN block-scaled dot")
  got = rep.compiled(_DECOMPOSED).gemms[0].implementation
  assert got.startswith("emulation: XLA decomposed"), got


def test_compiled_report_compiles_and_reports():
  rep = nv.compiled_report(lambda a, b: a @ b, jnp.ones((4, 8)),
                           jnp.ones((8, 2)))
  assert [(g.gemm, g.reason) for g in rep.gemms] == [
      ("other", "not an NVFP4 layer")]


# --- Ahead of time: where JAX's CUDA plugin is installed ----------------------

_WHY = aot.unavailable_reason()
needs_plugin = pytest.mark.skipif(
    _WHY is not None, reason=f"compiles for Blackwell ahead of time: {_WHY}")


def _cudnn_visible() -> bool:
  if _WHY is not None:
    return False
  with aot.compiling_for("b200") as c:
    return c.cudnn_visible()


# jax 0.10's deviceless compile hands block-scaled dots to cuDNN; jax 0.11's
# decomposes them all (`aot.Compiler.cudnn_visible`): the assertions that
# cuDNN's dot is there need the former.
_CUDNN_VISIBLE = _cudnn_visible()


def _gemm_hlo(c, m, n, k, impl=None):
  f = functools.partial(gemm_api.block_scaled_matmul, implementation=impl)
  return c.compile(f, _abstract(m, k), _abstract(n, k))


def _block_scaled_mma(c) -> str:
  return aot.describe_mma(tuple(m for t in c.triton_kernels
                                for m in aot.ptx_mma(t.ptx)))


@needs_plugin
@pytest.mark.parametrize("target", ["b200", "rtx-pro-6000"])
def test_check_device_target_passes(target, capsys):
  """`check_device --target` for B200 and RTX PRO 6000: every program
  compiles, the layer's GEMMs, the aligned GEMM and the MoE op's grouped
  GEMMs (NVFP4, MXFP4, MXFP8 recipes) run native FP4 / FP8."""
  from nvfp4_jax.tools import check_device  # pylint: disable=g-import-not-at-top
  assert check_device.ahead_of_time(target, sass=False) == 0
  out = capsys.readouterr().out
  assert "FAIL" not in out
  layer = next(l for l in out.splitlines() if "256 tokens" in l)
  if target == "b200":
    native = ("cuDNN __cudnn$blockScaledDot x3" if _CUDNN_VISIBLE else
              "cuDNN block-scaled dot x3 (dispatch; not verifiable")
  else:
    native = "Triton OMMA (mma.sync block_scale) kind::mxf4nvf4"
  assert native in layer, layer
  # The mixture of experts' three grouped GEMMs: the Triton kernel on codes.
  moe = next(l for l in out.splitlines() if l.startswith("| ragged_dot (MoE)"))
  grouped = ("Triton tcgen05 kind::mxf4nvf4 scale_vec::4X x3"
             if target == "b200" else
             "Triton OMMA (mma.sync block_scale) kind::mxf4nvf4 "
             "scale_vec::4X x3")
  assert grouped in moe and "| triton |" in moe, moe
  # MXFP4 and MXFP8 recipes: the same kernel on MX codes, E8M0 scales.
  for fmt, kind in (("MXFP4", "kind::mxf4 scale_vec::2X" if target == "b200"
                     else "kind::mxf4nvf4 scale_vec::2X"),
                    ("MXFP8", "kind::mxf8f6f4 scale_vec::1X")):
    moe = next(l for l in out.splitlines()
               if l.startswith(f"| ragged_dot (MoE, {fmt})"))
    grouped = ("Triton tcgen05 " if target == "b200" else
               "Triton OMMA (mma.sync block_scale) ") + kind + " x3"
    assert grouped in moe and "| triton |" in moe, moe


@needs_plugin
@pytest.mark.parametrize("target", ["gb10", "thor"])
def test_no_triton_gemm_where_its_mma_does_not_compile(target, monkeypatch):
  """cc 12.1 and 11.0: the default GEMM compiles (cuDNN), no Triton call;
  Triton named explicitly fails there as it did in the default before."""
  with aot.compiling_for(target) as c:
    assert "triton" not in gemm_api.BLOCK_SCALED_MATMUL.order()
    # jax 0.11.2's XLA aborts compiling the decomposed dot for cc >= 11.
    if _CUDNN_VISIBLE:
      low = aot.lowering(_gemm_hlo(c, 256, 384, 512))
      assert low.triton_calls == 0, low
      assert low.cudnn_block_scaled == int(_CUDNN_VISIBLE), low
    # The compile error the dispatch now avoids.
    with pytest.raises(NotImplementedError):
      _gemm_hlo(c, 256, 384, 512, "triton")
    # Without the guard, what the default did before: a compile error.
    monkeypatch.setattr(triton_gemm, "has_fp4_mma", lambda cc=None: True)
    with pytest.raises(Exception, match="TTIR->TTGIR"):
      _gemm_hlo(c, 256, 384, 512, "triton")


@needs_plugin
@pytest.mark.parametrize("target, k", [("rtx-pro-6000", 544),
                                       ("rtx-pro-6000", 4000),
                                       ("b200", 544)])
def test_triton_k_32_mod_64_compiles(target, k):
  """K = 32 (mod 64) (Wgrad's K for 4000 tokens): padded to 64, it compiles
  to the block-scaled MMA."""
  with aot.compiling_for(target) as c:
    low = aot.lowering(_gemm_hlo(c, 256, 384, k, "triton"))
    assert low.triton_calls == 1
    assert "kind::mxf4nvf4" in _block_scaled_mma(c), c.triton_kernels


@needs_plugin
@pytest.mark.parametrize("target, fmt, want", [
    ("b200", "mxfp8", "cudnn"), ("b200", "mxfp4", "tcgen05 kind::mxf4 "),
    ("rtx-pro-6000", "mxfp4", "kind::mxf4nvf4 scale_vec::2X"),
    ("rtx-pro-6000", "mxfp8", "kind::mxf8f6f4")])
def test_mx_gemms_run_native(target, fmt, want):
  s = jax.ShapeDtypeStruct
  mx = lambda rows: nv.MXArray(
      data=s((rows, 256), jnp.uint8) if fmt == "mxfp4" else s(
          (rows, 512), jnp.float8_e4m3fn),
      scales=s((rows, 16), jnp.float8_e8m0fnu), fmt=fmt)
  with aot.compiling_for(target) as c:
    low = aot.lowering(c.compile(gemm_api.block_scaled_matmul, mx(256),
                                 mx(384)))
    if want == "cudnn":
      assert low.cudnn_block_scaled == int(_CUDNN_VISIBLE), low
    else:
      assert low.triton_calls == 1, low
      assert want in _block_scaled_mma(c), c.triton_kernels


@needs_plugin
@pytest.mark.skipif(not _CUDNN_VISIBLE,
                    reason="this JAX's compile without a GPU decomposes "
                    "block-scaled dots (aot.Compiler.cudnn_visible)")
@pytest.mark.parametrize("cudnn_v, out_dtype, passes", [
    ((9, 14), jnp.float32, ()), ((9, 14), jnp.bfloat16, ("convert",)),
    ((9, 12), jnp.float32, ("multiply",))])
def test_b200_cudnn_dot_applies_alpha(cudnn_v, out_dtype, passes):
  """Compiled for a B200: with cuDNN 9.14 one `__cudnn$blockScaledDot` with
  alpha as its fifth operand and, for an FP32 output, no pass over the
  output after it (a BF16 output keeps its one cast, as the spec's single
  rounding wants: cuDNN's global scale has the result's type, so a BF16
  result would round alpha to BF16). With cuDNN 9.12 XLA multiplies after
  the call."""
  f = functools.partial(gemm_api.block_scaled_matmul,
                        implementation="scaled_matmul", out_dtype=out_dtype)
  with aot.compiling_for("b200", cudnn=cudnn_v) as c:
    hlo = c.compile(f, _abstract(256, 512), _abstract(384, 512))
  low = aot.lowering(hlo)
  assert low.cudnn_block_scaled == 1, low
  assert low.cudnn_global_scaled == (1 if cudnn_v >= (9, 13) else 0), low
  shape = "256,384]"
  full = [op for op in ("multiply", "convert") if re.search(
      rf"\[(?:1,)?{re.escape(shape)}\{{[^}}]*\}} {op}\(", hlo)]
  assert tuple(full) == passes, hlo


@needs_plugin
def test_b200_triton_gemm_applies_alpha_in_its_epilogue():
  """The Triton GEMM multiplies its FP32 accumulator by alpha before its one
  store: nothing runs over the output after the kernel."""
  f = functools.partial(gemm_api.block_scaled_matmul, implementation="triton")
  with aot.compiling_for("b200") as c:
    hlo = c.compile(f, _abstract(256, 384), _abstract(384, 384))
    ptx = "".join(k.ptx for k in c.triton_kernels)
  assert aot.lowering(hlo).triton_calls == 1
  assert not re.search(r"\[256,384\]\{[^}]*\} (multiply|convert)\(", hlo), hlo
  assert "mul.f32" in ptx or "mul.rn.f32" in ptx


@needs_plugin
def test_b200_k_48_leaves_cudnn_for_a_native_fallback():
  with aot.compiling_for("b200") as c:
    low = aot.lowering(_gemm_hlo(c, 256, 384, 48))
    assert low.cudnn_block_scaled == 0 and low.triton_calls == 1, low
    assert "tcgen05 kind::mxf4nvf4" in _block_scaled_mma(c)


@needs_plugin
def test_old_cudnn_decomposes_and_the_report_says_so():
  """cuDNN 9.8: the default GEMM avoids cuDNN (Triton, native); forced onto
  cuDNN, the compiled program is a decomposition, and `Report.compiled`
  reports it as one."""
  dn = (((1,), (0,)), ((), ()))

  def layer(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: nv.dot_general(
        x, w, dn, recipe=nv.Recipe.nvfp4(), key=jax.random.key(0),
        name="blk/mlp"), x, w)
    return y, vjp(dy)
  s = jax.ShapeDtypeStruct
  args = (s((256, 512), jnp.bfloat16), s((512, 384), jnp.float32),
          s((256, 384), jnp.float32))
  with aot.compiling_for("b200", cudnn=(9, 8)) as c:
    low = aot.lowering(_gemm_hlo(c, 256, 384, 512))
    assert low.triton_calls == 1 and low.cudnn_block_scaled == 0
    with nv.default_implementation("scaled_matmul"):
      rep = nv.report(layer, *args)
      compiled = rep.compiled(c.compile(layer, *args))
  assert {g.implementation for g in rep.quantized} == {
      "native FP4: cuDNN scaled_matmul"}
  assert all(g.implementation.startswith("emulation: XLA decomposed")
             for g in compiled.quantized), compiled


# --- Blackwell's E2M1 conversion in the quantizers ---------------------------


@pytest.mark.parametrize("cc, hw, want", [
    ((10, 0), True, True), ((10, 3), True, True),
    ((12, 0), True, False),  # XLA's Triton targets plain sm_120: no cvt.
    ((9, 0), True, False), ((10, 0), False, False)])
def test_round_to_nearest_codes_use_the_e2m1_conversion(monkeypatch, cc, hw,
                                                        want):
  """Lowered for CUDA (nothing runs): the RTNE quantizer carries
  `cvt.rn.satfinite.e2m1x2.f32` on 10.0/10.3 and the software encoder
  elsewhere or with `HW_E2M1` off; stochastic rounding never converts in
  hardware (see `e2m1_encode._ENCODE_CODES_CVT_ASM`). Bit-exactness on the
  device: tests/kernels/test_encoder.py's `test_assembly_equals_reference` and
  `check_device`, on a Blackwell GPU."""
  from jax._src.pallas.triton import pallas_call_registration as reg  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.quantize import pallas_triton as pallas_quantize  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(e2m1_encode, "HW_E2M1", hw)
  if hasattr(reg, "gpu_info_lib"):  # jax >= 0.11 asks the (absent) GPU.
    monkeypatch.setattr(reg, "gpu_info_lib", types.SimpleNamespace(
        get_gpu_info=lambda: types.SimpleNamespace(
            compute_capability=cc[0] * 10 + cc[1])))
  x = jax.ShapeDtypeStruct((32, 256), jnp.bfloat16)
  lower = lambda fn: jax.jit(fn).trace(x).lower(
      lowering_platforms=("cuda",)).as_text()
  jax.clear_caches()  # Traces are cached by function, not by target.
  with dispatch.target_device("gpu", cc):
    rtne = lower(pallas_quantize.quantize)
    assert ("cvt.rn.satfinite.e2m1x2.f32" in rtne) == want
    assert ("mul.rn.ftz.sat.f32" in rtne) != want  # The software encoder.
    # The quantize kernels convert the signed values (blocks NaN as a
    # whole: one NaN test per 8 elements), on their 8K tiles.
    assert ("testp.notanumber.f32" in rtne) == want
    # No sign gathering (the encoders of magnitudes: `_encode_codes_asm`,
    # `_encode_codes_cvt_asm`).
    assert ("shf.l.wrap.b32" in rtne) != want
    assert pallas_quantize.wide_tiles(False, False, False) == want
    # Four-over-Six takes the word path too: both candidates converted,
    # their codes decoded for the error terms, units by `fma.rm.f32x2`.
    fos = lower(lambda x: pallas_quantize.quantize(x, four_over_six=True))
    assert ("fma.rm.f32x2" in fos) == want
    assert ("cvt.rn.f16x2.e2m1x2" in fos) == want
    assert not pallas_quantize.wide_tiles(False, False, True)  # 4K tiles.
    two_d = lower(lambda x: pallas_quantize.quantize(x, block_2d=True))
    assert ("testp.notanumber.f32" in two_d) == want
    # The bf16 block values decode the converted codes in hardware too.
    vals = lower(lambda x: pallas_quantize.quantize(x, with_values=True))
    assert ("cvt.rn.f16x2.e2m1x2" in vals) == want
    if want:
      sr = lower(lambda x: pallas_quantize.quantize(
          x, rounding="stochastic", key=jax.random.key(0)))
      assert "e2m1x2" not in sr and "fma.rp.f32" in sr
    # The RHT columns kernel: packed FP32 butterfly and the word encoder.
    from nvfp4_jax.ops.quantize_rht_t import pallas_triton as pallas_rht  # pylint: disable=g-import-not-at-top
    rht = lower(lambda x: pallas_rht.quantize_rht_t(x, amax=jnp.float32(1)))
    # (Flushing subnormal partial sums as the reference does.)
    assert ("add.rn.ftz.f32x2" in rht) == want
    # Its codes as words (`paired_words.scale_encode_words`: the NaN test by
    # `setp.nan`), the encode scales looked up in the wrapper's table: no
    # division or reciprocal in the kernel.
    assert ("setp.nan.f32" in rht) == want
    if want:
      assert "div.rn.f32" not in rht and "rcp.rn" not in rht


def _triton_or_none():
  try:
    import triton  # pylint: disable=g-import-not-at-top
    from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top,unused-import
    return triton
  except ImportError:
    return None


def _sm100_asm(kernel: str, tmp_path, monkeypatch) -> dict:
  """`sass_report`'s case `kernel` lowered for cc 10.0 and compiled by
  triton for sm_100a: its `asm` (`ttgir`, `ptx`, ...)."""
  from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.tools import sass_report  # pylint: disable=g-import-not-at-top
  triton = _triton_or_none()
  monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
  case = next(c for c in sass_report.cases_for((10, 0)) if c.name == kernel)
  low = sass_report.lower_case(case, (10, 0))
  path = os.path.join(tmp_path, "k.ttir")
  with open(path, "w") as f:
    f.write(low.ttir)
  return triton.compile(path, target=GPUTarget("cuda", 100, 32), options=dict(
      num_warps=low.num_warps, num_stages=low.num_stages)).asm


@pytest.mark.skipif(_triton_or_none() is None, reason="needs triton")
@pytest.mark.parametrize("kernel", ["quantize_rtne", "quantize_2d",
                                    "rht_t_rtne", "quantize_fos",
                                    "quantize_2d_fos", "rht_t_fos"])
def test_signed_e2m1_conversion_sees_one_block_per_instance(kernel, tmp_path,
                                                          monkeypatch):
  """The quantize kernels' signed E2M1 conversion tests one element of each
  4-pair instance for NaN (`e2m1_encode._encode_codes_cvt_signed_asm`): Triton's
  layout for sm_100a gives each thread 4 (or 8) consecutive pairs of a
  block, so an instance never spans two blocks. Read from the TTGIR Triton
  3.6 compiles the kernel's TTIR to (no GPU)."""
  ttgir = _sm100_asm(kernel, tmp_path, monkeypatch)["ttgir"]
  layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
  # Four-over-Six's error terms convert too (`choose_four._error_terms_asm`,
  # no NaN test: a NaN gives NaN terms whatever its code).
  asm = [l for l in ttgir.splitlines() if "cvt.rn.satfinite.e2m1x2" in l
         and "0xBC00" not in l]
  # One conversion (the columns kernel: a block's 8 pairs) or one per half
  # block (the quantize kernels' word path: pairs 0-3 and 4-7 of each block
  # as `[..., 4]` arrays), per Four-over-Six candidate.
  candidates = 2 if kernel.endswith("_fos") else 1
  assert len(asm) in (candidates, 2 * candidates), asm
  for line in asm:
    if "packed_element = 1 " in line:
      # `paired_words.scale_encode_words` (the columns kernel's codes): one
      # instance per word, its 4 pairs 8 arrays split from one block's
      # pairs (one block per instance by construction; the split is
      # checked interpreted by tests/kernels/test_kernels.py's
      # test_rht_columns_words_path), 2 words per block.
      assert "setp.nan.f32" in line, line
      assert re.search(r": tensor<[\dx]+x2xf32, #\w+>[,\s]", line), line
      continue
    assert "testp.notanumber" in line, line
    shape, name = re.search(r": tensor<([\dx]+)xf32, (#\w+)>[,\s]", line
                            ).groups()
    assert shape.split("x")[-1] == str(8 * candidates // len(asm)), shape
    layout = layouts[name]
    if layout.startswith("#ttg.linear"):  # Registers' first bases: 1, 2
      # along the last axis (an instance's 4 consecutive registers: 4 pairs
      # of it).
      regs = re.search(r"register = \[(.*?)\], lane", layout).group(1)
      bases = [[int(v) for v in b.split(",")]
               for b in re.findall(r"\[([\d, ]+)\]", regs)]
      last = [0] * (len(bases[0]) - 1)
      assert bases[:2] == [last + [1], last + [2]], layout
      continue
    per_thread = re.search(r"sizePerThread = \[([\d, ]+)\]", layout)
    assert int(per_thread.group(1).split(",")[-1]) % 4 == 0, layout


@pytest.mark.skipif(_triton_or_none() is None, reason="needs triton")
def test_rht_columns_words_row_loads_share_one_base_address(tmp_path,
                                                            monkeypatch):
  """The columns kernel's word path (sm_100a) computes one 64-bit address
  per thread for its 16 row loads, the others that address plus a
  constant (`pallas_triton._bounded`: its index maps see the program ids
  bounded by the grid, so LLVM proves the 32-bit offsets' sums in range);
  with unbounded ids each load sign-extends and adds its own offset. Read
  from the PTX Triton 3.6 compiles the kernel's TTIR to (no GPU)."""
  ptx = _sm100_asm("rht_t_rtne", tmp_path, monkeypatch)["ptx"]
  rows = re.findall(r"ld\.global\.v4\.b32 \{[^}]*\}, \[ (%rd\d+) \+ 0 \]",
                    ptx)
  assert len(rows) == 16, rows  # 8 features per thread: 16-byte rows.
  roots = set()
  for reg in rows:
    derived = re.search(rf"add\.s64\s+{reg}, (%rd\d+), \d+;", ptx)
    roots.add(derived.group(1) if derived else reg)
  assert len(roots) == 1, roots


# --- Native FP4 plans: the weight quantized as it is stored -------------------


def test_native_plan_quantizes_the_weight_once_in_its_layout(monkeypatch):
  """Under a native plan (here: `default_implementation("triton")`, which
  the CPU runs as the reference), the weight is quantized as stored
  (`[in, out]`, 16x16 tiles): the same outputs and gradients, bit for bit,
  as quantizing its FP32 transpose, and the program has no FP32 transpose
  of the weight and no transpose of codes in the backward pass."""
  from nvfp4_jax.training import dot_general as dg  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)
  dn = (((1,), (0,)), ((), ()))

  def step(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: nv.dot_general(
        x, w, dn, recipe=nv.Recipe.nvfp4(), key=jax.random.key(0)), x, w)
    return y, vjp(dy)

  def run(on):
    monkeypatch.setattr(dg, "NATIVE_KERNEL_LAYOUT", on)
    jax.clear_caches()
    with nv.default_implementation("triton"):
      out = jax.jit(step)(x, w, dy)
      jaxpr = str(jax.make_jaxpr(step)(x, w, dy))
    return out, jaxpr
  (got, text_on), (want, text_off) = run(True), run(False)
  for g, h in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(h))
  transposed = lambda text: sorted(re.findall(
      r"(\w+\[[\d,]+\]) = transpose\[", text))
  # Off: the FP32 weight's transpose (before Fprop's quantizer) and Dgrad's
  # transpose of the codes; on: only Fprop's transpose of the codes.
  assert "f32[48,64]" in transposed(text_off) and "u8[64,48]" in transposed(
      text_off)
  assert "f32[48,64]" not in transposed(text_on), transposed(text_on)
  assert [t for t in transposed(text_on) if t.startswith("u8")] == [
      "u8[48,64]"]


@needs_plugin
def test_fsdp_step_on_two_h100s_gathers_weights_once_not_activations():
  """The trainer's GPT step (tiny, BF16) compiled for a 2-GPU H100 host
  (`aot.topology_devices`) with `fsdp=2`: XLA's all-gathers carry whole
  weights only (each once), its reduce-scatters the weight gradients, and
  nothing moves all-to-all; so each device sends what data parallelism
  all-reduces (`benchmarks.aot_collectives`). (How XLA schedules the
  gathers depends on its version: jax 0.10.2's issues one async gather per
  weight, jax 0.11.2's combines them into one gather of every weight.)"""
  from benchmarks import aot_collectives
  from nvfp4_jax.sharding import hlo
  text = aot_collectives.compile_step("tiny", "bf16", 4, 64, {"fsdp": 2})
  cs = [c for c in hlo.collectives(text) if not c.trivial]
  assert len(aot.topology_devices("h100", 2)) == 2
  assert not [c for c in cs if c.op == "all-to-all"]
  gathers = [c for c in cs if c.op == "all-gather"]
  assert gathers
  gathered = sum(c.result_bytes for c in gathers)
  scattered = sum(hlo._nbytes(d, s) for c in cs if c.op == "reduce-scatter"  # pylint: disable=protected-access
                  for d, s in c.operands)
  # The 2-D weights (every parameter but the norm scales) in bf16: gathered
  # whole once, and their gradients reduce-scattered from whole.
  from models import preset
  cfg = preset("tiny")
  width = 2 * cfg.d_ff
  per_block = cfg.d_model * (4 * cfg.d_model + width + cfg.d_ff)
  weights = 2 * (cfg.num_layers * per_block + 2 * 256 * cfg.d_model)
  assert gathered == weights, (gathered, weights)
  assert scattered >= weights - 2 * 256 * cfg.d_model * 2, (scattered,
                                                              weights)


# --- Where the E2M1 conversion compiles: the probe (cc >= 10 outside
# `e2m1_encode.HW_E2M1_CCS`) ----------------------------------------------------

_CVT = "cvt.rn.satfinite.e2m1x2.f32"


def _cuda_lowering(monkeypatch, cc):
  """`lower(fn, *args)`: `fn` lowered for CUDA (nothing compiled or run),
  Pallas-Triton asked for capability `cc` where it asks the GPU."""
  from jax._src.pallas.triton import pallas_call_registration as reg  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  if hasattr(reg, "gpu_info_lib"):  # jax >= 0.11 asks the (absent) GPU.
    monkeypatch.setattr(reg, "gpu_info_lib", types.SimpleNamespace(
        get_gpu_info=lambda: types.SimpleNamespace(
            compute_capability=cc[0] * 10 + cc[1])))
  return lambda fn, *args: jax.jit(fn).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()


def test_e2m1_probe_is_not_run_without_a_gpu_to_compile_for(monkeypatch):
  """No GPU capability (CPU, unknown), below 10.0, 10.0/10.3 (known), or a
  capability with no GPU of it here and no ahead-of-time compiler: the
  probe never compiles; the software encoder except on 10.0/10.3."""
  calls = []
  monkeypatch.setattr(e2m1_encode, "_E2M1_PROBES", {})
  monkeypatch.setattr(dispatch, "compile_probe",
                      lambda *a: calls.append(a))
  local = dispatch._local_gpu()  # pylint: disable=protected-access
  local_cc = None if local is None else tuple(
      int(v) for v in str(local.compute_capability).split(".")[:2])
  with dispatch.target_device("cpu"):
    assert not e2m1_encode.hardware_e2m1()
  with dispatch.target_device("gpu"):  # Capability unknown.
    assert not e2m1_encode.hardware_e2m1()
  with dispatch.target_device("gpu", (9, 0)):
    assert not e2m1_encode.hardware_e2m1()
  for cc in ((10, 0), (10, 3)):
    with dispatch.target_device("gpu", cc):
      assert e2m1_encode.hardware_e2m1()
  for cc in ((10, 1), (11, 0), (12, 0), (12, 1)):
    if cc == local_cc:
      continue
    with dispatch.target_device("gpu", cc):
      assert dispatch.probe_target() is None
      assert not e2m1_encode.hardware_e2m1()
  assert calls == [] and e2m1_encode._E2M1_PROBES == {}  # pylint: disable=protected-access


def test_e2m1_probe_falls_back_on_a_compile_error_and_is_cached(monkeypatch):
  """A probe compile that raises (ptxas on plain sm_120) gives the
  software encoder, one that compiles the conversion; each is compiled
  once per (capability, target), on abstract arguments, and the kernels
  follow the answer. The probe runs inside the quantizer's trace: its
  compile here lowers the probe program for CUDA (no GPU), so the probe
  kernel's assembly is checked to lower from within another trace too."""
  monkeypatch.setattr(e2m1_encode, "_E2M1_PROBES", {})
  monkeypatch.setattr(e2m1_encode, "_E2M1_PROBE_ERRORS", {})
  from nvfp4_jax.ops.quantize import pallas_triton as pallas_quantize  # pylint: disable=g-import-not-at-top
  lower = _cuda_lowering(monkeypatch, (12, 0))
  calls = []

  def fails(fn, *args):
    calls.append(args)
    raise RuntimeError("ptxas: Instruction 'cvt with .e2m1x2' not supported "
                       "on .target 'sm_120'")

  def compiles(fn, *args):
    calls.append(args)
    assert _CVT in lower(fn, *args)

  x = jax.ShapeDtypeStruct((32, 256), jnp.bfloat16)
  jax.clear_caches()  # Traces are cached by function, not by target.
  try:
    with dispatch.target_device("gpu", (12, 0)):
      with dispatch.probe_compiler(("sm_120", "test"), fails):
        sw = lower(pallas_quantize.quantize, x)
        assert not e2m1_encode.hardware_e2m1()
      jax.clear_caches()
      with dispatch.probe_compiler(("sm_120a", "test"), compiles):
        hw = lower(pallas_quantize.quantize, x)
        assert e2m1_encode.hardware_e2m1()
        # Switched off: no probe, the software encoder.
        monkeypatch.setattr(e2m1_encode, "HW_E2M1", False)
        assert not e2m1_encode.hardware_e2m1()
  finally:
    jax.clear_caches()
  assert (_CVT in sw, _CVT in hw) == (False, True)
  assert "mul.rn.ftz.sat.f32" in sw  # The software encoder.
  assert len(calls) == 2, calls  # One compile per target, then cached.
  assert all(type(a) is jax.ShapeDtypeStruct for c in calls for a in c)  # pylint: disable=unidiomatic-typecheck
  [err] = e2m1_encode._E2M1_PROBE_ERRORS.values()  # pylint: disable=protected-access
  assert "sm_120" in err


@needs_plugin
@pytest.mark.parametrize("target", ["rtx-pro-6000", "gb10"])
@pytest.mark.parametrize("features, want", [
    (None, False),  # Plain sm_120 / sm_121: ptxas rejects the conversion.
    ("ACCELERATED_FEATURES", True)])  # sm_120a / sm_121a, as on the GPU.
def test_e2m1_probe_compiles_for_the_target(monkeypatch, target, features,
                                            want):
  """Ahead of time for 12.0 / 12.1: the probe compiles once for the
  target's topology (XLA's Triton pipeline and ptxas), and the 1x16, 16x16,
  RHT columns and pair quantizers compile either way, with the conversion
  exactly where the probe compiled (their Triton IR, carried in the
  optimized HLO, holds the inline assembly that goes to ptxas as is)."""
  from nvfp4_jax.ops.quantize import pallas_triton as pallas_quantize  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.quantize_pair import pallas_triton as pallas_pair  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.quantize_rht_t import pallas_triton as pallas_rht  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(e2m1_encode, "_E2M1_PROBES", {})
  monkeypatch.setattr(e2m1_encode, "_E2M1_PROBE_ERRORS", {})
  probe = dispatch.compile_probe
  calls = []

  def counted(*args):
    calls.append(args)
    return probe(*args)
  monkeypatch.setattr(dispatch, "compile_probe", counted)
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
  programs = {
      "1x16": pallas_quantize.quantize,
      "16x16": lambda x: pallas_quantize.quantize(x, block_2d=True),
      "rht": lambda x: pallas_rht.quantize_rht_t(x, amax=jnp.float32(1)),
      "pair": lambda x: pallas_pair.quantize_pair(
          x, row_rounding="nearest", t_rounding="nearest", t_rht=True,
          key_row=None, key_t=None)}
  with aot.compiling_for(target, features=features) as c:
    for name, fn in programs.items():
      post = c.compile(fn, x)
      assert (_CVT in post) == want, name
      assert "__gpu$xla.gpu.triton" in post, name
    assert e2m1_encode.hardware_e2m1() == want
  assert len(calls) == 1, calls
  if not want:
    [err] = e2m1_encode._E2M1_PROBE_ERRORS.values()  # pylint: disable=protected-access
    assert "e2m1x2" in err and f"sm_{aot.target(target).cc[0]}" in err, err
