"""`nvfp4_jax.ragged_dot`: the mixture-of-experts GEMM equals a loop of
`nvfp4_jax.dot_general` over the experts, bit for bit on the reference.

The definition (training/ragged_dot.py): expert `e`'s rows go through
`dot_general(x[rows_e], w[e], recipe, key=fold_in(key, e))`. On the CPU both
sides multiply the same exact bf16 block values with XLA's dot, which sums a
row's products in the same order for any row count of two or more, so the
outputs and gradients are compared with `==`; a group of one token is
multiplied by XLA:CPU's matrix-vector path in the loop, whose summation
order differs: there the bound is the FP32 summation bound
`K * 2^-24 * sum |a_k b_k|` (the products are exact).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nv
from nvfp4_jax.core.recipe import Operand
from nvfp4_jax.ops.ragged_dot import api as rg
from nvfp4_jax.ops.ragged_quantize import api as rq

DN = (((1,), (0,)), ((), ()))


def heavy(rng, shape, scale=1.0):
  """Heavy-tailed values (Student t, 3 dof), as activations and gradients."""
  return jnp.asarray(rng.standard_t(3, shape) * scale, jnp.float32)


def run(x, w, gs, recipe, key, dy, **kw):
  @jax.jit
  def f(x, w, gs, key, dy):
    y, vjp = jax.vjp(lambda x, w: nv.ragged_dot(x, w, gs, recipe=recipe,
                                                key=key, **kw), x, w)
    return (y, *vjp(dy))
  return f(x, w, gs, key, dy)


@functools.partial(jax.jit, static_argnums=3)
def _expert(x, w, dy, recipe, key):
  y, vjp = jax.vjp(lambda x, w: nv.dot_general(x, w, DN, recipe=recipe,
                                               key=key), x, w)
  return (y, *vjp(dy))


def loop(x, w, gs, recipe, key, dy):
  """The definition: one `dot_general` per expert, on its own rows."""
  y = np.zeros((x.shape[0], w.shape[2]), np.float32)
  dx = np.zeros(x.shape, np.float32)
  dw = np.zeros(w.shape, np.float32)
  start = 0
  for e, n in enumerate(np.asarray(gs)):
    rows = slice(start, start + n)
    start += n
    if not n:
      continue
    ye, dxe, dwe = _expert(x[rows], w[e], dy[rows], recipe,
                           None if key is None else jax.random.fold_in(key, e))
    y[rows], dx[rows], dw[e] = ye, dxe, dwe
  return y, dx, dw


U = 2.0 ** -24


def check_gpu_gradients(x, dy, wa, gs, got, want):
  """Off the CPU the grouped kernels and the loop's GEMMs sum in other
  orders; their quantized operands are the same. A GEMM of n exact products
  moves by at most 2 n u sum |a b| between two orders; the block values'
  magnitudes are within a factor of 2 of the operands' (E2M1 and E4M3
  rounding, stochastic included) on each side, hence the factor 8 with
  the unquantized operands (Wgrad: Cauchy-Schwarz over the tokens, the RHT
  being orthogonal)."""
  (dx, dw), (ldx, ldw) = got, want
  n = dy.shape[1]
  bound = 8 * n * U * np.einsum("rn,rkn->rk", np.abs(dy[:len(wa)]), wa)
  assert np.all(np.abs(np.asarray(dx)[:len(wa)] - ldx[:len(wa)]) <= bound)
  start = 0
  for e, m in enumerate(np.asarray(gs)):
    xe, de = np.asarray(x[start:start + m]), np.asarray(dy[start:start + m])
    start += m
    pad = -(-m // 16) * 16
    b = 8 * pad * U * np.outer(np.linalg.norm(xe, axis=0),
                               np.linalg.norm(de, axis=0))
    assert np.all(np.abs(np.asarray(dw[e]) - ldw[e]) <= b), e


RECIPES = {
    "nvfp4": nv.Recipe.nvfp4(),
    "nvfp4-4o6": nv.Recipe.nvfp4(four_over_six="all"),
    "nvfp4-no-rht-1d": nv.Recipe.nvfp4(rht=False, two_d_weights=False),
    "mxfp4": nv.Recipe.mxfp4(),
    "mxfp8": nv.Recipe.mxfp8(),
    "bf16-forward": nv.Recipe.bf16_forward(),
}
# The paper's recipe runs in the fast tier; the other recipes (each compiles
# the op and the loop anew, ~10 s) in the slow tier.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("name", [
    "nvfp4", *(pytest.param(n, marks=SLOW) for n in RECIPES if n != "nvfp4")])
def test_equals_a_loop_of_dot_general_per_expert(name):
  """Uneven, empty and skewed groups, rows past the groups, SR, RHT, 16x16
  and Four-over-Six: outputs and both gradients equal the loop exactly
  (groups of at least two tokens; module docstring). A GEMM the recipe keeps
  in high precision multiplies FP32 operands, whose products round: there
  the bound is the FP32 summation bound, 2 K 2^-24 sum |a b|."""
  recipe = RECIPES[name]
  rng = np.random.default_rng(0)
  m, k, n = 120, 64, 96
  # Two distinct sizes (the loop compiles once per size).
  gs = jnp.array([37, 0, 2, 37, 0, 2, 37], jnp.int32)   # 115 of 120 rows.
  x = heavy(rng, (m, k))
  w = heavy(rng, (7, k, n), 0.1)
  dy = heavy(rng, (m, n))
  key = jax.random.key(3)
  y, dx, dw = run(x, w, gs, recipe, key, dy)
  ly, ldx, ldw = loop(x, w, gs, recipe, key, dy)
  exact = jax.default_backend() == "cpu"
  rows = np.repeat(np.arange(7), np.asarray(gs))
  wa = np.abs(np.asarray(w))[rows]
  if recipe.gemm_format("fprop") == "bf16" or not exact:
    bound = 8 * k * U * np.einsum("rk,rkn->rn", np.abs(x[:115]), wa)
    assert np.all(np.abs(np.asarray(y[:115]) - ly[:115]) <= bound)
  else:
    np.testing.assert_array_equal(np.asarray(y), ly)
  if exact:
    np.testing.assert_array_equal(np.asarray(dx), ldx)
    np.testing.assert_array_equal(np.asarray(dw), ldw)
  else:
    check_gpu_gradients(x, dy, wa, gs, (dx, dw), (ldx, ldw))
  # Rows past the groups and empty experts: zeros, never NaN.
  assert not np.any(np.asarray(y)[115:]) and not np.any(np.asarray(dx)[115:])
  assert not np.any(np.asarray(dw)[[1, 4]])


@SLOW
def test_one_token_group_within_the_summation_bound():
  """A group of one token: XLA:CPU's vector path in the loop sums in
  another order; equal within `K * 2^-24 * sum|a b|` (exact products)."""
  recipe = nv.Recipe.nvfp4()
  rng = np.random.default_rng(1)
  m, k, n = 40, 64, 32
  gs = jnp.array([1, 30, 9], jnp.int32)
  x, w, dy = heavy(rng, (m, k)), heavy(rng, (3, k, n), 0.1), heavy(rng, (m, n))
  key = jax.random.key(0)
  y, dx, dw = run(x, w, gs, recipe, key, dy)
  ly, ldx, ldw = loop(x, w, gs, recipe, key, dy)
  bound = 8 * k * U * (np.abs(x[:1]) @ np.abs(w[0])).max()
  assert np.abs(np.asarray(y[:1]) - ly[:1]).max() <= bound
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(np.asarray(y[1:]), ly[1:])
    np.testing.assert_array_equal(np.asarray(dw), ldw)   # Wgrad pads to 16.
  else:
    wa = np.abs(np.asarray(w))[np.repeat(np.arange(3), np.asarray(gs))]
    check_gpu_gradients(x, dy, wa, gs, (dx, dw), (ldx, ldw))


def test_operands_are_each_experts_own_quantization():
  """Codes, scales and amaxes of the grouped quantizers equal
  `nvfp4_jax.quantize` (rows) and `quantize_rht_t` (tokens, after the RHT,
  the group padded to 16) of each expert's slice, SR from its own key."""
  rng = np.random.default_rng(2)
  m, c = 70, 48
  gs = jnp.array([20, 0, 20, 27], jnp.int32)
  x = heavy(rng, (m, c))
  keys = jax.vmap(lambda e: jax.random.fold_in(jax.random.key(5), e))(
      jnp.arange(4))

  @jax.jit
  def grouped(x, gs, keys):
    q = rq.quantize_rows(x, gs, Operand(rounding="stochastic"), keys,
                         codes=True)
    sources, padded, length = rq.padded_layout(gs, m, 16)
    qt = rq.quantize_tokens(rq.to_padded(x, sources), padded,
                            Operand(rounding="stochastic", rht=True), keys,
                            codes=True)
    return q, qt, padded

  @jax.jit
  def alone(xe, xe_padded, key):
    return (nv.quantize(xe, rounding="stochastic", key=key),
            nv.quantize_rht_t(xe_padded, rounding="stochastic", key=key))

  q, qt, padded = grouped(x, gs, keys)
  start = pstart = 0
  u8 = lambda a: np.asarray(a).view(np.uint8)
  for e, (n, pn) in enumerate(zip(np.asarray(gs), np.asarray(padded))):
    if not n:
      assert q.amax[e] == 0 and qt.amax[e] == 0
      continue
    xe = x[start:start + n]
    ref, rt = alone(xe, jnp.pad(xe, ((0, pn - n), (0, 0))), keys[e])
    np.testing.assert_array_equal(q.data[start:start + n], ref.codes)
    np.testing.assert_array_equal(u8(q.scales[start:start + n]),
                                  u8(ref.scales))
    assert q.amax[e] == ref.amax
    np.testing.assert_array_equal(
        qt.data[:, pstart // 2:(pstart + pn) // 2], rt.codes)
    np.testing.assert_array_equal(
        u8(qt.scales[:, pstart // 16:(pstart + pn) // 16]), u8(rt.scales))
    assert qt.amax[e] == rt.amax
    start += n
    pstart += pn


def test_padding_keeps_blocks_inside_experts():
  """Switching the padding off (align='assume') on groups that do not start
  at multiples of 16 mixes two experts in a Wgrad block and changes the
  weight gradient: the padding is what makes it right."""
  recipe = nv.Recipe.nvfp4(stochastic_rounding=False)
  rng = np.random.default_rng(3)
  m, k, n = 64, 32, 32
  gs = jnp.array([21, 43], jnp.int32)
  x, w, dy = heavy(rng, (m, k)), heavy(rng, (2, k, n), 0.1), heavy(rng, (m, n))
  _, ldx, ldw = loop(x, w, gs, recipe, None, dy)
  _, dx, dw = run(x, w, gs, recipe, None, dy)
  _, _, dw_assumed = run(x, w, gs, recipe, None, dy, align="assume")
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(np.asarray(dw), ldw)
  else:
    wa = np.abs(np.asarray(w))[np.repeat(np.arange(2), np.asarray(gs))]
    check_gpu_gradients(x, dy, wa, gs, (dx, dw), (ldx, ldw))
  # Far beyond the summation bound: 2 experts' tokens in one block.
  assert np.abs(np.asarray(dw_assumed) - ldw).max() > 1e-3 * np.abs(ldw).max()


def test_check_mode_catches_a_misaligned_group():
  """align='check' raises on a group that does not start at a multiple of
  16, with concrete sizes at the call and with traced sizes when it runs;
  aligned groups pass and equal the padded layout."""
  recipe = nv.Recipe.nvfp4(stochastic_rounding=False)
  rng = np.random.default_rng(4)
  x, w = heavy(rng, (64, 32)), heavy(rng, (2, 32, 32), 0.1)
  bad = jnp.array([21, 43], jnp.int32)
  with pytest.raises(ValueError, match=r"expert 1's tokens start at row 21"):
    nv.ragged_dot(x, w, bad, recipe=recipe, align="check")
  f = jax.jit(lambda x, w, gs: jax.grad(lambda w: nv.ragged_dot(
      x, w, gs, recipe=recipe, align="check").sum())(w))
  with pytest.raises(Exception, match=r"expert 1's tokens start at row 21"):
    jax.block_until_ready(f(x, w, bad))
  good = jnp.array([32, 32], jnp.int32)
  checked = f(x, w, good)
  padded = jax.grad(lambda w: nv.ragged_dot(x, w, good, recipe=recipe).sum())(w)
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(checked, padded)
  else:  # Another token count for the Wgrad GEMM: the summation bound.
    b = 8 * 32 * U * np.abs(np.asarray(padded)).max() * 64
    assert np.abs(np.asarray(checked) - np.asarray(padded)).max() <= b


def test_residuals_are_fp4_codes():
  """What the forward pass saves for the backward pass: uint8 codes and
  E4M3 scales for X's Wgrad operand and the weights, no float copy of X
  (only the FP32 master weight, alive anyway)."""
  rng = np.random.default_rng(5)
  x, w = heavy(rng, (64, 32)), heavy(rng, (2, 32, 48), 0.1)
  gs = jnp.array([30, 34], jnp.int32)
  _, vjp = jax.vjp(lambda x, w: nv.ragged_dot(
      x, w, gs, recipe="nvfp4", key=jax.random.key(0)), x, w)
  leaves = jax.tree.leaves(vjp)
  floats = [l.shape for l in leaves if jnp.issubdtype(l.dtype, jnp.floating)
            and l.dtype not in (jnp.float8_e4m3fn,) and l.size > 2]
  assert floats == [w.shape]                       # The weight only.
  assert any(l.dtype == jnp.uint8 and l.shape == (32, 96 // 2 + 0 * 1)
             or l.dtype == jnp.uint8 for l in leaves)


def test_report_lists_the_expert_gemms():
  x = jnp.zeros((64, 32))
  w = jnp.zeros((2, 32, 48))
  gs = jnp.array([30, 34], jnp.int32)
  rep = nv.report(jax.grad(lambda w: nv.ragged_dot(
      x, w, gs, recipe="nvfp4", key=jax.random.key(0),
      name="moe/experts/up").sum()), w)
  gemms = {(g.layer, g.gemm): g.precision for g in rep.gemms}
  assert set(gemms) == {("moe/experts/up", g)
                        for g in ("fprop", "dgrad", "wgrad")}
  assert all(p.startswith("nvfp4") for p in gemms.values())


@SLOW
def test_bf16_recipe_is_ragged_dot():
  """Every GEMM in high precision: `jax.lax.ragged_dot` and its gradients
  up to the FP32 summation order (float32 operands: relative 2^-24 * K)."""
  rng = np.random.default_rng(6)
  x, w, dy = heavy(rng, (50, 32)), heavy(rng, (3, 32, 16)), heavy(rng, (50, 16))
  gs = jnp.array([10, 0, 35], jnp.int32)
  hi = jax.lax.Precision.HIGHEST
  y, dx, dw = run(x, w, gs, "bf16", None, dy, precision=hi)
  ry, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, gs, precision=hi),
                    x, w)
  rdx, rdw = vjp(dy)
  for a, b in ((y, ry), (dx, rdx), (dw, rdw)):
    np.testing.assert_allclose(a, b, rtol=32 * 2.0 ** -24 * 64, atol=1e-5)


@pytest.mark.parametrize("args, match", [
    (dict(k=40), r"contraction \(in\) dim K is 40, not a multiple of 16"),
    (dict(n=40), r"output dim N is 40, not a multiple of 16"),
    (dict(gs=[70, 0]), r"must be non-negative and sum to at most the 64"),
    (dict(gs=[-1, 3]), r"must be non-negative"),
    (dict(gs=[1, 2, 3]), r"group_sizes must be integers of shape \(2,\)"),
    (dict(gs_dtype=jnp.float32), r"group_sizes must be integers"),
    (dict(align="nope"), r"align must be one of"),
    (dict(x_shape=(64, 32, 1)), r"expected lhs \[M, K\] and rhs \[E, K, N\]"),
])
def test_bad_arguments_name_the_value_and_the_fix(args, match):
  k, n = args.get("k", 32), args.get("n", 32)
  x = jnp.zeros(args.get("x_shape", (64, k)))
  w = jnp.zeros((2, k, n))
  gs = jnp.asarray(args.get("gs", [32, 32]), args.get("gs_dtype", jnp.int32))
  with pytest.raises((ValueError, TypeError), match=match):
    nv.ragged_dot(x, w, gs, recipe="nvfp4", key=jax.random.key(0),
                  align=args.get("align", "pad"))


def test_nan_propagates_to_its_expert_only():
  """A NaN in one expert's tokens poisons that expert's outputs (its amax
  is NaN), not the other experts'."""
  rng = np.random.default_rng(7)
  x, w = heavy(rng, (48, 32)), heavy(rng, (2, 32, 32), 0.1)
  x = x.at[3, 5].set(jnp.nan)
  gs = jnp.array([16, 32], jnp.int32)
  y = nv.ragged_dot(x, w, gs, recipe="nvfp4", key=jax.random.key(0))
  assert np.isnan(np.asarray(y[:16])).all()
  assert np.isfinite(np.asarray(y[16:])).all()


@SLOW  # The GPU fallback's check; the suite's time budget.
def test_reference_gemms_agree_with_xla_ragged_dot_general():
  """The "lax" implementation (XLA's grouped GEMM, the GPU fallback) equals
  the reference loop up to the FP32 summation order (bf16 values, exact
  products: K * 2^-24 relative to sum |a b|)."""
  rng = np.random.default_rng(8)
  va = heavy(rng, (40, 32)).astype(jnp.bfloat16)
  vb = heavy(rng, (3, 32, 16)).astype(jnp.bfloat16)
  gs = jnp.array([10, 0, 25], jnp.int32)
  alpha = jnp.array([0.5, 2.0, 3.0], jnp.float32)
  for layout, b in (("kn", vb), ("nk", jnp.swapaxes(vb, 1, 2))):
    r = rg.ragged_values_matmul(va, b, gs, alpha, vb_layout=layout,
                                implementation="xla")
    l = rg.ragged_values_matmul(va, b, gs, alpha, vb_layout=layout,
                                implementation="lax")
    # |a| @ |b| over every expert bounds each row's sum of |products|.
    scale = max(float((np.abs(np.asarray(va, np.float32)) @ np.abs(
        np.asarray(vb[e], np.float32))).max()) for e in range(3))
    np.testing.assert_allclose(r, l, atol=32 * 2.0 ** -24 * 3 * scale)
    assert not np.any(np.asarray(r)[35:])
  vt = heavy(rng, (40, 16)).astype(jnp.bfloat16)
  r = rg.ragged_values_matmul_t(va, vt, gs, alpha, tokens_last=False,
                                implementation="xla")
  l = rg.ragged_values_matmul_t(va, vt, gs, alpha, tokens_last=False,
                                implementation="lax")
  np.testing.assert_allclose(r, l, rtol=1e-5, atol=1e-3)
  assert not np.any(np.asarray(r[1]))
