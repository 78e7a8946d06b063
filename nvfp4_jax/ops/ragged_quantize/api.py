"""The grouped quantizers of a mixture of experts: a ragged operand
quantized group by group.

`nvfp4_jax.ragged_dot` (`nvfp4_jax.training.ragged_dot`) runs a layer of `E`
experts as three grouped GEMMs (`nvfp4_jax.ops.ragged_dot`). Its operands are
ragged: the tokens (rows) are sorted by expert and split into contiguous
groups by `group_sizes` (see `reference.py`). This module quantizes them group
by group, so that each expert's operands are, code for code, what
`nvfp4_jax.dot_general` quantizes for that expert alone:

- `quantize_rows`: an activation quantized along its features (Fprop's X,
  Dgrad's dY), one tensor amax per group;
- `quantize_tokens`: the transposed activation quantized along the tokens
  (the Wgrad operands), after the RHT; each group starts at a multiple of
  the block (the op pads the groups: `padded_layout`), so no block and no
  Hadamard tile holds two experts' tokens;
- `quantize_experts`: the `[E, ., .]` weights, expert by expert (16x16
  tiles, one amax each).

Each returns a `Grouped` operand: the codes and scales, or the exact bf16
block values, that the grouped GEMMs multiply. Implementations: "xla" (the
reference, `reference.py`) and "pallas" (the Triton kernels,
`pallas_triton.py`).

Under `jax.jit` shardings (auto mode) the kernels run per shard
(`dispatch.Op.per_shard`, through `core.spmd`): on the rows or 16-token
blocks of a device's shard, each row's or block's group constants (amax,
stream seeds and position, computed on the whole array) split with it, so
the bytes are the whole call's. Where a split cannot keep the whole call's
bytes it is gathered instead (a column split under stochastic rounding):
see each `_*_per_shard`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from nvfp4_jax.core import dispatch
from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import spmd
from nvfp4_jax.core.hadamard import rht
from nvfp4_jax.core.recipe import Operand
from nvfp4_jax.ops.block_values.api import BLOCK_VALUES
from nvfp4_jax.ops.block_values.reference import dequantize_mx
from nvfp4_jax.ops.gather_rows.api import gather_rows
from nvfp4_jax.core.arrays import MXArray
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.ops.quantize.api import block_size
from nvfp4_jax.ops.quantize.mx import quantize_mx
from nvfp4_jax.ops.quantize.reference import quantize_reference
from nvfp4_jax.ops.ragged_quantize import reference as ref


@dataclasses.dataclass(frozen=True)
class Grouped:
  """An operand quantized group by group (or expert by expert).

  Attributes:
    data: NVFP4/MXFP4: packed E2M1 codes `[..., C // 2]`; MXFP8: E4M3
      `[..., C]`; None where only the values were kept.
    scales: E4M3 (NVFP4) or E8M0 (MX) block scales `[..., C // block]`.
    values: the exact bf16 block values `[..., C]` (element times block
      scale; the tensor scale is in `group_alpha`), or None.
    amax: FP32 `[E]`, each group's tensor amax (NVFP4), else None.
    fmt: static; "nvfp4", "mxfp4" or "mxfp8".
    four_over_six: static; the NVFP4 tensor scale's denominator is 1536.
  """

  data: jax.Array | None
  scales: jax.Array | None
  values: jax.Array | None
  amax: jax.Array | None
  fmt: str = "nvfp4"
  four_over_six: bool = False

  @property
  def tensor_denominator(self) -> float:
    return (nm.FOUR_OVER_SIX_NUMERATOR if self.four_over_six
            else nm.E4M3_MAX_X_E2M1_MAX)

  def block_values(self) -> jax.Array:
    """The bf16 block values (decoded from the codes if not kept)."""
    if self.values is not None:
      return self.values
    if self.fmt != "nvfp4":
      return dequantize_mx(MXArray(self.data, self.scales, self.fmt),
                           jnp.bfloat16)
    # The block values kernel (`nvfp4_jax.ops.block_values`) on a GPU:
    # values are per block, no group's constant enters.
    *lead, half = self.data.shape
    nb = half * 2 // nm.NVFP4_BLOCK
    q = NVFP4Array(codes=self.data.reshape(-1, half),
                   scales=self.scales.reshape(-1, nb),
                   amax=jnp.zeros((), jnp.float32))
    return BLOCK_VALUES(None, q).reshape(*lead, half * 2)

  def without_values(self) -> "Grouped":
    """The codes alone (what a residual keeps)."""
    return dataclasses.replace(self, values=None)

  def transposed(self) -> "Grouped":
    """Each expert's `[R, C]` matrix transposed, for 16x16-tiled weights:
    the values only (a tile's scale is the same in both layouts)."""
    return dataclasses.replace(self, data=None, scales=None,
                               values=jnp.swapaxes(self.block_values(), -1,
                                                   -2))


jax.tree_util.register_dataclass(
    Grouped, data_fields=["data", "scales", "values", "amax"],
    meta_fields=["fmt", "four_over_six"])


def alignment(recipe_wgrad: Operand, rht_size: int) -> int:
  """The token alignment of each group for the Wgrad operands: the block
  (16 NVFP4, 32 MX), and the Hadamard size where the RHT applies (as
  `dot_general` pads a layer's tokens)."""
  need = block_size(recipe_wgrad.format)
  if recipe_wgrad.rht:
    need = max(need, rht_size)
  return need


def padded_layout(group_sizes: jax.Array, m: int, align: int):
  """The layout with every group padded to `align` rows, as a gather map.

  Returns:
    `(sources, padded_sizes, length)`: int32 `[length]`, the row of `x`
    each padded position takes (`m`, out of range, for the padding: it
    reads zeros), the padded group sizes `[E]`, and the static padded
    length (room for `m` rows and `align - 1` rows of padding per group).
    A gather, not a scatter of the rows: XLA's row scatter on a GPU ran
    at under a tenth of copy bandwidth (1.8 ms for 65536 x 1408 bf16 on an
    H100, where the gather copies).
  """
  num_groups = group_sizes.shape[0]
  length = padded_length(m, num_groups, align)
  gs = group_sizes.astype(jnp.int32)
  padded = -(-gs // align) * align
  g = ref.group_of(padded, length)                       # E past the end.
  gs_e = jnp.concatenate([gs, jnp.zeros((1,), jnp.int32)])
  src_off = jnp.concatenate([ref.offsets(gs), jnp.zeros((1,), jnp.int32)])
  dst_off = jnp.concatenate([ref.offsets(padded), jnp.zeros((1,), jnp.int32)])
  local = jnp.arange(length, dtype=jnp.int32) - dst_off[g]
  sources = jnp.where(local < gs_e[g], src_off[g] + local, m)
  return sources, padded, length


def padded_length(m: int, num_groups: int, align: int) -> int:
  """Static room for `m` rows in `num_groups` groups each padded to a
  multiple of `align` rows."""
  return -(-(m + num_groups * (align - 1)) // align) * align


def to_padded(x: jax.Array, sources: jax.Array) -> jax.Array:
  """`x`'s rows in the padded layout of `padded_layout` (zeros between):
  `gather_rows` (the Pallas row gather on GPUs).

  Materialized (an optimization barrier, for the reference): fused into its
  consumer, the transposing quantizer, XLA:GPU gathered each element alone
  (0.78 ms for 65536 x 1408 bf16 on an H100, against about 0.1 ms for the
  copy).
  """
  return jax.lax.optimization_barrier(
      gather_rows(x, sources.astype(jnp.int32)))


def _encode(xf, op: Operand, block_group, amax, rbits, *, values, codes):
  if op.format == "nvfp4":
    packed, scales, vals = ref.encode_nvfp4(
        xf, block_group, amax, rbits, four_over_six=op.four_over_six,
        with_codes=codes, with_values=values)
    return packed, scales, vals, amax
  data, scales = ref.encode_mx(xf, op.format, rbits)
  vals = None
  if values:
    vals = dequantize_mx(MXArray(data.reshape(*data.shape[:-2], -1),
                                 scales, op.format), jnp.bfloat16)
  return (data if codes else None), scales, vals, None


def _finish(xshape, op: Operand, packed, scales, vals, amax) -> Grouped:
  rows, cols = xshape
  return Grouped(
      data=None if packed is None else packed.reshape(rows, -1),
      scales=None if scales is None else scales.reshape(rows, -1),
      values=None if vals is None else vals.reshape(rows, cols),
      amax=amax, fmt=op.format, four_over_six=op.four_over_six)


def quantize_rows(x: jax.Array, group_sizes: jax.Array, op: Operand,
                  keys: jax.Array | None, *, values: bool = True,
                  codes: bool = False,
                  implementation: str | None = None) -> Grouped:
  """`x [M, C]` quantized along `C`, each group of rows as its own tensor.

  Group `e`'s rows get `quantize(x[rows_e])`'s codes and scales: amax over
  the group, stochastic bytes from `keys[e]` at the element's index in the
  group's `[m_e, C]` tensor. NVFP4 runs `QUANTIZE_ROWS` (the Pallas kernel
  on a GPU, the reference elsewhere) after the group amaxes' reduction.
  """
  m, c = x.shape
  b = block_size(op.format)
  num_groups = group_sizes.shape[0]
  g = ref.group_of(group_sizes, m)
  row_seeds = local = None
  if op.rounding == "stochastic":
    off = jnp.concatenate([ref.offsets(group_sizes),
                           jnp.zeros((1,), jnp.int32)])
    local = (jnp.arange(m, dtype=jnp.int32) - off[g]).astype(jnp.uint32)
    seeds = ref.group_seeds(keys, num_groups)[g]
    row_seeds = (seeds[:, 0], seeds[:, 1])
  if op.format == "nvfp4":
    xf = nm.ftz(x.astype(jnp.float32)).reshape(m, c // b, b)
    amax = ref.segment_amax(ref.abs_bits(xf, (1, 2)), g, num_groups)
    row_amax = jnp.concatenate([amax, jnp.zeros((1,), jnp.float32)])[g]
    packed, scales, vals = QUANTIZE_ROWS(
        implementation, x, row_amax, row_seeds=row_seeds, row_index=local,
        four_over_six=op.four_over_six, with_codes=codes, with_values=values)
    return _finish((m, c), op, packed, scales, vals, amax)
  xf = nm.ftz(jax.lax.optimization_barrier(x).astype(jnp.float32))
  xf = xf.reshape(m, c // b, b)
  rbits = None
  if row_seeds is not None:
    rbits = ref._row_bytes(local, row_seeds, c, b)
  return _finish((m, c), op, *_encode(xf, op, None, None, rbits,
                                      values=values, codes=codes))


def _rows_per_shard(kernel, x, row_amax, *, row_seeds=None, row_index=None,
                    **kwargs):
  """The kernel on each shard of `x [M, C]` split under `jax.jit`
  shardings (`spmd.blockwise`): every row carries its own tensor amax,
  seeds and index within its tensor (computed on the whole array), so
  these split with the rows and a shard's bytes are the whole call's.
  Rows split anywhere (16-row tiles with `block_2d`: expert weights split
  along E); the columns in 16-element blocks, but not with stochastic
  rounding, whose stream positions the kernel numbers from the row's first
  column (a split of C is gathered there)."""
  if jnp.ndim(x) != 2:
    return kernel(x, row_amax, row_seeds=row_seeds, row_index=row_index,
                  **kwargs)
  m, c = x.shape
  rows = m // nm.NVFP4_BLOCK if kwargs.get("block_2d") else m
  cols = 1 if row_seeds is not None else c // nm.NVFP4_BLOCK

  def run(op, **kw):
    x, amax, seeds, index = op
    return kernel(x, amax, row_seeds=seeds, row_index=index, **kw)
  return spmd.blockwise(run, (x, row_amax, row_seeds, row_index),
                        grid=(rows, cols), **kwargs)


QUANTIZE_ROWS = dispatch.Op("ragged_quantize_rows", {
    "xla": ref._quantize_rows_xla,
    "pallas": "nvfp4_jax.ops.ragged_quantize.pallas_triton:quantize_rows",
}, per_shard=_rows_per_shard)


def quantize_tokens(x: jax.Array, padded_sizes: jax.Array, op: Operand,
                    keys: jax.Array | None, *, rht_size: int = 16,
                    sign_vector=None, values: bool = True,
                    codes: bool = False,
                    implementation: str | None = None) -> Grouped:
  """`x [L, F]` (padded tokens x features) quantized along the tokens, each
  group of tokens as its own tensor, after the RHT where `op.rht`: the
  result is `[F, L]`.

  The groups are `padded_sizes` (multiples of the block and the Hadamard
  size, from `padded_layout`), so the result for group `e` is
  `quantize(rht(x_e^T))` with `x_e` its tokens padded with zero rows, as
  `dot_general` quantizes a layer's Wgrad operand: amax after the RHT over
  the group, stochastic bytes from `keys[e]` at the element's index in the
  group's `[F, padded m_e]` tensor. NVFP4 with the 16-point RHT, writing
  codes or values, runs `TOKEN_BLOCK_AMAX` and `QUANTIZE_TOKENS` (the
  Pallas kernels on a GPU, the reference elsewhere).
  """
  length, f = x.shape
  b = block_size(op.format)
  num_groups = padded_sizes.shape[0]
  nb = length // b
  bg = ref.group_of(padded_sizes, length)[::b]           # [nb]
  block_seeds = local_blk = words = None
  if op.rounding == "stochastic":
    ps = jnp.concatenate([padded_sizes.astype(jnp.int32),
                          jnp.zeros((1,), jnp.int32)])
    off = jnp.concatenate([ref.offsets(ps[:-1]), jnp.zeros((1,), jnp.int32)])
    words = (ps // 4).astype(jnp.uint32)[bg]
    local_blk = ((jnp.arange(nb, dtype=jnp.int32) * b - off[bg]) // b
                 ).astype(jnp.uint32)
    seeds = ref.group_seeds(keys, num_groups)[bg]
    block_seeds = (seeds[:, 0], seeds[:, 1])
  if (op.format == "nvfp4" and op.rht and rht_size == nm.NVFP4_BLOCK
      and not op.four_over_six and values != codes):
    bits = TOKEN_BLOCK_AMAX(implementation, x, sign_vector=sign_vector)
    amax = ref.segment_amax(bits, bg, num_groups)
    block_amax = jnp.concatenate([amax, jnp.zeros((1,), jnp.float32)])[bg]
    packed, scales, vals = QUANTIZE_TOKENS(
        implementation, x, block_amax, block_seeds=block_seeds,
        block_index=local_blk, block_words=words, sign_vector=sign_vector,
        values=values)
    return _finish((f, length), op, packed, scales, vals, amax)
  xt = x.T
  if op.rht:
    xt = rht(xt, sign_vector=sign_vector, size=rht_size)
  xf = nm.ftz(jax.lax.optimization_barrier(xt).astype(jnp.float32))
  xf = xf.reshape(f, nb, b)
  amax = None
  if op.format == "nvfp4":
    amax = ref.segment_amax(ref.abs_bits(xf, (0, 2)), bg, num_groups)
  rbits = None
  if block_seeds is not None:
    rbits = ref._token_bytes(f, local_blk, words, block_seeds, b)
  block_group = jnp.broadcast_to(bg[None, :], (f, nb))
  return _finish((f, length), op, *_encode(xf, op, block_group, amax, rbits,
                                           values=values, codes=codes))


def _token_amax_per_shard(kernel, x, **kwargs):
  """The kernel on each shard of `x [T, F]` split under `jax.jit`
  shardings (`spmd.blockwise`): the tokens in 16-token blocks (a block's
  RHT and amax stay on one device), the features anywhere, each block's
  amax max-reduced over the axes that split the features (a max is exact
  in any order)."""
  if jnp.ndim(x) != 2:
    return kernel(x, **kwargs)
  t, f = x.shape

  def run(x, feature_axes=(), **kw):
    bits = kernel(x, **kw)
    return jax.lax.pmax(bits, feature_axes) if feature_axes else bits

  def shard_kwargs(spec, x):
    del x
    return {"feature_axes": spmd.entry_axes(spec[1])}
  return spmd.blockwise(run, x, grid=(t // nm.NVFP4_BLOCK, f),
                        shard_kwargs=shard_kwargs, **kwargs)


def _tokens_per_shard(kernel, x, block_amax, *, block_seeds=None,
                      block_index=None, block_words=None, **kwargs):
  """The kernel on each shard of `x [T, F]` split under `jax.jit`
  shardings (`spmd.blockwise`; the result `[F, T]` split transposed):
  every 16-token block carries its group's amax, seeds, its index within
  the group and the group's words per row (computed on the whole array),
  so these split with the tokens and a shard's bytes are the whole
  call's. The features split anywhere, but not with stochastic rounding,
  whose stream positions the kernel numbers from the first feature (a
  split of F is gathered there)."""
  if jnp.ndim(x) != 2:
    return kernel(x, block_amax, block_seeds=block_seeds,
                  block_index=block_index, block_words=block_words, **kwargs)
  t, f = x.shape
  cols = 1 if block_seeds is not None else f

  def run(op, **kw):
    x, amax, seeds, index, words = op
    return kernel(x, amax, block_seeds=seeds, block_index=index,
                  block_words=words, **kw)
  return spmd.blockwise(run, (x, block_amax, block_seeds, block_index,
                              block_words),
                        grid=(t // nm.NVFP4_BLOCK, cols),
                        transposed_out=True, **kwargs)


TOKEN_BLOCK_AMAX = dispatch.Op("ragged_token_block_amax", {
    "xla": ref._token_block_amax_xla,
    "pallas": "nvfp4_jax.ops.ragged_quantize.pallas_triton:token_block_amax",
}, per_shard=_token_amax_per_shard)

QUANTIZE_TOKENS = dispatch.Op("ragged_quantize_tokens", {
    "xla": ref._quantize_tokens_xla,
    "pallas": "nvfp4_jax.ops.ragged_quantize.pallas_triton:quantize_tokens",
}, per_shard=_tokens_per_shard)


def quantize_experts(w: jax.Array, op: Operand, keys: jax.Array | None, *,
                     values: bool = True, codes: bool = True) -> Grouped:
  """Each expert's `w[e]` (`[R, C]`) quantized along `C` as `op` says,
  exactly `nvfp4_jax.quantize` / `quantize_mx` of that expert alone
  (16x16 tiles and the amax per expert). NVFP4 runs `QUANTIZE_ROWS` on the
  stacked `[E * R, C]` rows, each with its expert's amax and stream (the
  Pallas kernel on a GPU)."""
  num, r, c = w.shape
  if op.format == "nvfp4" and (not op.block_2d or r % nm.NVFP4_BLOCK == 0):
    wf = nm.ftz(w.astype(jnp.float32))
    amax = jax.lax.bitcast_convert_type(
        ref.abs_bits(wf, (1, 2)), jnp.float32)
    row_seeds = row_index = None
    if op.rounding == "stochastic":
      seeds = jnp.repeat(ref.group_seeds(keys, num)[:num], r, axis=0)
      row_seeds = (seeds[:, 0], seeds[:, 1])
      row_index = jnp.tile(jnp.arange(r, dtype=jnp.uint32), num)
    packed, scales, vals = QUANTIZE_ROWS(
        None, w.reshape(num * r, c), jnp.repeat(amax, r),
        row_seeds=row_seeds, row_index=row_index,
        four_over_six=op.four_over_six, with_codes=True,
        with_values=values, block_2d=op.block_2d)
    return Grouped(
        data=packed.reshape(num, r, c // 2) if codes else None,
        scales=scales.reshape(num, r, -1),
        values=None if vals is None else vals.reshape(num, r, c),
        amax=amax, fmt=op.format, four_over_six=op.four_over_six)

  def one(we, key):
    if op.format == "nvfp4":
      q, vals = quantize_reference(
          we, block_2d=op.block_2d, rounding=op.rounding, key=key,
          with_values=True, four_over_six=op.four_over_six)
      return q.codes, q.scales, vals, q.amax
    q = quantize_mx(we, op.format, rounding=op.rounding, key=key)
    vals = dequantize_mx(q, jnp.bfloat16)
    return q.data, q.scales, vals, jnp.zeros((), jnp.float32)
  if keys is None:
    data, scales, vals, amax = jax.vmap(lambda we: one(we, None))(w)
  else:
    data, scales, vals, amax = jax.vmap(one)(w, keys)
  return Grouped(data=data if codes else None, scales=scales,
                 values=vals if values else None,
                 amax=amax if op.format == "nvfp4" else None, fmt=op.format,
                 four_over_six=op.four_over_six)
