"""The grouped (mixture-of-experts) quantizers in pure jnp.

A ragged tensor here is a 2-D array whose rows (tokens) are split into `E`
contiguous groups (experts) by `group_sizes`: group `e` holds rows
`offsets[e] : offsets[e] + group_sizes[e]` (`offsets` the exclusive cumsum);
rows past `sum(group_sizes)` belong to no group.

Every function computes, group by group, exactly what the dense quantizers
compute on that group's rows alone (`nvfp4_jax.quantize`, `quantize_rht_t`),
with the group sizes as traced data:

- a quantized operand has one tensor amax per group (a segment max);
- stochastic rounding draws, for each group, the stream of that group's own
  key at the element's index within the group's tensor (`core.prng`).

The `_*_xla` functions are the references of the Pallas kernels
(`pallas_triton.py`): the "xla" implementations of `api`'s ops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng
from nvfp4_jax.core import tile
from nvfp4_jax.core.hadamard import rht


def offsets(group_sizes: jax.Array) -> jax.Array:
  """The exclusive cumsum of `group_sizes`: each group's first row, int32."""
  gs = group_sizes.astype(jnp.int32)
  return jnp.cumsum(gs) - gs


def group_of(group_sizes: jax.Array, n: int) -> jax.Array:
  """The group of each of `n` rows, int32 `[n]`: `E` for rows past the end."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return jnp.searchsorted(ends, jnp.arange(n, dtype=jnp.int32),
                          side="right").astype(jnp.int32)


def segment_amax(amax_bits: jax.Array, groups: jax.Array,
                 num_groups: int) -> jax.Array:
  """Per-group `max |x|` from per-slice magnitudes' bit patterns.

  Args:
    amax_bits: uint32 bit patterns of non-negative FP32 maxima (NaN sorts
      above +Inf, as in `tile.abs_max`).
    groups: the group of each slice (`num_groups` for none).
    num_groups: E.

  Returns:
    FP32 `[E]`: 0 for an empty group, NaN where a NaN was seen.
  """
  # A masked max per group (E x n compares, no scatter: XLA's scatter-max
  # on a GPU serializes on the few group addresses); an empty group's max
  # is 0, amax 0.
  mine = groups[None, :] == jnp.arange(num_groups, dtype=groups.dtype)[:, None]
  m = jnp.max(jnp.where(mine, amax_bits[None, :], jnp.uint32(0)), axis=1)
  return jax.lax.bitcast_convert_type(m, jnp.float32)


def abs_bits(xf: jax.Array, axis) -> jax.Array:
  """`tile.abs_max` as uint32 bit patterns (for segment reductions)."""
  bits = jax.lax.bitcast_convert_type(xf, jnp.uint32) & jnp.uint32(0x7FFFFFFF)
  return jnp.max(bits, axis=axis)


def group_seeds(keys: jax.Array | None, num_groups: int) -> jax.Array:
  """The stream seeds of every group's key, uint32 `[E + 1, 2]` (the last
  row, for rows of no group, is zero)."""
  if keys is None:
    return jnp.zeros((num_groups + 1, 2), jnp.uint32)
  seeds = jax.vmap(prng.seeds_from_key)(keys)
  return jnp.concatenate([seeds, jnp.zeros((1, 2), jnp.uint32)])


def block_bytes(word_base: jax.Array, seeds: jax.Array,
                block: int) -> jax.Array:
  """The stream's bytes of blocks, uint8 `[..., block]`, from each block's
  first hash word index `word_base` (uint32 `[...]`, see
  `prng.block_word_base`) and its group's seeds (`[..., 2]`)."""
  lane = jax.lax.broadcasted_iota(jnp.uint32, (*word_base.shape, block // 4),
                                  word_base.ndim)
  words = prng.sr_hash(word_base[..., None] + lane, seeds[..., 0, None],
                       seeds[..., 1, None])
  return prng.word_bytes(words)


def encode_nvfp4(xf: jax.Array, block_group: jax.Array, amax: jax.Array,
                 rbits: jax.Array | None, *, four_over_six: bool,
                 with_codes: bool, with_values: bool):
  """1x16 NVFP4 encoding of blocks `[rows, nb, 16]`, each with its group's
  tensor scale (`amax[block_group]`; `block_group` `[rows, nb]`, E for
  blocks of no group, which take scale constants of amax 0).

  The block math of `quantize_reference` (`tile.encode_blocks`) with the
  per-tensor constants gathered per block: for a block of group `e` the
  same FP32 operations on the same values as quantizing group `e` alone.
  """
  amax_e = jnp.concatenate([amax, jnp.zeros((1,), jnp.float32)])
  s6, inv = jax.lax.optimization_barrier(
      nm.nvfp4_scale_constants(amax_e, four_over_six=four_over_six))
  return tile.encode_blocks(
      xf, tile.block_amax(xf, False), s6[block_group], inv[block_group],
      rbits=rbits, with_codes=with_codes, with_values=with_values,
      barrier=jax.lax.optimization_barrier, four_over_six=four_over_six)


def encode_mx(xf: jax.Array, fmt: str, rbits: jax.Array | None):
  """MX encoding of blocks `[rows, nb, 32]` (`ops.quantize.mx`'s block math;
  MX has no tensor scale, so no group enters): `(data, scales)` with data
  packed E2M1 `[rows, nb, 16]` (mxfp4) or E4M3 `[rows, nb, 32]` (mxfp8)."""
  elem_max = nm.E2M1_MAX if fmt == "mxfp4" else nm.E4M3_MAX
  biased = nm.e8m0_scale_exponent(tile.abs_max(xf, axis=-1), elem_max)
  y = nm.ftz(xf * nm.e8m0_inverse_to_f32(biased)[..., None])
  scales = jax.lax.bitcast_convert_type(biased.astype(jnp.uint8),
                                        jnp.float8_e8m0fnu)
  if fmt == "mxfp8":
    y = jnp.clip(y, -nm.E4M3_MAX, nm.E4M3_MAX)
    return jax.lax.optimization_barrier(y.astype(jnp.float8_e4m3fn)), scales
  if rbits is None:
    return nm.pack_e2m1(nm.e2m1_encode_nearest(y)), scales
  return nm.pack_e2m1(nm.e2m1_encode_stochastic(y, rbits)), scales


# ----------------------------------------------------------------------------
# The kernels' references.
# ----------------------------------------------------------------------------


def _row_bytes(local, row_seeds, c: int, b: int) -> jax.Array:
  """The stochastic bytes `[M, C // b, b]` of rows at index `local` of
  their tensors (`[*, C]`, seeds `row_seeds`)."""
  blk = jnp.arange(c // b, dtype=jnp.uint32)
  base = local[:, None] * jnp.uint32(c // 4) + blk[None, :] * (b // 4)
  seeds = jnp.stack(row_seeds, axis=-1)
  return block_bytes(base, seeds[:, None, :], b)


def _quantize_rows_xla(x, row_amax, *, row_seeds=None, row_index=None,
                       four_over_six=False, with_codes=True,
                       with_values=True, block_2d=False):
  """The reference of `pallas_triton.quantize_rows` (the same arguments):
  1x16 NVFP4 of each row with its own tensor amax `row_amax[r]`."""
  m, c = x.shape
  b = nm.NVFP4_BLOCK
  xf = nm.ftz(jax.lax.optimization_barrier(x).astype(jnp.float32))
  xf = xf.reshape(m, c // b, b)
  rbits = None
  if row_seeds is not None:
    rbits = _row_bytes(row_index.astype(jnp.uint32), row_seeds, c, b)
  s6, inv = jax.lax.optimization_barrier(
      nm.nvfp4_scale_constants(row_amax, four_over_six=four_over_six))
  packed, scales, vals = tile.encode_blocks(
      xf, tile.block_amax(xf, block_2d), s6[:, None], inv[:, None],
      rbits=rbits, with_codes=with_codes, with_values=with_values,
      barrier=jax.lax.optimization_barrier, four_over_six=four_over_six,
      block_2d=block_2d)
  return packed, (scales if with_codes else None), vals


def _token_bytes(f: int, local_blk, words, block_seeds, b: int) -> jax.Array:
  """The stochastic bytes `[F, nb, b]` of token blocks at block `local_blk`
  of their tensors (`[F, 4 * words]`, seeds `block_seeds`)."""
  row = jnp.arange(f, dtype=jnp.uint32)
  base = row[:, None] * words[None, :] + local_blk[None, :] * jnp.uint32(b // 4)
  seeds = jnp.stack(block_seeds, axis=-1)
  return block_bytes(base, jnp.broadcast_to(seeds[None], (f, *seeds.shape)),
                     b)


def _rht_tokens(x, sign_vector):
  """`rht(x.T)` flushed, as FP32 blocks `[F, T // 16, 16]`."""
  t, f = x.shape
  b = nm.NVFP4_BLOCK
  z = rht(x.T, sign_vector=sign_vector, size=b)
  return nm.ftz(jax.lax.optimization_barrier(z).astype(jnp.float32)).reshape(
      f, t // b, b)


def _token_block_amax_xla(x, *, sign_vector=None):
  """The reference of `pallas_triton.token_block_amax`."""
  return abs_bits(_rht_tokens(x, sign_vector), (0, 2))


def _quantize_tokens_xla(x, block_amax, *, block_seeds=None, block_index=None,
                         block_words=None, sign_vector=None, values=False):
  """The reference of `pallas_triton.quantize_tokens` (the same arguments)."""
  xf = _rht_tokens(x, sign_vector)
  f = xf.shape[0]
  rbits = None
  if block_seeds is not None:
    rbits = _token_bytes(f, block_index.astype(jnp.uint32),
                         block_words.astype(jnp.uint32), block_seeds,
                         nm.NVFP4_BLOCK)
  s6, inv = jax.lax.optimization_barrier(
      nm.nvfp4_scale_constants(block_amax))
  packed, scales, vals = tile.encode_blocks(
      xf, tile.block_amax(xf, False), s6[None, :], inv[None, :],
      rbits=rbits, with_codes=not values, with_values=values,
      barrier=jax.lax.optimization_barrier)
  if values:
    return None, None, vals
  return packed, scales, None
