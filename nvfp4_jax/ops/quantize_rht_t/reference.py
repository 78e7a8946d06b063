"""The Wgrad operand's reference: `quantize(rht(x.T))`, a composition of
`nvfp4_jax.core.hadamard.rht` and the 1x16 quantizer's reference.

Its codes, scale bytes and amax are the same on every CPU and on the GPU:
the RHT's FP32 arithmetic is defined (`nvfp4_jax.core.tile.hadamard_rows`:
flushed products and partial sums, the butterfly's order), as the columns
kernels compute it. Against an implementation that sums in another order
(tensor cores, TE's kernel) a zero output may differ in its sign alone,
which changes its FP4 code from 0 to 8 (both decode to 0), never a scale.
"""

from __future__ import annotations



from nvfp4_jax.core import prng
from nvfp4_jax.core.hadamard import rht

from nvfp4_jax.ops.quantize.api import _reduced_amax
from nvfp4_jax.ops.quantize.reference import quantize_reference


def _transposed(placement: prng.Placement | None) -> prng.Placement | None:
  return None if placement is None else placement.T


def _quantize_rht_t_xla(x, *, rounding, key, amax, sign_vector, size,
                        placement=None, amax_axes=()):
  z = rht(x.T, sign_vector=sign_vector, size=size)
  if amax is None:
    amax = _reduced_amax(z, amax_axes)
  return quantize_reference(z, rounding=rounding, key=key, amax=amax,
                            placement=_transposed(placement))
