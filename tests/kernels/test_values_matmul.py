"""The emulated GEMM's Mosaic GPU kernel (`pallas_kernels.values_matmul`).

On the CPU the kernel is lowered for CUDA (layouts, wgmma shapes and shared
memory are checked there) and the dispatch is checked to fall back to the
reference. On a Hopper GPU it is compiled and compared with the reference.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax.core import dispatch
from nvfp4_jax.ops.quantize import api as quantize_api
from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
from nvfp4_jax.ops.block_scaled_matmul import reference as gemm_ref
from nvfp4_jax.ops.block_scaled_matmul import pallas_mosaic_gpu as vm
from tests.kernels.test_kernels import heavy

ON_HOPPER = (jax.default_backend() == "gpu"
             and dispatch.compute_capability() is not None
             and dispatch.compute_capability()[0] == 9)
HOPPER_ONLY = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")

# GPT base (16 x 1024 tokens): [M, K] x [K, N] of Fprop, Dgrad and Wgrad.
FPROP_DGRAD = ((16384, 768, 2304), (16384, 768, 768), (16384, 768, 4096),
               (16384, 2048, 768), (16384, 2304, 768), (16384, 4096, 768),
               (16384, 768, 2048))
WGRAD = ((768, 16384, 2304), (768, 16384, 768), (768, 16384, 4096),
         (2048, 16384, 768))


def test_supported_takes_full_waves_of_output_tiles_only():
  """The kernel takes the Fprop and Dgrad shapes (hundreds of 128 x 256
  tiles) and turns down Wgrad's (K = tokens, under one wave of 132 SMs),
  where XLA's split-K GEMM was measured faster, and shapes off its tiles."""
  assert all(vm.supported(m, n, k) for m, k, n in FPROP_DGRAD)
  assert not any(vm.supported(m, n, k) for m, k, n in WGRAD)
  assert not vm.supported(16384, 768 + 64, 768)   # N off the 256 tile.
  assert not vm.supported(16384, 768, 768 + 32)   # K off the 64 step.
  assert not vm.supported(16384 + 64, 768, 768)   # M off the 128 tile.
  assert vm.supported(16384, 768, 768, vm.Config(wg_split_n=False))


@pytest.mark.parametrize("vb_kn", [False, True])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_hopper(vb_kn, out_dtype):
  """Both layouts of `vb` and both outputs lower for CUDA (shared memory
  fits: FP32 epilogue tiles take a pipeline stage's room)."""
  m, k, n = 4096, 512, 2048
  args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
          jax.ShapeDtypeStruct((k, n) if vb_kn else (n, k), jnp.bfloat16),
          jax.ShapeDtypeStruct((), jnp.float32))
  for cfg in (vm.Config(), vm.Config(wg_split_n=False)):
    f = jax.jit(functools.partial(vm.values_matmul, out_dtype=out_dtype,
                                  vb_kn=vb_kn, config=cfg, num_sms=132))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    # alpha goes in as the 0-d scalar it is, read by the kernel's epilogue:
    # no broadcast (a kernel launch of its own on the GPU) before the call.
    assert "stablehlo.broadcast_in_dim" not in text


def test_refuses_what_it_does_not_run():
  a = jnp.ones((4096, 512), jnp.bfloat16)
  b = jnp.ones((2048, 512), jnp.bfloat16)
  kw = dict(num_sms=132)
  with pytest.raises(NotImplementedError, match="bf16 operands only"):
    vm.values_matmul(a.astype(jnp.float32), b, jnp.float32(1), **kw)
  with pytest.raises(NotImplementedError, match="out_dtype"):
    vm.values_matmul(a, b, jnp.float32(1), out_dtype=jnp.float16, **kw)
  with pytest.raises(NotImplementedError, match="XLA's GEMM runs it"):
    vm.values_matmul(a[:256], b, jnp.float32(1), **kw)


def test_dispatch_falls_back_to_the_reference_off_hopper(monkeypatch):
  """`implementation=None` runs the reference where the kernel cannot run
  (the CPU; a mocked Blackwell), with the reference's result; an explicit
  "pallas" there says why and names the fix."""
  va = jnp.asarray(heavy((64, 128), seed=1), jnp.bfloat16)
  vb = jnp.asarray(heavy((32, 128), seed=2), jnp.bfloat16)
  alpha = jnp.float32(0.75)
  want = gemm_api.block_values_matmul(va, vb, alpha, implementation="xla")
  if jax.default_backend() != "gpu":
    with pytest.raises(NotImplementedError, match="implementation='xla'"):
      gemm_api.block_values_matmul(va, vb, alpha, implementation="pallas")
  monkeypatch.setattr(dispatch, "compute_capability", lambda: (10, 0))
  got = gemm_api.block_values_matmul(va, vb, alpha)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  if jax.default_backend() != "gpu":  # A claimed Hopper with no GPU device.
    monkeypatch.setattr(dispatch, "platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "compute_capability", lambda: (9, 0))
    big_a = jnp.zeros((4096, 128), jnp.bfloat16)
    big_b = jnp.zeros((4096, 128), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="no GPU device"):
      gemm_api.block_values_matmul(big_a, big_b, alpha, implementation="pallas")
    got = gemm_api.block_values_matmul(va, vb, alpha)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _operands(m, k, n, vb_kn, seed):
  """Block values of heavy-tailed tensors, as the quantizers write them."""
  qa, va = quantize_api.quantize_with_values(heavy((m, k), seed=seed))
  qb, vb = quantize_api.quantize_with_values(heavy((n, k), seed=seed + 1),
                                      block_2d=True)
  return va, (vb.T if vb_kn else vb), gemm_ref.gemm_alpha(qa, qb)


def _tolerance(va, vb, alpha, vb_kn, out_dtype):
  """Where the kernel and XLA may differ: both sum K exact FP32 products
  (bf16 x bf16), in different orders. Each order's error is at most
  (K - 1) u sum|a b| (u = 2^-24, first-order bound of recursive summation),
  so the two differ by at most twice that, times alpha; a bf16 output can
  then round to neighbours: one bf16 ulp (2^-7 relative) more."""
  a = np.abs(np.asarray(va, np.float32))
  b = np.abs(np.asarray(vb, np.float32))
  mag = a @ (b if vb_kn else b.T)
  k = va.shape[1]
  tol = 2 * (k - 1) * 2.0**-24 * mag * float(alpha)
  return tol, (2.0**-7 if out_dtype == jnp.bfloat16 else 0.0)


@HOPPER_ONLY
@pytest.mark.parametrize("m,k,n", [(16384, 768, 2304), (16384, 2048, 768),
                                   (8192, 1024, 4096)])
@pytest.mark.parametrize("vb_kn,out_dtype", [(True, jnp.bfloat16),
                                             (False, jnp.float32),
                                             (False, jnp.bfloat16)])
def test_equals_the_reference_on_hopper(m, k, n, vb_kn, out_dtype):
  va, vb, alpha = _operands(m, k, n, vb_kn, seed=m + k + n)
  got = np.asarray(vm.values_matmul(va, vb, alpha, out_dtype=out_dtype,
                                    vb_kn=vb_kn), np.float32)
  want = np.asarray(gemm_api.block_values_matmul(
      va, vb, alpha, out_dtype=out_dtype, vb_kn=vb_kn,
      implementation="xla"), np.float32)
  tol, rel = _tolerance(va, vb, alpha, vb_kn, out_dtype)
  assert np.all(np.abs(got - want) <= tol + rel * np.abs(want))


@HOPPER_ONLY
def test_default_runs_the_kernel_on_hopper_and_propagates_nan_inf():
  """Switched on by default for a large output (the compiled program calls
  the Mosaic GPU kernel, no XLA GEMM), and NaN/Inf in an operand reach the
  output rows they touch."""
  m, k, n = 16384, 768, 2304
  va, vb, alpha = _operands(m, k, n, False, seed=7)
  va = va.at[3, 5].set(jnp.nan).at[9, 1].set(jnp.inf)
  f = jax.jit(lambda a, b, s: gemm_api.block_values_matmul(a, b, s))
  hlo = f.lower(va, vb, alpha).compile().as_text()
  assert "mosaic_gpu" in hlo and "gemm_fusion" not in hlo
  out = np.asarray(f(va, vb, alpha))
  assert np.all(np.isnan(out[3])) and not np.isnan(out[2]).any()
  row = out[9]
  assert np.all(np.isnan(row) | np.isinf(row))


def test_identical_calls_trace_and_lower_the_kernel_once():
  """Every layer of a model calls the Mosaic GPU kernels with the same shapes
  and configuration; each kernel is jitted per static configuration, so
  those calls share one traced kernel (one jaxpr object: JAX lowers it once
  and calls it from each site; the `moe-small` step for an H100 lowered 16
  kernels instead of 64, 18 s instead of 41). Traced on the CPU with the
  H100's SM count; nothing runs."""
  from nvfp4_jax.ops.ragged_dot import pallas_mosaic_gpu as rm
  spec = jax.ShapeDtypeStruct
  va, w = spec((256, 128), jnp.bfloat16), spec((4, 128, 256), jnp.bfloat16)
  dense_a, dense_b = spec((8192, 768), jnp.bfloat16), spec((4096, 768),
                                                           jnp.bfloat16)
  gs = jnp.asarray([64, 0, 128, 64], jnp.int32)

  def f(va, w, a, b):
    return (rm.ragged_values_matmul(va, w, gs, num_sms=132),
            rm.ragged_values_matmul(va + 1, w, gs, num_sms=132),
            rm.ragged_values_matmul_t(va, va, gs, num_sms=132),
            rm.ragged_values_matmul_t(va + 1, va, gs, num_sms=132),
            vm.values_matmul(a, b, jnp.float32(1), num_sms=132),
            vm.values_matmul(a + 1, b, jnp.float32(2), num_sms=132))

  eqns = jax.make_jaxpr(f)(va, w, dense_a, dense_b).jaxpr.eqns
  calls = {}
  for e in eqns:
    if e.params.get("name") in ("_fprop_call", "_wgrad_call", "_call"):
      calls.setdefault(e.params["name"], []).append(e.params["jaxpr"])
  assert sorted(calls) == ["_call", "_fprop_call", "_wgrad_call"], calls
  for name, jaxprs in calls.items():
    assert len(jaxprs) == 2 and jaxprs[0] is jaxprs[1], name
