"""Pallas-Triton kernels of the grouped quantizers (`api.quantize_rows`,
`api.quantize_tokens`).

The rows of `x [M, C]` are split into groups (experts); each row is quantized
along `C` (1x16 blocks) as a row of its group's own tensor: the block math of
`nvfp4_jax.ops.quantize.pallas_triton`'s kernel (`quantize_kernel` with
`grouped=True`), with the per-tensor constants computed per row from its
group's amax, and the stochastic-rounding stream of its group's key at the
row's index within the group. The group amaxes are one XLA reduction before
the kernel (a segment max: every block needs its group's complete amax).
One pass reads each element once and writes the codes and scales and/or the
exact bf16 block values the grouped GEMM consumes.

The Wgrad operands (`quantize_tokens`, 16-point RHT along the tokens) are
`nvfp4_jax.ops.quantize_rht_t`'s columns kernels with the same change: every
16-token block lies in one group (the op pads the groups to whole blocks),
so an amax pass writes each block's post-RHT maximum (`token_block_amax`,
reduced per group by XLA) and the encode pass takes each block's group
constants, stream, and position in its group's `[F, T_e]` tensor.

Interpreted on CPU (the tests check them against `api`'s pure-jnp path bit
for bit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng
from nvfp4_jax.core import tile
from nvfp4_jax.core.hadamard import default_sign_vector
from nvfp4_jax.ops.quantize.config import default_config
from nvfp4_jax.ops.quantize.pallas_triton import outputs
from nvfp4_jax.ops.quantize.pallas_triton import quantize_kernel
from nvfp4_jax.ops.quantize_rht_t import pallas_triton as rht_cols
from nvfp4_jax.ops.ragged_quantize.config import token_tiles
from pallas_kernels import e2m1_encode
from pallas_kernels import fp32
from pallas_kernels import launch

B = nm.NVFP4_BLOCK


def quantize_rows(x: jax.Array, row_amax: jax.Array, *,
                  row_seeds: tuple[jax.Array, jax.Array] | None = None,
                  row_index: jax.Array | None = None,
                  four_over_six: bool = False, with_codes: bool = True,
                  with_values: bool = True, block_2d: bool = False,
                  config=None):
  """NVFP4 1x16 codes/scales/values of `x [M, C]`, row `r` with the tensor
  amax `row_amax[r]` (its group's).

  Args:
    x: `[M, C]` float, `C` a multiple of 16.
    row_amax: FP32 `[M]`, each row's tensor amax.
    row_seeds: stochastic rounding: `(seed0, seed1)`, uint32 `[M]` each, the
      stream seeds of each row's tensor; None rounds to nearest even.
    row_index: with `row_seeds`, each row's index within its tensor, `[M]`.
    four_over_six: Four-over-Six (the amaxes' constants use 1536).
    with_codes, with_values: which outputs to write.
    block_2d: 16x16 tiles (stacked expert weights `[E * R, C]`, `R` a
      multiple of 16, so no tile holds two experts' rows).
    config: tiles (`nvfp4_jax.ops.quantize.config.QuantizeConfig`).

  Returns:
    `(packed uint8 [M, C // 2] or None, scales e4m3 [M, C // 16] or None,
    bf16 values [M, C] or None)`.

  Raises:
    NotImplementedError: on a backend the kernels do not support.
  """
  interpret = launch.check_backend("quantize_rows")
  m, c = x.shape
  nb_total = c // B
  stochastic = row_seeds is not None
  cfg = config or default_config(m, c, block_2d)
  br, bnb = cfg.block_rows, max(1, cfg.block_cols // B)
  grid = (launch.cdiv(m, br), launch.cdiv(nb_total, bnb))
  rows_padded = grid[0] * br

  def per_row(v, dtype):
    # Whole row tiles (no masked 1-D loads); the padding rows are not stored.
    v = v.astype(dtype)
    return jnp.pad(v, (0, rows_padded - m))

  row_spec = pl.BlockSpec((br,), lambda i, j: (i,))
  in_specs = [row_spec]
  args = [per_row(row_amax, jnp.float32)]
  if stochastic:
    in_specs += [row_spec] * 3
    args += [per_row(row_seeds[0], jnp.uint32),
             per_row(row_seeds[1], jnp.uint32),
             per_row(row_index, jnp.uint32)]
  in_specs.append(pl.BlockSpec((br, bnb, B), lambda i, j: (i, j, 0)))
  args.append(x.reshape(m, nb_total, B))
  out_shape, out_specs = outputs(m, nb_total, br, bnb, with_codes,
                                 with_values)
  kernel = functools.partial(
      quantize_kernel, block_2d=block_2d, stochastic=stochastic,
      with_codes=with_codes, with_values=with_values, interpret=interpret,
      m=m, nb_total=nb_total, four_over_six=four_over_six,
      words_per_row=c // 4, grouped=True)
  outs = list(launch.pallas_call(
      kernel, interpret=interpret, num_warps=cfg.num_warps, num_stages=1,
      name="nvfp4_quantize_rows", grid=grid, in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape)(*args))
  packed = scales = values = None
  if with_codes:
    packed = outs.pop(0).reshape(m, c // 2)
    scales = outs.pop(0)
  if with_values:
    values = tile.values_from_pairs(outs.pop(0)).reshape(m, c)
  return packed, scales, values


# ----------------------------------------------------------------------------
# The Wgrad operands: 16-point RHT along the tokens, quantized along them.
# ----------------------------------------------------------------------------


def _token_block_amax_kernel(x_ref, out_ref, *, tokens: int, features: int,
                             interpret: bool, sign_vector: tuple[int, ...]):
  """Each 16-token block's `max |rht|` over the tile's features, as the
  bit pattern of the flushed, bf16-rounded maximum (`_store_amax_partials`'
  rule, per block)."""
  nb, _, bf = x_ref.shape
  i, j = pl.program_id(0), pl.program_id(1)
  mask = launch.bounds_mask((nb, 1, bf), (0, i * nb, tokens // B, nb),
                            (2, j * bf, features, bf))
  keep = fp32.max_magnitude(interpret)
  m = None
  for y in rht_cols._butterfly(rht_cols._load_rows(x_ref, 0, mask, nb, bf),
                               sign_vector, interpret):
    m = y if m is None else keep(m, y)
  amax = tile.round_hadamard(tile.abs_max(m, axis=1))          # [nb]
  out_ref[...] = jax.lax.bitcast_convert_type(amax, jnp.uint32).reshape(nb, 1)


def token_block_amax(x: jax.Array, *, sign_vector=None, config=None
                     ) -> jax.Array:
  """`max |rht(x_b.T)|` of every 16-token block `x_b` of `x [T, F]`, as
  uint32 bit patterns `[T // 16]` (the post-RHT amax of a block's group is
  the maximum over its blocks: `reference.segment_amax`)."""
  interpret = launch.check_backend("token_block_amax")
  t, f = x.shape
  cfg, nb, bf, grid = token_tiles(t, f, config)
  kernel = functools.partial(
      _token_block_amax_kernel, tokens=t, features=f, interpret=interpret,
      sign_vector=tuple(sign_vector or default_sign_vector(B)))
  parts = launch.pallas_call(
      kernel, interpret=interpret, num_warps=cfg.num_warps, num_stages=1,
      name="nvfp4_ragged_rht_amax", grid=grid,
      in_specs=[pl.BlockSpec((nb, B, bf), lambda i, j: (i, 0, j))],
      out_specs=pl.BlockSpec((nb, 1), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((t // B, grid[1]), jnp.uint32))(
          x.reshape(t // B, B, f))
  return jnp.max(parts, axis=1)


def _tokens_kernel(*refs, sr: bool, values: bool, interpret: bool,
                   tokens: int, features: int, sign_vector: tuple[int, ...]):
  """`nvfp4_jax.ops.quantize_rht_t`'s columns kernel with the per-tensor
  constants, streams and stream positions of each 16-token block's group:
  `amax_ref [nb]` the group's amax, and with SR the seeds `[nb]` x 2, the
  block's index within its group's `[F, T_e]` tensor and that tensor's
  words per row (`T_e / 4`)."""
  refs = list(refs)
  amax_ref = refs.pop(0)
  if sr:
    seed0_ref, seed1_ref, local_ref, words_ref = refs[:4]
    refs = refs[4:]
  x_ref, out_ref, scales_ref = refs
  nb, _, bf = x_ref.shape
  i, j = pl.program_id(0), pl.program_id(1)
  blocks = tokens // B
  blk_dim = lambda axis: (axis, i * nb, blocks, nb)
  feat_dim = lambda axis: (axis, j * bf, features, bf)
  mask = launch.bounds_mask((nb, 1, bf), blk_dim(0), feat_dim(2))
  sums = rht_cols._butterfly(rht_cols._load_rows(x_ref, 0, mask, nb, bf),
                             sign_vector, interpret)
  z = fp32.round_hadamard(interpret)(rht_cols._tree_stack(sums))
  divide = fp32.exact_divide(interpret)
  per_block = lambda ref: jnp.broadcast_to(ref[...].reshape(nb, 1), (nb, bf))
  rwords = None
  if sr:
    row = (j * bf + jax.lax.broadcasted_iota(jnp.int32, (nb, bf), 1)
           ).astype(jnp.uint32)
    base = (row * per_block(words_ref)
            + per_block(local_ref) * jnp.uint32(B // 4))
    rwords = rht_cols._tree_stack(prng.block_words(
        base, per_block(seed0_ref), per_block(seed1_ref)))
  s6, inv = nm.nvfp4_scale_constants(amax_ref[...].reshape(nb, 1),
                                     divide=divide)
  packed, scales, vals = tile.encode_blocks(
      z, tile.block_amax(z, False), s6, inv, divide=divide, rwords=rwords,
      split_pack=True, with_values=values, with_codes=not values,
      values_as_pairs=True, encoder=e2m1_encode.block_encoder(interpret))
  out = jnp.transpose(vals if values else packed, (1, 0, 2))
  launch.store(out_ref, out, launch.bounds_mask(out.shape, feat_dim(0),
                                                blk_dim(1)))
  if scales_ref is not None:
    launch.store(scales_ref, scales.T, launch.bounds_mask(
        (bf, nb), feat_dim(0), blk_dim(1)))


def quantize_tokens(x: jax.Array, block_amax: jax.Array, *,
                    block_seeds: tuple[jax.Array, jax.Array] | None = None,
                    block_index: jax.Array | None = None,
                    block_words: jax.Array | None = None,
                    sign_vector=None, values: bool = False, config=None):
  """`q(rht(x_e.T))` of every group `e` of 16-token blocks of `x [T, F]`.

  Args:
    x: `[T, F]` tokens (each group's tokens on whole 16-token blocks).
    block_amax: FP32 `[T // 16]`, each block's group's post-RHT amax.
    block_seeds: stochastic rounding: `(seed0, seed1)`, uint32 `[T // 16]`,
      each block's group's stream seeds; None rounds to nearest even.
    block_index, block_words: with `block_seeds`, each block's index within
      its group and its group's words per feature row (`T_e // 4`).
    sign_vector: the 16-point RHT's signs.
    values: write the bf16 block values `[F, T]`; else the codes
      `[F, T // 2]` and scales `[F, T // 16]`.

  Returns:
    `(packed, scales, None)` or `(None, None, values)`.
  """
  interpret = launch.check_backend("quantize_tokens")
  t, f = x.shape
  cfg, nb, bf, grid = token_tiles(t, f, config)
  sr = block_seeds is not None
  nblk = grid[0] * nb

  def per_block(v, dtype):
    return jnp.pad(v.astype(dtype), (0, nblk - t // B))

  blk_spec = pl.BlockSpec((nb,), lambda i, j: (i,))
  args, in_specs = [per_block(block_amax, jnp.float32)], [blk_spec]
  if sr:
    args += [per_block(block_seeds[0], jnp.uint32),
             per_block(block_seeds[1], jnp.uint32),
             per_block(block_index, jnp.uint32),
             per_block(block_words, jnp.uint32)]
    in_specs += [blk_spec] * 4
  args.append(x.reshape(t // B, B, f))
  in_specs.append(pl.BlockSpec((nb, B, bf), lambda i, j: (i, 0, j)))
  n = B // 2
  out_shape = [jax.ShapeDtypeStruct((f, t // B, n),
                                    jnp.uint32 if values else jnp.uint8)]
  out_specs = [pl.BlockSpec((bf, nb, n), lambda i, j: (j, i, 0))]
  if not values:
    out_shape.append(jax.ShapeDtypeStruct((f, t // B), jnp.float8_e4m3fn))
    out_specs.append(pl.BlockSpec((bf, nb), lambda i, j: (j, i)))
  kernel = functools.partial(
      _tokens_kernel, sr=sr, values=values, interpret=interpret, tokens=t,
      features=f, sign_vector=tuple(sign_vector or default_sign_vector(B)))
  if values:  # No scales output: the kernel gets None in its place.
    kernel = functools.partial(_with_none_last, kernel)
  outs = launch.pallas_call(
      kernel, interpret=interpret, num_warps=cfg.num_warps, num_stages=1,
      name="nvfp4_ragged_quantize_tokens" + ("_values" if values else ""),
      grid=grid, in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape)(*args)
  if values:
    return None, None, tile.values_from_pairs(outs[0].reshape(f, t // 2))
  return outs[0].reshape(f, t // 2), outs[1], None


def _with_none_last(kernel, *refs):
  return kernel(*refs, None)
