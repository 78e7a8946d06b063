"""E2M1 encoding inside the Pallas-Triton kernels, and where the GPU's own
conversion is used.

`block_encoder` (`tile.encode_blocks`' rounding, packing and block values)
is inline PTX on the GPU, bit for bit the `nvfp4_jax.core.tile` functions it
replaces (tests/kernels/test_encoder.py, tests/kernels/test_kernels.py); interpreted, it is
those functions. Where the GPU converts FP32 to E2M1 in hardware
(`hardware_e2m1`: `HW_E2M1_CCS`, else a compile probe,
`e2m1_conversion_compiles`), round-to-nearest codes come from that
conversion.
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
from pallas_kernels import launch


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
# into bit 3 of each nibble. tests/kernels/test_encoder.py checks a model of each
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


def asm_operands(first: int, values: bool, stochastic: bool):
  """Operands of an instance (pack=4, four pairs of elements) whose inputs
  start at `$first`: `(ye, yo, d, rand)`, the even elements' scaled values
  (`$1-$4` where `first` is 1), the odd ones' (`$5-$8`), then with `values`
  the pairs' decoded scales `d` and with `stochastic` their hash words,
  each shifted so that the pair's bytes are its low two (even: byte 0, odd:
  byte 1): `rand(k, odd)` is pair k's `(register, prmt selector)`, or None.
  The word paths' assemblies (`paired_words`) lay out their operands so."""
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
  ye, yo, _, rand = asm_operands(1, False, stochastic)
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
  ye, yo, d, rand = asm_operands(4, True, stochastic)
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
  ye, yo, _, _ = asm_operands(1, False, False)
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
  ye, yo, d, _ = asm_operands(4, True, False)
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
  (`e2m1x2_cvt_model`, tested against it in tests/kernels/test_encoder.py).
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
  ye, yo, _, _ = asm_operands(1, False, False)
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
  key = (launch.compute_capability(), target)
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
  cc = launch.compute_capability()
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


def block_encoder(interpret: bool, block_nan: bool = False
                  ) -> Callable | None:
  """`tile.encode_blocks(encoder=...)` for this backend: None (the
  reference's jnp encoders) when interpreted, `_ENCODE_ASM` on the GPU.

  `block_nan`: the caller's scaled values are NaN in whole blocks only
  (where the block's decoded scale is NaN; see
  `_encode_codes_cvt_signed_asm`) and its tile keeps at least 8
  consecutive elements of a block in one thread (`y` from a `[rows, nb,
  16]` load of contiguous blocks: 8 per thread, read from the TTGIR by
  tests/tools/test_aot.py), so an assembly instance's 4 pairs lie in one block:
  then, where the E2M1 conversion exists, round-to-nearest codes convert
  the signed values directly (one conversion per pair, one NaN test per 8
  elements).
  """
  if interpret or not ASM_ENCODE:
    return None
  if block_nan:
    return functools.partial(_asm_encode, block_nan=True)
  return _asm_encode
