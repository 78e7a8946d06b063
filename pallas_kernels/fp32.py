"""Exact FP32 arithmetic inside the Pallas-Triton kernels.

The numerics live in `nvfp4_jax.core.numerics` (and `nvfp4_jax.core.prng`);
the kernels apply those same jnp functions to their tiles. What is here only
makes them lower to Triton with the same results, each helper taking
`interpret` and returning the reference's jnp function when interpreted
(CPU), one or a few PTX instructions on the GPU, bit for bit the same:

- Triton lowers FP32 `/` to the approximate `div.full.f32`; `exact_divide`
  returns an IEEE `div.rn.f32` (inline PTX) on GPU and plain division in
  interpret mode, where XLA's division is already correctly rounded;
  `exact_reciprocal` and `flushed_reciprocal` likewise.
- The reference's flushes (`numerics.ftz`) as `.ftz` instructions:
  `flush`, `abs_flush`, `ftz_multiply`, `ftz_add`, `ftz_subtract`,
  `flush_bf16`, `round_hadamard`.
- NaN-propagating maxima (`max_magnitude`, where a float `max` in Triton
  drops NaN), and per-program partial amaxes as uint32 bit patterns
  (`abs_max_bits`, `combine_partial_amax`: the form
  `nvfp4_jax.core.tile.abs_max` reduces, NaN-propagating in Triton too).

Blackwell's packed FP32 (`.f32x2`) is in `fp32x2`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plt

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import tile


def exact_divide(interpret: bool) -> Callable[[jax.Array, jax.Array],
                                              jax.Array]:
  """Correctly rounded FP32 division for use inside a kernel."""
  if interpret:
    return jnp.divide

  def div_rn(a, b):
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32),
                                jnp.asarray(b, jnp.float32))
    [out] = plt.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return out
  return div_rn


def exact_reciprocal(interpret: bool) -> Callable[[jax.Array], jax.Array]:
  """`exact_divide(interpret)(1, b)`, bit for bit: on the GPU
  `rcp.rn.f32`, which the PTX ISA specifies as the IEEE 754 reciprocal
  rounded to nearest even (subnormals supported, no `.ftz`), the same
  correctly rounded result as `div.rn.f32` of 1 (also IEEE 754, round to
  nearest even) and a shorter sequence (no numerator to scale)."""
  if interpret:
    return lambda b: jnp.divide(jnp.float32(1.0), b)

  def rcp_rn(b):
    b = jnp.asarray(b, jnp.float32)
    [out] = plt.elementwise_inline_asm(
        "rcp.rn.f32 $0, $1;", args=[b], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(b.shape, jnp.float32)])
    return out
  return rcp_rn


def _f32_asm(instr: str) -> Callable[[jax.Array], jax.Array]:
  """One FP32 instruction `instr d, a` per element, as an assembly."""
  def f(x):
    x = jnp.asarray(x, jnp.float32)
    [out] = plt.elementwise_inline_asm(
        f"{instr} $0, $1;", args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return out
  return f


def abs_flush(interpret: bool) -> Callable[[jax.Array], jax.Array]:
  """`numerics.ftz(|x|)`: on the GPU one `abs.ftz.f32` (PTX ISA `abs`:
  with `.ftz` a subnormal input is flushed to a sign-preserving zero before
  the absolute value is taken, so subnormals give +0; NaN stays NaN), where
  an absolute value and `flush` take two."""
  if interpret:
    return lambda x: nm.ftz(jnp.abs(x))
  return _f32_asm("abs.ftz.f32")


def flushed_reciprocal(interpret: bool) -> Callable[[jax.Array], jax.Array]:
  """`exact_reciprocal(flush(x))` for `|x| <= 2^126`: on the GPU one
  `rcp.rn.ftz.f32`. PTX ISA `rcp`: `.rn` is the IEEE 754 reciprocal
  rounded to nearest even (as `rcp.rn.f32`), and `.ftz` flushes subnormal
  inputs to sign-preserving zero (`flush`'s result, whose reciprocal is
  the signed infinity) and subnormal results to zero; no result is
  subnormal there (`|1/x| >= 2^-126`), so the two agree bit for bit, NaN,
  zeros and infinities included. Saves `flush`'s instruction; the callers
  show the bound."""
  if interpret:
    return lambda x: exact_reciprocal(True)(nm.ftz(x))
  return _f32_asm("rcp.rn.ftz.f32")


def flush(interpret: bool) -> Callable[[jax.Array], jax.Array]:
  """`numerics.ftz` in a kernel: on the GPU one `cvt.ftz.f32.f32` per
  element (an FTZ addition of -0: subnormals become signed zeros, everything
  else passes) instead of an absolute value, a compare and a select."""
  if interpret:
    return nm.ftz

  def ftz(x):
    [out] = plt.elementwise_inline_asm(
        "cvt.ftz.f32.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return out
  return ftz


def ftz_multiply(interpret: bool) -> Callable[[jax.Array, jax.Array],
                                               jax.Array]:
  """`ftz(x) * e` for `tile.encode_blocks(multiply=...)` on unflushed `x`.

  On the GPU one `mul.ftz.f32` per element (it flushes subnormal inputs and
  products; see `tile.encode_blocks`) instead of a compare, a select and a
  multiplication; interpreted, the reference's `numerics.ftz(x) * e`.
  """
  if interpret:
    return lambda x, e: nm.ftz(x) * e

  def mul_ftz(x, e):
    x, e = jnp.broadcast_arrays(x, e)
    [out] = plt.elementwise_inline_asm(
        "mul.ftz.f32 $0, $1, $2;", args=[x, e], constraints="=f,f,f",
        pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape,
                                                          jnp.float32)])
    return out
  return mul_ftz


def _binary_ftz(interpret: bool, instr: str, twin: Callable
                ) -> Callable[[jax.Array, jax.Array], jax.Array]:
  if interpret:
    return twin

  def op(a, b):
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32),
                                jnp.asarray(b, jnp.float32))
    [out] = plt.elementwise_inline_asm(
        f"{instr} $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return out
  return op


def ftz_add(interpret: bool) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """`tile.flushed_sum` (`ftz(a + b)`, the RHT butterfly's additions): on
  the GPU one `add.rn.ftz.f32` (PTX ISA `add`: with `.ftz` subnormal inputs
  and results become sign-preserving zeros), where a plain addition would
  keep a subnormal partial sum that the reference flushes."""
  return _binary_ftz(interpret, "add.rn.ftz.f32", tile.flushed_sum)


def ftz_subtract(interpret: bool
                 ) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """`tile.flushed_difference` (`ftz(a - b)`): on the GPU one
  `sub.rn.ftz.f32`."""
  return _binary_ftz(interpret, "sub.rn.ftz.f32", tile.flushed_difference)


def max_magnitude(interpret: bool) -> Callable[[jax.Array, jax.Array],
                                                jax.Array]:
  """A running elementwise maximum of magnitudes: `m, v -> w` where
  `|w| = max(|m|, |v|)`, NaN if either is NaN; the sign of `w` is undefined.
  FP32 or bf16 (`m` and `v` of one dtype).

  On the GPU one `max.NaN.xorsign.abs` per FP32 element or bf16 pair (FMNMX,
  HMNMX2: no separate absolute values, and NaN propagates where a float
  `max` in Triton would drop it); interpreted, the same in jnp.
  """
  if interpret:
    return lambda m, v: jnp.where(jnp.isnan(m) | jnp.isnan(v), jnp.nan,
                                  jnp.maximum(jnp.abs(m), jnp.abs(v)))

  def max_abs(m, v):
    m, v = jnp.broadcast_arrays(m, v)
    pairs = m.dtype == jnp.bfloat16
    [out] = plt.elementwise_inline_asm(
        f"max.NaN.xorsign.abs.{'bf16x2' if pairs else 'f32'} $0, $1, $2;",
        args=[m, v], constraints="=r,r,r" if pairs else "=f,f,f",
        pack=2 if pairs else 1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(m.shape, m.dtype)])
    return out
  return max_abs


def flush_bf16(interpret: bool) -> Callable[[jax.Array], jax.Array]:
  """`numerics.ftz` of bf16 values, kept in bf16 (exact: they are bf16).

  On the GPU per pair of elements: both halves widened to FP32 (a shift and
  a mask), two `cvt.ftz.f32.f32`, repacked (`prmt`): five instructions, where
  Triton's own widening, the two flushes and the narrowing take six.
  """
  if interpret:
    return lambda x: nm.ftz(x.astype(jnp.float32)).astype(jnp.bfloat16)

  def ftz(x):
    [out] = plt.elementwise_inline_asm(
        """{
        .reg .b32 lo, hi;
        shl.b32 lo, $1, 16;
        and.b32 hi, $1, 0xFFFF0000;
        cvt.ftz.f32.f32 lo, lo;
        cvt.ftz.f32.f32 hi, hi;
        prmt.b32 $0, lo, hi, 0x7632;
        }""", args=[x], constraints="=r,r", pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)])
    return out
  return ftz


def round_hadamard(interpret: bool) -> Callable[[jax.Array], jax.Array]:
  """`tile.round_hadamard` (flush, round to bf16, back to FP32) in a kernel.

  On the GPU per pair of elements: two `cvt.ftz.f32.f32`, one
  `cvt.rn.bf16x2.f32`, and a shift and a mask to widen the halves again
  (five instructions, where Triton's per-element conversions take seven).
  """
  if interpret:
    return tile.round_hadamard

  def rnd(y):
    [out] = plt.elementwise_inline_asm(
        """{
        .reg .b32 a, b, p;
        cvt.ftz.f32.f32 a, $2;
        cvt.ftz.f32.f32 b, $3;
        cvt.rn.bf16x2.f32 p, b, a;
        shl.b32 $0, p, 16;
        and.b32 $1, p, 0xFFFF0000;
        }""", args=[y], constraints="=f,=f,f,f", pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(y.shape, jnp.float32)])
    return out
  return rnd


def flushed_block_amax(x: jax.Array, block_2d: bool) -> jax.Array:
  """`tile.block_amax(ftz(x), block_2d)` of unflushed FP32 blocks.

  Flushing is monotone in the magnitude, so the flushed maximum is the
  maximum's flush: one flush per block instead of one per element.
  """
  return nm.ftz(tile.block_amax(x, block_2d))


def abs_max_bits(x: jax.Array) -> jax.Array:
  """`tile.abs_max` of all of FP32 `x`, as its uint32 bit pattern (a partial)."""
  return jax.lax.bitcast_convert_type(tile.abs_max(x), jnp.uint32)


def combine_partial_amax(*bits: jax.Array) -> tuple[jax.Array, ...]:
  """Reduces per-program amax bit patterns (uint32) to FP32 tensor amaxes.

  Several partial arrays (one kernel's, of one shape) are reduced by one
  variadic reduction: one XLA kernel for all, not one per amax. The bit
  patterns of non-negative floats order as the floats, and a NaN's
  (`abs_max_bits`) above Inf's, so the maximum propagates NaN.

  Returns:
    One FP32 scalar per argument.
  """
  zero = np.uint32(0)
  maxes = jax.lax.reduce(
      bits, (zero,) * len(bits),
      lambda a, b: tuple(jnp.maximum(u, v) for u, v in zip(a, b)),
      tuple(range(bits[0].ndim)))
  return tuple(jax.lax.bitcast_convert_type(m, jnp.float32) for m in maxes)
