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
from nvfp4_jax.fused import quantize_rht_t, quantize_x_and_rht_t
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
  if op.format == "nvfp4" and op.rht:
    return quantize_rht_t(x, rounding=op.rounding, key=key,
                          sign_vector=recipe.rht_sign_vector,
                          size=recipe.rht_size)
  xt = x.T
  if op.rht:
    xt = rht(xt, sign_vector=recipe.rht_sign_vector, size=recipe.rht_size)
  return quantize_operand(xt, op, key)


def quantize_both(x: jax.Array, row_op: Operand, wgrad_op: Operand,
                  recipe: Recipe, key: jax.Array | None
                  ) -> tuple[QArray | None, QArray | None]:
  """`(q(x), q(rht(x^T)))` of an activation (X) or gradient (dY).

  `row_op` quantizes `x` along its last axis (Fprop's X, Dgrad's dY) and
  `wgrad_op` its transpose for Wgrad; either may be high precision (None is
  returned for it). When both are the recipe's NVFP4 1x16 + RHT pair, one fused
  quantizer reads `x` once for both (the Pallas kernel on GPU). With a key,
  the two operands round with `jax.random.split(key)`.
  """
  if "stochastic" not in (row_op.rounding, wgrad_op.rounding):
    key = None
  fusable = (row_op.format == wgrad_op.format == "nvfp4" and wgrad_op.rht
             and not row_op.block_2d and row_op.rounding == wgrad_op.rounding
             and (row_op.rounding == "nearest") == (key is None))
  if fusable:
    return quantize_x_and_rht_t(x, key=key, sign_vector=recipe.rht_sign_vector,
                                size=recipe.rht_size)
  keys = jax.random.split(key) if key is not None else (None, None)
  q_row = quantize_operand(x, row_op, keys[0]) if row_op.quantized else None
  q_t = (quantize_wgrad_operand(x, wgrad_op, recipe, keys[1])
         if wgrad_op.quantized else None)
  return q_row, q_t


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


def _gemm(name: str, out_dtype):
  """A named block-scaled GEMM region taking quantized operands."""
  return _named(name, lambda a, b: block_scaled_matmul(a, b,
                                                       out_dtype=out_dtype))


def _linear_fwd(x, w, key, recipe: Recipe, precision, out_dtype, x_dtype):
  del x_dtype
  fprop_q = recipe.gemm_format("fprop") != "bf16"
  wgrad_q = recipe.gemm_format("wgrad") != "bf16"
  qx, qxt = _named("nvfp4_quantize_x", lambda x: quantize_both(
      x, recipe.fprop_x, recipe.wgrad_x, recipe, None))(x)
  if fprop_q:
    qw = _named("nvfp4_quantize_w", lambda w: quantize_operand(
        w.T, recipe.fprop_w, None))(w)
    y = _gemm("nvfp4_fprop", out_dtype)(qx, qw)
  else:
    y = _named("bf16_fprop", functools.partial(
        _hp_matmul, dtype=out_dtype, precision=precision))(x, w)
    qw = None
  # Dgrad's weight: with identical 16x16 settings it is Fprop's quantized W,
  # transposed (exactly what quantizing the kernel along `out` gives);
  # otherwise it is quantized in the backward pass from `w`, alive anyway.
  reuse_w = (qw is not None and recipe.dgrad_w == recipe.fprop_w
             and recipe.fprop_w.block_2d)
  return y, (qxt if wgrad_q else x, w, qw if reuse_w else None, key)


def _linear_bwd(recipe: Recipe, precision, out_dtype, x_dtype, res, dy):
  x_saved, w, qw_fprop, key = res
  dgrad_q = recipe.gemm_format("dgrad") != "bf16"
  wgrad_q = recipe.gemm_format("wgrad") != "bf16"
  if recipe.needs_key and key is None:
    raise ValueError(
        "this recipe uses stochastic rounding in the backward pass but no key "
        "was given: pass key= to nvfp4_jax.dot_general, or rngs={'nvfp4': "
        "key} to the NVFP4 layer's apply (a new key every step).")
  qdy, qdyt = _named("nvfp4_quantize_dy", lambda dy, key: quantize_both(
      dy, recipe.dgrad_dy, recipe.wgrad_dy, recipe, key))(dy, key)

  if dgrad_q:
    qw = (qw_fprop.T if qw_fprop is not None else _named(
        "nvfp4_quantize_w", lambda w: quantize_operand(
            w, recipe.dgrad_w, None))(w))
    dx = _gemm("nvfp4_dgrad", jnp.float32)(qdy, qw)
  else:
    dx = _named("bf16_dgrad", lambda dy, w: _hp_matmul(
        dy, w.T, out_dtype, precision))(dy, w)
  if wgrad_q:
    dw = _gemm("nvfp4_wgrad", jnp.float32)(x_saved, qdyt)
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
