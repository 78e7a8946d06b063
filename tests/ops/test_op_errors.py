"""The public ops' bad inputs: each gets a clear error that names the
offending value and says what to do.

Three parts:
- named cases: shapes, dtypes, roundings, keys and amaxes a user gets wrong,
  each with its message;
- the ops' table (issue 42): each call, the error it raises and the
  fragments its message must hold;
- a property sweep (issue 14, item 3): for generated shapes, dtypes and
  arguments each public op either returns the documented result (checked
  by shape) or raises a TypeError/ValueError whose message names the
  offending value and says what to do. It is traced abstractly
  (`jax.eval_shape`: the checks run at trace time, no FLOPs needed) and
  needs `hypothesis` (the `test` extra); without it only the sweep skips.

The layers', configs', rules' and export files' tables are
`tests/training/test_bad_inputs.py`; the CLI's,
`tests/train/test_train_cli_errors.py`.
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nv
from error_tables import assert_error
from error_tables import table_params
from nvfp4_jax.core import prng
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
from nvfp4_jax.ops.quantize_rht_t import api as rht_t_api

try:
  from hypothesis import given, settings  # pylint: disable=g-import-not-at-top
  from hypothesis import strategies as st  # pylint: disable=g-import-not-at-top
except ImportError:  # The sweep's tests skip; the named cases run.

  class _Absent:
    """Stands for hypothesis' strategies and settings at decoration time."""

    def __getattr__(self, name):
      return self

    def __call__(self, *args, **kwargs):
      return self

  st = _Absent()

  def settings(**_):
    return lambda test: test

  def given(**_):
    return pytest.mark.skip(reason="the property sweep needs hypothesis "
                            "(pip install -e '.[test]')")


# -- Named cases. -------------------------------------------------------------


@pytest.mark.parametrize("k", [8, 100, 24, 31])
def test_nvfp4_k_not_multiple_of_16(k):
  pad = -(-k // 16) * 16
  with pytest.raises(ValueError, match=rf"size {k}, not a multiple of 16.*pad it to {pad}"):
    nv.quantize(jnp.ones((4, k)))


@pytest.mark.parametrize("k", [16, 48, 100])
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_k_not_multiple_of_32(k, fmt):
  with pytest.raises(ValueError, match=rf"{fmt}.*size {k}, not a multiple of 32"):
    nv.quantize_mx(jnp.ones((4, k)), fmt)


@pytest.mark.parametrize("shape", [(20, 32), (8, 16), (2, 24, 16)])
def test_2d_rows_not_multiple_of_16(shape):
  with pytest.raises(ValueError, match=rf"16x16.*got shape {re_shape(shape)}"):
    nv.quantize(jnp.ones(shape), block_2d=True)
  jax.jit(nv.quantize)(jnp.ones(shape))  # fine with 1x16 scaling


def test_2d_needs_two_axes():
  with pytest.raises(ValueError, match=r"got shape \(32,\)"):
    nv.quantize(jnp.ones((32,)), block_2d=True)


def re_shape(shape):
  return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize("fn", ["nvfp4", "mxfp4", "mxfp8"])
def test_zero_d(fn):
  with pytest.raises(ValueError, match=r"non-empty array with at least one axis; got shape \(\)"):
    _quantize(fn, jnp.float32(1.0))


@pytest.mark.parametrize("shape", [(0, 16), (0,), (4, 0)])
@pytest.mark.parametrize("fn", ["nvfp4", "mxfp4"])
def test_empty(fn, shape):
  with pytest.raises(ValueError, match=rf"non-empty.*got shape {re_shape(shape)}"):
    _quantize(fn, jnp.ones(shape))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_, jnp.int8])
@pytest.mark.parametrize("fn", ["nvfp4", "mxfp4", "mxfp8"])
def test_integer_dtype(fn, dtype):
  name = jnp.dtype(dtype).name
  with pytest.raises(TypeError, match=rf"got dtype {name}\. Cast it first"):
    _quantize(fn, jnp.ones((4, 32), dtype))


def test_numpy_and_list_inputs_accepted():
  q = jax.jit(nv.quantize)(np.ones((2, 16), np.float32))
  assert q.shape == (2, 16)
  with pytest.raises(TypeError, match="int"):
    nv.quantize([[1] * 16])


@pytest.mark.parametrize("rounding", ["up", "RTNE", "Nearest", ""])
def test_unknown_rounding(rounding):
  with pytest.raises(ValueError, match=rf"unknown rounding {rounding!r}; use one of"):
    nv.quantize(jnp.ones((4, 32)), rounding=rounding)
  with pytest.raises(ValueError, match=rf"unknown rounding {rounding!r}"):
    nv.quantize_mx(jnp.ones((4, 32)), "mxfp4", rounding=rounding)


def test_stochastic_without_key():
  with pytest.raises(ValueError, match=r"rounding='stochastic' needs a key"):
    nv.quantize(jnp.ones((4, 32)), rounding="stochastic")
  with pytest.raises(ValueError, match=r"rounding='stochastic' needs a key"):
    nv.quantize_mx(jnp.ones((4, 32)), "mxfp4", rounding="stochastic")
  with pytest.raises(ValueError, match=r"jax.random.key"):
    jax.jit(lambda x: nv.quantize(x, rounding="stochastic"))(jnp.ones((4, 32)))


def test_mx_unknown_format_and_sr_for_mxfp8():
  with pytest.raises(ValueError, match=r"unknown MX format 'mxfp6'"):
    nv.quantize_mx(jnp.ones((4, 32)), "mxfp6")
  with pytest.raises(ValueError, match=r"stochastic rounding.*mxfp8"):
    nv.quantize_mx(jnp.ones((4, 32)), "mxfp8", rounding="stochastic",
                   key=jax.random.key(0))


def test_amax_must_be_scalar():
  with pytest.raises(ValueError, match=r"amax must be a scalar, got shape \(2,\)"):
    nv.quantize(jnp.ones((4, 32)), amax=jnp.ones((2,)))


def test_errors_are_raised_under_jit_at_trace_time():
  with pytest.raises(ValueError, match="size 40"):
    jax.jit(nv.quantize)(jnp.ones((4, 40)))
  with pytest.raises(ValueError, match=r"16x16.*\(20, 32\)"):
    jax.jit(lambda x: nv.quantize(x, block_2d=True))(jnp.ones((20, 32)))


def test_transpose_needs_2d_scaling():
  q = jax.jit(nv.quantize)(jnp.ones((16, 32)))
  with pytest.raises(ValueError, match=r"block_2d.*quantize x\.T instead"):
    _ = q.T


def test_pack_odd_axis():
  with pytest.raises(ValueError, match=r"even last axis, got shape \(3, 5\)"):
    nv.pack_e2m1(jnp.zeros((3, 5), jnp.uint8))


def test_random_bytes_bad_sizes():
  seeds = jnp.zeros((2,), jnp.uint32)
  with pytest.raises(ValueError, match=r"divisible by 4, got \(3, 5\)"):
    prng.random_bytes(seeds, (3, 5))
  with pytest.raises(ValueError, match=r"at most 2\^34 elements; got 17179869200"):
    prng.random_bytes(seeds, (17179869200,))


def test_block_scaled_matmul_errors():
  quantize = jax.jit(nv.quantize)
  a = quantize(jnp.ones((4, 32)))
  b = quantize(jnp.ones((8, 64)))
  with pytest.raises(ValueError, match=r"contraction sizes differ, a \(4, 32\) vs b \(8, 64\)"):
    gemm_api.block_scaled_matmul(a, b)
  with pytest.raises(TypeError, match=r"b must be an NVFP4Array, NVFP4Values or MXArray, got ndarray"):
    gemm_api.block_scaled_matmul(a, np.ones((4, 32)))
  c = quantize(jnp.ones((2, 4, 32)))
  with pytest.raises(ValueError, match=r"a must be 2-D \[rows, K\], got shape \(2, 4, 32\)"):
    gemm_api.block_scaled_matmul(c, a)


def test_dequantize_wrong_type():
  with pytest.raises(TypeError, match="NVFP4Array, NVFP4Values or MXArray"):
    nv.dequantize(jnp.ones((4, 32)))
  with pytest.raises(TypeError, match="NVFP4Array, NVFP4Values or MXArray"):
    nv.block_dequantize(jnp.ones((4, 32)))


def _quantize(fn, x):
  if fn == "nvfp4":
    return nv.quantize(x)
  return nv.quantize_mx(x, fn)

# -- The ops' table (issue 42): a call, the error it raises, the fragments
# its message holds (the offending value and the fix). --------------------

X = jax.random.normal(jax.random.key(0), (32, 64))
W = jax.random.normal(jax.random.key(1), (64, 32))
DN = (((1,), (0,)), ((), ()))
Q = nv.quantize(X)
KEY = jax.random.key(2)

OPS = {
    "amax negative": (lambda: nv.quantize(X, amax=-1.0), ValueError,
                      ["amax=-1.0", ">= 0", "amax=None"]),
    "amax NaN": (lambda: nv.quantize(X, amax=jnp.nan), ValueError,
                 ["amax=nan", "finite", "amax=None"]),
    "amax Inf": (lambda: nv.quantize(X, amax=jnp.inf), ValueError,
                 ["amax=inf", "finite", "amax=None"]),
    "amax zero with nonzero data": (
        lambda: nv.quantize(X, amax=0.0), ValueError,
        ["amax=0.0", "nonzero elements", "amax=None"]),
    "amax not a scalar": (lambda: nv.quantize(X, amax=jnp.ones(2)),
                          ValueError, ["shape (2,)", "FP32 scalar"]),
    "amax of quantize_with_values": (
        lambda: nv.quantize_with_values(X, amax=-2.0), ValueError,
        ["quantize_with_values", "amax=-2.0", "amax=None"]),
    "key an int": (
        lambda: nv.quantize(X, rounding="stochastic", key=0), TypeError,
        ["got int 0", "key=jax.random.key(0)"]),
    "key a batch of keys": (
        lambda: nv.quantize(X, rounding="stochastic",
                            key=jax.random.split(KEY, 2)), TypeError,
        ["shape (2,)", "key=jax.random.key(0)"]),
    "key a string for MX": (
        lambda: nv.quantize_mx(X, "mxfp4", rounding="stochastic", key="k"),
        TypeError, ["'k'", "key=jax.random.key(0)"]),
    "stochastic without key": (
        lambda: nv.quantize(X, rounding="stochastic"), ValueError,
        ["rounding='stochastic' needs a key", "key=jax.random.key(0)"]),
    "unknown rounding": (lambda: nv.quantize(X, rounding="round"), ValueError,
                         ["'round'", "'nearest'"]),
    "integer input": (lambda: nv.quantize(X.astype(jnp.int32)), TypeError,
                      ["int32", "x.astype(jnp.float32)"]),
    "NVFP4Array with inconsistent shapes": (
        lambda: nv.dequantize(NVFP4Array(Q.codes, Q.scales[:, :3], Q.amax)),
        ValueError, ["(32, 32)", "(32, 3)", "nvfp4_jax.quantize"]),
    "NVFP4Array with int32 codes": (
        lambda: nv.block_scaled_matmul(
            NVFP4Array(Q.codes.astype(jnp.int32), Q.scales, Q.amax), Q),
        ValueError, ["block_scaled_matmul", "int32", "uint8",
                     "nvfp4_jax.quantize"]),
    "NVFP4Array with a vector amax": (
        lambda: nv.block_dequantize(NVFP4Array(Q.codes, Q.scales,
                                               jnp.ones(2))),
        ValueError, ["amax", "shape (2,)", "float32 scalar"]),
    "weight_only_matmul with a hand-built weight": (
        lambda: nv.weight_only_matmul(X, NVFP4Array(Q.codes[:, :8], Q.scales,
                                                    Q.amax)),
        ValueError, ["weight_only_matmul", "(32, 8)", "nvfp4_jax.quantize"]),
    "dimension_numbers without batch dims": (
        lambda: nv.dot_general(X, W, ((1,), (0,)), recipe="nvfp4"),
        ValueError, ["got ((1,), (0,))", "(((x.ndim - 1,), (0,)), ((), ()))"]),
    "dimension_numbers an int": (
        lambda: nv.dot_general(X, W, 1, recipe="nvfp4"), ValueError,
        ["got 1", "((lhs_contracting, rhs_contracting)"]),
    "dimension_numbers out of range": (
        lambda: nv.dot_general(X, W, (((5,), (0,)), ((), ())), recipe="nvfp4"),
        ValueError, ["(((5,), (0,)), ((), ()))", "lhs (32, 64)",
                     "(((x.ndim - 1,), (0,)), ((), ()))"]),
    "dimension_numbers repeating an axis": (
        lambda: nv.dot_general(X, W, (((1, 1), (0, 0)), ((), ())),
                               recipe="bf16"),
        ValueError, ["(((1, 1), (0, 0)), ((), ()))", "distinct axes"]),
    "contracted sizes differ": (
        lambda: nv.dot_general(X, W[:48], DN, recipe="nvfp4"), ValueError,
        ["lhs (32, 64)", "rhs (48, 32)", "kernel's sizes"]),
    "K not a multiple of 16": (
        lambda: nv.dot_general(X[:, :40], W[:40], DN, recipe="nvfp4",
                               key=KEY),
        ValueError, ["is 40, not a multiple of 16", "pad it to 48",
                     "keep this layer in bf16"]),
    "recipe an unknown preset": (
        lambda: nv.dot_general(X, W, DN, recipe="fp8"), ValueError,
        ["recipe='fp8'", "'nvfp4'", "'mxfp8'"]),
    "recipe an int": (
        lambda: nv.dot_general(X, W, DN, recipe=3), TypeError,
        ["got 3 (int)", "recipe=Recipe.nvfp4()", "recipe='bf16'"]),
    "integer operands of a quantized GEMM": (
        lambda: nv.dot_general(X.astype(jnp.int32), W, DN, recipe="nvfp4"),
        TypeError, ["int32", "lhs.astype(jnp.float32)", "Recipe.bf16()"]),
    "backward pass without a key": (
        lambda: jax.grad(lambda w: nv.dot_general(
            X, w, DN, recipe="nvfp4").sum())(W), ValueError,
        ["no key was given", "pass key="]),
}


@pytest.mark.parametrize("call, error, fragments", table_params(OPS))
def test_ops_name_the_value_and_the_fix(call, error, fragments):
  assert_error(call, error, fragments)


def test_the_ops_table_holds_its_cases():
  assert len(OPS) >= 26, len(OPS)


# -- The property sweep. -------------------------------------------------------

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)
DTYPES = ["float32", "bfloat16", "float16", "float64", "int32", "uint8",
          "bool", "complex64"]
FLOATS = {"float32", "bfloat16", "float16", "float64"}
SIZES = [0, 1, 3, 15, 16, 17, 32, 40, 48, 64]
# A fix is an instruction: these words start one in the library's messages.
# ("e.g." ends in a dot, after which `\b` cannot match before a space.)
FIX = re.compile(r"\b(pad|use|cast|pass|keep|set|flatten|split|fix|disable|"
                 r"raise)\b|\be\.g\.", re.I)


def _spec(shape, dtype):
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _raises_clearly(fn, *tokens):
  """`fn()` raises TypeError/ValueError naming one of `tokens` and a fix."""
  with pytest.raises((TypeError, ValueError)) as e:
    fn()
  msg = str(e.value)
  assert any(t in msg for t in tokens), (msg, tokens)
  assert FIX.search(msg) or "must" in msg, msg


shapes = st.lists(st.sampled_from(SIZES), min_size=0, max_size=3)


@SETTINGS
@given(shape=shapes, dtype=st.sampled_from(DTYPES), block_2d=st.booleans(),
       rounding=st.sampled_from(["nearest", "stochastic", "sr"]),
       with_key=st.booleans(), amax=st.sampled_from([None, (), (2,)]))
def test_quantize(shape, dtype, block_2d, rounding, with_key, amax):
  key = jax.random.key(0) if with_key else None
  amax_v = None if amax is None else jnp.ones(amax)

  def call():
    return jax.eval_shape(lambda x: nv.quantize(
        x, block_2d=block_2d, rounding=rounding, key=key, amax=amax_v),
                          _spec(shape, dtype))
  bad = []  # (condition, tokens the message must name)
  if dtype not in FLOATS:
    bad.append(dtype)
  if not shape or 0 in shape:
    bad.append(str(tuple(shape)))
  elif shape[-1] % 16:
    bad.append(f"size {shape[-1]}")
  if block_2d and shape and 0 not in shape and (
      len(shape) < 2 or shape[-2] % 16):
    bad.append(str(tuple(shape)))
  if rounding == "sr":
    bad.append("'sr'")
  if rounding == "stochastic" and not with_key:
    bad.append("needs a key")
  if amax == (2,):
    bad.append("(2,)")
  if bad:
    _raises_clearly(call, *bad)
    return
  q = call()
  k = shape[-1]
  chex.assert_shape([q.codes, q.scales, q.amax],
                    [(*shape[:-1], k // 2), (*shape[:-1], k // 16), ()])


@SETTINGS
@given(shape=shapes, dtype=st.sampled_from(DTYPES),
       fmt=st.sampled_from(["mxfp4", "mxfp8", "nvfp4"]),
       rounding=st.sampled_from(["nearest", "stochastic"]))
def test_quantize_mx(shape, dtype, fmt, rounding):
  key = jax.random.key(0)

  def call():
    return jax.eval_shape(lambda x: nv.quantize_mx(
        x, fmt, rounding=rounding, key=key), _spec(shape, dtype))
  bad = []
  if fmt == "nvfp4":
    bad.append("'nvfp4'")
  if dtype not in FLOATS:
    bad.append(dtype)
  if not shape or 0 in shape:
    bad.append(str(tuple(shape)))
  elif shape[-1] % 32:
    bad.append(f"size {shape[-1]}")
  if rounding == "stochastic" and fmt == "mxfp8":
    bad.append("mxfp8")
  if bad:
    _raises_clearly(call, *bad)
    return
  m = call()
  assert m.shape == tuple(shape)


@SETTINGS
@given(tokens=st.sampled_from(SIZES), features=st.sampled_from(SIZES),
       extra=st.booleans(), size=st.sampled_from([16, 32, 64, 12]),
       dtype=st.sampled_from(["float32", "bfloat16", "int32"]))
def test_quantize_rht_t(tokens, features, extra, size, dtype):
  shape = (2, tokens, features) if extra else (tokens, features)

  def call():
    return jax.eval_shape(lambda x: rht_t_api.quantize_rht_t(x, size=size),
                          _spec(shape, dtype))
  bad = []
  if dtype == "int32":
    bad.append(dtype)
  if 0 in shape:
    bad.append(str(shape))
  elif extra:
    bad.append(str(shape))
  if size == 12:
    bad.append("12")
  elif not extra and 0 not in shape and tokens % max(16, size):
    bad.append(f"token count {tokens}")
  if bad:
    _raises_clearly(call, *bad)
    return
  assert call().shape == (features, tokens)


@SETTINGS
@given(lhs=st.lists(st.sampled_from([1, 3, 16, 32, 40]), min_size=1,
                    max_size=3),
       k=st.sampled_from([16, 20, 32]), k_rhs=st.sampled_from([16, 20, 32]),
       n=st.sampled_from([8, 16, 48]), dtype=st.sampled_from(
           ["float32", "bfloat16", "int32"]),
       recipe=st.sampled_from(["nvfp4", "bf16", "mxfp4"]))
def test_dot_general_forward(lhs, k, k_rhs, n, dtype, recipe):
  r = nv.Recipe.from_name(recipe)
  x, w = _spec((*lhs, k), dtype), _spec((k_rhs, n), "float32")
  dn = (((len(lhs),), (0,)), ((), ()))

  def call():
    return jax.eval_shape(lambda x, w: nv.dot_general(
        x, w, dn, recipe=r, key=jax.random.key(0)), x, w)
  bad = []
  if r.quantized and dtype == "int32":
    bad.append(dtype)
  if k != k_rhs:
    bad.append(f"{(*lhs, k)}")
  elif r.quantized:
    block = 16 if recipe == "nvfp4" else 32
    if k % block:
      bad.append(f"is {k}")
    if recipe == "nvfp4" and n % 16:  # 16x16 weight tiles: out too.
      bad.append(f"out={n}")
  if bad:
    _raises_clearly(call, *bad)
    return
  if k != k_rhs:  # bf16: jax.lax.dot_general's own error.
    return
  want = jax.eval_shape(lambda x, w: jax.lax.dot_general(x, w, dn), x, w)
  assert call().shape == want.shape


@SETTINGS
@given(n=st.sampled_from([8, 16, 48]), tokens=st.sampled_from([1, 16, 40]))
def test_dot_general_backward_checks_where_it_runs(n, tokens):
  """The Dgrad GEMM quantizes dY along `out`: checked in the backward pass;
  the forward pass (1x16 weights) takes any `out`."""
  r = nv.Recipe.nvfp4(two_d_weights=False)
  x, w = _spec((tokens, 32), "float32"), _spec((32, n), "float32")
  dn = (((1,), (0,)), ((), ()))
  f = lambda x, w: nv.dot_general(x, w, dn, recipe=r,
                                  key=jax.random.key(0), name="proj")
  assert jax.eval_shape(f, x, w).shape == (tokens, n)
  grad = lambda: jax.eval_shape(
      jax.grad(lambda x, w: f(x, w).sum(), argnums=1), x, w)
  if n % 16:
    _raises_clearly(grad, f"'proj'")
  else:
    assert grad().shape == (32, n)


@pytest.mark.parametrize("rules,match", [
    (dict(rules=(("(", nv.Recipe.bf16()),)), r"bad rule pattern '\('"),
    (dict(rules=(("a", "bf16"),)), r"rule 'a' maps to str"),
    (dict(rules=(("a",),)), r"a rule is a \(pattern, Recipe\) pair"),
    (dict(default="nvfp4"), r"default must be a Recipe"),
    (dict(late_switch=5), r"late_switch must be a LateSwitch"),
])
def test_rules_errors(rules, match):
  with pytest.raises((TypeError, ValueError), match=match):
    nv.PrecisionRules(**rules)


def test_nan_and_inf_propagate_through_every_quantizer():
  x = np.ones((32, 64), np.float32)
  x[3, 5] = np.nan
  for fn in (nv.quantize, lambda x: nv.quantize(x, block_2d=True),
             rht_t_api.quantize_rht_t):
    assert not np.isfinite(np.asarray(nv.dequantize(fn(jnp.asarray(x))))).any()
  x[3, 5] = np.inf
  assert not np.isfinite(np.asarray(nv.dequantize(
      nv.quantize(jnp.asarray(x))))).all()
