"""The reference of `quantize_pair`: each operand by its own quantizer's reference.
"""

from __future__ import annotations



from nvfp4_jax.core.arrays import NVFP4Values
from nvfp4_jax.core.hadamard import rht
from nvfp4_jax.core.recipe import Operand

from nvfp4_jax.ops.quantize.api import _reduced_amax
from nvfp4_jax.ops.quantize.api import quantize_operand
from nvfp4_jax.ops.quantize.reference import quantize_reference
from nvfp4_jax.ops.quantize_rht_t.reference import _transposed


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
