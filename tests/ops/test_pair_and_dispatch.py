"""Dispatch between implementations and the fused pair op (issue 15, "one
definition of every numeric step"): the RHT sizes each kernel takes, SR on
any operand with its own key, `quantize_pair` against the single-operand
references, validation before dispatch (the same error from every
implementation), platform preferences and fallbacks, any token count, and
the recipe a layer runs at a step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nv
from nvfp4_jax.core import dispatch
from nvfp4_jax.ops.quantize import api as quantize_api
from nvfp4_jax.ops.quantize_pair import api as pair_api
from nvfp4_jax.ops.quantize_rht_t import api as rht_t_api
from nvfp4_jax.ops.quantize import reference as quantize_ref
from nvfp4_jax.core import prng
from nvfp4_jax.core.recipe import OPERANDS
from nvfp4_jax.core.recipe import Operand
from nvfp4_jax.ops.quantize_rht_t import config as rht_config
from nvfp4_jax.ops.quantize_rht_t import pallas_triton as pallas_rht
from quantizer_checks import (FOS_PAIRS, KEY, NO_RHT_PAIRS, PAIRS, SR,
                              SR_RHT, assert_same, heavy, jit_xla, rht_input)

T, K, N = 48, 64, 32


# -- Bug 1: the RHT kernel at sizes whose matrix is not exact in bf16. -------


@pytest.mark.parametrize("size", [16, 64])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_every_kernel_rht_size_matches_reference(size, rounding):
  x = rht_input((128, 48), jnp.bfloat16, seed=size)
  key = KEY if rounding == "stochastic" else None
  f = functools.partial(rht_t_api.quantize_rht_t, rounding=rounding, key=key,
                        size=size)
  want = jit_xla(f)(x)
  got = jax.jit(functools.partial(f, implementation="pallas"))(x)
  assert_same(got, want, f"size {size}")
  # And the reference is quantize(rht(x.T)) of that size.
  assert_same(want, jax.jit(lambda x: quantize_ref.quantize_reference(
      nv.rht(x.T, size=size), rounding=rounding, key=key))(x))


@pytest.mark.parametrize("size", [4, 32, 128])
def test_kernel_refuses_inexact_rht_sizes_and_default_falls_back(size):
  x = rht_input((128, 48), jnp.bfloat16, seed=size)
  assert size not in rht_config.SUPPORTED_SIZES
  with pytest.raises(NotImplementedError, match="Hadamard sizes"):
    rht_t_api.quantize_rht_t(x, size=size, implementation="pallas")
  with dispatch.default_implementation("pallas"):
    got = jax.jit(functools.partial(rht_t_api.quantize_rht_t, size=size))(x)
  assert_same(got, jit_xla(rht_t_api.quantize_rht_t, size=size)(x))


# -- Bug 2: a Recipe that validates runs: SR on any E2M1 operand. -----------


@pytest.mark.parametrize("operand", ["fprop_x", "fprop_w", "wgrad_x",
                                     "dgrad_w"])
def test_stochastic_rounding_on_any_operand_runs_with_its_key(operand):
  base = nv.Recipe.nvfp4(two_d_weights=operand != "dgrad_w")
  op = getattr(base, operand)
  recipe = base.replace(**{operand: Operand(
      format="nvfp4", block_2d=op.block_2d, rounding="stochastic",
      rht=op.rht)})
  x = heavy((T, K), seed=1)
  w = heavy((K, N), seed=2) * 0.05
  dy = heavy((T, N), seed=3)
  dn = (((1,), (0,)), ((), ()))

  def vjp(key):
    y, f = jax.vjp(lambda x, w: nv.dot_general(x, w, dn, recipe=recipe,
                                               key=key), x, w)
    return (y, *f(dy))
  a, b, c = (jax.jit(vjp)(jax.random.key(i)) for i in (1, 1, 2))
  for u, v in zip(a, b):
    np.testing.assert_array_equal(u, v)  # A function of the key.
  # The stochastic operand changes with the key, and only where it is used.
  changed = [bool(np.any(np.asarray(u != v))) for u, v in zip(a, c)]
  uses = {"fprop_x": (True, True, True), "fprop_w": (True, False, True),
          "wgrad_x": (False, True, True), "dgrad_w": (False, True, True)}
  # dY is stochastic in all of them: dX and dW always change with the key.
  assert changed == [uses[operand][0], True, True], changed
  # Fprop with an SR operand quantizes with exactly that operand's key.
  keys = recipe.operand_keys(jax.random.key(1))

  @jax.jit
  def fprop(x, w):
    qx = nv.quantize(x, rounding=recipe.fprop_x.rounding, key=keys["fprop_x"])
    qw = nv.quantize(w.T, block_2d=recipe.fprop_w.block_2d,
                     rounding=recipe.fprop_w.rounding, key=keys["fprop_w"])
    return nv.block_scaled_matmul(qx, qw, implementation="xla")
  np.testing.assert_array_equal(a[0], fprop(x, w))


def test_forward_sr_without_key_is_a_clear_error():
  recipe = nv.Recipe.nvfp4().replace(fprop_x=SR)
  with pytest.raises(ValueError, match="forward operand stochastically"):
    nv.dot_general(jnp.ones((16, 32)), jnp.ones((32, 16)),
                   (((1,), (0,)), ((), ())), recipe=recipe)


def test_operand_keys_are_distinct_and_none_for_nearest():
  recipe = nv.Recipe.nvfp4()
  keys = recipe.operand_keys(jax.random.key(0))
  assert {op for op, k in keys.items() if k is not None} == {
      "dgrad_dy", "wgrad_dy"}
  every = nv.Recipe(**{op: SR for op in ("fprop_x", "fprop_w", "dgrad_dy",
                                         "dgrad_w", "wgrad_dy")},
                    wgrad_x=SR)
  data = [tuple(np.asarray(jax.random.key_data(k)))
          for k in every.operand_keys(jax.random.key(0)).values()]
  assert len(set(data)) == 6
  # Operand i streams with row i of one draw of the layer key's bits: the
  # seeds key's data are the seed words the quantizers use, unhashed.
  words = np.asarray(jax.random.bits(jax.random.key(0), (6, 2), jnp.uint32))
  every_keys = every.operand_keys(jax.random.key(0))
  for i, op in enumerate(OPERANDS):
    k = every_keys[op]
    assert jax.random.key_impl(k) == jax.random.key_impl(prng.seeds_key(
        jnp.zeros(2, jnp.uint32)))
    assert np.array_equal(np.asarray(prng.seeds_from_key(k)), words[i]), op
  assert np.array_equal(np.asarray(prng.seeds_from_key(keys["dgrad_dy"])),
                        words[2])
  # A seeds key draws nothing but its seed words.
  with pytest.raises(TypeError, match="draws nothing else"):
    jax.random.uniform(keys["dgrad_dy"], (3,))


# -- The pair op: one dispatch, the kernel refuses what it cannot fuse. ------


@pytest.mark.parametrize("pair", range(len(PAIRS)))
def test_quantize_pair_matches_single_operand_references(pair):
  row, wgrad = PAIRS[pair]
  x = rht_input((64, 48), jnp.bfloat16, seed=pair)
  kr, kt = prng.pair_keys(KEY)
  f = functools.partial(pair_api.quantize_pair, row=row, wgrad=wgrad,
                        key_row=kr, key_t=kt)
  want_row = want_t = None
  if row.quantized:
    want_row = jax.jit(lambda x: quantize_ref.quantize_reference(
        x, rounding=row.rounding, key=kr if row.rounding == "stochastic"
        else None))(x)
  if wgrad.quantized:
    want_t = jit_xla(rht_t_api.quantize_rht_t, rounding=wgrad.rounding,
                     key=kt if wgrad.rounding == "stochastic" else None)(x)
  for impl in ("xla", "pallas"):
    q_row, q_t = jax.jit(functools.partial(f, implementation=impl))(x)
    for got, want in ((q_row, want_row), (q_t, want_t)):
      if want is None:
        assert got is None, impl
      else:
        assert_same(got, want, impl)


def _kernel_and_reference_pair(x, row, wgrad, key_row, key_t):
  """`quantize_pair` of `x` by the Pallas kernels and by the reference."""
  f = functools.partial(pair_api.quantize_pair, row=row, wgrad=wgrad,
                        key_row=key_row, key_t=key_t)
  return (jax.jit(functools.partial(f, implementation="pallas"))(x),
          jax.jit(functools.partial(f, implementation="xla"))(x))


@pytest.mark.parametrize("pair", range(len(FOS_PAIRS)))
def test_pair_kernel_four_over_six_matches_reference(pair):
  """Four-over-Six operands in the fused pair kernels, bit for bit (no
  fallback to the reference), and different from the 6-only encoding."""
  row, wgrad = FOS_PAIRS[pair]
  x = heavy((64, 48), jnp.bfloat16, seed=10 + pair)
  kr, kt = prng.pair_keys(KEY)
  got, want = _kernel_and_reference_pair(x, row, wgrad, kr, kt)
  for g, w, op in zip(got, want, (row, wgrad)):
    if not op.quantized:
      assert g is None and w is None
      continue
    assert_same(g, w)
    assert g.four_over_six == op.four_over_six
  if row.quantized:  # The reference pair's row is `quantize`'s reference.
    assert_same(want[0], jax.jit(lambda x: quantize_ref.quantize_reference(
        x, rounding=row.rounding, four_over_six=row.four_over_six,
        key=kr if row.rounding == "stochastic" else None))(x))
  if wgrad.quantized:
    plain = jax.jit(lambda x: pair_api.quantize_pair(
        x, Operand(format="bf16"), Operand(format="nvfp4", rht=True,
                                           rounding=wgrad.rounding),
        key_t=kt, implementation="pallas")[1])(x)
    assert not np.array_equal(np.asarray(plain.scales.astype(jnp.float32)),
                              np.asarray(got[1].scales.astype(jnp.float32)))


@pytest.mark.parametrize("pair", range(len(NO_RHT_PAIRS)))
def test_pair_kernel_without_rht_matches_reference(pair):
  """The `--no-rht` ablation's pairs run the 1x16 kernel on `x.T` (no
  fallback to the reference) and equal `quantize_reference(x.T)` bit for bit,
  SR stream included."""
  row, wgrad = NO_RHT_PAIRS[pair]
  x = heavy((64, 48), jnp.bfloat16, seed=30 + pair)
  kr, kt = prng.pair_keys(KEY)
  got, want = _kernel_and_reference_pair(x, row, wgrad, kr, kt)
  for g, w in zip(got, want):
    assert (g is None) == (w is None)
    if g is not None:
      assert_same(g, w)
  assert_same(want[1], jax.jit(lambda x: quantize_ref.quantize_reference(
      x.T, rounding=wgrad.rounding, four_over_six=wgrad.four_over_six,
      key=kt if wgrad.rounding == "stochastic" else None))(x))
  assert got[1].shape == (48, 64)


@pytest.mark.parametrize("row,wgrad", [
    (Operand(format="mxfp4"), Operand(format="mxfp4")),
    (Operand(format="nvfp4", block_2d=True), Operand(format="nvfp4")),
])
def test_pair_kernel_refuses_unfusable_pairs_and_default_falls_back(row, wgrad):
  x = heavy((64, 64), jnp.bfloat16, seed=4)
  with pytest.raises(NotImplementedError, match="pair kernels"):
    pair_api.quantize_pair(x, row, wgrad, implementation="pallas")
  with dispatch.default_implementation("pallas"):
    got = jax.jit(lambda x: pair_api.quantize_pair(x, row, wgrad))(x)
  want = jax.jit(lambda x: pair_api.quantize_pair(x, row, wgrad,
                                               implementation="xla"))(x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g).reshape(-1).view(np.uint8),
                                  np.asarray(w).reshape(-1).view(np.uint8))


# -- Validation once, before dispatch: the same error from every impl. -------


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("call,match", [
    (lambda impl: rht_t_api.quantize_rht_t(jnp.ones((32, 32)), amax=jnp.ones(2),
                                       implementation=impl), "amax must be"),
    (lambda impl: rht_t_api.quantize_rht_t(jnp.ones((40, 32)),
                                       implementation=impl), "token count 40"),
    (lambda impl: rht_t_api.quantize_rht_t(jnp.ones((32, 32)), rounding="sr",
                                       implementation=impl), "unknown rounding"),
    (lambda impl: pair_api.quantize_pair(jnp.ones((32, 32)), SR, SR_RHT,
                                      implementation=impl), "needs a key"),
    (lambda impl: quantize_api.quantize_with_values(jnp.ones((32, 40)),
                                             implementation=impl),
     "not a multiple of 16"),
    (lambda impl: nv.quantize(jnp.ones((32, 32)), amax=jnp.ones(3),
                              implementation=impl), "amax must be"),
])
def test_validation_is_the_same_for_every_implementation(impl, call, match):
  with pytest.raises(ValueError, match=match):
    call(impl)


def test_one_platform_preference_for_every_op():
  from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
  ops = [quantize_api.QUANTIZE, rht_t_api.QUANTIZE_RHT_T, pair_api.QUANTIZE_PAIR,
         quantize_api.QUANTIZE_WITH_VALUES, gemm_api.VALUES_MATMUL]
  for op in ops:
    assert op.preferred is None, op.name  # All read dispatch.PREFERRED.
    assert "xla" in op.implementations and "pallas" in op.implementations
  # The GEMM adds native FP4 on Blackwell and otherwise reads PREFERRED too.
  assert gemm_api.gemm_preference("gpu", (9, 0)) == dispatch.PREFERRED["gpu"]
  assert gemm_api.gemm_preference("cpu", None) == ()


@pytest.mark.parametrize("cc,order", [
    ((9, 0), ("pallas", "xla")),
    ((10, 0), ("scaled_matmul", "triton", "pallas", "xla")),
    ((12, 0), ("triton", "scaled_matmul", "pallas", "xla")),
    (None, ("pallas", "xla")),
])
def test_gemm_default_is_native_fp4_on_blackwell(monkeypatch, cc, order):
  from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
  monkeypatch.setattr(dispatch, "platform", lambda: "gpu")
  monkeypatch.setattr(dispatch, "compute_capability", lambda: cc)
  assert gemm_api.BLOCK_SCALED_MATMUL.order() == order
  # Quantizers keep the Pallas kernels on every GPU.
  assert quantize_api.QUANTIZE.order() == ("pallas", "xla")


def test_native_paths_fall_back_where_they_cannot_run(monkeypatch):
  """On a (mocked) Blackwell without jax-triton or cuDNN lowering, the
  default GEMM falls back to the emulation: same result as the reference."""
  from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
  # The operands are quantized for the device that is here: a quantizer
  # traced for a mocked Blackwell would compile Blackwell's E2M1
  # conversion for this GPU (ptxas refuses it on sm_90a).
  a = jax.jit(nv.quantize)(heavy((32, 64), seed=1))
  b = jax.jit(nv.quantize)(heavy((16, 64), seed=2))
  monkeypatch.setattr(dispatch, "compute_capability", lambda: (10, 0))
  monkeypatch.setattr(dispatch, "platform", lambda: "gpu")

  def refuse(*args, **kwargs):
    raise NotImplementedError("not here")
  impls = dict(gemm_api.BLOCK_SCALED_MATMUL.implementations,
               scaled_matmul=refuse, triton=refuse)
  op = dispatch.Op("block_scaled_matmul", impls,
                   gemm_api.BLOCK_SCALED_MATMUL.preferred)
  assert op.order()[:2] == ("scaled_matmul", "triton")
  got = jax.jit(lambda a, b: op(None, a, b, out_dtype=jnp.float32))(
      a, b)  # "pallas", interpreted.
  np.testing.assert_array_equal(got, jax.jit(functools.partial(
      gemm_api.block_scaled_matmul, implementation="xla"))(a, b))


# -- Forward-only use at any token count; Wgrad operands padded inside. ------


@pytest.mark.parametrize("tokens", [1, 47])  # One token; a partial block.
def test_any_token_count_forward_and_backward(tokens):
  recipe = nv.Recipe.nvfp4()
  x = heavy((tokens, K), seed=tokens)
  w = heavy((K, N), seed=5) * 0.05
  dy = heavy((tokens, N), seed=6)
  dn = (((1,), (0,)), ((), ()))
  key = jax.random.key(0)

  @jax.jit  # The layer, one program; its composition from the ops, another.
  def layer(x, w, dy):
    y = nv.dot_general(x, w, dn, recipe=recipe)  # Forward needs no key.
    _, f = jax.vjp(lambda x, w: nv.dot_general(x, w, dn, recipe=recipe,
                                               key=key), x, w)
    return (y, *f(dy))

  @jax.jit
  def composed(x, w, dy):
    qx = nv.quantize(x)
    qw = nv.quantize(w.T, block_2d=True)
    y = nv.block_scaled_matmul(qx, qw)
    # Backward: the Wgrad operands are padded with zero tokens, which change
    # neither their amax nor the product: dW equals the GEMM of the padded
    # operands, and dX the Dgrad of the unpadded dY.
    pad = -tokens % 16
    xp, dyp = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, dy))
    keys = recipe.operand_keys(key)
    qxt = rht_t_api.quantize_rht_t(xp)
    qdyt = rht_t_api.quantize_rht_t(dyp, rounding="stochastic",
                                key=keys["wgrad_dy"])
    dw = nv.block_scaled_matmul(qxt, qdyt)
    qdy = nv.quantize(dyp, rounding="stochastic", key=keys["dgrad_dy"])
    dx = nv.block_scaled_matmul(qdy, qw.T)[:tokens]
    return y, dx, dw

  for got, want in zip(layer(x, w, dy), composed(x, w, dy)):
    np.testing.assert_array_equal(got, want)


def test_mismatched_contraction_is_a_clear_error():
  with pytest.raises(ValueError, match=r"contracting dims do not match.*"
                     r"\(16, 32\).*\(48, 16\)"):
    nv.dot_general(jnp.ones((16, 32)), jnp.ones((48, 16)),
                   (((1,), (0,)), ((), ())), recipe=nv.Recipe.nvfp4())


# -- One place decides a layer's recipe at a step. ----------------------------


def test_recipe_at_applies_rules_and_late_switch():
  rules = nv.PrecisionRules(
      rules=((r"^head", nv.Recipe.bf16()),),
      late_switch=nv.LateSwitch(step=10, mode="forward"))
  assert rules.recipe_at("block/up") == nv.Recipe.nvfp4()
  assert rules.recipe_at("block/up", 9) == nv.Recipe.nvfp4()
  assert rules.recipe_at("block/up", 10) == nv.Recipe.bf16_forward()
  assert rules.recipe_at("head", 10) == nv.Recipe.bf16()
  own = nv.Recipe.mxfp4()
  assert rules.recipe_at("head", 3, recipe=own) == own
  assert rules.recipe_at("head", 12, recipe=own) == own.with_bf16_forward()
  assert nv.PrecisionRules.high_precision().recipe_at("x", 5) == nv.Recipe.bf16()
