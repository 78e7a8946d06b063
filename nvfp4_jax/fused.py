"""The recipe's operand quantizers: one tensor, its GEMM operands, one dispatch each.

The recipe quantizes X twice per step: along `in` for Fprop and, for Wgrad,
`rht(X.T)` along tokens (and dY likewise, along `out` for Dgrad, with
stochastic rounding). The references here are compositions of
`nvfp4_jax.quantize` and `nvfp4_jax.rht`; the Pallas kernels
(`pallas_kernels.quantize_rht_t`, `pallas_kernels.quantize_pair`) compute the
same bytes while reading the tensor once per pass (an amax pass, then an
encode pass that writes both operands), as TransformerEngine's fused
cast-transpose-RHT does.

Each op validates its arguments, then dispatches on `implementation=`: "xla"
(the reference), "pallas" (the kernels; interpreted on CPU) or None (the
kernels on GPU, the reference elsewhere; combinations a kernel cannot run
raise `NotImplementedError` there and fall back to the reference).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from nvfp4_jax import dispatch
from nvfp4_jax import numerics as nm
from nvfp4_jax import prng
from nvfp4_jax import spmd
from nvfp4_jax.hadamard import rht
from nvfp4_jax.hadamard import rht_matrix
from nvfp4_jax.mx import quantize_mx
from nvfp4_jax.nvfp4 import quantize
from nvfp4_jax.nvfp4 import quantize_reference
from nvfp4_jax.nvfp4 import tensor_amax
from nvfp4_jax.qarray import NVFP4Array
from nvfp4_jax.qarray import NVFP4Values
from nvfp4_jax.qarray import check_amax
from nvfp4_jax.qarray import check_input
from nvfp4_jax.qarray import check_rounding
from nvfp4_jax.quant import QArray
from nvfp4_jax.recipe import Operand

B = nm.NVFP4_BLOCK


def block_size(fmt: str) -> int:
  """Elements per scale block of a quantized format."""
  return nm.NVFP4_BLOCK if fmt == "nvfp4" else nm.MX_BLOCK


def _check_tokens_x(x, what: str) -> jax.Array:
  x = check_input(x, block=1, block_2d=False, what=what)
  if x.ndim != 2:
    raise ValueError(f"{what} takes x as [tokens, features]; got shape "
                     f"{x.shape}. Flatten the leading axes first.")
  return x


def _check_wgrad_tokens(tokens: int, op: Operand, size: int, what: str):
  need = max(block_size(op.format), size if op.rht else 1)
  if tokens % need:
    raise ValueError(
        f"{what}: the token count {tokens} must be a multiple of {need} (the "
        f"Wgrad operand is quantized along tokens in blocks of "
        f"{block_size(op.format)}{f' after a {size}-point RHT' if op.rht else ''}"
        f"); pad the tokens to {-(-tokens // need) * need} (zero rows change "
        f"neither the amax nor the product).")


# ----------------------------------------------------------------------------
# quantize_rht_t: the Wgrad operand q(rht(x^T)).
# ----------------------------------------------------------------------------


def quantize_rht_t(x: jax.Array, *, rounding: str = "nearest",
                   key: jax.Array | None = None,
                   amax: jax.Array | None = None,
                   sign_vector: Sequence[int] | None = None, size: int = 16,
                   placement: prng.Placement | None = None,
                   amax_axes: Sequence[str] = (),
                   implementation: str | None = None) -> NVFP4Array:
  """The Wgrad operand: `quantize(rht(x.T))` for `x: [tokens, features]`.

  Transpose, RHT (bf16-rounded), amax of the transformed tensor, then 1x16
  quantization along tokens with RTNE or SR.

  Args:
    x: `[tokens, features]` float array; tokens a multiple of 16 and `size`.
    rounding: "nearest" (X) or "stochastic" (dY).
    key: PRNG key for stochastic rounding; the SR stream runs over the
      `[features, tokens]` result in row-major order.
    amax: the amax of `rht(x.T)` if already reduced (e.g. a `pmax` across
      shards); computed otherwise.
    sign_vector, size: the RHT's signs and size (see `nvfp4_jax.rht`).
    placement: for a shard of a sharded tensor (inside `shard_map`), where
      `x` sits in the whole `[tokens, features]` tensor; the result is then
      the shard of the whole tensor's operand (`nvfp4_jax.sharding`).
    amax_axes: the mesh axes that split the tensor; the amax (when not given)
      is max-reduced across them.
    implementation: "xla", "pallas" or None.

  Returns:
    NVFP4Array of logical shape `[features, tokens]`.
  """
  what = "quantize_rht_t"
  x = _check_tokens_x(x, what)
  rht_matrix(sign_vector, size)  # Validates both.
  _check_wgrad_tokens(x.shape[0], Operand(rht=True), size, what)
  check_rounding(rounding, key, size=x.size, what=what)
  return QUANTIZE_RHT_T(implementation, x, rounding=rounding, key=key,
                        amax=check_amax(amax, what), sign_vector=sign_vector,
                        size=size, placement=placement,
                        amax_axes=tuple(amax_axes))


def _transposed(placement: prng.Placement | None) -> prng.Placement | None:
  return None if placement is None else placement.T


def _reduced_amax(x: jax.Array, axes: Sequence[str]) -> jax.Array | None:
  """The whole tensor's amax from a shard `x` (None without axes: the
  quantizer takes `max |x|` itself)."""
  if not axes:
    return None
  return spmd.reduce_amax(tensor_amax(nm.ftz(x.astype(jnp.float32))), axes)


def _quantize_rht_t_xla(x, *, rounding, key, amax, sign_vector, size,
                        placement=None, amax_axes=()):
  z = rht(x.T, sign_vector=sign_vector, size=size)
  if amax is None:
    amax = _reduced_amax(z, amax_axes)
  return quantize_reference(z, rounding=rounding, key=key, amax=amax,
                            placement=_transposed(placement))


QUANTIZE_RHT_T = dispatch.Op("quantize_rht_t", {
    "xla": _quantize_rht_t_xla,
    "pallas": "pallas_kernels.quantize_rht_t:quantize_rht_t",
})


# ----------------------------------------------------------------------------
# quantize_pair: both GEMM operands of one tensor (X or dY).
# ----------------------------------------------------------------------------


def quantize_operand(x: jax.Array, op: Operand, key: jax.Array | None, *,
                     placement: prng.Placement | None = None,
                     amax_axes: Sequence[str] = (),
                     implementation: str | None = None) -> QArray:
  """Quantizes `x` along its last axis as `op` says (no RHT).

  `placement` and `amax_axes`: for a shard (see `quantize_rht_t`).
  """
  if op.format == "nvfp4":
    return quantize(x, block_2d=op.block_2d, rounding=op.rounding, key=key,
                    four_over_six=op.four_over_six,
                    amax=_reduced_amax(x, amax_axes), placement=placement,
                    implementation=implementation)
  return quantize_mx(x, op.format, rounding=op.rounding, key=key,
                    placement=placement)


def quantize_pair(x: jax.Array, row: Operand, wgrad: Operand, *,
                  key_row: jax.Array | None = None,
                  key_t: jax.Array | None = None,
                  rht_size: int = 16,
                  sign_vector: Sequence[int] | None = None,
                  placement: prng.Placement | None = None,
                  amax_axes: Sequence[str] = (),
                  values: tuple[bool, bool] = (False, False),
                  implementation: str | None = None
                  ) -> tuple[QArray | NVFP4Values | None,
                             QArray | NVFP4Values | None]:
  """Both quantized operands of a tensor `x: [tokens, features]`.

  `row` quantizes `x` along features (Fprop's X, Dgrad's dY); `wgrad`
  quantizes `x.T` along tokens, after the RHT if `wgrad.rht` (Wgrad's X^T and
  dY^T). An operand in "bf16" is not quantized and comes back as None. Each
  has its own amax, rounding and key.

  Args:
    x: `[tokens, features]`.
    row, wgrad: the two `Operand`s.
    key_row, key_t: their stochastic-rounding keys (see
      `Recipe.operand_keys`); required where they round stochastically.
    rht_size, sign_vector: the RHT of the Wgrad operand.
    placement, amax_axes: for a shard of a sharded tensor (inside
      `shard_map`): `x`'s place in the whole tensor and the mesh axes that
      split it. Both operands are then the shards of the whole tensor's.
    values: `(row, wgrad)`: return that operand as `NVFP4Values` (its exact
      bf16 block values, written instead of codes and scales: the operand of
      the emulated GEMM, see `gemm.consumes_values`). NVFP4 operands only
      (ignored for an operand in bf16, which comes back as None).
    implementation: "xla", "pallas" or None. The Pallas kernel fuses the
      recipe's NVFP4 pairs (1x16 rows + RHT'd tokens) into one read of `x`
      per pass; it raises `NotImplementedError` for other pairs.

  Returns:
    `(q_row [tokens, features] or None, q_t [features, tokens] or None)`.
  """
  what = "quantize_pair"
  x = _check_tokens_x(x, what)
  values = tuple(bool(v) for v in values)
  if len(values) != 2:
    raise ValueError(f"{what}: values must be two bools (row, wgrad), got "
                     f"{values!r}.")
  for op, key, name, as_values in ((row, key_row, "row", values[0]),
                                   (wgrad, key_t, "wgrad", values[1])):
    if not isinstance(op, Operand):
      raise TypeError(f"{what}: {name} must be an Operand, got {op!r}.")
    if op.quantized:
      check_rounding(op.rounding, key, size=x.size, what=f"{what} ({name})")
    if as_values and op.quantized and op.format != "nvfp4":
      raise ValueError(
          f"{what}: values=True for the {name} operand needs the nvfp4 "
          f"format, got {op.format!r}; pass values=False for it.")
  if row.quantized:
    check_input(x, block=block_size(row.format), block_2d=row.block_2d,
                what=f"{what} (row operand)")
  if wgrad.quantized:
    if wgrad.block_2d:
      raise ValueError(f"{what}: the Wgrad operand takes 1x16 blocks, not "
                       f"block_2d.")
    if wgrad.rht:
      rht_matrix(sign_vector, rht_size)
    _check_wgrad_tokens(x.shape[0], wgrad, rht_size, what)
  return QUANTIZE_PAIR(implementation, x, row, wgrad, key_row=key_row,
                       key_t=key_t, rht_size=rht_size, sign_vector=sign_vector,
                       placement=placement, amax_axes=tuple(amax_axes),
                       values=values)


def _operand_xla(x, op: Operand, key, *, placement, amax_axes,
                 as_values: bool):
  if not as_values:
    return quantize_operand(x, op, key, placement=placement,
                            amax_axes=amax_axes, implementation="xla")
  # `quantize_operand`'s NVFP4 quantizer, keeping the values, not the codes.
  q, vals = quantize_reference(
      x, block_2d=op.block_2d, rounding=op.rounding, key=key,
      amax=_reduced_amax(x, amax_axes), with_values=True,
      four_over_six=op.four_over_six, placement=placement)
  return NVFP4Values(vals, q.amax, four_over_six=op.four_over_six)


def _quantize_pair_xla(x, row, wgrad, *, key_row, key_t, rht_size,
                       sign_vector, placement=None, amax_axes=(),
                       values=(False, False)):
  q_row = q_t = None
  if row.quantized:
    q_row = _operand_xla(x, row, key_row, placement=placement,
                         amax_axes=amax_axes, as_values=values[0])
  if wgrad.quantized:
    xt = x.T
    if wgrad.rht:
      xt = rht(xt, sign_vector=sign_vector, size=rht_size)
    q_t = _operand_xla(xt, wgrad, key_t, placement=_transposed(placement),
                       amax_axes=amax_axes, as_values=values[1])
  return q_row, q_t


QUANTIZE_PAIR = dispatch.Op("quantize_pair", {
    "xla": _quantize_pair_xla,
    "pallas": "pallas_kernels.quantize_pair:quantize_pair",
})


def split_key(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The keys `quantize_x_and_rht_t(x, key=key)` uses: `(k_x, k_rht)`."""
  return prng.pair_keys(key)


def quantize_x_and_rht_t(x: jax.Array, *, key: jax.Array | None = None,
                         sign_vector: Sequence[int] | None = None,
                         size: int = 16, implementation: str | None = None
                         ) -> tuple[NVFP4Array, NVFP4Array]:
  """The recipe's NVFP4 pair: `(q(x), q(rht(x.T)))` (see `quantize_pair`).

  Args:
    x: `[tokens, features]`; both axes multiples of 16 (tokens of `size`).
    key: None: both round to nearest (the recipe's X). A key: both round
      stochastically (the recipe's dY), with keys `split_key(key)`.
    sign_vector, size: the RHT's signs and size.
    implementation: "xla", "pallas" or None.

  Returns:
    `(q_x [tokens, features], q_rht_xt [features, tokens])`.
  """
  rounding = "nearest" if key is None else "stochastic"
  k_x, k_t = (None, None) if key is None else split_key(key)
  return quantize_pair(
      x, Operand(format="nvfp4", rounding=rounding),
      Operand(format="nvfp4", rounding=rounding, rht=True), key_row=k_x,
      key_t=k_t, rht_size=size, sign_vector=sign_vector,
      implementation=implementation)


# ----------------------------------------------------------------------------
# quantize_with_values: codes plus the exact bf16 block values.
# ----------------------------------------------------------------------------


def quantize_with_values(x: jax.Array, *, block_2d: bool = False,
                         rounding: str = "nearest",
                         key: jax.Array | None = None,
                         amax: jax.Array | None = None,
                         four_over_six: bool = False,
                         implementation: str | None = None
                         ) -> tuple[NVFP4Array, jax.Array]:
  """`quantize(x)` plus its exact bf16 block values, for a Hopper GEMM.

  The values are `fp4 * f32(block scale)` (exact in bf16); a GEMM on them
  with FP32 accumulation times `gemm_alpha` is the exact NVFP4 GEMM
  (`nvfp4_jax.gemm.block_values_matmul`). The Pallas kernel writes them in
  the same pass as the codes, saving the dequantize pass of the GEMM.

  Returns:
    `(NVFP4Array, bf16 values of x's shape)`.
  """
  what = "quantize_with_values"
  x = check_input(x, block=B, block_2d=block_2d, what=what)
  check_rounding(rounding, key, size=x.size, what=what)
  return QUANTIZE_WITH_VALUES(implementation, x, block_2d=block_2d,
                              rounding=rounding, key=key,
                              amax=check_amax(amax, what), with_values=True,
                              four_over_six=bool(four_over_six))


QUANTIZE_WITH_VALUES = dispatch.Op("quantize_with_values", {
    "xla": quantize_reference,
    "pallas": "pallas_kernels.quantize:quantize",
})
