"""`quantize_rht_t` of a sharded `x: [tokens, features]`, bit for bit the whole one's.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import spmd
from nvfp4_jax.core.arrays import NVFP4Array

from nvfp4_jax.ops.quantize_rht_t.api import quantize_rht_t as _local_quantize_rht_t


def quantize_rht_t(x: jax.Array, mesh: Mesh, spec: P, *,
                   rounding: str = "nearest", key: jax.Array | None = None,
                   sign_vector: Sequence[int] | None = None, size: int = 16,
                   implementation: str | None = None) -> NVFP4Array:
  """`nvfp4_jax.quantize_rht_t(x)` (the Wgrad operand) of a sharded
  `x: [tokens, features]`; bit for bit the whole tensor's.

  Args:
    x: `[tokens, features]` float array.
    mesh: the device mesh.
    spec: the `PartitionSpec` of `x` over `mesh`.
    rounding: as `nvfp4_jax.quantize_rht_t`.
    key: as `nvfp4_jax.quantize_rht_t` (one key for the whole tensor).
    sign_vector, size: the RHT's signs and size.
    implementation: as `nvfp4_jax.quantize_rht_t`, for each shard; None
      takes the `default_implementation` block's.

  Returns:
    An `NVFP4Array` `[features, tokens]` split by the transposed `spec`.

  Raises:
    ValueError: a token shard that is not a multiple of 16 and `size` (the
      blocks and Hadamard tiles run along tokens), or a feature split that
      is uneven.
  """
  spmd.check_2d(x, "sharding.quantize_rht_t")
  spmd.check_blocks(dict(mesh.shape), spec, np.shape(x),
                    (max(nm.NVFP4_BLOCK, size), 1),
                    what="sharding.quantize_rht_t: x",
                    dim_names=("tokens", "features"))
  return _quantize_rht_t(
      x, key, mesh=mesh, spec=spec, rounding=rounding,
      sign_vector=None if sign_vector is None else tuple(sign_vector),
      size=size, implementation=spmd.resolve_implementation(implementation))


@functools.partial(jax.jit, static_argnames=spmd.STATIC + (
    "rounding", "sign_vector", "size"))
def _quantize_rht_t(x, key, *, mesh, spec, rounding, sign_vector, size,
                    implementation):
  def local(x, key):
    return _local_quantize_rht_t(
        x, rounding=rounding, key=key, sign_vector=sign_vector, size=size,
        placement=spmd.placement(spec, x.shape),
        amax_axes=spmd.spec_axes(spec), implementation=implementation)
  return spmd.shard_map(local, mesh=mesh, in_specs=(spec, P()),
                        out_specs=spmd.transposed(spec))(x, key)
