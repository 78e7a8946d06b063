"""Block-level compositions of the numerics: the reference and every kernel call these.

`nvfp4_jax.core.numerics` defines each elementwise step of NVFP4_SPEC section 2;
this module composes them on a tile of 16-element blocks, `[rows, blocks, 16]`,
in TransformerEngine's order. The pure-jnp reference quantizer applies them to
the whole tensor (one tile), the Pallas kernels to the tiles of their grid, so
"kernel == reference" holds by construction and the kernel tests check the
plumbing (tiling, masks, layouts), not two transcriptions of the spec.

Everything here lowers both to XLA and to Pallas-Triton: elementwise
operations, selects, reductions over a tile's axes and small dots. Steps that
lower differently take the difference as an argument (`divide`, `barrier`,
`split_pack`, `tensor_cores`); none changes a bit of the result.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng

B = nm.NVFP4_BLOCK


def _identity(x):
  return x


def abs_max(x: jax.Array, axis=None) -> jax.Array:
  """`max |x|` over `axis` of FP32 `x`; a NaN anywhere gives NaN.

  Reduces the magnitudes' bit patterns as unsigned integers: for non-negative
  floats the order is the same, and every NaN sorts above +Inf. (Triton lowers
  a float `max` to `maxnumf`, which drops NaN; XLA's propagates it. The bit
  form behaves the same on both.)
  """
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0x7FFFFFFF)
  return jax.lax.bitcast_convert_type(jnp.max(bits, axis=axis), jnp.float32)


def block_amax(xf: jax.Array, block_2d: bool) -> jax.Array:
  """Block amax `[rows, nb]` of flushed FP32 blocks `[rows, nb, 16]`.

  With `block_2d` the rows hold 16x16 tiles (rows % 16 == 0, a tile's 16 rows
  consecutive): one amax per tile, replicated over its 16 rows, as the
  quantized array reports its scales.
  """
  a = abs_max(xf, axis=-1)
  if not block_2d:
    return a
  rows, nb = a.shape
  t = abs_max(a.reshape(rows // B, B, nb), axis=1)
  return jnp.broadcast_to(t[:, None, :], (rows // B, B, nb)).reshape(rows, nb)


def _round_significant(v: jax.Array, bits: int) -> jax.Array:
  """Non-negative FP32 `v` rounded to `bits` significant bits (RTNE), on its
  bit pattern (integer operations: no compiler contracts them)."""
  drop = 24 - bits
  b = jax.lax.bitcast_convert_type(v, jnp.uint32)
  b = (b + jnp.uint32((1 << (drop - 1)) - 1) + ((b >> drop) & 1)) & jnp.uint32(
      ~((1 << drop) - 1) & 0xFFFFFFFF)
  return jax.lax.bitcast_convert_type(b, jnp.float32)


def error_terms(y: jax.Array, codes: jax.Array, d: jax.Array, *,
                flush: Callable = nm.ftz) -> jax.Array:
  """Four-over-Six's per-element error term: `(R8(|q - y|) * d)^2`, exact.

  `y` are the scaled values the encoder rounded to `codes`, `q` their E2M1
  values and `d` the block's decoded E4M3 scale (FP32, `[..., nb]`): `|q - y|
  * d` is the element's quantization error in units of the tensor factor.
  Every step is exact and free of multiply-adds, so all backends give the
  same bits whatever they fuse:

  - `|q - y|` comes from the bit patterns: `q` lies in `y`'s binade or is the
    next power of two (for `|y| < 8`, except stochastic rounding's lift of
    `|y| < 0.25` to 0.5, split at that power of two), so it is the difference
    of the two patterns times `y`'s ulp; where `q` is 0 it is `|y|`; for
    `|y| >= 8` (a saturated or underflowed block scale) it is taken as `|y|`;
  - rounding it to 8 significant bits (`R8`) keeps `R8 * d` (E4M3: 4
    significant bits) and its square within FP32's 24 bits.
  """
  a = jnp.abs(y)
  b = jax.lax.bitcast_convert_type(a, jnp.uint32).astype(jnp.int32)
  qv = nm.e2m1_decode(codes & 7)
  bq = jax.lax.bitcast_convert_type(qv, jnp.uint32).astype(jnp.int32)
  e = (b >> 23) & 0xFF
  as_f32 = lambda bits: jax.lax.bitcast_convert_type(
      jnp.clip(bits, 1, 254).astype(jnp.uint32) << 23, jnp.float32)
  ulp = as_f32(e - 23)
  near = jnp.abs(bq - b).astype(jnp.float32) * ulp
  # Stochastic rounding may lift |y| < 0.25 to 0.5, past the next power of
  # two p: |q - y| = (0.5 - p) + (p - |y|), both parts exact.
  p = as_f32(e + 1)
  lifted = (0.5 - p) + ((((e + 1) << 23) - b).astype(jnp.float32) * ulp)
  r = jnp.where(qv == 0.0, a, jnp.where(
      a >= 8.0, a, jnp.where((qv == 0.5) & (a < 0.25), lifted, near)))
  m = flush(_round_significant(flush(r), 8) * d[..., None])
  return flush(m * m)


def _tile_sum(t: jax.Array, block_2d: bool) -> jax.Array:
  """uint32 sums `[rows, nb]` of `[rows, nb, 16]` per block, or per 16x16
  tile (replicated over its rows). Integer sums: any order, same result."""
  s = jnp.sum(t, axis=-1, dtype=jnp.uint32)
  if not block_2d:
    return s
  rows, nb = s.shape
  s = jnp.sum(s.reshape(rows // B, B, nb), axis=1, dtype=jnp.uint32)
  return jnp.broadcast_to(s[:, None, :], (rows // B, B, nb)).reshape(rows, nb)


def choose_four(sq6: jax.Array, sq4: jax.Array, block_2d: bool) -> jax.Array:
  """Whether each block (tile) takes the 4-candidate: its summed error terms
  are smaller than the 6-candidate's (ties keep 6).

  The terms are summed exactly as integers in a unit common to both
  candidates, 2^-22 of the block's largest term (smaller parts of terms are
  dropped, the same way on every backend): the choice depends on no
  summation order, and a 16x16 tile of `W` and of `W.T` choose alike.
  Blocks with a non-finite term keep 6.
  """
  mx = jnp.maximum(block_amax(sq6, block_2d), block_amax(sq4, block_2d))
  finite = mx < jnp.inf  # False for inf and NaN.
  e = ((jax.lax.bitcast_convert_type(mx, jnp.uint32) >> 23) & 0xFF).astype(
      jnp.int32)
  unit = jax.lax.bitcast_convert_type(
      ((jnp.minimum(149 - e, 127) + 127) << 23).astype(jnp.uint32),
      jnp.float32)  # 2^(22 - exponent of the largest term).

  def units(sq):
    v = sq * unit[..., None]  # A power of two: exact, at most 2^24.
    return jnp.where(v < jnp.inf, jnp.floor(v), 0.0).astype(jnp.uint32)
  return finite & (_tile_sum(units(sq4), block_2d)
                   < _tile_sum(units(sq6), block_2d))


def value_pairs(values: jax.Array) -> jax.Array:
  """bf16 `[..., 2n]` as uint32 `[..., n]`: element `2j` in the low half of
  word `j`, `2j + 1` in the high half (the memory order of the bf16 array,
  so `jax.lax.bitcast_convert_type(pairs, jnp.bfloat16)` undoes it)."""
  bits = jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16),
                                      jnp.uint16).astype(jnp.uint32)
  lo, hi = jnp.unstack(bits.reshape(*bits.shape[:-1], -1, 2), axis=-1)
  return lo | (hi << 16)


def values_from_pairs(pairs: jax.Array) -> jax.Array:
  """Inverse of `value_pairs`: bf16 `[..., 2n]` from uint32 `[..., n]` (a
  bitcast; kernels store pairs, their wrappers call this outside)."""
  v = jax.lax.bitcast_convert_type(pairs, jnp.bfloat16)
  return v.reshape(*pairs.shape[:-1], -1)


def encode_blocks(xf: jax.Array, bamax: jax.Array, s_enc_over_6: jax.Array,
                  inv_s_enc: jax.Array, *, divide: Callable = nm.divide,
                  rbits: jax.Array | None = None,
                  rwords: jax.Array | None = None, with_values: bool = False,
                  with_codes: bool = True, values_as_pairs: bool = False,
                  barrier: Callable = _identity, split_pack: bool = False,
                  four_over_six: bool = False, block_2d: bool = False,
                  multiply: Callable = jnp.multiply,
                  flush: Callable = nm.ftz, encoder: Callable | None = None):
  """NVFP4_SPEC section 2, steps 2-4, on blocks `[rows, nb, 16]`.

  Args:
    xf: flushed FP32 values `[rows, nb, 16]`.
    bamax: block amax `[rows, nb]` (see `block_amax`).
    s_enc_over_6, inv_s_enc: the per-tensor constants
      (`numerics.nvfp4_scale_constants`).
    divide: correctly rounded FP32 division for this backend.
    rbits: uint8 `[rows, nb, 16]` random bytes for stochastic rounding (see
      `prng.tile_bytes`); None (and no `rwords`) rounds to nearest even.
    rwords: the same random bits as uint32 hash words `[rows, nb, 4]`
      (`prng.tile_words`), instead of `rbits`.
    with_values: also return the exact bf16 block values (`fp4 * f32(d)`).
    with_codes: False: return None for the packed codes (only the values,
      the scales and, for the caller, nothing else are needed).
    values_as_pairs: return the values as uint32 `[rows, nb, 8]` (see
      `value_pairs`) instead of bf16 `[rows, nb, 16]`.
    barrier: applied to the E4M3 scales; under XLA pass
      `jax.lax.optimization_barrier`, which keeps XLA:GPU from fusing the
      FP32->E4M3->FP32 round trip away. (It does not lower in kernels, which
      need none.)
    split_pack: the packing's lowering (see `numerics.pack_e2m1`).
    four_over_six: Four-over-Six: encode every block (16x16 tile with
      `block_2d`) twice, with its max mapped to 6 and to 4 (scale x 1.5), and
      keep the candidate with the smaller error (`error_terms`,
      `choose_four`). The constants must come from
      `nvfp4_scale_constants(..., four_over_six=True)`.
    block_2d: the blocks' rows form 16x16 tiles (for `four_over_six`).
    multiply: the scaling `xf * enc` for this backend. GPU kernels pass
      unflushed values and an FTZ multiplication (`mul.ftz.f32` flushes
      subnormal inputs, the flush this function otherwise expects done, in
      the same instruction; it also flushes subnormal products, which
      encode to the same codes and error terms as they are: below 0.25).
    flush: `numerics.ftz` for this backend (Four-over-Six's error terms).
    encoder: a lowering of step 4 (rounding, packing and the values) for
      this backend, called as `encoder(y, rwords, d, codes=, values=)` on
      the scaled values `y` `[rows, nb, 16]`, the hash words (or None) and
      the decoded scales `d` `[rows, nb]`; it returns `(packed or None,
      value pairs or None)`, bit for bit what this function computes
      otherwise (GPU kernels pass `pallas_kernels.e2m1_encode.block_encoder`).
      Not used with `four_over_six`, whose choice needs the codes.

  Returns:
    `(packed uint8 [rows, nb, 8] or None, scales e4m3 [rows, nb], values or
    None)`.
  """
  if rwords is not None:
    if rbits is not None:
      raise ValueError("encode_blocks takes rbits or rwords, not both.")
    if encoder is None or four_over_six:
      rbits = prng.word_bytes(rwords)
  if encoder is not None and with_values and not values_as_pairs:
    raise ValueError("an encoder returns the values as pairs: pass "
                     "values_as_pairs=True.")

  def scaled(expansion):
    """Steps 2-3: the E4M3 scales, their FP32 values, the scaled blocks."""
    scales = barrier(nm.nvfp4_block_decode_scale(bamax, s_enc_over_6,
                                                 expansion=expansion))
    d = scales.astype(jnp.float32)
    enc = nm.nvfp4_block_encode_scale(d, inv_s_enc, divide=divide)
    return scales, d, multiply(xf, enc[..., None])

  if encoder is not None and not four_over_six:
    scales, d, y = scaled(None)
    packed, values = encoder(y, rwords, d, codes=with_codes,
                             values=with_values)
    return packed, scales, values

  def encode(expansion):
    scales, d, y = scaled(expansion)
    if rbits is None:
      codes = nm.e2m1_encode_nearest(y)
    else:
      codes = nm.e2m1_encode_stochastic(y, rbits)
    return scales, d, y, codes

  scales, d, y, codes = encode(None)
  if four_over_six:
    scales4, d4, y4, codes4 = encode(1.5)
    four = choose_four(error_terms(y, codes, d, flush=flush),
                       error_terms(y4, codes4, d4, flush=flush), block_2d)
    codes = jnp.where(four[..., None], codes4, codes)
    d = jnp.where(four, d4, d)
    scales = d.astype(jnp.float8_e4m3fn)  # Exact: both are E4M3 values.
  values = None
  if with_values:
    values = (nm.e2m1_decode(codes) * d[..., None]).astype(jnp.bfloat16)
    if values_as_pairs:
      values = value_pairs(values)
  packed = nm.pack_e2m1(codes, split=split_pack) if with_codes else None
  return packed, scales, values


def block_value_pairs(packed: jax.Array, scales: jax.Array,
                      dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
  """The block values of each byte's two codes, `(even, odd)`, each
  `[rows, nb, 8]`, from packed codes `[rows, nb, 8]` and E4M3 scales
  `[rows, nb]`: `even[..., j]` is element `2j` of its block (the low nibble),
  `odd[..., j]` element `2j + 1`.

  The values are `fp4 * f32(d)`, exact in bfloat16 (at most 6 significant
  bits, within [2^-10, 2688]), so the FP32 and bf16 results are the same
  numbers. A kernel that contracts over K can multiply the even and odd
  elements of its activations with these two halves instead of interleaving
  them (`nvfp4_jax.ops.weight_only_matmul.pallas_triton`).
  """
  s = scales.astype(jnp.float32)[..., None]
  packed = packed.astype(jnp.uint8)
  return tuple((nm.e2m1_decode(c) * s).astype(dtype)
               for c in (packed & 0xF, packed >> 4))


def block_values(packed: jax.Array, scales: jax.Array,
                 dtype=jnp.bfloat16) -> jax.Array:
  """Block values `fp4 * f32(d)` `[rows, nb, 16]` from packed codes
  `[rows, nb, 8]` and E4M3 scales `[rows, nb]`: `block_value_pairs`
  interleaved (`numerics.unpack_e2m1`'s element order).
  """
  even, odd = block_value_pairs(packed, scales, dtype)
  return jnp.stack([even, odd], axis=-1).reshape(*even.shape[:-1], -1)


def bf16_exact_matrix(h: np.ndarray) -> bool:
  """Whether every entry of the (host) matrix `h` is exact in bfloat16."""
  h = np.asarray(h, np.float32)
  return bool(np.all(h.astype(jnp.bfloat16).astype(np.float32) == h))


def hadamard_rows(v: jax.Array, sign_vector: Sequence[int]) -> jax.Array:
  """`v @ H` of runs of `size` elements, the RHT step (NVFP4_SPEC section 4),
  as the reference defines it on every backend and CPU.

  Flush the inputs, `hadamard_butterfly`'s operations (every product and
  every partial sum flushed, the sums in the Sylvester order) on whole
  rows, flush and round to bf16 (`round_hadamard`): the result is returned
  in FP32 (holding bf16 values). Elementwise operations only, each flushed
  explicitly: no result depends on the host's instruction set, on a
  backend's flush mode or on the dot a compiler picks (XLA:CPU lowers a
  small FP32 dot to YNNPACK on some CPUs and to its own loops on others:
  their summation orders differ, and so do the signs of the zeros that
  flushed products leave, as an `fma` chain keeps the last product's). The
  columns kernels run the butterfly on one array per element (the same
  operations on the same pairs: `tests/core/test_hadamard.py` holds the two
  layouts to the same bits); the tensor-core kernels `hadamard_sums`.

  Args:
    v: `[n, size]` FP32 (or narrower) values.
    sign_vector: the RHT's signs, `size` of them (`size` a power of two).
  """
  n = len(sign_vector)
  _check_butterfly(v.shape[-1], n)
  y = flushed_product(nm.ftz(v.astype(jnp.float32)),
                      jnp.asarray(butterfly_weights(sign_vector)))
  lead = y.shape[:-1]
  h = 1
  while h < n:  # Round h pairs element k with k + h in runs of 2h.
    y = y.reshape(*lead, n // (2 * h), 2, h)
    a, b = y[..., 0, :], y[..., 1, :]
    y = jnp.stack([flushed_sum(a, b), flushed_difference(a, b)],
                  axis=-2).reshape(*lead, n)
    h *= 2
  return round_hadamard(y)


def hadamard_sums(v: jax.Array, h: jax.Array, *,
                  bf16_operands: bool) -> jax.Array:
  """The FP32 sums `v @ H` of the tensor-core kernels' tiles (flushed `v`
  in, before the output's flush and bf16 rounding), a dot.

  Equal to `hadamard_butterfly`'s sums wherever those are exact and no
  product or partial sum is subnormal; elsewhere the summation order and
  the flushes are the dot's own (tensor cores keep subnormal products and
  partial sums; interpreted, XLA:CPU's dot flushes both).

  Args:
    v: `[n, size]` FP32 values, flushed.
    h: the `[size, size]` RHT matrix, FP32.
    bf16_operands: multiply on bf16 operands (tensor cores). Only a lowering
      choice, allowed when it changes nothing: `v` holds bf16 values and `H`'s
      entries are exact in bf16 (`bf16_exact_matrix`; sizes that are powers of
      4), so every product is exact either way. Otherwise the dot runs in FP32
      (IEEE, not TF32).
  """
  if bf16_operands:
    return jnp.dot(v.astype(jnp.bfloat16), h.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)
  return jnp.dot(v.astype(jnp.float32), h.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST,
                 preferred_element_type=jnp.float32)


def flushed_product(v: jax.Array, c) -> jax.Array:
  """FP32 `ftz(v * c)`: a subnormal product becomes a zero of its sign, on
  every backend (`mul.ftz`'s product on the GPU, what XLA:CPU's FTZ mode
  gives implicitly)."""
  return nm.ftz(v * c)


def flushed_sum(a: jax.Array, b: jax.Array) -> jax.Array:
  """FP32 `ftz(a + b)` (round to nearest even; `add.ftz` on the GPU)."""
  return nm.ftz(a + b)


def flushed_difference(a: jax.Array, b: jax.Array) -> jax.Array:
  """FP32 `ftz(a - b)` (round to nearest even; `sub.ftz` on the GPU)."""
  return nm.ftz(a - b)


def _check_butterfly(n: int, signs: int) -> None:
  if signs != n or n < 2 or n & (n - 1):
    raise ValueError(f"hadamard_butterfly needs a power-of-2 block with one "
                     f"sign per element; got {n} arrays, {signs} signs.")


def butterfly_weights(sign_vector: Sequence[int]) -> tuple[np.float32, ...]:
  """Element `k`'s factor in `hadamard_butterfly`: `s[k] / sqrt(size)` in
  FP32, column 0 of `hadamard.rht_matrix` (the same division: the entries
  of `H`, whose magnitudes are all this one number)."""
  n = len(sign_vector)
  return tuple(np.float32(s) / np.sqrt(np.float32(n)) for s in sign_vector)


def hadamard_butterfly(vs: Sequence[jax.Array], sign_vector: Sequence[int],
                       *, multiply: Callable = flushed_product,
                       add: Callable = flushed_sum,
                       subtract: Callable = flushed_difference
                       ) -> list[jax.Array]:
  """The RHT's FP32 sums of blocks held as separate arrays, one per element
  of the block (`vs[k]`: element `k` of every block; FP32, flushed, or
  unflushed with an FTZ `multiply`): the fast Walsh-Hadamard transform.
  The reference's definition of the sums (`hadamard_rows`).

  Element `k` is first multiplied by its entry of `H`, `s[k] / sqrt(size)`
  (`butterfly_weights`; for sizes that are powers of 4 a power of two, so
  the product is exact unless it is subnormal, and then flushed), then
  `log2(size)` rounds of additions and subtractions, each result flushed,
  give `(v * s) @ H_size / sqrt(size)`, the Sylvester matrix's sums in its
  natural order. Every operation is IEEE FP32 with round to nearest even,
  so the sums, their rounding and the signs of their zeros are defined:
  the same bits wherever the operations are the defaults' (a kernel's
  lowering of each, its `mul.ftz` / `add.ftz` / `sub.ftz`, or XLA's `*`,
  `+`, `-` and an explicit flush).

  Args:
    vs: `size` arrays of one shape, element `k` of every block in `vs[k]`.
    sign_vector: the RHT's signs, one per element; `size` a power of two.
    multiply: `multiply(v, c)`: `flushed_product` for this backend.
    add, subtract: `flushed_sum` and `flushed_difference` for this backend
      (a kernel may pair lanes).

  Returns:
    The `size` sums, `[k]` the block's output `k`, each shaped as `vs[k]`.
  """
  n = len(vs)
  _check_butterfly(n, len(sign_vector))
  y = [multiply(v, c) for v, c in zip(vs, butterfly_weights(sign_vector))]
  h = 1
  while h < n:
    for start in range(0, n, 2 * h):
      for k in range(start, start + h):
        y[k], y[k + h] = add(y[k], y[k + h]), subtract(y[k], y[k + h])
    h *= 2
  return y


def round_hadamard(y: jax.Array) -> jax.Array:
  """The last step of `hadamard_rows`: flush the FP32 sums, round to bf16
  (returned in FP32). In GPU kernels, `pallas_kernels.fp32.round_hadamard`
  does the same in PTX.

  Monotone in the magnitude: the rounded maximum magnitude is the maximum of
  the rounded magnitudes, so an amax may round once, after reducing the sums.
  """
  return nm.ftz(y).astype(jnp.bfloat16).astype(jnp.float32)
