"""`quantize_pair`: both GEMM operands of one tensor (X or dY).

The recipe quantizes X twice per step: along `in` for Fprop and, for Wgrad,
`rht(X.T)` along tokens (and dY likewise, along `out` for Dgrad, with
stochastic rounding). The reference composes the two quantizers; the Pallas
kernels (`pallas_triton.py`) compute the same bytes while reading the tensor
once per pass.
"""

from __future__ import annotations

from typing import Sequence

import jax

from nvfp4_jax.core import dispatch
from nvfp4_jax.core import prng
from nvfp4_jax.core import spmd
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.arrays import NVFP4Values
from nvfp4_jax.core.arrays import QArray
from nvfp4_jax.core.arrays import check_input
from nvfp4_jax.core.arrays import check_rounding
from nvfp4_jax.core.hadamard import rht_matrix
from nvfp4_jax.core.recipe import Operand

from nvfp4_jax.ops.quantize.api import block_size
from nvfp4_jax.ops.quantize_pair.reference import _quantize_pair_xla
from nvfp4_jax.ops.quantize_rht_t.api import _check_tokens_x
from nvfp4_jax.ops.quantize_rht_t.api import _check_wgrad_tokens


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
      the emulated GEMM, see `block_scaled_matmul.api.gemm_plan`). NVFP4 operands only
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


def _quantize_pair_pallas(x, row: Operand, wgrad: Operand, **kwargs):
  """The Pallas kernels' call: the `Operand`s as primitive arguments."""
  row_ok = row.format == "nvfp4" and not row.block_2d
  t_ok = wgrad.format == "nvfp4" and not wgrad.block_2d
  if (row.quantized and not row_ok) or (wgrad.quantized and not t_ok):
    raise NotImplementedError(
        f"the Pallas pair kernels quantize NVFP4 1x16 rows and NVFP4 Wgrad "
        f"operands; got row={row}, wgrad={wgrad}. Use implementation='xla'.")
  from nvfp4_jax.ops.quantize_pair import pallas_triton  # pylint: disable=g-import-not-at-top
  return pallas_triton.quantize_pair(
      x, row_rounding=row.rounding if row.quantized else None,
      t_rounding=wgrad.rounding if wgrad.quantized else None,
      t_rht=wgrad.rht, row_four_over_six=row.four_over_six,
      t_four_over_six=wgrad.four_over_six, **kwargs)


def _per_shard(kernel, x, row: Operand, wgrad: Operand, **kwargs):
  """The kernel on each shard of `x` split under `jax.jit` shardings
  (`spmd.blockwise`): both operands are the whole tensor's shards, bit for
  bit (amaxes max-reduced over the axes that split `x`, stochastic rounding
  at the shard's global offset). A split that would cut a block (16
  features for the row operand; 16 tokens, or an RHT tile, for the Wgrad
  operand) leaves that dimension gathered."""
  if kwargs.get("placement") is not None or kwargs.get("amax_axes"):
    return kernel(x, row, wgrad, **kwargs)
  need_t = max(block_size(wgrad.format), kwargs.get("rht_size", 16) if wgrad.rht
               else 1) if wgrad.quantized else 1
  need_row = block_size(row.format) if row.quantized else 1
  return spmd.blockwise(
      lambda x, **kw: kernel(x, row, wgrad, **kw), x,
      grid=(x.shape[0] // need_t, x.shape[1] // need_row),
      transposed_out=(False, True),
      shard_kwargs=lambda spec, x: dict(
          placement=spmd.placement(spec, x.shape),
          amax_axes=spmd.spec_axes(spec)), **kwargs)


QUANTIZE_PAIR = dispatch.Op("quantize_pair", {
    "xla": _quantize_pair_xla,
    "pallas": _quantize_pair_pallas,
}, per_shard=_per_shard)


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
