"""`gather_rows(x, index)`: rows of `x` by index, zeros where an index names
no row; the reference or the Pallas kernel (`GATHER_ROWS`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax.core import dispatch
from nvfp4_jax.ops.gather_rows import sharded

# Under `jax.jit` shardings the kernel runs per shard of the index
# (`sharded.gather_per_shard`); the reference is XLA's gather, which XLA
# partitions itself.
GATHER_ROWS = dispatch.Op("gather_rows", {
    "xla": "nvfp4_jax.ops.gather_rows.reference:gather_rows",
    "pallas": "nvfp4_jax.ops.gather_rows.pallas_triton:gather_rows",
}, per_shard=sharded.gather_per_shard)


def gather_rows(x: jax.Array, index: jax.Array, *,
                implementation: str | None = None) -> jax.Array:
  """`x[index]` along the first axis, zeros where `index` is outside
  `[0, x.shape[0])` (any trailing axes are carried along).

  Args:
    x: `[rows, ...]`.
    index: int32 `[M]`.
    implementation: "xla" (the reference), "pallas", or None (the
      platform's preference).

  Raises:
    ValueError: `x` has no axes, or `index` is not a 1-D int32 array.
  """
  if x.ndim < 1:
    raise ValueError(f"gather_rows: x needs a row axis, got shape {x.shape}.")
  if index.ndim != 1 or index.dtype != jnp.int32:
    raise ValueError(
        f"gather_rows: index must be int32 [M], got {index.dtype}"
        f"{list(index.shape)}; pass index.astype(jnp.int32).")
  shape = x.shape
  flat = x.reshape(shape[0], -1) if x.ndim != 2 else x
  out = GATHER_ROWS(implementation, flat, index)
  return out.reshape((index.shape[0],) + shape[1:])
