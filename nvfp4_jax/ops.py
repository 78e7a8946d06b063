"""`dot_general` with the NVFP4 training recipe: a `jax.custom_vjp` over 3 GEMMs.

The forward pass runs Fprop; the backward pass runs Dgrad and Wgrad; each GEMM
quantizes its two operands as the `Recipe` says and multiplies them with the
block-scaled GEMM (`block_scaled_matmul`: FP32 accumulation, tensor scales
applied as one FP32 `alpha`).

Residuals are saved quantized: the Wgrad operand `q(rht(X^T))` (0.5625 bytes
per element instead of 2 for bf16 X) and the quantized weight, so the
activation memory of a linear layer drops by ~3.5x.

Layout. The kernel is flax's `[in, out]`; in TE's terms `W = kernel^T`:
Fprop `Y = X @ W^T = bsm(q(X), q(kernel^T))`, Dgrad `dX = dY @ W =
bsm(q(dY), q(kernel))`, Wgrad `dkernel = X^T @ dY = bsm(q(rht(X^T)),
q(rht(dY^T)))`, where `bsm(a, b) = a @ b^T` over the quantized axis.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from nvfp4_jax import numerics as nm
from nvfp4_jax.gemm import block_scaled_matmul
from nvfp4_jax.hadamard import rht
from nvfp4_jax.mx import quantize_mx
from nvfp4_jax.nvfp4 import quantize
from nvfp4_jax.quant import QArray
from nvfp4_jax.recipe import Operand, Recipe


def _block(fmt: str) -> int:
  return nm.NVFP4_BLOCK if fmt == "nvfp4" else nm.MX_BLOCK


def quantize_operand(x: jax.Array, op: Operand, key: jax.Array | None
                     ) -> QArray:
  """Quantizes `x` along its last axis as `op` says (no RHT)."""
  if op.format == "nvfp4":
    return quantize(x, block_2d=op.block_2d, rounding=op.rounding, key=key)
  return quantize_mx(x, op.format, rounding=op.rounding, key=key)


def quantize_wgrad_operand(x: jax.Array, op: Operand, recipe: Recipe,
                           key: jax.Array | None) -> QArray:
  """`q(rht(x^T))` (or `q(x^T)` without RHT): quantized along the token axis."""
  xt = x.T
  if op.rht:
    xt = rht(xt, sign_vector=recipe.rht_sign_vector, size=recipe.rht_size)
  return quantize_operand(xt, op, key)


def _named(name: str, fn: Callable) -> Callable:
  """Jits `fn` under `name`, so each GEMM is a named region of the jaxpr."""
  fn.__name__ = fn.__qualname__ = name
  return jax.jit(fn)


def _hp_matmul(a, b, dtype, precision):
  return jax.lax.dot_general(a.astype(dtype), b.astype(dtype),
                             (((1,), (0,)), ((), ())), precision=precision)


def check_shapes(recipe: Recipe, tokens: int, k: int, n: int) -> None:
  """Raises a ValueError naming any dimension a quantized GEMM cannot block."""
  checks = (("fprop", ((k, "contraction (in) dim K"),)),
            ("dgrad", ((n, "output dim N"),)),
            ("wgrad", ((tokens, "token count"),)))
  for gemm, dims in checks:
    fmt = recipe.gemm_format(gemm)
    if fmt == "bf16":
      continue
    b = _block(fmt)
    for size, what in dims:
      if size % b:
        raise ValueError(
            f"{gemm} GEMM in {fmt}: the {what} is {size}, not a multiple of "
            f"{b}; pad it to {-(-size // b) * b} or keep this layer in bf16 "
            f"with a precision rule.")
  if recipe.fprop_w.block_2d and n % nm.NVFP4_BLOCK:
    raise ValueError(
        f"16x16 weight scaling needs the output dim N={n} to be a multiple of "
        f"16; pad it or disable two_d_weights.")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _linear(x, w, key, recipe: Recipe, precision, out_dtype, x_dtype):
  y, _ = _linear_fwd(x, w, key, recipe, precision, out_dtype, x_dtype)
  return y


def _linear_fwd(x, w, key, recipe: Recipe, precision, out_dtype, x_dtype):
  del x_dtype
  if recipe.gemm_format("fprop") != "bf16":
    def nvfp4_fprop(x, w):
      qx = quantize_operand(x, recipe.fprop_x, None)
      qw = quantize_operand(w.T, recipe.fprop_w, None)
      return block_scaled_matmul(qx, qw, out_dtype=out_dtype), qw
    y, qw = _named("nvfp4_fprop", nvfp4_fprop)(x, w)
  else:
    y = _named("bf16_fprop", functools.partial(
        _hp_matmul, dtype=out_dtype, precision=precision))(x, w)
    qw = None

  # Dgrad's weight: with identical 16x16 settings it is Fprop's quantized W,
  # transposed (exactly what quantizing kernel along `out` gives); otherwise it
  # is quantized in the backward pass from `w`, which is alive anyway.
  reuse_w = (qw is not None and recipe.dgrad_w == recipe.fprop_w
             and recipe.fprop_w.block_2d)
  if recipe.gemm_format("wgrad") != "bf16":
    x_saved = _named("nvfp4_wgrad_x", lambda x: quantize_wgrad_operand(
        x, recipe.wgrad_x, recipe, None))(x)
  else:
    x_saved = x
  return y, (x_saved, w, qw if reuse_w else None, key)


def _linear_bwd(recipe: Recipe, precision, out_dtype, x_dtype, res, dy):
  x_saved, w, qw_fprop, key = res
  if recipe.needs_key and key is None:
    raise ValueError(
        "this recipe uses stochastic rounding in the backward pass but no key "
        "was given: pass key= to nvfp4_jax.dot_general, or rngs={'nvfp4': "
        "key} to the NVFP4 layer's apply (a new key every step).")
  key_d, key_w = (jax.random.split(key) if key is not None else (None, None))

  if recipe.gemm_format("dgrad") != "bf16":
    def nvfp4_dgrad(dy, w, qw_fprop, key_d):
      qdy = quantize_operand(dy, recipe.dgrad_dy, key_d)
      qw = (qw_fprop.T if qw_fprop is not None
            else quantize_operand(w, recipe.dgrad_w, None))
      return block_scaled_matmul(qdy, qw, out_dtype=jnp.float32)
    dx = _named("nvfp4_dgrad", nvfp4_dgrad)(dy, w, qw_fprop, key_d)
  else:
    dx = _named("bf16_dgrad", lambda dy, w: _hp_matmul(
        dy, w.T, out_dtype, precision))(dy, w)

  if recipe.gemm_format("wgrad") != "bf16":
    def nvfp4_wgrad(dy, qxt, key_w):
      qdyt = quantize_wgrad_operand(dy, recipe.wgrad_dy, recipe, key_w)
      return block_scaled_matmul(qxt, qdyt, out_dtype=jnp.float32)
    dw = _named("nvfp4_wgrad", nvfp4_wgrad)(dy, x_saved, key_w)
  else:
    dw = _named("bf16_wgrad", lambda x, dy: _hp_matmul(
        x.T, dy, jnp.float32, precision))(x_saved, dy)
  return dx.astype(x_dtype), dw.astype(w.dtype), None


_linear.defvjp(_linear_fwd, _linear_bwd)


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, *,
                recipe: Recipe, key: jax.Array | None = None,
                precision=None, preferred_element_type=None) -> jax.Array:
  """`jax.lax.dot_general` whose three GEMMs follow `recipe`.

  Supports the contractions of linear layers (`nn.Dense`, `nn.DenseGeneral`,
  `nn.Einsum` with a weight): no batch dimensions; the free dimensions of
  `lhs` are flattened into tokens, those of `rhs` into output features.

  Args:
    lhs: activations, e.g. `[..., in]`.
    rhs: weights, e.g. `[in, out]`; float32 weights are quantized directly, so
      the weight gradient is produced in FP32.
    dimension_numbers: as for `jax.lax.dot_general`.
    recipe: the `Recipe`. With every GEMM in bf16 this is exactly
      `jax.lax.dot_general` (same outputs and gradients).
    key: PRNG key for stochastic rounding; needed when the recipe uses it and
      gradients are taken. Split internally for Dgrad and Wgrad; pass a new key
      every step and layer.
    precision: precision of the high-precision GEMMs.
    preferred_element_type: output dtype; default the promoted input dtype.

  Returns:
    The result, with `jax.lax.dot_general`'s shape.
  """
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc = tuple(lc), tuple(rc)
  if not recipe.quantized:
    if preferred_element_type is not None:
      lhs = lhs.astype(preferred_element_type)
      rhs = rhs.astype(preferred_element_type)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)
  if lb or rb:
    raise NotImplementedError(
        "nvfp4_jax.dot_general quantizes linear-layer GEMMs; batched GEMMs "
        "(attention scores and values) stay in high precision by the recipe. "
        "Use jax.lax.dot_general for them.")
  for name, a in (("lhs", lhs), ("rhs", rhs)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise TypeError(f"dot_general: {name} must be floating, got {a.dtype}.")
  out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
  lhs_free = [d for d in range(lhs.ndim) if d not in lc]
  rhs_free = [d for d in range(rhs.ndim) if d not in rc]
  k = 1
  for d in lc:
    k *= lhs.shape[d]
  free_shape = ([lhs.shape[d] for d in lhs_free]
                + [rhs.shape[d] for d in rhs_free])
  x = jnp.transpose(lhs, lhs_free + list(lc)).reshape(-1, k)
  w = jnp.transpose(rhs, list(rc) + rhs_free).reshape(k, -1)
  check_shapes(recipe, x.shape[0], k, w.shape[1])
  y = _linear(x, w, key, recipe, precision, out_dtype, x.dtype)
  return y.reshape(free_shape)
