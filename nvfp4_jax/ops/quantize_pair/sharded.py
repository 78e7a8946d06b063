"""`quantize_pair` of a sharded `x: [tokens, features]`, each operand bit for bit the whole one's.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from nvfp4_jax.core import spmd
from nvfp4_jax.core.recipe import Operand

from nvfp4_jax.ops.quantize.api import block_size
from nvfp4_jax.ops.quantize_pair.api import quantize_pair as _local_quantize_pair


def quantize_pair(x: jax.Array, mesh: Mesh, spec: P, row: Operand,
                  wgrad: Operand, *, key_row: jax.Array | None = None,
                  key_t: jax.Array | None = None, rht_size: int = 16,
                  sign_vector: Sequence[int] | None = None,
                  implementation: str | None = None):
  """`nvfp4_jax.quantize_pair` of a sharded `x: [tokens, features]`: both
  GEMM operands of X (or dY), each bit for bit the whole tensor's.

  Args:
    x: `[tokens, features]`.
    mesh: the device mesh.
    spec: the `PartitionSpec` of `x` over `mesh`.
    row, wgrad: the two `Operand`s, as `nvfp4_jax.quantize_pair`.
    key_row, key_t: their stochastic-rounding keys (one each for the whole
      tensor).
    rht_size, sign_vector: the RHT of the Wgrad operand.
    implementation: as `nvfp4_jax.quantize_pair`, for each shard; None
      takes the `default_implementation` block's.

  Returns:
    `(q_row split like x, q_t split by the transposed spec)`; None for an
    operand in bf16.

  Raises:
    ValueError: `spec` would split a block of either operand.
  """
  spmd.check_2d(x, "sharding.quantize_pair")
  need_t = max(block_size(wgrad.format),
               rht_size if wgrad.rht else 1) if wgrad.quantized else 1
  need_row = block_size(row.format) if row.quantized else 1
  spmd.check_blocks(dict(mesh.shape), spec, np.shape(x), (need_t, need_row),
                    what="sharding.quantize_pair: x",
                    dim_names=("tokens", "features"))
  return _quantize_pair(
      x, key_row, key_t, mesh=mesh, spec=spec, row=row, wgrad=wgrad,
      rht_size=rht_size,
      sign_vector=None if sign_vector is None else tuple(sign_vector),
      implementation=spmd.resolve_implementation(implementation))


@functools.partial(jax.jit, static_argnames=spmd.STATIC + (
    "row", "wgrad", "rht_size", "sign_vector"))
def _quantize_pair(x, key_row, key_t, *, mesh, spec, row, wgrad, rht_size,
                   sign_vector, implementation):
  def local(x, key_row, key_t):
    return _local_quantize_pair(
        x, row, wgrad, key_row=key_row, key_t=key_t, rht_size=rht_size,
        sign_vector=sign_vector, placement=spmd.placement(spec, x.shape),
        amax_axes=spmd.spec_axes(spec), implementation=implementation)
  return spmd.shard_map(local, mesh=mesh, in_specs=(spec, P(), P()),
                        out_specs=(spec, spmd.transposed(spec)))(x, key_row,
                                                              key_t)
