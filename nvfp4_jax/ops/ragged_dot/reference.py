"""The grouped (mixture-of-experts) quantizers and GEMMs in pure jnp.

A ragged tensor here is a 2-D array whose rows (tokens) are split into `E`
contiguous groups (experts) by `group_sizes`: group `e` holds rows
`offsets[e] : offsets[e] + group_sizes[e]` (`offsets` the exclusive cumsum);
rows past `sum(group_sizes)` belong to no group.

Every function computes, group by group, exactly what the dense op computes on
that group's rows alone (`nvfp4_jax.quantize`, `block_scaled_matmul`), with
the group sizes as traced data:

- a quantized operand has one tensor amax per group (a segment max);
- stochastic rounding draws, for each group, the stream of that group's own
  key at the element's index within the group's tensor (`core.prng`);
- the GEMMs multiply each row (Fprop, Dgrad) or each group's tokens (Wgrad)
  with its group's weight and its group's `alpha`.

The GEMMs are reference loops over the groups: every group's product is a
dense `lax.dot_general` of the whole operand, masked to the group's rows
(`E` times the FLOPs: the truth and the CPU default, not a fast path; the
GPU kernels in `pallas_mosaic_gpu.py` compute only each group's tiles).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng
from nvfp4_jax.core import tile
from nvfp4_jax.core.arrays import MXArray
from nvfp4_jax.ops.block_values.reference import dequantize_mx


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
# GEMMs on exact values (the emulation), one group at a time.
# ----------------------------------------------------------------------------


def _f32_dot(a, b, dims, precision=None):
  return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def ragged_values_matmul(va, vb, group_sizes, alpha=None, *,
                         out_dtype=jnp.float32, vb_layout="kn",
                         precision=None):
  """Row `r` of group `e`: `(va[r] @ vb[e]) * alpha[e]` (`vb[e].T` for
  `vb_layout="nk"`), FP32 accumulation, one cast; rows of no group are 0."""
  m = va.shape[0]
  num_groups = vb.shape[0]
  n = vb.shape[2] if vb_layout == "kn" else vb.shape[1]
  g = group_of(group_sizes, m)
  dims = ((1,), (0,)) if vb_layout == "kn" else ((1,), (1,))

  def body(e, acc):
    y = _f32_dot(va, vb[e], dims, precision)
    if alpha is not None:
      y = y * alpha[e]
    return jnp.where((g == e)[:, None], y, acc)

  acc = jax.lax.fori_loop(0, num_groups, body,
                          jnp.zeros((m, n), jnp.float32))
  return acc.astype(out_dtype)


def ragged_values_matmul_t(va, vb, group_sizes, alpha=None, *,
                           out_dtype=jnp.float32, tokens_last=True,
                           precision=None):
  """Group `e`'s `(va_e^T-contraction vb_e) * alpha[e]`, `[E, K, N]`:
  `va [K, M]`, `vb [N, M]` contracted over group `e`'s tokens (columns), or
  with `tokens_last=False` `va [M, K]`, `vb [M, N]` over its rows. Both
  operands are masked to the group (a non-finite value elsewhere stays
  out); an empty group gives zeros."""
  axis = 1 if tokens_last else 0
  m = va.shape[axis]
  num_groups = group_sizes.shape[0]
  g = group_of(group_sizes, m)

  def one(e):
    mask = g == e
    mask = mask[None, :] if tokens_last else mask[:, None]
    a = jnp.where(mask, va, jnp.zeros((), va.dtype))
    b = jnp.where(mask, vb, jnp.zeros((), vb.dtype))
    y = _f32_dot(a, b, ((axis,), (axis,)), precision)
    if alpha is not None:
      y = y * alpha[e]
    return y.astype(out_dtype)

  return jax.lax.map(one, jnp.arange(num_groups))


# ----------------------------------------------------------------------------
# GEMMs on codes (what the native FP4 kernels multiply), one group at a time.
# ----------------------------------------------------------------------------


CODES_FORMATS = ("nvfp4", "mxfp4", "mxfp8")


def codes_values(codes: jax.Array, scales: jax.Array,
                 fmt: str = "nvfp4") -> jax.Array:
  """An operand's exact bf16 block values `[..., C]` from its codes:
  NVFP4 packed E2M1 `[..., C // 2]` with E4M3 scales `[..., C // 16]`;
  MXFP4 packed E2M1 `[..., C // 2]` or MXFP8 E4M3 `[..., C]` with E8M0
  scales `[..., C // 32]` (`dequantize_mx`: no tensor scale)."""
  if fmt != "nvfp4":
    if fmt not in CODES_FORMATS:
      raise ValueError(f"codes_values: fmt must be one of {CODES_FORMATS}, "
                       f"got {fmt!r}.")
    return dequantize_mx(MXArray(codes, scales, fmt), jnp.bfloat16)
  *lead, half = codes.shape
  nb = half * 2 // nm.NVFP4_BLOCK
  v = tile.block_values(codes.reshape(-1, nb, nm.NVFP4_BLOCK // 2),
                        scales.reshape(-1, nb))
  return v.reshape(*lead, half * 2)


def ragged_codes_matmul(a_codes, a_scales, b_codes, b_scales, group_sizes,
                        alpha=None, *, out_dtype=jnp.float32, fmt="nvfp4"):
  """`ragged_values_matmul` (layout "nk") of the operands' block values:
  row `r` of group `e` times `b[e].T`, `b [E, N, K]` quantized along K
  (`fmt`: both operands' format, see `codes_values`)."""
  return ragged_values_matmul(codes_values(a_codes, a_scales, fmt),
                              codes_values(b_codes, b_scales, fmt),
                              group_sizes, alpha, out_dtype=out_dtype,
                              vb_layout="nk")


def ragged_codes_matmul_t(a_codes, a_scales, b_codes, b_scales, group_sizes,
                          alpha=None, *, out_dtype=jnp.float32, fmt="nvfp4"):
  """`ragged_values_matmul_t` (tokens last) of the operands' block values:
  `a [K, L]`, `b [N, L]` quantized along the tokens."""
  return ragged_values_matmul_t(codes_values(a_codes, a_scales, fmt),
                                codes_values(b_codes, b_scales, fmt),
                                group_sizes, alpha, out_dtype=out_dtype,
                                tokens_last=True)
