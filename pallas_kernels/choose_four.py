"""Four-over-Six's choice on the word paths (sm_100a/sm_103a).

`tile.encode_blocks(four_over_six=True)` from each candidate's hardware
conversion: the candidates' codes are `paired_words.scale_encode_codes`'
(the 6- and the 4-candidate's encode scales), their error terms
`words_error_terms`' (the conversion's codes decoded exactly), the choice
`words_choose_four`' (`tile.choose_four`'s integer sums, each term's units
from one FMA rounding down).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import tile
from pallas_kernels import fp32x2


def _error_terms_asm(odd: bool) -> str:
  """Two elements' error terms (`$0`, `$1`: elements j and j + 1 of the
  even or odd elements) from the pairs' even and odd elements (`$2-$3`,
  `$4-$5`), their block's encode scale (`$6-$7`) and decoded scale
  (`$8-$9`, FP32). Per pair, as `paired_words._scale_encode_cvt_asm`: the
  FTZ products `y` by `mul.rn.ftz.f32x2` and their codes by
  `cvt.rn.satfinite.e2m1x2.f32`; then per element, the twin's steps (see
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
  asm = fp32x2.x2_asm(
      "mov.b64 b, {$4, $5};\nmov.b64 c, {0f4B000000, 0f4B000000};"
      "\nfma.rm.f32x2 d, a, b, c;").replace(
          ".reg .b64 a, b, d;", ".reg .b64 a, b, c, d;")
  return jax.lax.bitcast_convert_type(fp32x2.x2_call(asm, [terms, ub]),
                                      jnp.uint32)


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
  mx3 = fp32x2.max_magnitude3(interpret)
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
