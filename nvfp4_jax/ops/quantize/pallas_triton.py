"""Pallas-Triton kernel of `nvfp4_jax.quantize` (1x16 and 16x16 blocks).

Data flow of `quantize`: the tensor amax is one XLA reduction (a global max
must be complete before any block can be encoded); then one kernel reads each
element once and writes the packed codes, the E4M3 scales and, optionally, the
exact bf16 block-dequantized values that a Hopper GEMM consumes. Pass `amax=`
(e.g. a `pmax` across shards, or an amax fused into the producer) to skip the
reduction.

The tile math is `nvfp4_jax.core.tile` (`block_amax`, `encode_blocks`) and
`nvfp4_jax.core.prng.tile_words`, the functions the reference applies to the whole
tensor: codes, scales and amax are the reference's by construction, and
tests/kernels/test_kernels.py checks the plumbing. On the GPU the rounding and
packing (step 4) is `e2m1_encode.block_encoder`'s assembly, bit for bit the
reference's (tests/kernels/test_encoder.py). Arguments are validated by
`nvfp4_jax.quantize` before dispatch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng
from nvfp4_jax.core import tile
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.arrays import NVFP4Values
from pallas_kernels import choose_four
from pallas_kernels import e2m1_encode
from pallas_kernels import fp32
from pallas_kernels import launch
from pallas_kernels import paired_words
from nvfp4_jax.ops.quantize.config import QuantizeConfig
from nvfp4_jax.ops.quantize.config import default_config

B = nm.NVFP4_BLOCK


def tile_masks(rows: int, nb: int, m: int, nb_total: int):
  """Bounds masks of a `[rows, nb, ...]` tile (None where no tile is partial)."""
  row0, blk0 = pl.program_id(0) * rows, pl.program_id(1) * nb
  dims = ((0, row0, m, rows), (1, blk0, nb_total, nb))
  return {w: launch.bounds_mask((rows, nb, w), *dims)
          for w in (B, B // 2, B // 4)} | {
      0: launch.bounds_mask((rows, nb), *dims)}


def _tile_amax(a: jax.Array, block_2d: bool) -> jax.Array:
  """`tile.block_amax` from the rows' block amax `a` `[rows, nb]`."""
  if not block_2d:
    return a
  rows, nb = a.shape
  t = tile.abs_max(a.reshape(rows // B, B, nb), axis=1)
  return jnp.broadcast_to(t[:, None, :], (rows // B, B, nb)).reshape(rows, nb)


def quantize_kernel(*refs, block_2d: bool, stochastic: bool,
                    with_codes: bool, with_values: bool, interpret: bool,
                    m: int, nb_total: int, four_over_six: bool,
                    words_per_row: int, words: bool = False,
                    grouped: bool = False):
  """The quantize kernel's program.

  With `words`, Blackwell's round-to-nearest codes (and block values) from
  bf16 pairs (see below). With `grouped`, each row is quantized as a row of its own tensor
  (the grouped quantizer of `nvfp4_jax.ops.ragged_quantize.pallas_triton`): the
  amax ref holds one tensor amax per row `[rows]`, and with stochastic
  rounding the seeds refs one pair per row (`[rows]` each) and the origin
  ref each row's index within its tensor.
  """
  refs = list(refs)
  amax_ref = refs.pop(0)
  if grouped:
    seeds_ref = (refs.pop(0), refs.pop(0)) if stochastic else None
  else:
    seeds_ref = refs.pop(0) if stochastic else None
  origin_ref = refs.pop(0) if stochastic else None
  x_ref = refs.pop(0)
  codes_ref, scales_ref = (refs.pop(0), refs.pop(0)) if with_codes else (
      None, None)
  values_ref = refs.pop(0) if with_values else None
  divide = fp32.exact_divide(interpret)
  # Shape (1,), not scalars: the inline-asm division needs tensor operands.
  rows, nb, _ = x_ref.shape
  amax = amax_ref[...]
  if grouped:
    amax = amax.reshape(rows, 1)  # One tensor per row: [rows, 1] constants.
  if words:  # `nm.nvfp4_scale_constants`, 1 / S_enc by `rcp.rn`.
    s_enc_over_6, inv_s_enc = paired_words.words_scale_constants(
        amax, interpret, four_over_six)
    if not grouped:
      # As scalars (the maximum of one element): Triton then computes them
      # once, where it recomputes `[1]` tensors (the division included)
      # for each layout they are broadcast to.
      s_enc_over_6, inv_s_enc = jnp.max(s_enc_over_6), jnp.max(inv_s_enc)
  else:
    s_enc_over_6, inv_s_enc = nm.nvfp4_scale_constants(
        amax, divide=divide, four_over_six=four_over_six)
  mask = tile_masks(rows, nb, m, nb_total)

  if words:
    # Blackwell's round-to-nearest codes from bf16 pairs as uint32 words
    # `[rows, nb, 8]`, read as two halves `[rows, nb, 4]` (words 0-3 and
    # 4-7 of each block): Triton gives each thread one 128-bit vector of
    # each half, both halves of a block in the same thread (the same
    # layout), whatever is stored (codes, values or both: no shuffles for
    # the block amax, no layout conversion before the stores). The block
    # amax is a tree of bf16x2 magnitude maxima over the words
    # (`max_magnitude_words`, exact: the elements are bf16, and a NaN
    # anywhere makes the block's NaN), its two lanes widened for the last
    # maximum, whose absolute value and flush are one `abs.ftz`; then per
    # half the widened pairs, products and E2M1 conversion in one assembly.
    h = B // 4
    at = lambda ref, k: ref.at[:, :, pl.ds(k * h, h)]  # Half k of a block.
    halves = [launch.load(at(x_ref, k), mask[h]) for k in range(2)]
    mxw = paired_words.max_magnitude_words(interpret)
    pm = mxw(*halves)
    while pm.shape[-1] > 1:  # Halving the block's 4 word maxima.
      pm = mxw(*jnp.unstack(pm.reshape(*pm.shape[:-1], -1, 2), axis=-1))
    lo, hi = paired_words.widen_words(pm.reshape(rows, nb))
    # Flushed before the 16x16 tile's maximum: the flush is monotone in
    # the magnitude, so the same maximum.
    bamax = _tile_amax(fp32.abs_flush(interpret)(
        fp32.max_magnitude(interpret)(lo, hi)), block_2d)
    scales, enc = paired_words.words_block_scales(bamax, s_enc_over_6,
                                                  inv_s_enc, interpret)
    d = scales.astype(jnp.float32)
    if four_over_six:
      _words_four_over_six(at, halves, bamax, s_enc_over_6, inv_s_enc,
                           scales, enc, d, codes_ref, scales_ref, values_ref,
                           mask, block_2d, interpret)
      return
    for k, w in enumerate(halves):
      even, odd = paired_words.widen_words(w)
      if not with_codes:  # Values alone: `paired_words.scale_encode_values`.
        launch.store(at(values_ref, k), paired_words.scale_encode_values(
            even, odd, enc, d, interpret), mask[h])
        continue
      packed = paired_words.scale_encode_codes(even, odd, enc, interpret)
      launch.store(at(codes_ref, k), packed, mask[h])
      if with_values:  # Decoded from the codes: `paired_words.words_values`.
        launch.store(at(values_ref, k), paired_words.words_values(
            packed, d, interpret), mask[h])
    if with_codes:
      launch.store(scales_ref, scales, mask[0])
    return
  x = launch.load(x_ref, mask[B]).astype(jnp.float32)  # Flushed when scaled.
  rwords = None
  if stochastic and grouped:
    # Each row's place in its own tensor's stream.
    shape = (rows, nb, B // 4)
    per_row = lambda v: jnp.broadcast_to(v.reshape(rows, 1, 1), shape)
    blk = pl.program_id(1) * nb + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    lane = jax.lax.broadcasted_iota(jnp.uint32, shape, 2)
    rwords = prng.sr_hash(
        prng.block_word_base(per_row(origin_ref[...]), blk, words_per_row)
        + lane, per_row(seeds_ref[0][...]), per_row(seeds_ref[1][...]))
  elif stochastic:
    # The tile's place in the (whole, maybe sharded) tensor's stream.
    rwords = prng.tile_words(origin_ref[0] + pl.program_id(0) * rows, rows,
                             origin_ref[1] + pl.program_id(1) * nb, nb,
                             words_per_row, seeds_ref[0], seeds_ref[1])
  packed, scales, values = tile.encode_blocks(
      x, fp32.flushed_block_amax(x, block_2d), s_enc_over_6, inv_s_enc,
      divide=divide, rwords=rwords, with_values=with_values,
      with_codes=with_codes, values_as_pairs=True, split_pack=True,
      four_over_six=four_over_six, block_2d=block_2d,
      multiply=fp32.ftz_multiply(interpret),
      flush=fp32.flush(interpret),
      # NaN scaled values only in whole blocks (a NaN block amax or tensor
      # amax), each block's 16 elements loaded contiguously.
      encoder=e2m1_encode.block_encoder(interpret, block_nan=True))
  if with_codes:
    launch.store(codes_ref, packed, mask[B // 2])
    launch.store(scales_ref, scales, mask[0])
  if with_values:  # bf16 pairs as uint32 (see `tile.value_pairs`).
    launch.store(values_ref, values, mask[B // 2])


def _words_four_over_six(at, halves, bamax, s_enc_over_6, inv_s_enc, scales6,
                         enc6, d6, codes_ref, scales_ref, values_ref, mask,
                         block_2d, interpret):
  """The word path's Four-over-Six (`tile.encode_blocks(four_over_six=
  True)`): both candidates' codes by the E2M1 conversion
  (`paired_words.scale_encode_codes`), the choice by
  `choose_four.words_choose_four` (error terms of the conversion's codes,
  decoded exactly), the chosen codes, scales and
  (`paired_words.words_values`) block values stored."""
  h = B // 4
  scales4, enc4 = paired_words.words_block_scales(
      bamax, s_enc_over_6, inv_s_enc, interpret, expansion=1.5)
  d4 = scales4.astype(jnp.float32)
  pairs = [paired_words.widen_words(w) for w in halves]
  four = choose_four.words_choose_four(pairs, enc6, d6, enc4, d4, block_2d,
                                       interpret)
  scales = jnp.where(four, scales4, scales6)
  d = jnp.where(four, d4, d6)
  for k, (even, odd) in enumerate(pairs):
    packed = jnp.where(
        four[..., None],
        paired_words.scale_encode_codes(even, odd, enc4, interpret),
        paired_words.scale_encode_codes(even, odd, enc6, interpret))
    if codes_ref is not None:
      launch.store(at(codes_ref, k), packed, mask[h])
    if values_ref is not None:
      launch.store(at(values_ref, k), paired_words.words_values(
          packed, d, interpret), mask[h])
  if scales_ref is not None:
    launch.store(scales_ref, scales, mask[0])


# Whether the interpreted kernel takes the word path of Blackwell's
# round-to-nearest codes (its assembly replaced by software twins); tests
# switch it on to check that path's plumbing against the reference.
WORDS_INTERPRETED = False


def wide_tiles(stochastic: bool, with_values: bool,
               four_over_six: bool) -> bool:
  """Whether `default_config(wide=True)` applies: round-to-nearest codes
  (and block values), where the kernel converts with Blackwell's E2M1
  conversion (the word path). Four-over-Six takes the word path on the
  default 4K tiles: its 8K tiles compile to 173 registers per thread
  (sm_100a, offline `sass_report`) for 24.4 instructions per element,
  its 4K tiles to 80 for 25.6 (untimed: occupancy against the per-thread
  work)."""
  del with_values  # Decoded from the codes on that path.
  return not (stochastic or four_over_six) and e2m1_encode.hardware_e2m1()


def outputs(m: int, nb_total: int, br: int, bnb: int, with_codes: bool,
            with_values: bool) -> tuple[list, list]:
  """`(out_shape, out_specs)` of a quantize kernel over `[m, nb_total, 16]`
  in `[br, bnb, 16]` tiles: packed codes and E4M3 scales, then the value
  pairs (uint32), as asked."""
  out_shape, out_specs = [], []
  if with_codes:
    out_shape += [jax.ShapeDtypeStruct((m, nb_total, B // 2), jnp.uint8),
                  jax.ShapeDtypeStruct((m, nb_total), jnp.float8_e4m3fn)]
    out_specs += [pl.BlockSpec((br, bnb, B // 2), lambda i, j: (i, j, 0)),
                  pl.BlockSpec((br, bnb), lambda i, j: (i, j))]
  if with_values:
    out_shape.append(jax.ShapeDtypeStruct((m, nb_total, B // 2), jnp.uint32))
    out_specs.append(pl.BlockSpec((br, bnb, B // 2), lambda i, j: (i, j, 0)))
  return out_shape, out_specs


def quantize(x: jax.Array, *, block_2d: bool = False,
             rounding: str = "nearest", key: jax.Array | None = None,
             amax: jax.Array | None = None, with_values: bool = False,
             with_codes: bool = True, four_over_six: bool = False,
             placement: prng.Placement | None = None,
             config: QuantizeConfig | None = None):
  """`nvfp4_jax.quantize` as a Pallas-Triton kernel (interpreted on CPU).

  Args:
    x: float array `[..., K]`, validated by `nvfp4_jax.quantize`.
    block_2d, rounding, key, amax, four_over_six, placement: as
      `nvfp4_jax.quantize`.
    with_values: also return the exact bf16 block-dequantized values
      `[..., K]` (`fp4 * f32(scale)`, the Hopper GEMM's operand).
    with_codes: False: write the values only (not the codes and scales) and
      return them as `NVFP4Values` (`with_values` is then implied).
    config: tile sizes; defaults to `default_config`.

  Returns:
    An `NVFP4Array`, or `(NVFP4Array, values)` with `with_values`, or
    `NVFP4Values` without `with_codes`.

  Raises:
    NotImplementedError: on a backend the kernels do not support.
  """
  interpret = launch.check_backend("quantize")
  shape = x.shape
  k = shape[-1]
  m = x.size // k
  if amax is None:
    amax = tile.abs_max(nm.ftz(x.astype(jnp.float32)))
  stochastic = rounding == "stochastic"
  cfg = config or default_config(m, k, block_2d, wide=wide_tiles(
      stochastic, with_values, four_over_six))
  if block_2d and cfg.block_rows % B:
    raise ValueError(
        f"16x16 scaling needs block_rows to be a multiple of {B}; got "
        f"{cfg.block_rows}.")
  nb_total = k // B
  br, bnb = cfg.block_rows, max(1, cfg.block_cols // B)
  grid = (launch.cdiv(m, br), launch.cdiv(nb_total, bnb))

  # The per-tensor constants are computed in the kernel, with its exact
  # division (XLA:GPU's FP32 division is not correctly rounded).
  in_specs = [launch.scalar_spec(1)]
  args = [amax.reshape(1)]
  origin, words_per_row = prng.stream_origin(placement, k)
  if stochastic:
    in_specs += [launch.scalar_spec(2), launch.scalar_spec(2)]
    args += [prng.seeds_from_key(key), origin]
  # Blackwell's round-to-nearest codes read bf16 pairs as uint32 words
  # (`WORDS_INTERPRETED`: also interpreted, the assembly's software twins).
  # Codes, block values or both (the values decoded from the codes).
  words = ((WORDS_INTERPRETED if interpret else e2m1_encode.hardware_e2m1())
           and x.dtype == jnp.bfloat16 and not stochastic)
  if words:
    in_specs.append(pl.BlockSpec((br, bnb, B // 2), lambda i, j: (i, j, 0)))
    args.append(jax.lax.bitcast_convert_type(
        x.reshape(m, nb_total, B // 2, 2), jnp.uint32))
  else:
    in_specs.append(pl.BlockSpec((br, bnb, B), lambda i, j: (i, j, 0)))
    args.append(x.reshape(m, nb_total, B))
  with_values = with_values or not with_codes
  out_shape, out_specs = outputs(m, nb_total, br, bnb, with_codes,
                                 with_values)

  kernel = functools.partial(
      quantize_kernel, block_2d=block_2d, stochastic=stochastic,
      with_codes=with_codes, with_values=with_values, interpret=interpret,
      m=m, nb_total=nb_total, four_over_six=four_over_six,
      words_per_row=words_per_row, words=words)
  name = "nvfp4_quantize_2d" if block_2d else "nvfp4_quantize"
  outs = list(launch.pallas_call(
      kernel, interpret=interpret, num_warps=cfg.num_warps, num_stages=1,
      name=name if with_codes else name + "_values",
      grid=grid, in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape)(*args))
  if with_values:
    outs[-1] = tile.values_from_pairs(outs[-1]).reshape(shape)
  if not with_codes:
    return NVFP4Values(outs[0], amax, four_over_six=four_over_six)
  lead = shape[:-1]
  q = NVFP4Array(codes=outs[0].reshape(*lead, k // 2),
                 scales=outs[1].reshape(*lead, nb_total), amax=amax,
                 block_2d=block_2d, four_over_six=four_over_six)
  if with_values:
    return q, outs[2]
  return q
