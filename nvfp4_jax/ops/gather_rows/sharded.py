"""The row gather per shard under `jax.jit` shardings (auto mode).

The Pallas kernel, opaque to XLA's SPMD partitioner, runs on each device's
shard of the index through `custom_partitioning` (`spmd.partitioned`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax.core import spmd


def gather_per_shard(fn: Callable, x: jax.Array, index: jax.Array,
                     **kwargs) -> jax.Array:
  """`fn(x, index, **kwargs)`, a row gather kernel (`x [rows, D]`, `index
  [M]` -> `[M, D]`), run per shard under `jax.jit` shardings: each device
  gathers the rows of its shard of `index` from the whole `x` (gathered
  where split: an index may name any row), so the result's rows are split
  as `index` is and no device computes another's rows. Where
  `spmd.blockwise` calls its kernel as it is, this is `fn(x, index,
  **kwargs)`."""
  if (jnp.ndim(x) != 2 or jnp.ndim(index) != 1
      or not spmd.auto_partitions((x, index))):
    return fn(x, index, **kwargs)
  from jax.experimental.custom_partitioning import SdyShardingRule  # pylint: disable=g-import-not-at-top

  def shardings(mesh, arg_shapes):
    spec = getattr(arg_shapes[1].sharding, "spec", None) or ()
    m = spmd.entry([a for a in (spmd.entry_axes(spec[0]) if spec else ())
                    if a in mesh.shape])
    return ((NamedSharding(mesh, P(None, None)), NamedSharding(mesh, P(m))),
            NamedSharding(mesh, P(m, None)), None)

  rule = SdyShardingRule((("r", "d"), ("m",)), (("m", "d2"),),
                         need_replication_factors=("r", "d", "d2"))
  return spmd.partitioned(lambda x, index: fn(x, index, **kwargs),
                          [x, index], shardings=shardings, rule=rule)
