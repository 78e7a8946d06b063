"""The word paths of the quantize kernels (sm_100a/sm_103a): NVFP4 blocks
from bf16 pairs held as uint32 words, through the GPU's E2M1 conversion.

A kernel takes them where `e2m1_encode.hardware_e2m1` (`ops/quantize` and
`ops/quantize_rht_t`): `widen_words` and `max_magnitude_words` read the
loaded words, `words_scale_constants` / `words_block_scales` (or its table
lookup, `encode_scale_table` / `words_block_scales_table`) make the scales,
`scale_encode_codes`, `scale_encode_words` and `scale_encode_values` scale
and convert the elements, `words_values` decodes the codes to bf16 value
pairs. Each is bit for bit the reference's step for the blocks it is given
(NaN as a whole; see `e2m1_encode._encode_codes_cvt_signed_asm`);
interpreted, its software twin. Four-over-Six's choice on these paths is in
`choose_four`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

from nvfp4_jax.core import numerics as nm
from pallas_kernels import e2m1_encode
from pallas_kernels import fp32


def widen_words(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """uint32 words of bf16 pairs -> `(even, odd)` FP32 elements (exact: the
  low and high half, widened): one shift and one mask per word."""
  f = lambda h: jax.lax.bitcast_convert_type(h, jnp.float32)
  return f(w << 16), f(w & jnp.uint32(0xFFFF0000))


def _scale_convert_ptx(ye: str, yo: str, code: str) -> list[str]:
  """PTX lines converting one pair (elements `ye`, `yo`) times the encode
  scale pair `ee` to its two E2M1 codes in the byte register `code`
  (registers `x`, `e`, `o`): `_scale_encode_cvt_asm`'s steps."""
  return [f"mov.b64 x, {{{ye}, {yo}}};",
          "mul.rn.ftz.f32x2 x, x, ee;",
          "mov.b64 {e, o}, x;",
          f"cvt.rn.satfinite.e2m1x2.f32 {code}, o, e;"]


def _scale_encode_cvt_asm(nan_test: str = "testp.notanumber.f32 nan, $9;"
                          ) -> str:
  """`mul.ftz.f32` of 4 pairs by their block's encode scale (`$9`), two
  products per `mul.ftz.f32x2` (Blackwell's packed FP32: per lane the same
  IEEE multiplication, flushing subnormal inputs and results, PTX ISA
  `mul`), then `e2m1_encode._encode_codes_cvt_signed_asm`'s conversion
  and NaN select, the NaN test on the encode scale itself (the same in both
  instances of a block: ptxas keeps one). The same predicate as a test of
  a product: the block encode scale `words_block_scales` makes is NaN or
  a positive finite number (the reciprocal of a product of the decoded
  scale and `1 / S_enc`, which share the sign of `S_enc`: +0 or positive
  and below 2^126; +Inf clamped to F32_MAX), so `ftz(x) * enc` is NaN
  exactly where `x` or `enc` is, and a NaN `x` makes its block's amax,
  scale and `enc` NaN. `mov.b64 x, {a, b}` puts `a` in the low lane, which
  `mov.b64 {e, o}, x` reads back as `e`."""
  ye, yo, _, _ = e2m1_encode.asm_operands(1, False, False)
  body = []
  for k in range(4):
    body += _scale_convert_ptx(ye[k], yo[k], f"b{k}")
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
  `e2m1_encode._encode_codes_cvt_signed_asm`) the ISA does not say which codes the
  conversion writes, but any E2M1 code decodes to a finite f16, and its
  product by NaN is NaN: every value NaN, as the reference's."""
  ye, yo, _, _ = e2m1_encode.asm_operands(4, False, False)
  body = []
  for k in range(4):
    body += [*_scale_convert_ptx(ye[k], yo[k], "b"),
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
  tests/kernels/test_encoder.py checks against the reference; a NaN block's codes
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
      amax, divide=fp32.exact_divide(interpret),
      numerator=nm.FOUR_OVER_SIX_NUMERATOR if four_over_six
      else nm.E4M3_MAX_X_E2M1_MAX)
  s_enc_over_6 = s_enc * jnp.float32(1.0 / nm.E2M1_MAX)
  inv_s_enc = fp32.flush(interpret)(fp32.exact_reciprocal(interpret)(s_enc))
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
  enc = fp32.flushed_reciprocal(interpret)(
      scales.astype(jnp.float32) * inv_s_enc)
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
