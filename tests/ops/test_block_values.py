"""Operands as block values (`NVFP4Values`): the quantizers write the bf16
block values of the operands the emulated GEMM multiplies at once, instead of
codes and scales that a dequantize pass would decode right after.

The values are the codes' exact decoding (`fp4 * f32(scale)`), so everything
here is bit-exact: values == `block_dequantize(codes)`, and a layer's outputs
and gradients are those of the codes path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nv
from nvfp4_jax.core import dispatch
from nvfp4_jax.ops.quantize_pair import api as pair_api
from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
from nvfp4_jax.ops.block_values import api as values_api
from nvfp4_jax.training import dot_general as ops
from nvfp4_jax.core import prng
from nvfp4_jax.core.arrays import NVFP4Values
from nvfp4_jax.core.recipe import Operand
from quantizer_checks import (FOS_PAIRS, KEY, NO_RHT_PAIRS, PAIRS, f32_bits,
                              heavy, rht_input)


def bf16_bits(a) -> np.ndarray:
  return np.asarray(a).view(np.uint16)


def assert_values_of(got: NVFP4Values, codes: nv.NVFP4Array, what=""):
  """`got` holds exactly the block values of `codes` (bits), same amax."""
  assert isinstance(got, NVFP4Values), (what, type(got))
  assert got.four_over_six == codes.four_over_six, what
  assert got.shape == codes.shape, what
  np.testing.assert_array_equal(bf16_bits(got.values),
                                bf16_bits(nv.block_dequantize(codes)[0]),
                                err_msg=f"{what}: values differ")
  np.testing.assert_array_equal(f32_bits(got.amax), f32_bits(codes.amax),
                                err_msg=f"{what}: amax differs")


ALL_PAIRS = ([("pair", i) for i in range(len(PAIRS))]
             + [("fos", i) for i in range(len(FOS_PAIRS))]
             + [("no_rht", i) for i in range(len(NO_RHT_PAIRS))])


def _pair(kind, i):
  return {"pair": PAIRS, "fos": FOS_PAIRS, "no_rht": NO_RHT_PAIRS}[kind][i]


def _pair_cases():
  """Every (pair, implementation). The fast tier keeps the first case of
  each kind on both paths and every fused pair's kernel; the rest run in
  the slow tier (the CPU suite's budget)."""
  for kind, i in ALL_PAIRS:
    for impl in ("xla", "pallas"):
      fast = i == 0 or (impl == "pallas" and kind == "pair")
      yield pytest.param(kind, i, impl, id=f"{kind}-{i}-{impl}",
                         marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("kind,i,impl", _pair_cases())
def test_pair_values_are_the_codes_block_values(impl, kind, i):
  """Every pair kernel (fused RTNE pair, split SR pair, RHT'd operand alone,
  the no-RHT 1x16 route, Four-over-Six) writes the values of the codes it
  would write, for each operand asked as values and in each combination."""
  row, wgrad = _pair(kind, i)
  x = (rht_input if kind == "pair" else heavy)((64, 48), jnp.bfloat16,
                                                seed=40 + i)
  kr, kt = prng.pair_keys(KEY)
  f = functools.partial(pair_api.quantize_pair, row=row, wgrad=wgrad,
                        key_row=kr, key_t=kt, implementation=impl)
  codes = jax.jit(f)(x)
  modes = [(True, True)]
  if kind == "pair" and row.quantized and wgrad.quantized:
    modes += [(True, False), (False, True)]  # The recipe's X pair is (T, F).
  for values in modes:
    got = jax.jit(functools.partial(f, values=values))(x)
    for g, c, op, as_values in zip(got, codes, (row, wgrad), values):
      if not op.quantized:
        assert g is None
      elif as_values:
        assert_values_of(g, c, f"{kind}{i} {values}")
      else:
        assert isinstance(g, nv.NVFP4Array)
        np.testing.assert_array_equal(np.asarray(g.codes),
                                      np.asarray(c.codes))


def test_values_need_nvfp4():
  x = heavy((64, 64), jnp.bfloat16, seed=1)
  with pytest.raises(ValueError, match="values=True for the row operand "
                     "needs the nvfp4 format, got 'mxfp4'"):
    pair_api.quantize_pair(x, Operand(format="mxfp4"), Operand(format="mxfp4"),
                        values=(True, False))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_gemm_on_values_equals_gemm_on_codes(impl):
  a = nv.quantize(heavy((32, 64), jnp.bfloat16, seed=2))
  b = nv.quantize(heavy((48, 64), jnp.bfloat16, seed=3), block_2d=True)
  va = NVFP4Values(nv.block_dequantize(a)[0], a.amax)
  vb = NVFP4Values(nv.block_dequantize(b)[0], b.amax)
  want = jax.jit(functools.partial(nv.block_scaled_matmul,
                                   implementation=impl))(a, b)
  mm = jax.jit(functools.partial(nv.block_scaled_matmul, implementation=impl))
  for x, y in ((va, b), (a, vb), (va, vb)):
    np.testing.assert_array_equal(f32_bits(mm(x, y)), f32_bits(want))
  # dequantize/block_dequantize read values like codes.
  np.testing.assert_array_equal(np.asarray(nv.dequantize(va)),
                                np.asarray(nv.dequantize(a)))


def test_gemm_on_values_refuses_native_paths_and_mx():
  a = nv.quantize(heavy((32, 64), jnp.bfloat16, seed=2))
  va = NVFP4Values(nv.block_dequantize(a)[0], a.amax)
  for impl in ("triton", "scaled_matmul"):
    with pytest.raises(ValueError, match="holds block values"):
      nv.block_scaled_matmul(va, a, implementation=impl)
  mx = nv.quantize_mx(heavy((32, 64), jnp.bfloat16, seed=3), "mxfp4")
  with pytest.raises(TypeError, match="multiplies an NVFP4 operand, got "
                     "MXArray"):
    nv.block_scaled_matmul(va, mx)


@pytest.mark.parametrize("cc,values", [(None, True), ((9, 0), True),
                                       ((10, 0), False), ((12, 0), False)])
def test_values_only_where_the_gemm_is_emulated(monkeypatch, cc, values):
  """Blackwell's native GEMMs read the codes: no values are asked there."""
  monkeypatch.setattr(dispatch, "platform", lambda: "gpu" if cc else "cpu")
  monkeypatch.setattr(dispatch, "compute_capability", lambda: cc)
  assert gemm_api.consumes_values() is values
  with dispatch.default_implementation("triton"):
    assert not gemm_api.consumes_values()
  with dispatch.default_implementation("xla"):
    assert gemm_api.consumes_values()


@pytest.mark.parametrize("recipe", [
    nv.Recipe.nvfp4(),
    pytest.param(nv.Recipe.nvfp4(stochastic_rounding=False),
                 marks=pytest.mark.slow),
    pytest.param(nv.Recipe.nvfp4(four_over_six="all"),
                 marks=pytest.mark.slow),  # Also with values, below.
    nv.Recipe.nvfp4(four_over_six="all", residuals="values")])
def test_layer_bit_equal_to_the_codes_path(monkeypatch, recipe):
  """Outputs and gradients of the values path equal those with every
  operand as codes (the values switched off), bit for bit; with
  `residuals="values"` the saved operands are values too."""
  x = heavy((48, 64), jnp.bfloat16, seed=5)
  w = heavy((64, 32), jnp.float32, seed=6) * 0.1

  def run():
    def f(x, w):
      y = nv.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=recipe,
                         key=jax.random.key(7))
      return jnp.sum(y.astype(jnp.float32) * jnp.linspace(-1, 1, 32))
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)

  got = run()
  plan = ops.gemm_plan
  monkeypatch.setattr(ops, "gemm_plan", lambda *a, **k: dataclasses.replace(
      plan(*a, **k), values=False))
  monkeypatch.setattr(ops, "saved_residuals", lambda *a: "codes")
  want = run()
  for g, wv in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g, np.float32),
                                  np.asarray(wv, np.float32))
  assert np.any(np.asarray(got[1][0]) != 0)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_values_residuals_are_saved_and_multiplied_undecoded(monkeypatch,
                                                             impl):
  """`Recipe(residuals="values")`: the forward pass saves Wgrad's
  `q(rht(X^T))` and Dgrad's weight as bf16 block values, and the backward
  pass decodes nothing; with "codes" it saves codes and scales and decodes
  both (one `BLOCK_VALUES` call each). Gradients are equal bit for bit."""
  x = heavy((48, 64), jnp.bfloat16, seed=8)
  w = heavy((64, 32), jnp.float32, seed=9) * 0.1
  dy = heavy((48, 32), jnp.float32, seed=10)  # y is FP32, as w is.
  decoded = []
  block_values = values_api.BLOCK_VALUES
  monkeypatch.setattr(gemm_api, "BLOCK_VALUES", lambda impl, q: (
      decoded.append(q.shape), block_values(impl, q))[1])
  grads, saved = {}, {}
  for residuals in ("codes", "values"):
    recipe = nv.Recipe.nvfp4(residuals=residuals)
    with nv.default_implementation(impl):
      _, vjp = jax.vjp(lambda x, w: nv.dot_general(
          x, w, (((1,), (0,)), ((), ())), recipe=recipe,
          key=jax.random.key(7)), x, w)
      saved[residuals] = {(str(a.dtype), a.shape)
                          for a in jax.tree.leaves(vjp) if a.ndim == 2}
      decoded.clear()
      grads[residuals] = jax.jit(vjp)(dy)
      saved[residuals, "decoded"] = sorted(decoded)
  # q(rht(X^T)) is [in, tokens], the weight's values [in, out].
  assert {("bfloat16", (64, 48)), ("bfloat16", (64, 32))} <= saved["values"]
  assert not [s for s in saved["values"] if s[0] in ("uint8", "float8_e4m3fn")]
  assert ("uint8", (64, 24)) in saved["codes"]  # q(rht(X^T))'s codes.
  assert ("uint8", (64, 16)) in saved["codes"]  # The weight's codes.
  assert saved["values", "decoded"] == []
  assert saved["codes", "decoded"] == [(64, 32), (64, 48)]
  for g, want in zip(grads["values"], grads["codes"]):
    np.testing.assert_array_equal(np.asarray(g, np.float32),
                                  np.asarray(want, np.float32))


def test_residuals_choice_is_validated():
  with pytest.raises(ValueError, match="unknown residuals 'bf16'; use "
                     "'codes'"):
    nv.Recipe.nvfp4(residuals="bf16")
  assert "values" in repr(nv.Recipe.nvfp4(residuals="values"))


def test_residuals_choice_is_resolved_with_the_gemm_backend():
  """`gemm_plan` decides once, from the platform it is given, and the layer
  its residuals from it (`saved_residuals`): the emulation (Hopper, CPU)
  multiplies values and saves them on request; a native FP4 GEMM
  (Blackwell) multiplies codes, so "values" saves codes and says so."""
  hopper = gemm_api.gemm_plan(platform="gpu", cc=(9, 0))
  assert (hopper.backend, hopper.values,
          ops.saved_residuals("values", hopper)) == ("pallas", True, "values")
  cpu = gemm_api.gemm_plan(platform="cpu", cc=None)
  assert (cpu.backend, cpu.values, ops.saved_residuals("values", cpu)) == (
      "xla", True, "values")
  b200 = gemm_api.gemm_plan(platform="gpu", cc=(10, 0))
  with pytest.warns(UserWarning, match="residuals='values'.*saves codes"):
    b200_residuals = ops.saved_residuals("values", b200)
  assert (b200.backend, b200.values, b200_residuals) == (
      "scaled_matmul", False, "codes")
  # A default_implementation block overrides the platform's preference.
  assert gemm_api.gemm_plan(platform="gpu", cc=(10, 0), impl="xla").values
