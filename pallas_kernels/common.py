"""Plumbing shared by the Pallas-Triton kernels: backend checks, exact division,
NaN-propagating maxima and the launch helper.

The numerics live in `nvfp4_jax.core.numerics` (and `nvfp4_jax.core.prng`); the kernels
apply those same jnp functions to their tiles. What is here only makes them
lower to Triton with the same results:

- Triton lowers FP32 `/` to the approximate `div.full.f32`; `exact_divide`
  returns an IEEE `div.rn.f32` (inline PTX) on GPU and plain division in
  interpret mode, where XLA's division is already correctly rounded.
- Pallas-Triton does not mask `ref[...]` of a partial tile: out-of-bounds
  loads read other rows' (or other buffers') memory and out-of-bounds stores
  corrupt them. `bounds_mask` + `load`/`store` mask partial tiles explicitly
  (interpret mode pads instead, which hid this on CPU).
- Per-program partial amaxes travel as uint32 bit patterns (the form
  `nvfp4_jax.core.tile.abs_max` reduces, NaN-propagating in Triton too).
- `block_encoder` (E2M1 rounding, packing, block values) and `block_values`
  / `block_value_pairs` (decoding) are inline PTX on the GPU, bit for bit
  the `nvfp4_jax.core.tile` functions they replace (tests/test_encoder.py,
  tests/test_kernels.py); interpreted, they are those functions.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from nvfp4_jax.core import dispatch
from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import tile


def backend() -> str:
  """The platform the kernels will run on: "gpu", "cpu", "tpu", ...
  (a `dispatch.target_device` block's, if any)."""
  return dispatch.target_platform() or jax.default_backend()


def check_backend(what: str) -> bool:
  """Raises NotImplementedError where Pallas-Triton cannot run.

  Returns:
    Whether to run in interpret mode (True on CPU).
  """
  b = backend()
  if b == "cpu":
    return True
  if b != "gpu":
    raise NotImplementedError(
        f"{what}: the Pallas kernels target NVIDIA GPUs through Triton (and run "
        f"interpreted on CPU); backend {b!r} is not supported. Use "
        f"implementation='xla'.")
  cc = compute_capability()
  if cc is not None and cc < (8, 9):
    raise NotImplementedError(
        f"{what}: the kernels cast to float8_e4m3fn, which Triton supports from "
        f"compute capability 8.9; this GPU is {cc}. Use implementation='xla'.")
  return False


def compute_capability() -> tuple[int, int] | None:
  """`(major, minor)` of the first GPU, or None (`dispatch.compute_capability`)."""
  return dispatch.compute_capability()


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


# `block_values` on the GPU: E2M1 decoding by byte permutation (`prmt`), the
# way Triton's and TransformerEngine's FP8 conversions work. The magnitudes
# 0, .5, 1, 1.5, 2, 3, 4, 6 are the bf16 patterns 0x0000, 0x3F00, 0x3F80,
# 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0: their low and high bytes (entries
# 0-3, 4-7) are two 8-byte tables, and one `prmt` looks up four 3-bit codes
# (its selector nibbles) in one table. An instance takes 4 codes, one per
# byte ($2), and their bf16 scales ($3, $4), and returns their 4 values, 2
# per register ($0, $1): it gathers the magnitudes into selector nibbles,
# looks up both bytes, interleaves them, copies each code's sign (its bit 3,
# moved to its byte's msb) to bit 15 of its bf16, and multiplies by the
# scales with `mul.rn.bf16x2` (exact: at most 2 x 4 significant bits).
# Codes come one per byte (the jnp unpacking of nibbles) so that nothing
# reorders the assembly's packed bf16 results: XLA:GPU's Triton interleaves
# two such results pairwise, not element by element (seen on the H100).
# The low (lt0, lt1) and high (ht0, ht1) bytes of the eight magnitudes' bf16
# patterns, the lookup tables of both decoders.
_BF16_BYTE_TABLES = """mov.b32 lt0, 0xC0800000;
mov.b32 lt1, 0xC0804000;
mov.b32 ht0, 0x3F3F3F00;
mov.b32 ht1, 0x40404040;
"""
_DECODE_ASM = """{
.reg .b32 lt0, lt1, ht0, ht1, x, y, l, h, r4, t0, t1, s0, s1;
""" + _BF16_BYTE_TABLES + """and.b32 x, $2, 0x07070707;
shr.u32 y, x, 4;
or.b32 x, x, y;
prmt.b32 x, x, x, 0x0020;
prmt.b32 l, lt0, lt1, x;
prmt.b32 h, ht0, ht1, x;
prmt.b32 t0, l, h, 0x5140;
prmt.b32 t1, l, h, 0x7362;
shl.b32 r4, $2, 4;
prmt.b32 s0, r4, r4, 0x1000;
prmt.b32 s1, r4, r4, 0x3020;
and.b32 s0, s0, 0x80008000;
and.b32 s1, s1, 0x80008000;
or.b32 t0, t0, s0;
or.b32 t1, t1, s1;
mul.rn.bf16x2 t0, t0, $3;
mul.rn.bf16x2 t1, t1, $4;
mov.b32 $0, t0;
mov.b32 $1, t1;
}"""

# Whether `block_values` uses `_DECODE_ASM` on the GPU (benchmarks switch it
# off to time the jnp decode in the same run).
ASM_DECODE = True


def block_values(packed: jax.Array, scales: jax.Array, interpret: bool
                 ) -> jax.Array:
  """`tile.block_values(packed, scales)` (bf16 `[..., nb, 16]`) in a kernel.

  Interpreted, it is that function; on the GPU the same values come from
  `_DECODE_ASM` (about 3.5 instructions per element after unpacking, instead
  of ~15 integer and float operations), bit for bit: tests/test_kernels.py
  checks all 256 code bytes under all 256 E4M3 scales on the GPU.
  """
  if interpret or not ASM_DECODE:
    return tile.block_values(packed, scales)
  codes = nm.unpack_e2m1(packed)
  s = jnp.broadcast_to(scales.astype(jnp.bfloat16)[..., None], codes.shape)
  [values] = plt.elementwise_inline_asm(
      _DECODE_ASM, args=[codes, s], constraints="=r,=r,r,r,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, jnp.bfloat16)])
  return values


# `block_value_pairs` on the GPU: the same byte permutation, on packed bytes.
# An instance takes 4 bytes ($2, 8 codes) and each byte's bf16 scale ($3, $4:
# bytes 0-1, 2-3) and returns the values of the bytes' low nibbles (the even
# elements) or of their high nibbles (the odd ones), two per register ($0,
# $1), each in its byte's position: no nibble unpacking, and no result
# depends on how Triton packs a thread's elements into instances. Masked with
# 0x77777777 the bytes' nibbles are the magnitudes in element order, so the
# low 16 bits of the word and of the word shifted by 16 are selectors of four
# lookups each (elements 0-3 and 4-7); a `prmt` interleaves the low and high
# bytes of the even (0x6240) or odd (0x7351) elements into bf16 pairs; each
# code's sign (bit 3 of its nibble) is the msb of its byte in the word
# shifted left by 4 (even) or in the word itself (odd), moved to bits 15 and
# 31 by a `prmt`; `mul.rn.bf16x2` applies the scales (exact). The even and
# odd instances share their first 7 instructions, which ptxas computes once
# (Pallas-Triton lowers assembly with one result only, jax 0.11: two results
# fail to lower): ~3 instructions per value.
def _pair_decode_asm(odd: bool) -> str:
  interleave, sign = ("0x7351", "$2") if odd else ("0x6240", "r4")
  halves = "".join(f"""
prmt.b32 l, lt0, lt1, {sel};
prmt.b32 h, ht0, ht1, {sel};
prmt.b32 v, l, h, {interleave};
prmt.b32 s, {sign}, {sign}, {signsel};
and.b32 s, s, 0x80008000;
or.b32 v, v, s;
mul.rn.bf16x2 {out}, v, {scale};""" for sel, signsel, out, scale in (
      ("t", "0x1000", "$0", "$3"), ("u", "0x3020", "$1", "$4")))
  return """{
.reg .b32 lt0, lt1, ht0, ht1, t, u, l, h, r4, s, v;
""" + _BF16_BYTE_TABLES + """and.b32 t, $2, 0x77777777;
shr.u32 u, t, 16;
shl.b32 r4, $2, 4;""" + halves + "\n}"


_DECODE_PAIRS_ASM = (_pair_decode_asm(False), _pair_decode_asm(True))


def block_value_pairs(packed: jax.Array, scales: jax.Array, interpret: bool
                      ) -> tuple[jax.Array, jax.Array]:
  """`tile.block_value_pairs(packed, scales)` (bf16 `[..., nb, 8]` each) in a
  kernel: interpreted that function, on the GPU `_DECODE_PAIRS_ASM`, bit for
  bit (tests/test_kernels.py: all 256 code bytes under all 256 scales)."""
  if interpret or not ASM_DECODE:
    return tile.block_value_pairs(packed, scales)
  packed = packed.astype(jnp.uint8)
  s = jnp.broadcast_to(scales.astype(jnp.bfloat16)[..., None], packed.shape)
  return tuple(plt.elementwise_inline_asm(
      asm, args=[packed, s], constraints="=r,=r,r,r,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)]
  )[0] for asm in _DECODE_PAIRS_ASM)


# `tile.encode_blocks`' step 4 on the GPU: E2M1 rounding, packing and the
# block values in the FMA pipe. The kernels were bound by Hopper's integer
# pipe (half the FP32 rate; the encoders' bit manipulation ran there), so this
# rounds with FP32 fused multiply-adds and keeps the integer work to three
# minima, a funnel shift and a share of one logic operation per element.
#
# With `u = sat(|y| / 8)` (the `.sat` maps NaN to 0 and clamps at |y| = 8; a
# power-of-two scaling, exact unless `u` is flushed, where the code is 0
# anyway) the three grid regimes of E2M1 (steps 1/2 below 2, 1 below 4, 2
# from 4) give candidate codes `C_j = 2^23 + off_j + round(|y| / step_j)`
# (offsets 0, 2, 4) as the FP32 sum of one FFMA: rounding to nearest even at
# ulp 1 is `rint`, and stochastically `ceil(|y| / step - (r + 1/2) / 256)`,
# i.e. up iff `256 t > r + 1/2` (`numerics.e2m1_encode_stochastic`), from two
# FFMAs rounding up (`ceil(RP(z) / 512) = ceil(z / 512)`: multiples of 512 are
# FP32 numbers). The stochastic candidates carry one more (2^23 + 1 + ...):
# their `z / 512` reaches down to -1, and below 2^23 the ulp is 1/2. A finer
# regime's candidate is never below the right one above its range and a
# coarser one never below it inside, so the code is the minimum of the three
# and 7 (saturation), taken on the bit patterns (FP32 order = uint32 order
# for positive numbers): `2^23 + base + code`. An IMAD chain packs 8 codes'
# low nibbles into one word; a funnel-shift chain gathers the signs' bits
# into bit 3 of each nibble. tests/test_encoder.py checks a model of each
# FP32 rounding against `numerics` on the CPU (all of its cases), and on the
# GPU the assembly itself.
_NEAREST = (0, (("c1", "0f41800000", "0f4B000000"),   # 16u + 2^23: 2|y|
                ("c2", "0f41000000", "0f4B000002"),   # 8u + 2^23 + 2
                ("c3", "0f40800000", "0f4B000004")))  # 4u + 2^23 + 4
_STOCHASTIC = (1, (("c1", "0f46000000", "0f4B000001"),  # 8192u = 512|y|/(1/2)
                   ("c2", "0f45800000", "0f4B000003"),  # 4096u = 512|y|/1
                   ("c3", "0f45000000", "0f4B000005")))  # 2048u = 512|y|/2


def _base(stochastic: bool) -> int:
  """The candidates' bit pattern for code 0: `2^23 + base`."""
  return 0x4B000000 + (_STOCHASTIC if stochastic else _NEAREST)[0]


def _code_asm(y: str, rand: tuple[str, str] | None, out: str) -> str:
  """PTX setting `out` to the bits of `2^23 + base + code magnitude` of the
  scaled value `y` (`_base`).

  `rand`: `(register, prmt selector)` of the element's random byte for
  stochastic rounding (the selector moves it under 0x4B: `2^23 + r`), or
  None to round to nearest even.
  """
  lines = [f"abs.ftz.f32 u, {y};", "mul.rn.ftz.sat.f32 u, u, 0f3E000000;"]
  if rand is None:
    lines += [f"fma.rn.f32 {c}, u, {k}, {b};" for c, k, b in _NEAREST[1]]
  else:
    reg, sel = rand
    # q = -(2r + 1), exact.
    lines += [f"prmt.b32 q, {reg}, k4b, {sel};",
              "fma.rn.f32 q, q, 0fC0000000, 0f4B7FFFFF;"]
    for c, k, b in _STOCHASTIC[1]:  # / 512 + 2^23 + 1 + off
      lines += [f"fma.rp.f32 {c}, u, {k}, q;",
                f"fma.rp.f32 {c}, {c}, 0f3B000000, {b};"]
  sat = _base(rand is not None) + 7
  lines += [f"min.u32 {out}, c1, c2;", f"min.u32 {out}, {out}, c3;",
            f"min.u32 {out}, {out}, {sat:#010x};"]
  return "\n".join(lines)


# Operands of an instance (pack=4, four pairs of elements): the even elements'
# scaled values $1-$4, the odd ones' $5-$8, then (values) the pairs' decoded
# scales and (stochastic) their hash words, each shifted so that the pair's
# bytes are its low two (even: byte 0, odd: byte 1).
def _operands(first: int, values: bool, stochastic: bool):
  ye = [f"${first + k}" for k in range(4)]
  yo = [f"${first + 4 + k}" for k in range(4)]
  nxt = first + 8
  d = None
  if values:
    d, nxt = [f"${nxt + k}" for k in range(4)], nxt + 4
  rand = lambda k, odd: None
  if stochastic:
    w = [f"${nxt + k}" for k in range(4)]
    rand = lambda k, odd: (w[k], "0x7441" if odd else "0x7440")
  return ye, yo, d, rand


def _encode_codes_asm(stochastic: bool) -> str:
  """One output register: the 4 pairs' packed bytes (even element in the low
  nibble), each byte computed from its own pair only."""
  ye, yo, _, rand = _operands(1, False, stochastic)
  order = [(y[k], rand(k, odd)) for k in (3, 2, 1, 0)
           for y, odd in ((yo, True), (ye, False))]  # Nibble 7 first.
  body = []
  for n, (y, r) in enumerate(order):
    body.append(_code_asm(y, r, "m"))
    if n == 0:
      body += ["mov.b32 acc, m;", f"shr.b32 s, {y}, 28;"]
    else:  # acc = acc * 16 + m; s = s << 4 | y >> 28 (y's sign -> bit 3).
      body += ["mad.lo.u32 acc, acc, 16, m;", f"shf.l.wrap.b32 s, {y}, s, 4;"]
  # sum(m_i 16^i) = sum(code_i 16^i) + sum(base 16^i) mod 2^32.
  correction = -sum(_base(stochastic) << (4 * i) for i in range(8)) % 2**32
  body += [f"add.u32 acc, acc, {correction:#010x};",
           "lop3.b32 $0, s, 0x88888888, acc, 0xEA;"]  # (s & 0x888..) | acc
  return ("{\n.reg .b32 u, q, c1, c2, c3, m, acc, s, k4b;\n"
          "mov.b32 k4b, 0x4B000000;\n" + "\n".join(body) + "\n}")


def _encode_values_asm(stochastic: bool) -> str:
  """Four output registers: pair k's bf16 block values (even element low)."""
  ye, yo, d, rand = _operands(4, True, stochastic)
  body = []
  for k in range(4):
    for y, odd, v in ((ye[k], False, "ve"), (yo[k], True, "vo")):
      # c << 22 is the E2M1 value's FP32 pattern times 2^-126 (0.5 -> 2^-127
      # subnormal, 6 -> 1.5 * 2^-124); with the sign, times 2^126 (exact,
      # no flush), times d (exact): `e2m1_decode(code) * d`.
      low = -_base(stochastic) << 22 & 0xFFFFFFFF  # (m - base) << 22
      body += [_code_asm(y, rand(k, odd), "m"),
               f"mad.lo.u32 {v}, m, 0x00400000, {low:#010x};",
               f"lop3.b32 {v}, {y}, 0x80000000, {v}, 0xEA;",
               f"mul.rn.f32 {v}, {v}, 0f7E800000;",
               f"mul.rn.f32 {v}, {v}, {d[k]};"]
    body.append(f"cvt.rn.bf16x2.f32 ${k}, vo, ve;")
  return ("{\n.reg .b32 u, q, c1, c2, c3, m, ve, vo, k4b;\n"
          "mov.b32 k4b, 0x4B000000;\n" + "\n".join(body) + "\n}")


def _encode_codes_cvt_asm() -> str:
  """`_encode_codes_asm(False)` with Blackwell's E2M1 conversion
  (`HW_E2M1_CCS`): `cvt.rn.satfinite.e2m1x2.f32` rounds two values to
  nearest even and packs them (first operand in the high nibble).

  Bit for bit the software encoder by construction: the magnitude converted
  is `max(|y|, 0)` with `abs.ftz` (FTZ flushes subnormals, which round to
  code 0 in both; `max` without `.NaN` maps NaN to 0, as the software
  encoder's `.sat` does); on non-negative finite inputs the conversion is
  E2M1's round-to-nearest-even with saturation at 6 (`.satfinite`: code 7),
  the encoder's rounding (`numerics.e2m1_encode`: ties to the even code,
  whose mantissa bit is 0, as the `rint` of `2^23 + off + |y| / step` with
  an even offset); the sign bits come from `y` itself, gathered as before.
  Checked bit for bit on the device by `benchmarks.check_device` (the
  quantizers against the CPU reference).
  """
  ye, yo, _, _ = _operands(1, False, False)
  body = []
  for k in range(4):  # Byte k: pair k, odd element high.
    body += [f"abs.ftz.f32 e, {ye[k]};", "max.f32 e, e, 0f00000000;",
             f"abs.ftz.f32 o, {yo[k]};", "max.f32 o, o, 0f00000000;",
             f"cvt.rn.satfinite.e2m1x2.f32 b{k}, o, e;"]
  body.append("mov.b32 acc, {b0, b1, b2, b3};")
  order = [y[k] for k in (3, 2, 1, 0) for y in (yo, ye)]  # Nibble 7 first.
  body.append(f"shr.b32 s, {order[0]}, 28;")
  body += [f"shf.l.wrap.b32 s, {y}, s, 4;" for y in order[1:]]
  body.append("lop3.b32 $0, s, 0x88888888, acc, 0xEA;")  # (s & 0x88..) | acc
  return ("{\n.reg .b32 e, o, acc, s;\n.reg .b8 b0, b1, b2, b3;\n"
          + "\n".join(body) + "\n}")


def _encode_values_cvt_asm() -> str:
  """`_encode_values_asm(False)` with Blackwell's E2M1 conversions
  (`HW_E2M1_CCS`): pair k's bf16 block values `e2m1_decode(code) * d`
  (even element low), for any scaled values.

  Bit for bit the software encoder, per the PTX ISA: the code's magnitude
  comes from `_encode_codes_cvt_asm`'s conversion of `max(|y|, 0)` (NaN ->
  0); `cvt.rn.f16x2.e2m1x2` decodes two E2M1 codes to f16, exactly (every
  E2M1 value is an f16; the packed byte's upper nibble to the upper half),
  `cvt.f32.f16` widens exactly, the sign is `y`'s bit 31 (as the code's
  sign bit, `numerics.e2m1_encode_nearest`), and the rest is the software
  encoder's: `mul.rn.f32` by `d` (exact: at most 2 x 4 significant bits)
  and `cvt.rn.bf16x2.f32` (exact). A NaN `d` gives the GPU's canonical NaN,
  as there.
  """
  ye, yo, d, _ = _operands(4, True, False)
  body = []
  for k in range(4):
    body += [f"abs.ftz.f32 e, {ye[k]};", "max.f32 e, e, 0f00000000;",
             f"abs.ftz.f32 o, {yo[k]};", "max.f32 o, o, 0f00000000;",
             "cvt.rn.satfinite.e2m1x2.f32 b, o, e;",
             "cvt.rn.f16x2.e2m1x2 h, b;",
             "mov.b32 {he, ho}, h;",
             "cvt.f32.f16 e, he;", "cvt.f32.f16 o, ho;",
             f"lop3.b32 e, {ye[k]}, 0x80000000, e, 0xEA;",
             f"lop3.b32 o, {yo[k]}, 0x80000000, o, 0xEA;",
             f"mul.rn.f32 e, e, {d[k]};", f"mul.rn.f32 o, o, {d[k]};",
             f"cvt.rn.bf16x2.f32 ${k}, o, e;"]
  return ("{\n.reg .b32 e, o, h;\n.reg .b16 he, ho;\n.reg .b8 b;\n"
          + "\n".join(body) + "\n}")


def _encode_codes_cvt_signed_asm() -> str:
  """`_encode_codes_cvt_asm` without the magnitudes and the sign gathering,
  for kernels whose blocks are NaN as a whole (`block_encoder(...,
  block_nan=True)`): the conversion takes the signed scaled values.

  Per the PTX ISA (`cvt`, "Floating Point Conversion" with `.f4x2type`
  `.e2m1x2`), `cvt.rn.satfinite.e2m1x2.f32 d, a, b` rounds each FP32 input
  to E2M1 to nearest even, clamps finite and infinite magnitudes above
  MAX_NORM (6.0) to +-6.0 (`.satfinite`; code 7), and packs the value of `a`
  into the upper and that of `b` into the lower nibble. As any IEEE
  conversion it keeps the sign, also of results that round to zero (-0.1
  and -0 give 0x8, E2M1's -0): the code is `sign | magnitude code`,
  `numerics.e2m1_encode_nearest`'s, which takes the sign from bit 31 of `y`
  (`common.e2m1x2_cvt_model`, tested against it in tests/test_encoder.py).
  Subnormal inputs round to +-0 in both. The ISA does not say which code a
  NaN input gets (E2M1 has no NaN), so NaNs are not converted: the kernels
  that take this encoder have NaN scaled values exactly in the blocks whose
  decoded scale is NaN (a NaN element makes its block amax NaN, hence the
  scale and the reciprocal, and every `y` of the block; a NaN scale makes
  every `y` NaN; the reciprocal is finite otherwise and `x` is then not
  NaN), and there `mul.ftz.f32` returned the canonical NaN (0x7FFFFFFF,
  sign 0), for which the other encoders write code 0. So one element of
  the instance (its 4 pairs are 8 consecutive elements of one block, see
  `block_encoder`) decides: NaN -> the word 0, else the conversion's.
  Checked bit for bit on the device by `benchmarks.check_device`.
  """
  ye, yo, _, _ = _operands(1, False, False)
  body = [f"cvt.rn.satfinite.e2m1x2.f32 b{k}, {yo[k]}, {ye[k]};"
          for k in range(4)]  # Byte k: pair k, odd element high.
  body += ["mov.b32 acc, {b0, b1, b2, b3};",
           f"testp.notanumber.f32 nan, {ye[0]};",
           "selp.b32 $0, 0, acc, nan;"]
  return ("{\n.reg .b32 acc;\n.reg .b8 b0, b1, b2, b3;\n.reg .pred nan;\n"
          + "\n".join(body) + "\n}")


# The E2M1 magnitudes' rounding thresholds (between code i and i + 1).
_E2M1_THRESHOLDS = np.array([.25, .75, 1.25, 1.75, 2.5, 3.5, 5.], np.float32)


def e2m1x2_cvt_model(y: np.ndarray) -> np.ndarray:
  """NumPy model of `_encode_codes_cvt_signed_asm`'s conversion, per
  element: the E2M1 code of FP32 `y` as `cvt.rn.satfinite.e2m1x2.f32`
  writes it (round to nearest, ties to the even code; magnitudes above 6
  and infinities to 6; the sign kept), and code 0 for NaN (the word of a
  NaN block). Written from the ISA's description (comparisons against the
  thresholds), independently of `numerics.e2m1_encode_nearest`."""
  y = np.asarray(y, np.float32)
  mag = np.abs(y)
  above = (mag[..., None] > _E2M1_THRESHOLDS).sum(-1)
  tie_up = ((mag[..., None] == _E2M1_THRESHOLDS)
            & (np.arange(7) % 2 == 1)).sum(-1)  # To the even code i + 1.
  code = (above + tie_up).astype(np.uint8) | np.where(
      np.signbit(y), np.uint8(8), np.uint8(0))
  return np.where(np.isnan(y), np.uint8(0), code)


_ENCODE_ASM = {(v, sr): (_encode_values_asm if v else _encode_codes_asm)(sr)
               for v in (False, True) for sr in (False, True)}
_ENCODE_CODES_CVT_SIGNED_ASM = _encode_codes_cvt_signed_asm()
_ENCODE_VALUES_CVT_ASM = _encode_values_cvt_asm()
# Round-to-nearest codes where the E2M1 conversion compiles (HW_E2M1_CCS).
# Stochastic rounding keeps the software encoder: PTX's `cvt.rs` takes
# caller-given random bits, but its specification does not say how they
# enter the rounding, so nothing shows it gives the reference's bits
# (`numerics.e2m1_encode_stochastic`: up iff 256 t > r + 1/2).
_ENCODE_CODES_CVT_ASM = _encode_codes_cvt_asm()

# Whether the kernels convert with the hardware's E2M1 conversion where the
# GPU has it (benchmarks switch it off to compare in the same run).
HW_E2M1 = True


# Where the E2M1 conversion compiles in the Pallas-Triton kernels without
# asking: it is an arch-specific instruction (sm_100a, sm_103a, sm_110a,
# sm_120a, sm_121a and the `f` families), and XLA's Triton pipeline targets
# sm_100a/sm_103a on these. On the other capabilities from 10.0 the target
# depends on the compile: a GPU reports its accelerated features (XLA then
# targets e.g. sm_120a), an ahead-of-time compile for a bare capability
# targets plain sm_120, where ptxas rejects the instruction ("not supported
# on .target 'sm_120'"). There `hardware_e2m1` compiles a probe.
HW_E2M1_CCS = ((10, 0), (10, 3))

# `(compute capability, dispatch.probe_target())` -> whether the probe
# compiled; the error where it did not.
_E2M1_PROBES: dict[Any, bool] = {}
_E2M1_PROBE_ERRORS: dict[Any, str] = {}


def _e2m1_probe_kernel(x_ref, o_ref):
  """The word encoder's assembly (`_ENCODE_CODES_CVT_ASM`) on one tile."""
  ye, yo = x_ref[0], x_ref[1]
  [packed] = plt.elementwise_inline_asm(
      _ENCODE_CODES_CVT_ASM, args=[ye, yo],
      constraints="=r," + ",".join(["f"] * 8), pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(ye.shape, jnp.int8)])
  o_ref[...] = packed


def _e2m1_probe(x: jax.Array) -> jax.Array:
  return pl.pallas_call(
      _e2m1_probe_kernel, name="e2m1_probe",
      out_shape=jax.ShapeDtypeStruct(x.shape[1:], jnp.int8),
      compiler_params=plt.CompilerParams(num_warps=1, num_stages=1))(x)


def e2m1_conversion_compiles() -> bool:
  """Whether a Pallas-Triton kernel with `cvt.rn.satfinite.e2m1x2.f32`
  (`_ENCODE_CODES_CVT_ASM`) compiles for the GPU the program compiles for
  (`dispatch.probe_target`: this process's GPU, or the target of an
  ahead-of-time compile): compiled once per (capability, target) and
  cached; False where there is nothing to compile for, or the compile
  raises (e.g. ptxas on plain sm_120). Safe inside a trace: the probe is a
  separate program on abstract arguments."""
  target = dispatch.probe_target()
  if target is None:
    return False
  key = (compute_capability(), target)
  if key not in _E2M1_PROBES:
    try:
      dispatch.compile_probe(
          _e2m1_probe, jax.ShapeDtypeStruct((2, 32, 32), jnp.float32))
      _E2M1_PROBES[key] = True
    except Exception as e:  # pylint: disable=broad-except
      _E2M1_PROBES[key] = False
      _E2M1_PROBE_ERRORS[key] = f"{type(e).__name__}: {e}"[:2000]
  return _E2M1_PROBES[key]


def hardware_e2m1() -> bool:
  """Whether the kernels convert to E2M1 with `cvt...e2m1x2.f32` on the GPU
  they compile for: on `HW_E2M1_CCS`, and from compute capability 10.0 on
  where the conversion compiles (`e2m1_conversion_compiles`)."""
  if not HW_E2M1:
    return False
  cc = compute_capability()
  if cc is None or tuple(cc) < (10, 0):
    return False
  return tuple(cc) in HW_E2M1_CCS or e2m1_conversion_compiles()

# Whether the kernels use `_ENCODE_ASM` on the GPU (benchmarks switch it off
# to time the jnp encoders in the same run).
ASM_ENCODE = True


def _asm_encode(y: jax.Array, rwords: jax.Array | None, d: jax.Array, *,
                codes: bool, values: bool, block_nan: bool = False):
  """`tile.encode_blocks`' encoder on the GPU (see `block_encoder`)."""
  ye, yo = jnp.unstack(y.reshape(*y.shape[:-1], -1, 2), axis=-1)
  args = [ye, yo]
  extra, sr = [], rwords is not None
  if sr:  # Pair 2w + o uses bytes 2o, 2o + 1 of word w.
    extra = [jnp.stack([rwords, rwords >> 16], axis=-1).reshape(ye.shape)]
  packed = vals = None
  if codes:
    asm = (_ENCODE_CODES_CVT_ASM if not sr and hardware_e2m1()
           else _ENCODE_ASM[False, sr])
    if asm is _ENCODE_CODES_CVT_ASM and block_nan:
      asm = _ENCODE_CODES_CVT_SIGNED_ASM
    [packed] = plt.elementwise_inline_asm(
        asm, args=args + extra,
        constraints="=r," + ",".join(["f"] * 8 + ["r"] * (4 * len(extra))),
        pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(ye.shape,
                                                          jnp.int8)])
    # Triton's integers are signless: results are declared signed.
    packed = jax.lax.bitcast_convert_type(packed, jnp.uint8)
  if values:
    db = jnp.broadcast_to(d[..., None], ye.shape)
    [vals] = plt.elementwise_inline_asm(
        _ENCODE_VALUES_CVT_ASM if not sr and hardware_e2m1()
        else _ENCODE_ASM[True, sr], args=args + [db] + extra,
        constraints="=r,=r,=r,=r," + ",".join(
            ["f"] * 12 + ["r"] * (4 * len(extra))),
        pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(ye.shape,
                                                          jnp.int32)])
    vals = jax.lax.bitcast_convert_type(vals, jnp.uint32)
  return packed, vals


def widen_words(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """uint32 words of bf16 pairs -> `(even, odd)` FP32 elements (exact: the
  low and high half, widened): one shift and one mask per word."""
  f = lambda h: jax.lax.bitcast_convert_type(h, jnp.float32)
  return f(w << 16), f(w & jnp.uint32(0xFFFF0000))


def _scale_encode_cvt_asm(nan_test: str = "testp.notanumber.f32 nan, $9;"
                          ) -> str:
  """`mul.ftz.f32` of 4 pairs by their block's encode scale (`$9`), two
  products per `mul.ftz.f32x2` (Blackwell's packed FP32: per lane the same
  IEEE multiplication, flushing subnormal inputs and results, PTX ISA
  `mul`), then `_encode_codes_cvt_signed_asm`'s conversion and NaN
  select, the NaN test on the encode scale itself (the same in both
  instances of a block: ptxas keeps one). The same predicate as a test of
  a product: the block encode scale `words_block_scales` makes is NaN or
  a positive finite number (the reciprocal of a product of the decoded
  scale and `1 / S_enc`, which share the sign of `S_enc`: +0 or positive
  and below 2^126; +Inf clamped to F32_MAX), so `ftz(x) * enc` is NaN
  exactly where `x` or `enc` is, and a NaN `x` makes its block's amax,
  scale and `enc` NaN. `mov.b64 x, {a, b}` puts `a` in the low lane, which
  `mov.b64 {e, o}, x` reads back as `e`."""
  ye, yo, _, _ = _operands(1, False, False)
  body = []
  for k in range(4):
    body += [f"mov.b64 x, {{{ye[k]}, {yo[k]}}};",
             "mul.rn.ftz.f32x2 x, x, ee;",
             "mov.b64 {e, o}, x;",
             f"cvt.rn.satfinite.e2m1x2.f32 b{k}, o, e;"]
  body += ["mov.b32 acc, {b0, b1, b2, b3};", "selp.b32 $0, 0, acc, nan;"]
  return ("{\n.reg .b32 acc, e, o;\n.reg .b64 x, ee;\n"
          ".reg .b8 b0, b1, b2, b3;\n.reg .pred nan;\n"
          "mov.b64 ee, {$9, $9};\n" + nan_test + "\n"
          + "\n".join(body) + "\n}")


_SCALE_ENCODE_CVT_ASM = _scale_encode_cvt_asm()
# The same with the NaN test as a floating-point comparison of the encode
# scale with itself (PTX ISA `setp`: `.nan` is true iff either operand is
# NaN; `testp.notanumber` is true iff its operand is NaN: the same
# predicate), which ptxas emits as one FSETP where `testp` takes an
# integer mask and compare.
_SCALE_ENCODE_CVT_SETP_ASM = _scale_encode_cvt_asm("setp.nan.f32 nan, $9, $9;")


def _decode_pair_ptx(code: str, k: int) -> list[str]:
  """PTX lines decoding the two E2M1 codes of byte register `code` into
  bf16 value pair `$k` under the f16 scale `dh` (registers `h`, `he`,
  `ho`, `e`, `o`): `cvt.rn.f16x2.e2m1x2`, each code value times `dh` by an
  exact mixed-precision FMA with -0, one `cvt.rn.bf16x2.f32` (exact: see
  `_words_values_asm`)."""
  return [f"cvt.rn.f16x2.e2m1x2 h, {code};", "mov.b32 {he, ho}, h;",
          "fma.rn.f32.f16 e, he, dh, 0f80000000;",
          "fma.rn.f32.f16 o, ho, dh, 0f80000000;",
          f"cvt.rn.bf16x2.f32 ${k}, o, e;"]


def _scale_values_cvt_asm() -> str:
  """`_scale_encode_cvt_asm`'s products and conversions, each pair's codes
  then decoded to its bf16 block values as `_words_values_asm` does, in
  the same assembly (`$0-$3` the value pairs; `$4-$11` the elements,
  `$12` the encode scale, `$16` the decoded scale `d`, FP32): the codes
  stay in the conversions' 8-bit registers, no packed word and no NaN
  test. Exact, as `words_values`: the decoded values are those of the
  codes `scale_encode_codes` writes, outside NaN blocks; in a NaN block
  (the scaled values are NaN exactly where `d` is NaN: see
  `_encode_codes_cvt_signed_asm`) the ISA does not say which codes the
  conversion writes, but any E2M1 code decodes to a finite f16, and its
  product by NaN is NaN: every value NaN, as the reference's."""
  ye, yo, _, _ = _operands(4, False, False)
  body = []
  for k in range(4):
    body += [f"mov.b64 x, {{{ye[k]}, {yo[k]}}};",
             "mul.rn.ftz.f32x2 x, x, ee;",
             "mov.b64 {e, o}, x;",
             "cvt.rn.satfinite.e2m1x2.f32 b, o, e;",
             *_decode_pair_ptx("b", k)]
  return ("{\n.reg .b32 e, o, h;\n.reg .b64 x, ee;\n.reg .b16 he, ho, dh;\n"
          ".reg .b8 b;\nmov.b64 ee, {$12, $12};\ncvt.rn.f16.f32 dh, $16;\n"
          + "\n".join(body) + "\n}")


_SCALE_VALUES_CVT_ASM = _scale_values_cvt_asm()


def scale_encode_codes(xe: jax.Array, xo: jax.Array, enc: jax.Array,
                       interpret: bool) -> jax.Array:
  """Packed round-to-nearest codes `[..., n]` (even element in the low
  nibble; `n` a multiple of 4) of the even and odd elements `xe`, `xo`
  `[..., n]` times their block's encode scale `enc` `[...]`: `ftz(x) *
  enc` (`mul.ftz`), rounded to E2M1 as `tile.encode_blocks` does, for
  blocks NaN as a whole (`block_encoder`), where the E2M1 conversion exists
  (`hardware_e2m1`).

  Interpreted, its software twin: the FTZ product, `numerics.
  e2m1_encode_nearest` and code 0 for NaN (`e2m1x2_cvt_model`'s, which
  tests/test_encoder.py checks against the reference; a NaN block's codes
  are the GPU's, 0: the reference allows 0 or 8).
  """
  if interpret:
    def code(x):
      y = nm.ftz(x) * enc[..., None]
      return jnp.where(jnp.isnan(y), jnp.uint8(0), nm.e2m1_encode_nearest(y))
    return code(xe) | (code(xo) << 4)
  eb = jnp.broadcast_to(enc[..., None], xe.shape)
  [packed] = plt.elementwise_inline_asm(
      _SCALE_ENCODE_CVT_ASM, args=[xe, xo, eb],
      constraints="=r," + ",".join(["f"] * 12), pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(xe.shape, jnp.int8)])
  return jax.lax.bitcast_convert_type(packed, jnp.uint8)


def scale_encode_words(xe: jax.Array, xo: jax.Array, enc: jax.Array,
                       interpret: bool) -> jax.Array:
  """`scale_encode_codes` as uint32 words `[..., n / 4]` (word `j`: the
  codes of pairs `4j .. 4j + 3`, pair `4j + k` in byte `k`, i.e. the same
  bytes in memory order), for a kernel that stores words: one assembly
  instance per word (`_SCALE_ENCODE_CVT_SETP_ASM`, the NaN test as
  `setp.nan`), its 4 pairs taken as 8 arrays `[..., n / 4]` split from
  the pairs' axis (in a thread's registers where the axis is). Interpreted,
  the same split arrays into the assembly's software twin (per pair the
  FTZ product, `numerics.e2m1_encode_nearest`, code 0 for NaN, as
  `scale_encode_codes`'), so the split is checked off the GPU too."""
  n = xe.shape[-1]

  def quarters(x):  # x[..., 4j + k], k = 0 .. 3, each [..., n / 4].
    a, b = jnp.unstack(x.reshape(*x.shape[:-1], n // 4, 2, 2), axis=-1)
    # a[..., j, h] = x[..., 4j + 2h], b[..., j, h] = x[..., 4j + 2h + 1].
    a0, a1 = jnp.unstack(a, axis=-1)
    b0, b1 = jnp.unstack(b, axis=-1)
    return [a0, b0, a1, b1]
  eb = jnp.broadcast_to(enc[..., None], (*enc.shape, n // 4))
  args = quarters(xe) + quarters(xo) + [eb]
  if interpret:
    def code(x):
      y = nm.ftz(x) * eb
      return jnp.where(jnp.isnan(y), jnp.uint32(0),
                       nm.e2m1_encode_nearest(y).astype(jnp.uint32))
    words = jnp.zeros(eb.shape, jnp.uint32)
    for k in range(4):
      words |= (code(args[k]) | (code(args[4 + k]) << 4)) << (8 * k)
    return words
  [words] = plt.elementwise_inline_asm(
      _SCALE_ENCODE_CVT_SETP_ASM, args=args,
      constraints="=r," + ",".join(["f"] * 9), pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(eb.shape, jnp.int32)])
  return jax.lax.bitcast_convert_type(words, jnp.uint32)


def scale_encode_values(xe: jax.Array, xo: jax.Array, enc: jax.Array,
                        d: jax.Array, interpret: bool) -> jax.Array:
  """The bf16 block values (uint32 pairs, `tile.value_pairs`) of the codes
  `scale_encode_codes(xe, xo, enc)` under the blocks' decoded scales `d`
  (FP32 `[...]`), without the codes: on the GPU `_SCALE_VALUES_CVT_ASM`
  (conversion and decoding per pair in one assembly); interpreted,
  `words_values` of the twin's codes."""
  if interpret:
    return words_values(scale_encode_codes(xe, xo, enc, True), d, True)
  eb = jnp.broadcast_to(enc[..., None], xe.shape)
  db = jnp.broadcast_to(d[..., None], xe.shape)
  [vals] = plt.elementwise_inline_asm(
      _SCALE_VALUES_CVT_ASM, args=[xe, xo, eb, db],
      constraints="=r,=r,=r,=r," + ",".join(["f"] * 16), pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(xe.shape, jnp.int32)])
  return jax.lax.bitcast_convert_type(vals, jnp.uint32)


def block_encoder(interpret: bool, block_nan: bool = False
                  ) -> Callable | None:
  """`tile.encode_blocks(encoder=...)` for this backend: None (the
  reference's jnp encoders) when interpreted, `_ENCODE_ASM` on the GPU.

  `block_nan`: the caller's scaled values are NaN in whole blocks only
  (where the block's decoded scale is NaN; see
  `_encode_codes_cvt_signed_asm`) and its tile keeps at least 8
  consecutive elements of a block in one thread (`y` from a `[rows, nb,
  16]` load of contiguous blocks: 8 per thread, read from the TTGIR by
  tests/test_aot.py), so an assembly instance's 4 pairs lie in one block:
  then, where the E2M1 conversion exists, round-to-nearest codes convert
  the signed values directly (one conversion per pair, one NaN test per 8
  elements).
  """
  if interpret or not ASM_ENCODE:
    return None
  if block_nan:
    return functools.partial(_asm_encode, block_nan=True)
  return _asm_encode


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


def check_powers_of_two(config: Any, fields: tuple[str, ...]) -> None:
  """Raises a ValueError naming a tile-config field that is no power of two."""
  for name in fields:
    v = getattr(config, name)
    if not isinstance(v, int) or v < 1 or v & (v - 1):
      raise ValueError(f"{type(config).__name__}.{name}={v!r} must be a power "
                       f"of two (Triton block shapes are).")


def next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def pallas_call(kernel, *, interpret: bool, num_warps: int, num_stages: int,
                name: str, **kwargs) -> Any:
  """`pl.pallas_call` with Triton compiler parameters (or interpret mode).

  Under `jax.set_mesh` with Explicit axes the kernel runs in `auto_axes`,
  replicated: Pallas gives a kernel's blocks their operand's sharding, and
  the Triton lowering of a reduction rejects an Explicit one ("Length of
  sharding.spec (2) must be equal to aval's ndim (1)", jax 0.11). Sharded
  training goes through `nvfp4_jax.sharding` (shard_map), not this path.
  """
  call = pl.pallas_call(
      kernel, interpret=interpret, name=name,
      compiler_params=plt.CompilerParams(num_warps=num_warps,
                                         num_stages=num_stages),
      **kwargs)
  out_shape = kwargs["out_shape"]

  @functools.wraps(call)
  def run(*args):
    if interpret:
      # Interpreted, the kernel is XLA operations: a compile-time constant
      # operand (an amax given as a literal) would be folded into them, and
      # XLA reassociates products of constants (`(b * c1) * c2` as
      # `b * (c1 * c2)`: Four-over-Six's 4-candidate scale off by an E4M3
      # step). Compiled, a kernel's operands are opaque; so here too.
      args = tuple(jax.lax.optimization_barrier(a) if jnp.size(a) <= 16
                   else a for a in args)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not any(t == jax.sharding.AxisType.Explicit
                             for t in mesh.axis_types):
      return call(*args)
    if isinstance(out_shape, (list, tuple)):
      specs = tuple(jax.sharding.PartitionSpec() for _ in out_shape)
      return type(out_shape)(jax.sharding.auto_axes(
          lambda *a: tuple(call(*a)), out_sharding=specs)(*args))
    return jax.sharding.auto_axes(
        call, out_sharding=jax.sharding.PartitionSpec())(*args)
  return run


def scalar_spec(n: int) -> pl.BlockSpec:
  """A whole small 1-D operand (per-tensor constants, seeds) for every program."""
  return pl.BlockSpec((n,), lambda *idx: (0,))


def bounds_mask(shape: tuple[int, ...], *dims) -> jax.Array | None:
  """In-bounds mask of a tile, or None when every listed axis divides evenly.

  Args:
    shape: the tile's shape.
    *dims: `(axis, start, limit, block)`: elements `start + i` along `axis`
      are valid while `< limit`; the axis is skipped when `limit % block == 0`
      (then no tile is partial along it and the fast unmasked path is kept).
  """
  mask = None
  for axis, start, limit, block in dims:
    if limit % block == 0:
      continue
    idx = start + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    m = idx < limit
    mask = m if mask is None else mask & m
  return mask


def load(ref, mask: jax.Array | None) -> jax.Array:
  """`ref[...]`, out-of-bounds elements (`mask` False) not read.

  They come back as 0, except for float8 refs (no constant of that type
  lowers), whose masked elements are undefined: callers must not store them.
  """
  if mask is None:
    return ref[...]
  other = None if jnp.dtype(ref.dtype).itemsize == 1 and jnp.issubdtype(
      ref.dtype, jnp.floating) else 0
  return plt.load(ref, mask=mask, other=other)


def load_at(ref, idx, mask: jax.Array | None) -> jax.Array:
  """`ref[idx]` (a static or `pl.ds` index), masked as `load`."""
  return load(ref.at[idx], mask) if mask is not None else ref[idx]


def store(ref, value: jax.Array, mask: jax.Array | None) -> None:
  """`ref[...] = value`, skipping elements where `mask` is False."""
  if mask is None:
    ref[...] = value
  else:
    plt.store(ref, value, mask=mask)



# --- Blackwell's packed FP32 (`.f32x2`, sm_100a/sm_103a) ---------------------
#
# PTX ISA (`add`, `sub`, `mul`, "Floating Point Instructions"; PTX 8.6,
# sm_100 and up): with type `.f32x2` the operands are `.b64` register pairs
# and each lane is the `.f32` instruction of the same rounding and `.ftz`
# (`d[i] = a[i] op b[i]`, i = 0, 1: bits 0-31 and 32-63). So a paired
# instruction is bit for bit the two scalar ones it replaces; `mov.b64 x,
# {a, b}` puts `a` in lane 0 (bits 0-31), which `mov.b64 {a, b}, x` reads
# back. ptxas allocates the pairs as adjacent registers (FADD2, FMUL2: no
# moves in the SASS). Interpreted, each helper is its scalar jnp twin.


def _x2_asm(body: str) -> str:
  return ("{\n.reg .b64 a, b, d;\nmov.b64 a, {$2, $3};\n" + body
          + "\nmov.b64 {$0, $1}, d;\n}")


def _x2_call(asm: str, args: list[jax.Array]) -> jax.Array:
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
  asm = _x2_asm("mov.b64 b, {$4, $5};\nadd.rn.ftz.f32x2 d, a, b;")
  return lambda a, b: _x2_call(asm, [a, b])


def sub_x2(interpret: bool) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """`tile.flushed_difference` (`sub.rn.ftz.f32`), two lanes per
  `sub.rn.ftz.f32x2`."""
  if interpret:
    return tile.flushed_difference
  asm = _x2_asm("mov.b64 b, {$4, $5};\nsub.rn.ftz.f32x2 d, a, b;")
  return lambda a, b: _x2_call(asm, [a, b])


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
  asm = _x2_asm(f"mov.b64 b, {{{k}, {k}}};\nmul.rn.ftz.f32x2 d, a, b;")
  # bf16 `x`: the pair's register widened by a shift and a mask (exact).
  asm_bf16 = ("{\n.reg .b64 a, b;\n.reg .b32 l, h;\nshl.b32 l, $2, 16;\n"
              "and.b32 h, $2, 0xFFFF0000;\nmov.b64 a, {l, h};\n"
              f"mov.b64 b, {{{k}, {k}}};\nmul.rn.ftz.f32x2 a, a, b;\n"
              "mov.b64 {$0, $1}, a;\n}")

  def mul(x):
    if x.dtype != jnp.bfloat16:
      return _x2_call(asm, [x])
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
      return max_magnitude(False)(*xs)
    xs = jnp.broadcast_arrays(*[jnp.asarray(x, jnp.float32) for x in xs])
    [out] = plt.elementwise_inline_asm(
        "max.NaN.abs.f32 $0, $1, $2, $3;", args=list(xs),
        constraints="=f,f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(xs[0].shape, jnp.float32)])
    return out
  return mx


def max_magnitude_words(interpret: bool
                        ) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """`max_magnitude` of bf16 pairs held as uint32 words (the word path's
  loads: element `2j` in bits 0-15), lane by lane: one `max.NaN.xorsign.abs.bf16x2` per word on the
  GPU; interpreted, its twin (a NaN lane gives the canonical bf16 NaN
  0x7FFF, else the larger magnitude; the result's signs are undefined and
  the twin's are 0)."""
  if interpret:
    def mx(a, b):
      def lane(w, shift):
        return jax.lax.bitcast_convert_type(
            ((w >> shift) & jnp.uint32(0xFFFF)) << 16, jnp.float32)
      out = jnp.uint32(0)
      for shift in (0, 16):
        va, vb = lane(a, shift), lane(b, shift)
        m = jnp.where(jnp.isnan(va) | jnp.isnan(vb), jnp.float32(jnp.nan),
                      jnp.maximum(jnp.abs(va), jnp.abs(vb)))
        bits = jax.lax.bitcast_convert_type(m, jnp.uint32) >> 16
        bits = jnp.where(jnp.isnan(m), jnp.uint32(0x7FFF), bits)
        out = out | (bits << shift)
      return out
    return mx

  def mx(a, b):
    a, b = jnp.broadcast_arrays(a, b)
    [out] = plt.elementwise_inline_asm(
        "max.NaN.xorsign.abs.bf16x2 $0, $1, $2;", args=[a, b],
        constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])
    return jax.lax.bitcast_convert_type(out, jnp.uint32)
  return mx


def words_scale_constants(amax: jax.Array, interpret: bool,
                          four_over_six: bool = False
                          ) -> tuple[jax.Array, jax.Array]:
  """`numerics.nvfp4_scale_constants(amax, four_over_six=...)` for the word
  paths: `1 / S_enc` by `exact_reciprocal` (`rcp.rn.f32`, the same bits as
  `div.rn.f32` of 1) and its flush by `flush`."""
  s_enc = nm.global_encode_scale(
      amax, divide=exact_divide(interpret),
      numerator=nm.FOUR_OVER_SIX_NUMERATOR if four_over_six
      else nm.E4M3_MAX_X_E2M1_MAX)
  s_enc_over_6 = s_enc * jnp.float32(1.0 / nm.E2M1_MAX)
  inv_s_enc = flush(interpret)(exact_reciprocal(interpret)(s_enc))
  return s_enc_over_6, inv_s_enc


def words_encode(even: jax.Array, odd: jax.Array, bamax: jax.Array,
                 s_enc_over_6: jax.Array, inv_s_enc: jax.Array,
                 interpret: bool) -> tuple[jax.Array, jax.Array]:
  """`tile.encode_blocks`' round-to-nearest codes and scales of blocks
  given as their even and odd elements (FP32 `[..., nb, 8]` each, a block
  in one thread's registers) and their flushed block amax `[..., nb]`:
  `(packed uint8 [..., nb, 8], scales e4m3 [..., nb])`. The steps of
  `nvfp4_block_decode_scale` / `nvfp4_block_encode_scale`
  (`words_block_scales`: the flush and the reciprocal as one
  `rcp.rn.ftz`), then `scale_encode_codes` (blocks NaN as a whole; where the E2M1 conversion
  exists)."""
  scales, enc = words_block_scales(bamax, s_enc_over_6, inv_s_enc,
                                   interpret)
  return scale_encode_codes(even, odd, enc, interpret), scales


def words_block_scales(bamax: jax.Array, s_enc_over_6: jax.Array,
                       inv_s_enc: jax.Array, interpret: bool,
                       expansion: float | None = None
                       ) -> tuple[jax.Array, jax.Array]:
  """`words_encode`'s block scales: `(scales e4m3, encode scales FP32)` of
  the flushed block amax `bamax`, `nvfp4_block_decode_scale` (with its
  `expansion`: Four-over-Six's 4-candidate) and
  `nvfp4_block_encode_scale` with the flush and the reciprocal as one
  `rcp.rn.ftz` (`scale_encode_codes` takes the encode scales)."""
  scales = nm.nvfp4_block_decode_scale(bamax, s_enc_over_6,
                                       expansion=expansion)
  # `flushed_reciprocal` applies: |f32(scale)| <= 448 and |inv_s_enc| <=
  # F32_MAX / 2688 (`global_encode_scale`: |S_enc| >= fl(2688 / F32_MAX),
  # or infinite or NaN), so the product is below 448 * 1.27e35 < 2^126.
  enc = flushed_reciprocal(interpret)(scales.astype(jnp.float32) * inv_s_enc)
  enc = jnp.where(enc > nm.F32_MAX, jnp.float32(nm.F32_MAX), enc)
  return scales, enc


# E4M3 codes: every block decode scale a kernel can write is one of them.
E4M3_CODES = 256


def encode_scale_table(inv_s_enc: jax.Array) -> jax.Array:
  """The block encode scale of each E4M3 decode-scale code under the
  tensor constant `inv_s_enc` (FP32 `[256]`, entry `k` for the code with
  bits `k`): `numerics.nvfp4_block_encode_scale` of the codes' FP32
  values, the reference's own steps (outside a kernel, its correctly
  rounded division on every backend). A block's encode scale depends on
  nothing but its decode scale's code and `inv_s_enc`, so a kernel that
  looks it up (`words_block_scales_table`) gets the reference's bits for
  every input, with no reciprocal of its own; the NaN codes (0x7F, 0xFF)
  give NaN."""
  codes = jax.lax.bitcast_convert_type(
      jnp.arange(E4M3_CODES, dtype=jnp.uint8), jnp.float8_e4m3fn)
  return nm.nvfp4_block_encode_scale(
      codes.astype(jnp.float32), jnp.asarray(inv_s_enc, jnp.float32))


def words_block_scales_table(bamax: jax.Array, s_enc_over_6: jax.Array,
                             table_ref, interpret: bool,
                             expansion: float | None = None
                             ) -> tuple[jax.Array, jax.Array]:
  """`words_block_scales` with the encode scales looked up in
  `table_ref` (`encode_scale_table(inv_s_enc)`, a `[256]` FP32 ref) at
  the decode scales' bits: the same `(scales, encode scales)`, bit for
  bit (the table's entries are the reference's for each code; the
  gather's index is a byte, inside the table)."""
  code = e4m3_codes(bamax.astype(jnp.float32) * s_enc_over_6, expansion,
                    interpret)
  scales = jax.lax.bitcast_convert_type(code.astype(jnp.uint8),
                                        jnp.float8_e4m3fn)
  return scales, _gather_by_thread(table_ref, code)


# The E4M3 bytes of two FP32 values (`$2`: byte 0 -> `$0`, `$3`: byte 1
# -> `$1`), each zero-extended to 32 bits: one `cvt.rn.satfinite.e4m3x2.f32`
# (Triton's own conversion of FP32 to float8_e4m3fn; `$2` to the lower
# byte) and a `prmt` per byte (PTX ISA `prmt`: selector 0x4440 takes byte
# 0 of `w`, then byte 4, i.e. byte 0 of the zero operand, thrice; 0x4441:
# byte 1 of `w`).
_E4M3_CODES_ASM = """{
.reg .b16 h, z;
.reg .b32 w;
cvt.rn.satfinite.e4m3x2.f32 h, $3, $2;
mov.b16 z, 0;
mov.b32 w, {h, z};
prmt.b32 $0, w, 0, 0x4440;
prmt.b32 $1, w, 0, 0x4441;
}"""


def e4m3_codes(d: jax.Array, expansion: float | None,
               interpret: bool) -> jax.Array:
  """The bits of `numerics.nvfp4_block_decode_scale`'s E4M3 scales from
  the products `d = block_amax * s_enc_over_6`, as int32 (0 .. 255): its
  `expansion` and clamp, then on the GPU `_E4M3_CODES_ASM` (the conversion
  the cast lowers to, each element on its own: which two an instance
  takes does not matter), the bytes ready for a table index; interpreted,
  the cast's bits."""
  if expansion is not None:
    d = d * jnp.float32(expansion)
  d = jnp.where(d > nm.E4M3_MAX, jnp.float32(nm.E4M3_MAX), d)
  if interpret:
    return jax.lax.bitcast_convert_type(d.astype(jnp.float8_e4m3fn),
                                        jnp.uint8).astype(jnp.int32)
  return plt.elementwise_inline_asm(
      _E4M3_CODES_ASM, args=[d], constraints="=r,=r,f,f", pack=2,
      result_shape_dtypes=[jax.ShapeDtypeStruct(d.shape, jnp.int32)])[0]


def _gather_by_thread(ref, idx: jax.Array) -> jax.Array:
  """`ref[idx]`, the index split by halving its last axis down to arrays
  of one element per thread (whose gathers Triton lays out as they are),
  the results stacked back (`jnp.stack` pairs)."""
  if idx.shape[-1] % 2 or idx.shape[-1] <= 32:
    return ref[idx.reshape(-1)].reshape(idx.shape)
  e, o = jnp.unstack(idx.reshape(*idx.shape[:-1], -1, 2), axis=-1)
  ge, go = _gather_by_thread(ref, e), _gather_by_thread(ref, o)
  return jnp.stack([ge, go], axis=-1).reshape(idx.shape)


def words_encode_values(even: jax.Array, odd: jax.Array, bamax: jax.Array,
                        s_enc_over_6: jax.Array, inv_s_enc: jax.Array,
                        interpret: bool):
  """`words_encode` and the blocks' bf16 values as uint32 pairs
  (`words_values`): `(packed, scales, value pairs)`."""
  packed, scales = words_encode(even, odd, bamax, s_enc_over_6, inv_s_enc,
                                interpret)
  return packed, scales, words_values(packed, scales.astype(jnp.float32),
                                      interpret)


def _words_values_asm() -> str:
  """4 pairs' bf16 block values (`$0-$3`, even element low) from their
  packed codes (`$4`: byte k is pair k's, the odd element's code high) and
  the block's decoded scale (`$5`, FP32; `$6-$8` the same value).

  Exact, per the PTX ISA (`cvt` with `.e2m1x2` sources, sm_100a/sm_103a):
  `cvt.rn.f16x2.e2m1x2` converts both codes of a byte to f16 (every E2M1
  value, signed zeros included, is an f16; the upper nibble to the upper
  half), `cvt.rn.f16.f32` of `d` is exact (every E4M3 value, 2^-9 ..
  448, is an f16; NaN stays NaN), and the mixed-precision
  `fma.rn.f32.f16` (f16 multiplicands, FP32 addend and result: PTX ISA
  `fma`, sm_100) of code value, `d` and -0 is their product, exact in
  FP32 (at most 2 x 4 significant bits, magnitudes 2^-10 .. 2688: no
  rounding, no subnormal; the -0 addend keeps the product's signed zero),
  and
  `cvt.rn.bf16x2.f32` of it is exact (6 significant bits, within bf16's
  normal range): `bf16(e2m1_decode(code) * d)`, the reference's values. A
  NaN `d` (a NaN block) gives NaN values."""
  body = ["mov.b32 {c0, c1, c2, c3}, $4;", "cvt.rn.f16.f32 dh, $5;"]
  for k in range(4):
    body += _decode_pair_ptx(f"c{k}", k)
  return ("{\n.reg .b32 h, e, o;\n.reg .b16 he, ho, dh;\n"
          ".reg .b8 c0, c1, c2, c3;\n"
          + "\n".join(body) + "\n}")


_WORDS_VALUES_ASM = _words_values_asm()


def words_values(packed: jax.Array, d: jax.Array, interpret: bool
                 ) -> jax.Array:
  """The bf16 block values of packed codes `[..., nb, 8]` (uint8, even
  element low) under their blocks' decoded scales `d` (FP32 `[..., nb]`),
  as uint32 value pairs (`tile.value_pairs`): on the GPU
  `_WORDS_VALUES_ASM` (hardware E2M1 decoding, where `hardware_e2m1`);
  interpreted, `bf16(e2m1_decode(code) * d)`."""
  if interpret:
    db = d[..., None]
    half = lambda c: jax.lax.bitcast_convert_type(
        (nm.e2m1_decode(c) * db).astype(jnp.bfloat16),
        jnp.uint16).astype(jnp.uint32)
    return half(packed & 0xF) | (half(packed >> 4) << 16)
  db = jnp.broadcast_to(d[..., None], packed.shape)
  [vals] = plt.elementwise_inline_asm(
      _WORDS_VALUES_ASM, args=[packed.astype(jnp.uint8), db],
      constraints="=r,=r,=r,=r,r,f,f,f,f", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.int32)])
  return jax.lax.bitcast_convert_type(vals, jnp.uint32)


# --- Four-over-Six on the word paths (sm_100a/sm_103a) ------------------------
#
# `tile.encode_blocks(four_over_six=True)` from each candidate's hardware
# conversion: the candidates' codes are `scale_encode_codes`' (the 6- and
# the 4-candidate's encode scales), their error terms `words_error_terms`'
# (the conversion's codes decoded exactly), the choice `words_choose_four`'
# (`tile.choose_four`'s integer sums, each term's units from one FMA
# rounding down).


def _error_terms_asm(odd: bool) -> str:
  """Two elements' error terms (`$0`, `$1`: elements j and j + 1 of the
  even or odd elements) from the pairs' even and odd elements (`$2-$3`,
  `$4-$5`), their block's encode scale (`$6-$7`) and decoded scale
  (`$8-$9`, FP32). Per pair, as `_scale_encode_cvt_asm`: the FTZ products
  `y` by `mul.rn.ftz.f32x2` and their codes by `cvt.rn.satfinite.
  e2m1x2.f32`; then per element, the twin's steps (see
  `words_error_terms`)."""
  body = ["mov.b16 m1, 0xBC00;", "mov.b32 z, 0;"]  # f16 -1; +0.
  for i in range(2):
    body += [f"mov.b64 x, {{${2 + i}, ${4 + i}}};",
             f"mov.b64 ee, {{${6 + i}, ${6 + i}}};",
             "mul.rn.ftz.f32x2 x, x, ee;",
             "mov.b64 {e, o}, x;",
             "cvt.rn.satfinite.e2m1x2.f32 b, o, e;",
             "cvt.rn.f16x2.e2m1x2 h, b;",
             "mov.b32 {he, ho}, h;"]
    y, q = ("o", "ho") if odd else ("e", "he")
    body += [f"fma.rn.f32.f16 r, {q}, m1, {y};",  # y - q, exact.
             f"abs.f32 a, {y};",
             "setp.ge.f32 p, a, 0f41000000;",  # |y| >= 8: r = y.
             f"selp.f32 r, {y}, r, p;",
             f"cvt.rn.bf16x2.f32 r{i}, r, z;"]  # R8, widened.
  body += ["mov.b64 rr, {r0, r1};", "mov.b64 dd, {$8, $9};",
           "mul.rn.ftz.f32x2 rr, rr, dd;", "mul.rn.ftz.f32x2 rr, rr, rr;",
           "mov.b64 {$0, $1}, rr;"]
  return ("{\n.reg .b32 e, o, h, r, a, z, r0, r1;\n"
          ".reg .b64 x, ee, rr, dd;\n.reg .b16 he, ho, m1;\n.reg .b8 b;\n"
          ".reg .pred p;\n" + "\n".join(body) + "\n}")


_ERROR_TERMS_ASM = (_error_terms_asm(False), _error_terms_asm(True))


def words_error_terms(xe: jax.Array, xo: jax.Array, enc: jax.Array,
                      d: jax.Array, odd: bool, interpret: bool) -> jax.Array:
  """`tile.error_terms` (FP32 `[..., n]`) of the even (`odd` False) or odd
  elements of `scale_encode_codes(xe, xo, enc)`'s codes, under their
  blocks' decoded scales `d` (FP32 `[...]`), for round-to-nearest codes of
  blocks NaN as a whole: on the GPU `_ERROR_TERMS_ASM`, interpreted its
  twin, step by step:

  - `y = ftz(x) * enc` flushed (`mul.rn.ftz`) and its code `c` (the
    conversion; the twin: `numerics.e2m1_encode_nearest`, NaN -> 0) as
    `scale_encode_codes` computes them (ptxas shares them);
  - `q`, the signed E2M1 value of `c` (`cvt.rn.f16x2.e2m1x2`, exact), and
    `r = y - q` (`fma.rn.f32.f16` of `q`, -1 and `y`: exact, as `q` is 0
    or within a factor 2 of `y` for `|y| < 8` (Sterbenz), the reference's
    `|q - y|` up to the sign); `r = y` where `|y| >= 8` (the reference's
    `|y|` there), NaN where `y` is;
  - `R8(r)`: `cvt.rn.bf16x2.f32 d, r, 0` (round to nearest even to 8
    significant bits, the bf16 in the upper half: its FP32 widening),
    `tile._round_significant(r, 8)` up to the sign (NaN stays NaN, a
    rounding past F32_MAX gives Inf in both; `r` is 0 or at least 2^-25
    unless `y` is flushed, so never subnormal);
  - `m = ftz(R8 * d)`, `m * m` flushed (`mul.rn.ftz.f32x2`): the
    reference's products of the same magnitudes (its flushes of `r` and
    `m` included; the square drops the sign).

  So the terms are the reference's bit for bit where finite, and non-finite
  (Inf or NaN, possibly not the same) where its are, which keeps the block's
  6-candidate in both (`tile.choose_four`).
  """
  if interpret:
    def term(x, other_codes):
      del other_codes
      y = nm.ftz(nm.ftz(x) * enc[..., None])
      c = jnp.where(jnp.isnan(y), jnp.uint8(0), nm.e2m1_encode_nearest(y))
      r = jnp.where(jnp.abs(y) >= 8.0, y, y - nm.e2m1_decode(c))
      r8 = r.astype(jnp.bfloat16).astype(jnp.float32)
      m = nm.ftz(nm.ftz(r8) * d[..., None])
      return nm.ftz(m * m)
    return term(xo if odd else xe, None)
  eb = jnp.broadcast_to(enc[..., None], xe.shape)
  db = jnp.broadcast_to(d[..., None], xe.shape)
  [t] = plt.elementwise_inline_asm(
      _ERROR_TERMS_ASM[odd], args=[xe, xo, eb, db],
      constraints="=f,=f," + ",".join(["f"] * 8), pack=2,
      result_shape_dtypes=[jax.ShapeDtypeStruct(xe.shape, jnp.float32)])
  return t


def words_units(terms: jax.Array, unit: jax.Array, interpret: bool
                ) -> jax.Array:
  """`tile.choose_four`'s units of error terms, `floor(terms * unit)`,
  plus 2^23, as uint32 bit patterns of FP32 `2^23 + floor(terms * unit)`
  (the sums' common offset cancels in their difference), for finite terms
  and a power of two `unit` `[...]` with `terms * unit < 2^23`: on the GPU
  one `fma.rm.f32x2` of `terms`, `unit` and 2^23 per pair of terms (PTX
  ISA `fma`: the exact product plus 2^23, rounded toward minus infinity;
  in [2^23, 2^24) the FP32 numbers are the integers, so the result is
  `2^23 + floor(terms * unit)`, products below 1 included); interpreted,
  that value (non-finite terms give the word 0; they keep the block's
  6-candidate anyway)."""
  if interpret:
    v = terms * unit[..., None]
    return jnp.where(v < jnp.inf, jnp.floor(v), 0.0).astype(
        jnp.uint32) + jnp.uint32(0x4B000000)
  ub = jnp.broadcast_to(unit[..., None], terms.shape)
  asm = _x2_asm("mov.b64 b, {$4, $5};\nmov.b64 c, {0f4B000000, 0f4B000000};"
                "\nfma.rm.f32x2 d, a, b, c;").replace(
                    ".reg .b64 a, b, d;", ".reg .b64 a, b, c, d;")
  return jax.lax.bitcast_convert_type(_x2_call(asm, [terms, ub]), jnp.uint32)


def _rows_tiles(a: jax.Array, block_2d: bool, reduce: Callable) -> jax.Array:
  """`reduce(..., axis=1)` of `[rows, nb]` over each 16x16 tile's 16 rows,
  replicated over them (`block_2d`), or `a` itself."""
  if not block_2d:
    return a
  rows, nb = a.shape
  t = reduce(a.reshape(rows // nm.NVFP4_BLOCK, nm.NVFP4_BLOCK, nb), axis=1)
  return jnp.broadcast_to(t[:, None, :], (rows // nm.NVFP4_BLOCK,
                                          nm.NVFP4_BLOCK, nb)).reshape(
                                              rows, nb)


def _halve_last(xs: jax.Array, op: Callable) -> jax.Array:
  """`op` over the last axis (a power of two) by halving."""
  while xs.shape[-1] > 1:
    xs = op(*jnp.unstack(xs.reshape(*xs.shape[:-1], -1, 2), axis=-1))
  return xs[..., 0]


def words_choose_four(pairs: list[tuple[jax.Array, jax.Array]],
                      enc6: jax.Array, d6: jax.Array, enc4: jax.Array,
                      d4: jax.Array, block_2d: bool, interpret: bool
                      ) -> jax.Array:
  """`tile.choose_four` of blocks given as pairs `(even, odd)` of FP32
  elements `[rows, nb, w]` (a block's elements in one thread), under each
  candidate's encode and decoded scales `[rows, nb]`: bool `[rows, nb]`,
  True where the 4-candidate's summed units are smaller.

  The steps of `tile.choose_four` on `words_error_terms`: the block's
  (tile's) largest term `mx` (`max.NaN`, three sources per instruction:
  NaN if any term is), `finite = mx < Inf`, the unit `2^(22 - exponent
  of mx)` (capped at 2^127), each term's units by `words_units`, and the
  sums compared as their difference, a signed 32-bit integer: each term
  is below 2^23 units, so a 16x16 tile's 256 terms sum below 2^31.
  """
  terms = {}
  for c, (enc, d) in ((6, (enc6, d6)), (4, (enc4, d4))):
    terms[c] = [words_error_terms(e, o, enc, d, odd, interpret)
                for e, o in pairs for odd in (False, True)]
  mx3 = max_magnitude3(interpret)
  xs = terms[6] + terms[4]
  while len(xs) > 1:
    xs = [mx3(*xs[i:i + 3]) if i + 1 < len(xs) else xs[i]
          for i in range(0, len(xs), 3)]
  mx = _halve_last(xs[0], mx3)
  mx = _rows_tiles(mx, block_2d, tile.abs_max)  # NaN-propagating.
  finite = mx < jnp.inf
  e = ((jax.lax.bitcast_convert_type(mx, jnp.uint32) >> 23) & 0xFF).astype(
      jnp.int32)
  unit = jax.lax.bitcast_convert_type(
      ((jnp.minimum(149 - e, 127) + 127) << 23).astype(jnp.uint32),
      jnp.float32)
  diff = None
  for t4, t6 in zip(terms[4], terms[6]):
    v = words_units(t4, unit, interpret) - words_units(t6, unit, interpret)
    diff = v if diff is None else diff + v
  diff = _halve_last(diff, jnp.add)
  diff = _rows_tiles(diff, block_2d,
                     lambda a, axis: jnp.sum(a, axis=axis, dtype=jnp.uint32))
  return finite & (jax.lax.bitcast_convert_type(diff, jnp.int32) < 0)
