"""Blackwell's packed FP32 (`.f32x2`, sm_100a/sm_103a) inside the
Pallas-Triton kernels.

PTX ISA (`add`, `sub`, `mul`, "Floating Point Instructions"; PTX 8.6,
sm_100 and up): with type `.f32x2` the operands are `.b64` register pairs
and each lane is the `.f32` instruction of the same rounding and `.ftz`
(`d[i] = a[i] op b[i]`, i = 0, 1: bits 0-31 and 32-63). So a paired
instruction is bit for bit the two scalar ones it replaces; `mov.b64 x,
{a, b}` puts `a` in lane 0 (bits 0-31), which `mov.b64 {a, b}, x` reads
back. ptxas allocates the pairs as adjacent registers (FADD2, FMUL2: no
moves in the SASS). Interpreted, each helper is its scalar jnp twin
(`fp32`'s). `max_magnitude3` is sm_100's three-source maximum.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plt

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import tile
from pallas_kernels import fp32


def x2_asm(body: str) -> str:
  """Assembly of one paired instance: the FP32 operands `$2`, `$3` as the
  lanes of the `.b64` register `a`, then `body` (which writes `d`, and may
  read `$4`, `$5` ...), then `d`'s lanes as the results `$0`, `$1`."""
  return ("{\n.reg .b64 a, b, d;\nmov.b64 a, {$2, $3};\n" + body
          + "\nmov.b64 {$0, $1}, d;\n}")


def x2_call(asm: str, args: list[jax.Array]) -> jax.Array:
  """`asm` (an `x2_asm`) on FP32 `args` (broadcast together), two
  neighbouring elements per instance: the FP32 result."""
  args = jnp.broadcast_arrays(*[jnp.asarray(a, jnp.float32) for a in args])
  constraints = "=f,=f," + ",".join(["f", "f"] * len(args))
  [out] = plt.elementwise_inline_asm(
      asm, args=list(args), constraints=constraints, pack=2,
      result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])
  return out


def add_x2(interpret: bool) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """`tile.flushed_sum` (FP32 `ftz(a + b)`, round to nearest even:
  `add.rn.ftz.f32`, `ftz_add`'s), two lanes per `add.rn.ftz.f32x2` on the
  GPU."""
  if interpret:
    return tile.flushed_sum
  asm = x2_asm("mov.b64 b, {$4, $5};\nadd.rn.ftz.f32x2 d, a, b;")
  return lambda a, b: x2_call(asm, [a, b])


def sub_x2(interpret: bool) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """`tile.flushed_difference` (`sub.rn.ftz.f32`), two lanes per
  `sub.rn.ftz.f32x2`."""
  if interpret:
    return tile.flushed_difference
  asm = x2_asm("mov.b64 b, {$4, $5};\nsub.rn.ftz.f32x2 d, a, b;")
  return lambda a, b: x2_call(asm, [a, b])


def mul_ftz_const_x2(interpret: bool, c: float
                     ) -> Callable[[jax.Array], jax.Array]:
  """`ftz(x) * c` with its product flushed (`mul.rn.ftz.f32` by the FP32
  constant `c`, `ftz_multiply`'s), two lanes per `mul.rn.ftz.f32x2` with
  `c` an immediate operand of both lanes; FP32 or bf16 `x` (a bf16 pair
  widened in the same assembly, two instructions per pair). Interpreted,
  `ftz_multiply`'s twin."""
  c = np.float32(c)
  if interpret:
    return lambda x: nm.ftz(x.astype(jnp.float32)) * c
  k = f"0f{int(c.view(np.uint32)):08X}"
  asm = x2_asm(f"mov.b64 b, {{{k}, {k}}};\nmul.rn.ftz.f32x2 d, a, b;")
  # bf16 `x`: the pair's register widened by a shift and a mask (exact).
  asm_bf16 = ("{\n.reg .b64 a, b;\n.reg .b32 l, h;\nshl.b32 l, $2, 16;\n"
              "and.b32 h, $2, 0xFFFF0000;\nmov.b64 a, {l, h};\n"
              f"mov.b64 b, {{{k}, {k}}};\nmul.rn.ftz.f32x2 a, a, b;\n"
              "mov.b64 {$0, $1}, a;\n}")

  def mul(x):
    if x.dtype != jnp.bfloat16:
      return x2_call(asm, [x])
    [out] = plt.elementwise_inline_asm(
        asm_bf16, args=[x], constraints="=f,=f,r", pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return out
  return mul


def round_bf16_widened(interpret: bool) -> Callable[[jax.Array], jax.Array]:
  """`tile.round_hadamard` of an FP32 array, each result widened back to
  FP32 (exact): `f32(bf16(ftz(x)))`. On the GPU per pair of neighbouring
  elements one `add.rn.ftz.f32x2` of -0 (flushes subnormals to signed
  zeros, passes everything else: `x + -0 = x`, also for +0; the
  `cvt.ftz.f32.f32` of `round_hadamard`), then per element one
  `cvt.rn.bf16x2.f32 d, x, 0` (PTX ISA `cvt`: both sources rounded to
  nearest even, the first into the upper half of `d`, the second, +0,
  into the lower half as 0x0000): `d` is the bf16 result's bits followed
  by 16 zero bits, i.e. its FP32 widening, with no shift or mask to widen
  it."""
  if interpret:
    return lambda x: nm.ftz(x).astype(jnp.bfloat16).astype(jnp.float32)
  asm = """{
.reg .b64 a, z;
.reg .b32 l, h, zero;
mov.b32 zero, 0;
mov.b64 z, {0f80000000, 0f80000000};
mov.b64 a, {$2, $3};
add.rn.ftz.f32x2 a, a, z;
mov.b64 {l, h}, a;
cvt.rn.bf16x2.f32 $0, l, zero;
cvt.rn.bf16x2.f32 $1, h, zero;
}"""

  def rnd(x):
    x = jnp.asarray(x, jnp.float32)
    [out] = plt.elementwise_inline_asm(
        asm, args=[x], constraints="=f,=f,f,f", pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return out
  return rnd


def max_magnitude3(interpret: bool) -> Callable[..., jax.Array]:
  """The largest magnitude of two or three FP32 arrays, elementwise, NaN
  if any is NaN: on the GPU one `max.NaN.abs.f32 d, a, b, c` (PTX ISA
  `max`, three sources, sm_100: the maximum of the absolute values, NaN
  if any input is NaN) or `max.NaN.xorsign.abs.f32` of two (whose sign
  is then undefined: callers take the absolute value); interpreted, the
  same in jnp (result signs 0)."""
  if interpret:
    def mx(*xs):
      m = functools.reduce(jnp.maximum, [jnp.abs(x) for x in xs])
      nan = functools.reduce(jnp.logical_or, [jnp.isnan(x) for x in xs])
      return jnp.where(nan, jnp.float32(jnp.nan), m)
    return mx

  def mx(*xs):
    if len(xs) == 2:
      return fp32.max_magnitude(False)(*xs)
    xs = jnp.broadcast_arrays(*[jnp.asarray(x, jnp.float32) for x in xs])
    [out] = plt.elementwise_inline_asm(
        "max.NaN.abs.f32 $0, $1, $2, $3;", args=list(xs),
        constraints="=f,f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(xs[0].shape, jnp.float32)])
    return out
  return mx
