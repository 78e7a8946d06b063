"""E2M1 decoding inside the Pallas-Triton kernels.

`block_values` / `block_value_pairs` (a block's codes times its scale, in
bf16) are inline PTX on the GPU, byte permutations bit for bit the
`nvfp4_jax.core.tile` functions they replace (tests/kernels/test_kernels.py);
interpreted, they are those functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import tile


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
  of ~15 integer and float operations), bit for bit: tests/kernels/test_kernels.py
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
  bit (tests/kernels/test_kernels.py: all 256 code bytes under all 256 scales)."""
  if interpret or not ASM_DECODE:
    return tile.block_value_pairs(packed, scales)
  packed = packed.astype(jnp.uint8)
  s = jnp.broadcast_to(scales.astype(jnp.bfloat16)[..., None], packed.shape)
  return tuple(plt.elementwise_inline_asm(
      asm, args=[packed, s], constraints="=r,=r,r,r,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)]
  )[0] for asm in _DECODE_PAIRS_ASM)
