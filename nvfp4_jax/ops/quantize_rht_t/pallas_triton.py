"""Pallas-Triton kernels of `nvfp4_jax.quantize_rht_t`, the Wgrad operand.

Two passes over `x: [tokens, features]`, as the data flow needs (the amax of
the transformed tensor must be complete before any block is encoded): an
amax pass (`rht_amax`), then an encode pass (`quantize_call`). Each comes in
two layouts.

The columns kernels (`_columns_amax_kernel`, `_columns_kernel`; the default
for 16-point RHT, `COLUMNS`) hold each 16-token block of a feature in one
thread. `x` is viewed as `[tokens / 16, 16, features]`, and row `k` of every
block in a tile is loaded along the features as its own array; the Hadamard
transform is then the butterfly's additions on these arrays
(`nvfp4_jax.core.tile.hadamard_butterfly`), and stacked along a new, thread-local
last axis they are the reference's `[rows, blocks, 16]` tiles for
`tile.encode_blocks`. No transpose through shared memory and no shuffles:
on the H100 the encode pass writes codes 10-16% faster than the tensor-core
one at 8192^2 and at GPT base's shapes (block values up to 6%), and the amax
pass runs 7-16% faster (BENCHMARKS.md, 2026-11-26, fourth).

The tensor-core kernels (`_amax_kernel`, `_quantize_kernel`) transpose a
tile and multiply it by `H` on the tensor cores. They run the rest: the fused
pair (`fused_x=True`: the same read of `x` also produces the Fprop operand,
`x` quantized 1x16 along `features`, TE's fused cast + transpose, whose
blocks lie along the features), Four-over-Six (except round-to-nearest
codes where the columns kernel's word path runs: sm_100a/sm_103a), 64-point
RHT, and any call given an `RHTConfig`:

1. `_amax_kernel`: each program transforms `amax_steps` tiles in a loop
   (transpose + 16-point Hadamard on the tensor cores), keeps a running
   elementwise maximum of the sums' magnitudes, and writes their maximum,
   flushed and rounded to bf16 once; optionally the amax of `x` itself from
   the same read.
2. `_quantize_kernel`: transforms the tile again and quantizes it along the
   token axis (RTNE or SR), writing `[features, tokens/2]` codes and
   `[features, tokens/16]` scales.

The RHT matrix is an input (closed-over constants do not lower); the columns
kernels take the sign vector as Python constants. The tile math is the
reference's: the RHT step of `nvfp4_jax.rht` (`nvfp4_jax.core.tile.hadamard_rows`:
the columns kernels run its butterfly, `tile.hadamard_butterfly`, with the
same flushed operations, so their sums are the reference's bit for bit; the
tensor-core kernels `tile.hadamard_sums`) and `round_hadamard`, then
`tile.encode_blocks` and `prng.tile_words` (`prng.block_words`). The
tensor-core kernels' FP32 sums are the reference's wherever they are exact
and no product or partial sum is subnormal (only the summation order
differs, as between any two implementations, TE's included). The tensor-core kernels support the
Hadamard sizes whose matrix is exact in bf16 and fills a tensor-core dot (16
and 64). Other sizes raise `NotImplementedError` (dispatch falls back to the
reference). Arguments are validated by the public ops before dispatch.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng
from nvfp4_jax.core import spmd
from nvfp4_jax.core import tile
from nvfp4_jax.core.hadamard import default_sign_vector
from nvfp4_jax.core.hadamard import rht_matrix
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.arrays import NVFP4Values
from pallas_kernels import choose_four
from pallas_kernels import e2m1_encode
from pallas_kernels import fp32
from pallas_kernels import fp32x2
from pallas_kernels import launch
from pallas_kernels import paired_words
from nvfp4_jax.ops.quantize_rht_t.config import RHTConfig
from nvfp4_jax.ops.quantize_rht_t.config import default_config
from nvfp4_jax.ops.quantize_rht_t.config import check_size
from nvfp4_jax.ops.quantize_rht_t.config import AMAX_PROGRAMS
from nvfp4_jax.ops.quantize_rht_t.config import ColumnsConfig

B = nm.NVFP4_BLOCK


def rht_sums_transposed(v: jax.Array, h: jax.Array) -> jax.Array:
  """The FP32 sums of `rht(v.T)` (`tile.hadamard_sums`) of a flushed
  `[tokens, features]` tile, `[features * tokens / size, size]`: the
  `size`-token runs of each feature as rows."""
  t, f = v.shape
  n = h.shape[0]
  return tile.hadamard_sums(v.T.reshape(f * t // n, n), h,
                            bf16_operands=v.dtype == jnp.bfloat16)


def _flush(x: jax.Array, interpret: bool) -> jax.Array:
  """`ftz(x)`, bf16 kept in bf16 (pairs at a time on the GPU), else FP32."""
  if x.dtype == jnp.bfloat16:
    return fp32.flush_bf16(interpret)(x)
  return fp32.flush(interpret)(x.astype(jnp.float32))


def rht_transposed(x: jax.Array, h: jax.Array, interpret: bool) -> jax.Array:
  """`rht(x.T)` of a `[tokens, features]` tile, as FP32 `[features, tokens]`
  (flushed, `tile.hadamard_sums` on the tensor cores, `round_hadamard`, of
  its 16-token runs: the reference's `tile.hadamard_rows` wherever the sums
  are exact and no product or partial sum is subnormal).

  bf16 tiles multiply on bf16 operands (exact: see `check_size`).
  """
  t, f = x.shape
  y = rht_sums_transposed(_flush(x, interpret), h)
  return fp32.round_hadamard(interpret)(y).reshape(f, t)


def _amax_kernel(h_ref, x_ref, *out_refs, with_x: bool, tokens: int,
                 features: int, block_tokens: int, interpret: bool):
  """One program: `steps` token tiles of `block_tokens` x `bf`, one after
  another. Each tile is flushed, transposed and multiplied by `H`; a running
  elementwise maximum keeps the magnitudes of the FP32 sums (and of `x`,
  bf16 pairs at a time). One reduction at the end, then the flushes and the
  sums' bf16 rounding once (each monotone in the magnitude,
  `tile.round_hadamard`: the rounded maximum is the maximum rounded)."""
  bt_all, bf = x_ref.shape
  bt = block_tokens
  i, j = pl.program_id(0), pl.program_id(1)
  keep = fp32.max_magnitude(interpret)
  h = h_ref[...]

  def body(k, carry):
    m_t, m_x = carry
    mask = launch.bounds_mask((bt, bf),
                              (0, i * bt_all + k * bt, tokens, bt_all),
                              (1, j * bf, features, bf))
    x = launch.load_at(x_ref, (pl.ds(pl.multiple_of(k * bt, bt), bt),
                               slice(None)), mask)  # Out of bounds: 0.
    m_t = keep(m_t, rht_sums_transposed(_flush(x, interpret), h))
    return m_t, keep(m_x, x) if with_x else m_x

  n = h.shape[0]
  m_t, m_x = jax.lax.fori_loop(
      0, bt_all // bt, body, (jnp.zeros((bf * bt // n, n), jnp.float32),
                              jnp.zeros((bt, bf), x_ref.dtype)))
  _store_amax_partials(out_refs, m_t, m_x if with_x else None)


def _store_amax_partials(out_refs, m_t: jax.Array, m_x: jax.Array | None):
  """Writes an amax program's partials from its running maxima: the FP32
  sums' (`m_t`), flushed and rounded to bf16 once (`tile.round_hadamard` is
  monotone in the magnitude: the rounded maximum is the maximum rounded),
  and `x`'s (`m_x`, if given), flushed (the flushed maximum is the
  maximum's flush); as uint32 bit patterns (`fp32.abs_max_bits`)."""
  amax_t = tile.round_hadamard(tile.abs_max(m_t))
  out_refs[0][...] = jnp.full((1, 1), fp32.abs_max_bits(amax_t), jnp.uint32)
  if m_x is not None:
    amax_x = nm.ftz(tile.abs_max(m_x.astype(jnp.float32)))
    out_refs[1][...] = jnp.full((1, 1), fp32.abs_max_bits(amax_x), jnp.uint32)


def rht_amax(x: jax.Array, *, sign_vector: Sequence[int] | None = None,
             size: int = 16, with_x: bool = False,
             config: RHTConfig | ColumnsConfig | None = None):
  """`max |rht(x.T)|` (and `max |x|` with `with_x`) from one read of `x`.

  Returns:
    FP32 scalar amax of `rht(x.T)`, or `(amax_x, amax_rht)` with `with_x`.
  """
  check_size(size, "rht_amax")
  if _use_columns(config, size == B, "rht_amax"):
    outs = _columns_amax(x, sign_vector=sign_vector, with_x=with_x,
                         config=config)
  else:
    outs = _tensor_core_amax(x, sign_vector=sign_vector, size=size,
                             with_x=with_x, config=config)
  if with_x:  # Both from one reduction.
    amax_t, amax_x = fp32.combine_partial_amax(*outs)
    return amax_x, amax_t
  return fp32.combine_partial_amax(*outs)[0]


def _amax_grid(units: int, unit_tile: int, features: int, bf: int,
               amax_steps: int) -> tuple[int, tuple[int, int]]:
  """`(steps, grid)` of an amax pass over `units` token units (tokens or
  16-token blocks) in tiles of `unit_tile` x `bf`: tiles per program as
  configured, but no more than the tokens need, nor so many that fewer than
  `AMAX_PROGRAMS` programs remain."""
  tiles = launch.cdiv(units, unit_tile) * launch.cdiv(features, bf)
  steps = min(amax_steps, launch.next_pow2(launch.cdiv(units, unit_tile)),
              1 << (max(1, tiles // AMAX_PROGRAMS).bit_length() - 1))
  return steps, (launch.cdiv(units, unit_tile * steps),
                 launch.cdiv(features, bf))


def _tensor_core_amax(x, *, sign_vector, size: int, with_x: bool,
                      config: RHTConfig | None):
  """`rht_amax` by `_amax_kernel`: the per-program partials."""
  interpret = launch.check_backend("rht_amax")
  t, f = x.shape
  cfg = config or default_config(t, f, size)
  bt, bf = cfg.block_tokens, cfg.block_features
  steps, grid = _amax_grid(t, bt, f, bf, cfg.amax_steps)
  h = jnp.asarray(rht_matrix(sign_vector, size))
  part = jax.ShapeDtypeStruct(grid, jnp.uint32)
  n_out = 2 if with_x else 1
  kernel = functools.partial(_amax_kernel, with_x=with_x, tokens=t,
                             features=f, block_tokens=bt, interpret=interpret)
  return launch.pallas_call(
      kernel, interpret=interpret, num_warps=cfg.num_warps,
      num_stages=cfg.amax_stages, name="nvfp4_rht_amax", grid=grid,
      in_specs=[pl.BlockSpec((size, size), lambda i, j: (0, 0)),
                pl.BlockSpec((bt * steps, bf), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((1, 1), lambda i, j: (i, j))] * n_out,
      out_shape=[part] * n_out)(h, x)


def _quantize_kernel(*refs, fused_x: bool, sr_t: bool, sr_x: bool,
                     interpret: bool, tokens: int, features: int,
                     words_t: int, words_x: int, fos_t: bool, fos_x: bool,
                     values_t: bool, values_x: bool):
  refs = list(refs)
  # One amax per operand, each its own input: no stacking kernel before.
  amax_refs = [refs.pop(0) for _ in range(2 if fused_x else 1)]
  seeds_ref = refs.pop(0) if (sr_t or sr_x) else None
  # The stream origins of this shard's operands (see `prng.stream_origin`):
  # [row, block] of q(rht(x.T)), then of q(x).
  origin_ref = refs.pop(0) if (sr_t or sr_x) else None
  h_ref, x_ref = refs.pop(0), refs.pop(0)
  divide = fp32.exact_divide(interpret)
  # Shape (1,), not scalars: the inline-asm division needs tensor operands.
  consts = lambda k, fos: nm.nvfp4_scale_constants(
      amax_refs[k][...], divide=divide, four_over_six=fos)
  bt, bf = x_ref.shape
  i, j = pl.program_id(0), pl.program_id(1)  # token tile, feature tile
  tok = lambda axis, n: (axis, i * n, tokens // (bt // n), n)
  feat = lambda axis, n: (axis, j * n, features // (bf // n), n)
  x = launch.load(x_ref, launch.bounds_mask((bt, bf), tok(0, bt),
                                            feat(1, bf)))

  # Wgrad operand: rht(x.T), [features, tokens], blocks along tokens.
  z = rht_transposed(x, h_ref[...], interpret).reshape(bf, bt // B, B)
  encoder = e2m1_encode.block_encoder(interpret)
  rwords = None
  if sr_t:
    rwords = prng.tile_words(origin_ref[0] + j * bf, bf,
                             origin_ref[1] + i * (bt // B), bt // B, words_t,
                             seeds_ref[0], seeds_ref[1])
  packed, scales, vals = tile.encode_blocks(
      z, tile.block_amax(z, False), *consts(0, fos_t), divide=divide,
      rwords=rwords, split_pack=True, four_over_six=fos_t,
      flush=fp32.flush(interpret), with_values=values_t,
      with_codes=not values_t, values_as_pairs=True, encoder=encoder)
  _store_operand(refs, values_t, packed, scales, vals,
                 (feat(0, bf), tok(1, bt // B)), (feat(0, bf), tok(1, bt // 2)))

  if fused_x:  # Row operand: x, [tokens, features], blocks along features.
    xf = x.astype(jnp.float32).reshape(bt, bf // B, B)  # Flushed when scaled.
    rwords = None
    if sr_x:
      rwords = prng.tile_words(origin_ref[2] + i * bt, bt,
                               origin_ref[3] + j * (bf // B), bf // B, words_x,
                               seeds_ref[2], seeds_ref[3])
    packed, scales, vals = tile.encode_blocks(
        xf, fp32.flushed_block_amax(xf, False), *consts(1, fos_x),
        divide=divide, multiply=fp32.ftz_multiply(interpret),
        flush=fp32.flush(interpret),
        rwords=rwords, split_pack=True, four_over_six=fos_x,
        with_values=values_x, with_codes=not values_x, values_as_pairs=True,
        encoder=encoder)
    _store_operand(refs, values_x, packed, scales, vals,
                   (tok(0, bt), feat(1, bf // B)),
                   (tok(0, bt), feat(1, bf // 2)))


def _store_operand(refs, as_values: bool, packed, scales, vals, block_dims,
                   value_dims):
  """Stores one operand into the next output refs (popped from `refs`):
  codes and scales (`block_dims`: their tile's bounds), or the block values
  as a 2-D tile of uint32 pairs (`value_dims`; see `tile.value_pairs`)."""
  if as_values:
    vals = vals.reshape(vals.shape[0], -1)
    launch.store(refs.pop(0), vals, launch.bounds_mask(vals.shape,
                                                       *value_dims))
    return
  for a in (packed, scales):
    launch.store(refs.pop(0), a, launch.bounds_mask(a.shape, *block_dims))


# Whether the interpreted columns kernel takes the path of Blackwell's
# round-to-nearest codes (`_columns_words`, its assembly replaced by
# software twins); tests switch it on to check that path against the
# reference.
COLUMNS_WORDS_INTERPRETED = False

# Whether `quantize_call` runs the Wgrad operand alone (16-point RHT;
# Four-over-Six only on the word path) in `_columns_kernel` (benchmarks
# switch it off to time the tensor-core kernel in the same run).
COLUMNS = True


def _columns_words_apply(sr: bool, values: bool) -> bool:
  """Whether the columns kernel takes `_columns_words` (Blackwell's
  round-to-nearest codes; `COLUMNS_WORDS_INTERPRETED` where interpreted)."""
  on = (COLUMNS_WORDS_INTERPRETED if launch.backend() == "cpu"
        else e2m1_encode.hardware_e2m1())
  return on and not (sr or values)


def _use_columns(config, applies: bool, what: str) -> bool:
  """Whether a call runs the columns kernels: where they apply (16-point
  RHT; the Wgrad operand alone, without Four-over-Six unless its
  round-to-nearest codes take `_columns_words`) and `COLUMNS` is on,
  unless an `RHTConfig` asks for the tensor-core ones. A `ColumnsConfig`
  anywhere else is an error."""
  applies = applies and COLUMNS
  if isinstance(config, ColumnsConfig) and not applies:
    raise ValueError(
        f"{what}: a ColumnsConfig tiles the columns kernels, which run the "
        f"Wgrad operand alone with 16-point RHT, and Four-over-Six only for "
        f"round-to-nearest codes on sm_100a/sm_103a; this call runs the "
        f"tensor-core kernels: pass an RHTConfig or None.")
  return applies and not isinstance(config, RHTConfig)


def _tree_stack(parts: list[jax.Array]) -> jax.Array:
  """`jnp.stack(parts, axis=-1)` for a power-of-two count of arrays, from
  pairwise stacks along the last axis only (Triton's `join`): the first
  round pairs `k` with `k + n/2`, so the nested pairs flatten in order."""
  shape = parts[0].shape
  while len(parts) > 1:
    h = len(parts) // 2
    parts = [jnp.stack([parts[k], parts[k + h]], axis=-1) for k in range(h)]
  return parts[0].reshape(*shape, -1)


def _columns_kernel(*refs, sr: bool, values: bool, interpret: bool,
                    tokens: int, features: int, words_t: int,
                    sign_vector: tuple[int, ...], words: bool = False,
                    four_over_six: bool = False):
  """`q(rht(x.T))` of `nb` 16-token blocks x `bf` features, each 16-token
  block in the registers of the thread that owns its feature.

  `x_ref` is the tile `[nb, 16, bf]` of `x` viewed as `[tokens / 16, 16,
  features]`; element `k` of every block is loaded as its own `[nb, bf]`
  array (row `k` of each block, along the features). The Hadamard transform
  is the butterfly (`tile.hadamard_butterfly`) on these arrays; stacked
  along a new last axis, which Triton keeps in each thread, they are the
  `[nb, bf, 16]` blocks of the reference's tile math (`tile.encode_blocks`,
  as `_quantize_kernel` calls it): no transpose through shared memory, no
  shuffles for the block amax, one scale and one division per block. The
  outputs are `[bf, nb, 8]` (value pairs or bytes of codes) and the scales
  `[bf, nb]`, a transpose of thread-local axes.

  With `words` (Blackwell's round-to-nearest codes, `_columns_words`): the
  same values through packed FP32 instructions and the E2M1 conversion,
  also with `four_over_six` (the only path that takes it); the tensor
  constants and the encode-scale table come from the wrapper
  (`_columns_call`), the codes are stored as `[bf, 2 nb]` uint32 words
  (except with `four_over_six`), and the index maps see bounded program
  ids (`_bounded`).
  """
  refs = list(refs)
  # The word path's tensor constant `S_enc / 6` and encode-scale table
  # (`paired_words.encode_scale_table`), else the amax.
  amax_ref = refs.pop(0)
  table_ref = refs.pop(0) if words and not four_over_six else None
  seeds_ref = refs.pop(0) if sr else None
  origin_ref = refs.pop(0) if sr else None
  x_ref = refs.pop(0)
  out_ref, scales_ref = refs
  nb, _, bf = x_ref.shape
  i, j = pl.program_id(0), pl.program_id(1)  # block tile, feature tile
  blocks = tokens // B
  blk_dim = lambda axis: (axis, i * nb, blocks, nb)
  feat_dim = lambda axis: (axis, j * bf, features, bf)
  mask = launch.bounds_mask((nb, 1, bf), blk_dim(0), feat_dim(2))
  if words:
    packed, scales = _columns_words(_load_rows(x_ref, 0, mask, nb, bf),
                                    amax_ref, table_ref, sign_vector,
                                    interpret,
                                    four_over_six)
    out = jnp.transpose(packed, (1, 0, 2))
    if not four_over_six:  # uint32 words, 2 per block: `[bf, 2 nb]`.
      out = out.reshape(bf, 2 * nb)
      dims = (feat_dim(0), (1, 2 * i * nb, 2 * blocks, 2 * nb))
    else:
      dims = (feat_dim(0), blk_dim(1))
    launch.store(out_ref, out, launch.bounds_mask(out.shape, *dims))
    launch.store(scales_ref, scales.T, launch.bounds_mask(
        (bf, nb), feat_dim(0), blk_dim(1)))
    return
  sums = _butterfly(_load_rows(x_ref, 0, mask, nb, bf), sign_vector,
                    interpret)
  # The blocks as `[nb, bf, 16]`: the stacked axis stays in each thread's
  # registers, so what follows is the reference's tile math as it is.
  z = fp32.round_hadamard(interpret)(_tree_stack(sums))
  divide = fp32.exact_divide(interpret)
  rwords = None
  if sr:
    row = origin_ref[0] + j * bf + jax.lax.broadcasted_iota(
        jnp.int32, (nb, bf), 1)
    blk = origin_ref[1] + i * nb + jax.lax.broadcasted_iota(
        jnp.int32, (nb, bf), 0)
    rwords = _tree_stack(prng.block_words(
        prng.block_word_base(row, blk, words_t), seeds_ref[0], seeds_ref[1]))
  packed, scales, vals = tile.encode_blocks(
      z, tile.block_amax(z, False),
      *nm.nvfp4_scale_constants(amax_ref[...], divide=divide), divide=divide,
      rwords=rwords, split_pack=True, with_values=values,
      with_codes=not values, values_as_pairs=True,
      encoder=e2m1_encode.block_encoder(interpret))
  out = jnp.transpose(vals if values else packed, (1, 0, 2))
  launch.store(out_ref, out, launch.bounds_mask(out.shape, feat_dim(0),
                                                blk_dim(1)))
  launch.store(scales_ref, scales.T, launch.bounds_mask(
      (bf, nb), feat_dim(0), blk_dim(1)))


def _columns_words(rows: list[jax.Array], amax, table,
                   sign_vector: tuple[int, ...], interpret: bool,
                   four_over_six: bool = False):
  """`_columns_kernel`'s round-to-nearest codes and scales where the E2M1
  conversion exists (`e2m1_encode.hardware_e2m1`), bit for bit its default
  path: the butterfly's FTZ products by `s / 4` and its additions two
  lanes per packed FP32 instruction (`fp32x2.mul_ftz_const_x2`, `add_x2`,
  `sub_x2`: per lane the scalar instruction), each sum flushed and rounded
  to bf16, widened back in the same conversion
  (`fp32x2.round_bf16_widened`), the block amax a tree of three-input
  magnitude maxima of the 16 rounded values (`fp32x2.max_magnitude3`:
  exact, NaN if any is NaN), then the word encoder (the values are NaN in
  whole blocks, a NaN anywhere in a block's sums making its amax NaN):
  the decode scales' E4M3 bytes (`paired_words.e4m3_codes`), each block's
  encode scale looked up by its byte in the wrapper's table (`table`,
  `paired_words.encode_scale_table`: no reciprocal in the kernel) and the
  codes as uint32 words (`paired_words.scale_encode_words`). `amax` is the
  wrapper's constants ref: `[S_enc / 6]`, and `[S_enc / 6, 1 / S_enc]`
  with `four_over_six`, which takes the quantize kernel's word-path
  Four-over-Six (`paired_words.words_block_scales` per candidate, both
  candidates' codes by the conversion, the choice by
  `choose_four.words_choose_four`).

  Returns `(words uint32 [nb, bf, 2], scales e4m3 [nb, bf])`, or with
  `four_over_six` `(packed uint8 [nb, bf, 8], scales)`.
  """
  mul = lambda v, c: fp32x2.mul_ftz_const_x2(interpret, c)(v)
  sums = tile.hadamard_butterfly(
      list(rows), sign_vector, multiply=mul,
      add=fp32x2.add_x2(interpret), subtract=fp32x2.sub_x2(interpret))
  rnd = fp32x2.round_bf16_widened(interpret)
  z = [rnd(v) for v in sums]
  mx = fp32x2.max_magnitude3(interpret)
  m = z
  while len(m) > 2:  # 16 -> 6 -> 2 -> 1: 8 maxima per block.
    m = [mx(*m[k:k + 3]) if k + 1 < len(m) else m[k]
         for k in range(0, len(m), 3)]
  bamax = mx(m[0], m[1], m[1])  # Three sources: no sign to clear.
  even = _tree_stack(z[0::2])
  odd = _tree_stack(z[1::2])
  s_enc_over_6 = amax[0]
  if not four_over_six:
    scales, enc = paired_words.words_block_scales_table(
        bamax, s_enc_over_6, table, interpret)
    return paired_words.scale_encode_words(even, odd, enc, interpret), scales
  # Four-over-Six: both constants given (`amax[1]` is `1 / S_enc`), each
  # candidate's reciprocal in the kernel (`rcp.rn.ftz`; two table
  # lookups per block compile to more instructions here).
  (s6, e6), (s4, e4) = (paired_words.words_block_scales(
      bamax, s_enc_over_6, amax[1], interpret, expansion=x)
      for x in (None, 1.5))
  four = choose_four.words_choose_four(
      [(even, odd)], e6, s6.astype(jnp.float32), e4, s4.astype(jnp.float32),
      False, interpret)
  packed = jnp.where(four[..., None],
                     paired_words.scale_encode_codes(even, odd, e4, interpret),
                     paired_words.scale_encode_codes(even, odd, e6, interpret))
  return packed, jnp.where(four, s4, s6)


def _load_rows(x_ref, blk0, mask, nb: int, bf: int) -> list[jax.Array]:
  """Row `k` of each of `nb` 16-token blocks from block `blk0` of the tile
  `x_ref` (`[nb', 16, bf]`), as `[nb, bf]` arrays, for `k` = 0 .. 15."""
  return [launch.load_at(x_ref, (pl.ds(blk0, nb), pl.ds(k, 1), slice(None)),
                         mask).reshape(nb, bf) for k in range(B)]


def _butterfly(rows: list[jax.Array], sign_vector: tuple[int, ...],
               interpret: bool) -> list[jax.Array]:
  """`tile.hadamard_butterfly` of loaded rows, each operation the
  reference's (`tile.hadamard_rows`): each row multiplied by its sign and
  1/4 with an FTZ multiplication (the input's flush and the product's),
  the sums with FTZ additions and subtractions (`fp32.ftz_add`,
  `ftz_subtract`)."""
  return tile.hadamard_butterfly([r.astype(jnp.float32) for r in rows],
                                 sign_vector,
                                 multiply=fp32.ftz_multiply(interpret),
                                 add=fp32.ftz_add(interpret),
                                 subtract=fp32.ftz_subtract(interpret))


def _columns_amax_kernel(x_ref, *out_refs, with_x: bool, tokens: int,
                         features: int, blocks: int, interpret: bool,
                         sign_vector: tuple[int, ...]):
  """`_amax_kernel` in `_columns_kernel`'s layout: each program reduces its
  steps of `blocks` 16-token blocks x `bf` features one after another,
  keeping a running elementwise maximum of the butterfly's sums (and of
  `x`); one reduction, flush and bf16 rounding at the end."""
  nb_all, _, bf = x_ref.shape
  nb = blocks
  i, j = pl.program_id(0), pl.program_id(1)
  keep = fp32.max_magnitude(interpret)
  n_blocks = tokens // B

  def body(k, carry):
    m_t, m_x = carry
    mask = launch.bounds_mask((nb, 1, bf), (0, i * nb_all + k * nb, n_blocks,
                                            nb_all),
                              (2, j * bf, features, bf))
    rows = _load_rows(x_ref, pl.multiple_of(k * nb, nb), mask, nb, bf)
    for y in _butterfly(rows, sign_vector, interpret):
      m_t = keep(m_t, y)
    if with_x:  # In x's dtype: bf16 pairs at a time.
      for r in rows:
        m_x = keep(m_x, r)
    return m_t, m_x

  m_t, m_x = jax.lax.fori_loop(0, nb_all // nb, body,
                               (jnp.zeros((nb, bf), jnp.float32),
                                jnp.zeros((nb, bf), x_ref.dtype)))
  _store_amax_partials(out_refs, m_t, m_x if with_x else None)


def _columns_amax(x, *, sign_vector, with_x: bool,
                  config: ColumnsConfig | None):
  """`rht_amax` by `_columns_amax_kernel`: the per-program partials."""
  interpret = launch.check_backend("rht_amax")
  t, f = x.shape
  cfg = config or ColumnsConfig()
  blocks = t // B
  nb = min(cfg.blocks, launch.next_pow2(blocks))
  bf = max(B, min(cfg.block_features, launch.next_pow2(f)))
  steps, grid = _amax_grid(blocks, nb, f, bf, cfg.amax_steps)
  part = jax.ShapeDtypeStruct(grid, jnp.uint32)
  n_out = 2 if with_x else 1
  kernel = functools.partial(
      _columns_amax_kernel, with_x=with_x, tokens=t, features=f, blocks=nb,
      interpret=interpret,
      sign_vector=tuple(sign_vector or default_sign_vector(B)))
  return launch.pallas_call(
      kernel, interpret=interpret, num_warps=cfg.num_warps, num_stages=1,
      name="nvfp4_rht_amax_columns", grid=grid,
      in_specs=[pl.BlockSpec((nb * steps, B, bf), lambda i, j: (i, 0, j))],
      out_specs=[pl.BlockSpec((1, 1), lambda i, j: (i, j))] * n_out,
      out_shape=[part] * n_out)(x.reshape(blocks, B, f))


def columns_config(four_over_six: bool = False,
                   words: bool = False) -> ColumnsConfig:
  """`_columns_call`'s default tile: `ColumnsConfig()`; 2 blocks per
  thread for Four-over-Six (sm_100a, offline `sass_report`: 96 registers
  per thread and 29.4 instructions per element, where 4 blocks take 168
  registers for 28.0; untimed); 256 features for the round-to-nearest
  codes of the word path (`words`; 8 features per thread, 16-byte row
  loads: 8.1 instructions per element at 120 registers, where 128
  features give 9.0 at 72; 8 blocks of 256 features 7.9 at 150; untimed)."""
  if four_over_six:
    return ColumnsConfig(blocks=2)
  return ColumnsConfig(block_features=256) if words else ColumnsConfig()


def _bounded(grid: tuple[int, ...]):
  """Wraps a BlockSpec index map so that it sees each program id bounded
  by its grid dimension (`min(id, dim - 1)`: the id itself, as every id
  is below its dimension). The bound gives LLVM the offsets' ranges: it
  then proves that their 32-bit sums do not overflow and computes a
  thread's addresses from one 64-bit base plus constants (one address for
  the 16 row loads, immediate offsets in the loads), where an unbounded
  id leaves a sign extension and a 64-bit addition per access."""
  def wrap(index_map):
    def bounded(*ids):
      return index_map(*(jnp.minimum(p, d - 1) for p, d in zip(ids, grid)))
    return bounded
  return wrap


def _columns_call(x, *, amax_t, key_t, sign_vector, placement, values_t,
                  config: ColumnsConfig | None, four_over_six: bool = False):
  """`quantize_call` of the Wgrad operand alone by `_columns_kernel`."""
  interpret = launch.check_backend("quantize_rht_t")
  t, f = x.shape
  sr = key_t is not None
  # Blackwell's round-to-nearest codes take the packed path
  # (`COLUMNS_WORDS_INTERPRETED`: also interpreted, with software twins).
  words = _columns_words_apply(sr, values_t)
  cfg = config or columns_config(four_over_six, words)
  nb = min(cfg.blocks, launch.next_pow2(t // B))
  bf = max(B, min(cfg.block_features, launch.next_pow2(f)))
  if words:
    a = jnp.reshape(jnp.asarray(amax_t, jnp.float32), ())
    if interpret:  # As `launch.pallas_call` keeps the kernels' operands:
      a = jax.lax.optimization_barrier(a)  # computed, not constant-folded.
    s_enc_over_6, inv_s_enc = nm.nvfp4_scale_constants(
        a, four_over_six=four_over_six)
    if four_over_six:
      args = [jnp.stack([s_enc_over_6, inv_s_enc])]
      in_specs = [launch.scalar_spec(2)]
    else:
      args = [jnp.reshape(s_enc_over_6, (1,)),
              paired_words.encode_scale_table(inv_s_enc)]
      in_specs = [launch.scalar_spec(1),
                  launch.scalar_spec(paired_words.E4M3_CODES)]
  else:
    args = [jnp.reshape(amax_t, (1,)).astype(jnp.float32)]
    in_specs = [launch.scalar_spec(1)]
  origin_t, words_t = prng.stream_origin(
      None if placement is None else placement.T, t)
  if sr:
    args += [prng.seeds_from_key(key_t), origin_t]
    in_specs += [launch.scalar_spec(2)] * 2
  args.append(x.reshape(t // B, B, f))
  grid = (launch.cdiv(t // B, nb), launch.cdiv(f, bf))
  # The word path's index maps see the program ids bounded by the grid
  # (`_bounded`), so that one base address serves a thread's 16 row loads.
  index = _bounded(grid) if words else (lambda fn: fn)
  in_specs.append(pl.BlockSpec((nb, B, bf), index(lambda i, j: (i, 0, j))))
  n = B // 2  # Value pairs (uint32) or bytes of codes per block.
  out_shape = [jax.ShapeDtypeStruct((f, t // B, n),
                                    jnp.uint32 if values_t else jnp.uint8),
               jax.ShapeDtypeStruct((f, t // B), jnp.float8_e4m3fn)]
  out_specs = [pl.BlockSpec((bf, nb, n), index(lambda i, j: (j, i, 0))),
               pl.BlockSpec((bf, nb), index(lambda i, j: (j, i)))]
  as_words = words and not four_over_six
  if as_words:  # The codes as uint32 words, 2 per block.
    out_shape[0] = jax.ShapeDtypeStruct((f, t // B * 2), jnp.uint32)
    out_specs[0] = pl.BlockSpec((bf, 2 * nb), index(lambda i, j: (j, i)))
  if four_over_six and not words:  # `quantize_call` does not send these.
    raise ValueError("the columns kernel takes Four-over-Six only on its "
                     "word path (round-to-nearest codes, sm_100a/sm_103a).")
  kernel = functools.partial(
      _columns_kernel, sr=sr, values=values_t, interpret=interpret, tokens=t,
      features=f, words_t=words_t,
      sign_vector=tuple(sign_vector or default_sign_vector(B)), words=words,
      four_over_six=four_over_six)
  name = "nvfp4_quantize_rht_t_columns" + ("_values" if values_t else "")
  out, scales = launch.pallas_call(
      kernel, interpret=interpret, num_warps=cfg.num_warps, num_stages=1,
      name=name, grid=grid,
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape)(*args)
  if values_t:
    return NVFP4Values(tile.values_from_pairs(out.reshape(f, t // 2)), amax_t)
  if as_words:  # Little-endian: byte k of a word is its pair k's codes.
    out = jax.lax.bitcast_convert_type(out, jnp.uint8)
  return NVFP4Array(codes=out.reshape(f, t // 2), scales=scales, amax=amax_t,
                    four_over_six=four_over_six)


def quantize_call(x, *, amax_t, key_t, amax_x=None, key_x=None, size,
                  sign_vector, fused_x: bool,
                  config: RHTConfig | ColumnsConfig | None,
                  placement: prng.Placement | None = None,
                  four_over_six_t: bool = False,
                  four_over_six_x: bool = False,
                  values_t: bool = False, values_x: bool = False):
  """Launches the encode pass: `q(rht(x.T))` and, with `fused_x`, `q(x)`.

  A key (`key_t`, `key_x`) means that operand rounds stochastically;
  `placement` is `x`'s in the whole tensor when `x` is a shard;
  `four_over_six_*` encodes that operand with Four-over-Six; `values_*`
  writes that operand's bf16 block values (returned as `NVFP4Values`)
  instead of its codes and scales.
  """
  check_size(size, "quantize_rht_t")
  fos_columns = _columns_words_apply(key_t is not None, values_t)
  if _use_columns(config, size == B and not fused_x and (
      not four_over_six_t or fos_columns), "quantize_rht_t"):
    return _columns_call(x, amax_t=amax_t, key_t=key_t,
                         sign_vector=sign_vector, placement=placement,
                         values_t=values_t, config=config,
                         four_over_six=four_over_six_t)
  interpret = launch.check_backend("quantize_rht_t")
  t, f = x.shape
  cfg = config or default_config(t, f, size)
  bt, bf = cfg.block_tokens, cfg.block_features
  if bt % size:
    raise ValueError(f"block_tokens={bt} must be a multiple of the Hadamard "
                     f"size {size}.")
  sr_t, sr_x = key_t is not None, fused_x and key_x is not None
  # The per-tensor constants are computed in the kernel, with its exact
  # division (XLA:GPU's FP32 division is not correctly rounded). In the fused
  # pair unused seeds are zeros, so its seed layout is fixed: [t0, t1, x0,
  # x1]; the Wgrad operand alone takes [t0, t1].
  zeros = jnp.zeros((2,), jnp.uint32)
  seeds = [prng.seeds_from_key(key_t) if sr_t else zeros,
           prng.seeds_from_key(key_x) if sr_x else zeros]
  args = [jnp.reshape(a, (1,)).astype(jnp.float32)
          for a in ([amax_t, amax_x] if fused_x else [amax_t])]
  in_specs = [launch.scalar_spec(1)] * len(args)
  origin_t, words_t = prng.stream_origin(
      None if placement is None else placement.T, t)
  origin_x, words_x = prng.stream_origin(placement, f)
  if sr_t or sr_x:
    # The Wgrad operand alone: its two seeds and origin as they are (no
    # padding kernel).
    n = len(seeds) if fused_x else 1
    args += [jnp.concatenate(seeds[:n]),
             jnp.concatenate([origin_t, origin_x][:n])]
    in_specs += [launch.scalar_spec(2 * n)] * 2
  args += [jnp.asarray(rht_matrix(sign_vector, size)), x]
  in_specs += [pl.BlockSpec((size, size), lambda i, j: (0, 0)),
               pl.BlockSpec((bt, bf), lambda i, j: (i, j))]
  values_x = fused_x and values_x
  out_shape, out_specs = [], []

  def operand(rows, cols, rb, cb, index, as_values):
    """The outputs of a `[rows, cols]` operand tiled `[rb, cb]` at `index`."""
    if as_values:  # bf16 pairs as uint32 (see `tile.value_pairs`).
      out_shape.append(jax.ShapeDtypeStruct((rows, cols // 2), jnp.uint32))
      out_specs.append(pl.BlockSpec((rb, cb // 2), index))
      return
    out_shape.extend([
        jax.ShapeDtypeStruct((rows, cols // B, B // 2), jnp.uint8),
        jax.ShapeDtypeStruct((rows, cols // B), jnp.float8_e4m3fn)])
    out_specs.extend([
        pl.BlockSpec((rb, cb // B, B // 2), lambda i, j: (*index(i, j), 0)),
        pl.BlockSpec((rb, cb // B), index)])

  operand(f, t, bf, bt, lambda i, j: (j, i), values_t)
  if fused_x:
    operand(t, f, bt, bf, lambda i, j: (i, j), values_x)
  kernel = functools.partial(
      _quantize_kernel, fused_x=fused_x, sr_t=sr_t, sr_x=sr_x,
      interpret=interpret, tokens=t, features=f, words_t=words_t,
      words_x=words_x, fos_t=four_over_six_t, fos_x=four_over_six_x,
      values_t=values_t, values_x=values_x)
  name = "nvfp4_quantize_x_and_rht_t" if fused_x else "nvfp4_quantize_rht_t"
  if values_t or values_x:
    name += "_values"
  outs = list(launch.pallas_call(
      kernel, interpret=interpret, num_warps=cfg.num_warps, num_stages=1,
      name=name, grid=(launch.cdiv(t, bt), launch.cdiv(f, bf)),
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape)(*args))

  def result(rows, cols, amax, fos, as_values):
    if as_values:
      return NVFP4Values(tile.values_from_pairs(outs.pop(0)), amax,
                         four_over_six=fos)
    codes, scales = outs.pop(0), outs.pop(0)
    return NVFP4Array(codes=codes.reshape(rows, cols // 2), scales=scales,
                      amax=amax, four_over_six=fos)

  q_t = result(f, t, amax_t, four_over_six_t, values_t)
  if not fused_x:
    return q_t
  return result(t, f, amax_x, four_over_six_x, values_x), q_t


def quantize_rht_t(x: jax.Array, *, rounding: str = "nearest",
                   key: jax.Array | None = None, amax: jax.Array | None = None,
                   sign_vector: Sequence[int] | None = None, size: int = 16,
                   placement: prng.Placement | None = None,
                   amax_axes: Sequence[str] = (),
                   config: RHTConfig | ColumnsConfig | None = None,
                   four_over_six: bool = False,
                   values: bool = False) -> NVFP4Array | NVFP4Values:
  """`quantize(rht(x.T))` for `x: [tokens, features]`: the Wgrad operand.

  Args:
    x: `[tokens, features]`, validated by `nvfp4_jax.quantize_rht_t`.
    rounding, key: as `nvfp4_jax.quantize` (the SR stream runs over the
      `[features, tokens]` result).
    amax: the already reduced amax of `rht(x.T)`; computed by a kernel pass
      over `x` (max-reduced across the mesh axes `amax_axes`) when None.
    sign_vector, size: as `nvfp4_jax.rht`.
    placement: `x`'s place in the whole tensor, for a shard (see
      `nvfp4_jax.quantize_rht_t`).
    config: tile sizes: a `ColumnsConfig` for the columns kernels, an
      `RHTConfig` for the tensor-core ones (chosen by it).
    four_over_six: Four-over-Six block scaling (as `nvfp4_jax.quantize`).
    values: write the bf16 block values instead of codes and scales.

  Returns:
    NVFP4Array (`NVFP4Values` with `values`) of shape `[features, tokens]`.

  Raises:
    NotImplementedError: an unsupported Hadamard size or backend.
  """
  check_size(size, "quantize_rht_t")
  if amax is None:
    amax = spmd.reduce_amax(rht_amax(x, sign_vector=sign_vector, size=size,
                                     config=config), amax_axes)
  return quantize_call(
      x, amax_t=amax, key_t=key if rounding == "stochastic" else None,
      size=size, sign_vector=sign_vector, fused_x=False, config=config,
      placement=placement, four_over_six_t=four_over_six, values_t=values)
