"""Shared by the quantizer and kernel tests: heavy-tailed and RHT-exact test
data, bit-for-bit comparisons, the CPU reference ("truth") and the operand
pairs of `nvfp4_jax.ops.quantize_pair`.

Tests import it as a top-level module (tests/conftest.py puts tests/support
on `sys.path`).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4_jax as nf
from nvfp4_jax.core import dispatch
from nvfp4_jax.ops.quantize import reference as quantize_ref
from nvfp4_jax.core.recipe import Operand


def heavy(shape, dtype=jnp.float32, seed=0, *, sigma=1.5, outliers=30.0):
  """Gaussian x lognormal row and column scales, plus 0.5% outliers."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape)
  x *= np.exp(sigma * rng.standard_normal((*shape[:-1], 1)))
  x *= np.exp(sigma * rng.standard_normal((1,) * (len(shape) - 1)
                                          + shape[-1:]))
  mask = rng.random(shape) < 0.005
  x = np.where(mask, x * outliers, x)
  return jnp.asarray(x, jnp.float32).astype(dtype)


def f32_bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


def assert_same(got: nf.NVFP4Array, want: nf.NVFP4Array, what=""):
  """Codes, scale bytes, amax and block_2d identical."""
  assert got.block_2d == want.block_2d, what
  assert got.codes.shape == want.codes.shape, what
  np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(want.codes),
                                err_msg=f"{what}: codes differ")
  np.testing.assert_array_equal(
      np.asarray(got.scales).view(np.uint8),
      np.asarray(want.scales).view(np.uint8),
      err_msg=f"{what}: scale bytes differ")
  np.testing.assert_array_equal(f32_bits(got.amax), f32_bits(want.amax),
                                err_msg=f"{what}: amax differs")


_CPU = jax.devices("cpu")[0]


@contextlib.contextmanager
def on_cpu():
  """Within the block, programs run on the CPU and the dispatch picks the
  CPU's implementations, whatever device this process has: for tests whose
  claim is about XLA:CPU's arithmetic (a kernel's interpreted software twin,
  two XLA:CPU programs equal bit for bit). On a GPU, XLA:GPU compiles FP32
  division to `div.full.f32`, flushes subnormals and picks GEMM algorithms
  per shape, none of which the twins model; the kernels themselves are
  compared with `truth` on the GPU. Trace caches are cleared on entry and
  exit (JAX caches by argument types, not by this block)."""
  jax.clear_caches()
  try:
    with jax.default_device(_CPU), dispatch.target_device("cpu"):
      yield
  finally:
    jax.clear_caches()


def truth(fn, **kw):
  """`fn(*args, **kw)` jitted on the CPU: the reference bytes everywhere.

  On a GPU run the implementations (the "xla" reference included) run on the
  GPU and are compared with this: XLA:CPU's reference is the one tested
  against TE's arithmetic (tests/support/te_reference.py).
  """
  f = jax.jit(functools.partial(fn, **kw))

  def run(*args):
    with jax.default_device(_CPU):
      return f(*jax.device_put(args, _CPU))
  return run


def jit_ref(**kw):
  return truth(quantize_ref.quantize_reference, **kw)


def jit_xla(fn, **kw):
  """`fn(..., implementation="xla", **kw)` on the CPU (see `truth`)."""
  return truth(fn, implementation="xla", **kw)


block_values = truth(lambda q: nf.block_dequantize(q)[0])


def bf16_bits(a):
  return np.asarray(a).view(np.uint16)


KEY = jax.random.key(42)


def rht_input(shape, dtype, seed):
  """RHT test data whose 16-token Hadamard sums are exact in FP32.

  `rht` accumulates 16 products in FP32 and rounds to bf16; when a sum is not
  exact its bf16 result depends on the summation order, which differs between
  XLA:CPU, cuBLAS and the tensor cores (TE's kernel included), so no two
  implementations can promise the same bytes there (a flushed subnormal
  product or partial sum is such a rounding: see
  `test_rht_of_tiny_tokens_decodes_as_the_reference`). Small integers times
  per-column (2^-12..2^12) and per-token (2^0..2^6) powers of two keep every
  sum exact (< 2^17 units), while the block scales still spread widely.
  """
  rng = np.random.default_rng(seed)
  t, f = shape
  k = rng.integers(-127, 128, shape).astype(np.float32)
  k = np.where(rng.random(shape) < 0.7, np.round(k / 8), k)  # Mostly small.
  x = k * np.exp2(rng.integers(0, 7, (t, 1))) * np.exp2(
      rng.integers(-12, 13, (1, f)))
  return jnp.asarray(x, jnp.float32).astype(dtype)


# Operands and the pairs `quantize_pair` fuses (X: RTNE, dY: SR).
SR = Operand(format="nvfp4", rounding="stochastic")
SR_RHT = Operand(format="nvfp4", rounding="stochastic", rht=True)
RTNE = Operand(format="nvfp4")
RTNE_RHT = Operand(format="nvfp4", rht=True)

PAIRS = [
    (RTNE, RTNE_RHT),                               # X
    (SR, SR_RHT),                                   # dY
    (Operand(format="bf16"), RTNE_RHT),             # X, BF16 Fprop
    (SR, Operand(format="bf16")),                   # dY, BF16 Wgrad
    (SR, RTNE_RHT),                                 # mixed rounding
]

FOS = dict(format="nvfp4", four_over_six=True)
FOS_PAIRS = [
    (Operand(**FOS), Operand(**FOS, rht=True)),                     # X
    (Operand(**FOS, rounding="stochastic"),
     Operand(**FOS, rounding="stochastic", rht=True)),              # dY
    (RTNE, Operand(**FOS, rht=True)),          # Four-over-Six on one only
    (Operand(**FOS, rounding="stochastic"), Operand(format="bf16")),
    (Operand(format="bf16"), Operand(**FOS, rounding="stochastic", rht=True)),
]

NO_RHT_PAIRS = [
    (RTNE, Operand(format="nvfp4")),                                # X
    (SR, Operand(format="nvfp4", rounding="stochastic")),           # dY
    (Operand(format="bf16"), Operand(format="nvfp4")),
    (SR, Operand(format="nvfp4", rounding="stochastic",
                 four_over_six=True)),
]
