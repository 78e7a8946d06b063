"""The grouped row quantizer's Pallas kernel
(`ops/ragged_quantize/pallas_triton`).

`api.quantize_rows` reduces each group's amax, then quantizes every row with
its group's constants and stream (`QUANTIZE_ROWS`). The kernel ("pallas",
interpreted on the CPU, compiled on a GPU) must give the reference's bytes
("xla") exactly: codes, scales and bf16 block values, on heavy-tailed rows
of uneven, empty and skewed groups with rows past the sum, rounding to
nearest and stochastically, with and without Four-over-Six. The reference
path itself equals a per-expert loop of `nvfp4_jax.quantize`
(tests/ops/test_ragged_dot.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nv
from nvfp4_jax.core.recipe import Operand
from nvfp4_jax.ops.ragged_quantize import api as rq


def heavy(rng, shape):
  """Student-t (2 degrees of freedom) rows with a few outliers and zeros."""
  x = rng.standard_t(2, size=shape).astype(np.float32)
  x[rng.random(shape) < 0.01] *= 1e3
  x[rng.random(shape) < 0.05] = 0.0
  return jnp.asarray(x, jnp.bfloat16)


def _bytes(a):
  return None if a is None else np.asarray(a).view(np.uint8)


def _keys(n):
  return jax.vmap(lambda e: jax.random.fold_in(jax.random.key(3), e))(
      jnp.arange(n))


@pytest.mark.parametrize("sizes,m,rounding,four_over_six", [
    ([0, 21, 12, 0, 19], 64, "stochastic", False),   # Empty, rows past sum.
    ([59, 0, 5], 64, "nearest", False),               # Skewed.
    pytest.param([24, 0, 40], 64, "nearest", True,    # Four-over-Six.
                 marks=pytest.mark.slow),
])
def test_kernel_equals_reference(sizes, m, rounding, four_over_six):
  rng = np.random.default_rng(len(sizes) + m)
  x = heavy(rng, (m, 64))
  x = x.at[: sizes[0] or 1].multiply(1e-3)  # Groups of unlike amax.
  gs = jnp.asarray(sizes, jnp.int32)
  op = Operand(rounding=rounding, four_over_six=four_over_six)
  keys = _keys(len(sizes))

  def run(impl):
    return jax.jit(lambda x: rq.quantize_rows(
        x, gs, op, keys, values=True, codes=True, implementation=impl))(x)

  got, want = run("pallas"), run("xla")
  for field in ("data", "scales", "values", "amax"):
    np.testing.assert_array_equal(_bytes(getattr(got, field)),
                                  _bytes(getattr(want, field)), err_msg=field)


def test_kernel_uses_each_rows_own_group():
  """Switched off (one tensor amax for all rows, one stream), the rows of a
  small-amax group get other codes: the per-row constants and streams are
  what the kernel applies."""
  rng = np.random.default_rng(7)
  x = heavy(rng, (48, 32)).at[:16].multiply(1e-3)
  gs = jnp.asarray([16, 32], jnp.int32)
  op = Operand(rounding="stochastic")
  keys = _keys(2)
  q = jax.jit(lambda x: rq.quantize_rows(x, gs, op, keys, codes=True,
                                        implementation="pallas"))(x)
  sr = jax.jit(lambda x: nv.quantize(x, rounding="stochastic", key=keys[0]))
  whole, first = sr(x), sr(x[:16])
  np.testing.assert_array_equal(_bytes(q.data[:16]), _bytes(first.codes))
  assert not np.array_equal(_bytes(q.data[:16]), _bytes(whole.codes[:16]))


@pytest.mark.parametrize("sizes,rounding,values", [
    ([0, 32, 16, 0, 48], "stochastic", True),   # dY: SR, values; empty groups.
    ([80, 0, 16], "nearest", False),            # X: RTNE, codes and scales.
])
def test_token_kernels_equal_reference(sizes, rounding, values):
  """The Wgrad operands (16-point RHT along each group's tokens): the
  amax pass and the encode pass, with a tail of rows past the groups."""
  rng = np.random.default_rng(sum(sizes))
  length = 112  # sum(sizes) = 96, then one block of no group.
  x = heavy(rng, (length, 48)).at[: sizes[0] or 16].multiply(1e-3)
  gs = jnp.asarray(sizes, jnp.int32)
  op = Operand(rounding=rounding, rht=True)
  keys = _keys(len(sizes))

  def run(impl):
    return jax.jit(lambda x: rq.quantize_tokens(
        x, gs, op, keys, values=values, codes=not values,
        implementation=impl))(x)

  got, want = run("pallas"), run("xla")
  for field in ("data", "scales", "values", "amax"):
    np.testing.assert_array_equal(_bytes(getattr(got, field)),
                                  _bytes(getattr(want, field)), err_msg=field)


def test_the_op_runs_the_grouped_kernels_on_a_gpu():
  """Traced for a Hopper GPU (`dispatch.target_device`), the NVFP4 op's
  forward and backward quantize with the grouped kernels: the row kernel
  for X, dY and the stacked expert weights (16x16), the token amax pass for both Wgrad operands, the token
  encode pass writing X's codes (the residual) and dY's values, and the
  block-values kernel decoding the saved codes; on the CPU (the
  reference), none."""
  import re
  from nvfp4_jax.core import dispatch
  x = jnp.zeros((256, 64), jnp.bfloat16)
  w = jnp.zeros((4, 64, 32), jnp.float32)
  gs = jnp.asarray([64, 0, 100, 60], jnp.int32)

  def kernels():
    def f(x, w):
      y, vjp = jax.vjp(lambda x, w: nv.ragged_dot(
          x, w, gs, recipe="nvfp4", key=jax.random.key(0)), x, w)
      return vjp(y)
    names = re.findall(r"name=(nvfp4_\w+)", str(jax.make_jaxpr(f)(x, w)))
    return {n: names.count(n) for n in set(names)}

  jax.clear_caches()
  try:
    with dispatch.target_device("gpu", (9, 0)):
      gpu = kernels()
  finally:
    jax.clear_caches()
  assert gpu.get("nvfp4_quantize_rows") == 3, gpu
  assert gpu.get("nvfp4_ragged_rht_amax") == 2, gpu
  assert gpu.get("nvfp4_ragged_quantize_tokens") == 1, gpu
  assert gpu.get("nvfp4_ragged_quantize_tokens_values") == 1, gpu
  assert gpu.get("nvfp4_block_values", 0) >= 1, gpu
  if jax.default_backend() != "cpu":
    return
  cpu = kernels()
  assert not any(n in cpu for n in ("nvfp4_quantize_rows",
                                    "nvfp4_ragged_rht_amax")), cpu


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_expert_weights_kernel_equals_reference(rounding):
  """The stacked experts' 16x16 quantization by the row kernel (each row
  its expert's amax and stream, tiles inside one expert) gives the
  reference's bytes; the reference path equals `quantize` per expert
  (tests/ops/test_ragged_dot.py)."""
  from nvfp4_jax.core import dispatch
  rng = np.random.default_rng(11)
  w = jnp.asarray(rng.standard_t(2, (3, 32, 48)), jnp.float32)
  w = w.at[1].multiply(1e-3)
  op = Operand(block_2d=True, rounding=rounding)
  keys = _keys(3) if rounding == "stochastic" else None

  def run(impl):
    with dispatch.default_implementation(impl):
      return jax.jit(lambda w: rq.quantize_experts(w, op, keys))(w)

  got, want = run("pallas"), run("xla")
  for field in ("data", "scales", "values", "amax"):
    np.testing.assert_array_equal(_bytes(getattr(got, field)),
                                  _bytes(getattr(want, field)), err_msg=field)
