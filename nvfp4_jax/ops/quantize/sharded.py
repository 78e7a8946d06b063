"""`quantize` of a 2-D array split over a device mesh, bit for bit the whole one's.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import spmd
from nvfp4_jax.core.arrays import NVFP4Array

from nvfp4_jax.ops.quantize.api import quantize as _local_quantize
from nvfp4_jax.ops.quantize.reference import tensor_amax


def quantize(x: jax.Array, mesh: Mesh, spec: P, *, block_2d: bool = False,
             rounding: str = "nearest", key: jax.Array | None = None,
             implementation: str | None = None) -> NVFP4Array:
  """`nvfp4_jax.quantize(x)` of a 2-D `x` split over `mesh` by `spec`.

  Each device quantizes its shard (kernels included) with the tensor amax
  reduced across the axes in `spec` and its stochastic-rounding bytes taken
  at its global offset: codes, scales and amax equal `nvfp4_jax.quantize(x)`
  bit for bit.

  Args:
    x: `[rows, K]` float array.
    mesh: the device mesh.
    spec: the `PartitionSpec` of `x` over `mesh`.
    block_2d: as `nvfp4_jax.quantize`.
    rounding: as `nvfp4_jax.quantize`.
    key: as `nvfp4_jax.quantize` (one key for the whole tensor).
    implementation: as `nvfp4_jax.quantize`, for each shard; None takes the
      `default_implementation` block's.

  Returns:
    An `NVFP4Array` whose codes and scales are split like `x`.

  Raises:
    ValueError: `spec` would split a 16-element block (a 16x16 tile with
      `block_2d`), naming the dimension and the mesh axes.
  """
  spmd.check_2d(x, "sharding.quantize")
  blk = nm.NVFP4_BLOCK
  spmd.check_blocks(dict(mesh.shape), spec, np.shape(x),
                    (blk if block_2d else 1, blk),
                    what="sharding.quantize: x")
  return _quantize(x, key, mesh=mesh, spec=spec, block_2d=block_2d,
                   rounding=rounding, implementation=spmd.resolve_implementation(implementation))


@functools.partial(jax.jit, static_argnames=spmd.STATIC + ("block_2d",
                                                       "rounding"))
def _quantize(x, key, *, mesh, spec, block_2d, rounding, implementation):
  axes = spmd.spec_axes(spec)

  def local(x, key):
    amax = spmd.reduce_amax(
        tensor_amax(nm.ftz(x.astype(np.float32))), axes)
    return _local_quantize(x, block_2d=block_2d, rounding=rounding, key=key,
                          amax=amax, placement=spmd.placement(spec, x.shape),
                          implementation=implementation)
  return spmd.shard_map(local, mesh=mesh, in_specs=(spec, P()),
                        out_specs=spec)(x, key)
