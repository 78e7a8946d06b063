"""Pallas-Triton kernel of `gather_rows`: each program copies `block_rows`
rows (a tile of `block_cols` columns of each) from their sources, one
vectorized masked load per row tile; rows with no source are written as
zeros.

Why a kernel: alone, XLA:GPU's `jnp.take(x, index, axis=0, mode="fill")`
of `[131072, 512]` bf16 rows runs as fast (0.089 ms, 3.0 TB/s on an H100);
but inside a step XLA fuses the gather into its neighbours as an
elementwise loop with a select per element, which moved the
expert-parallel exchange's gathers at about 0.12 TB/s and fused into the
transposing quantizer gathered each element alone (BENCHMARKS.md,
"Expert parallelism on two GPUs"). A Pallas call is never fused: each
gather stays one pass of row copies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from nvfp4_jax.ops.gather_rows.config import GatherConfig
from nvfp4_jax.ops.gather_rows.config import default_config
from pallas_kernels import launch


def _kernel(index_ref, x_ref, o_ref, *, rows: int, m: int, d: int,
            config: GatherConfig):
  i, j = pl.program_id(0), pl.program_id(1)
  br, bc = config.block_rows, config.block_cols
  r = i * br + jnp.arange(br, dtype=jnp.int32)
  c = j * bc + jnp.arange(bc, dtype=jnp.int32)
  in_rows = r < m
  index = launch.load(index_ref, in_rows)
  found = in_rows & (index >= 0) & (index < rows)
  src = jnp.where(found, index, 0)
  cols = c < d
  values = launch.load(x_ref.at[src[:, None], c[None, :]],
                       found[:, None] & cols[None, :])
  launch.store(o_ref, values.astype(o_ref.dtype),
               in_rows[:, None] & cols[None, :])


def gather_rows(x: jax.Array, index: jax.Array, *,
                config: GatherConfig | None = None) -> jax.Array:
  """`x[index]` along rows (`x [rows, D]`, `index [M]` int32), zeros where
  `index` is outside `[0, rows)`. Equals `reference.gather_rows`.

  Raises:
    NotImplementedError: not a 2-D `x` and 1-D int32 `index`, a float8
      `x` (whose masked loads are undefined), or a backend without
      Pallas-Triton.
  """
  if x.ndim != 2 or index.ndim != 1 or index.dtype != jnp.int32:
    raise NotImplementedError(
        "the Pallas row gather takes x [rows, D] and int32 index [M]; got "
        f"{x.shape} and {index.dtype}{list(index.shape)}.")
  if jnp.dtype(x.dtype).itemsize == 1:
    raise NotImplementedError("the Pallas row gather skips 1-byte dtypes.")
  interpret = launch.check_backend("gather_rows")
  rows, d = x.shape
  m = index.shape[0]
  cfg = config or default_config(d)
  grid = (launch.cdiv(m, cfg.block_rows), launch.cdiv(d, cfg.block_cols))
  return launch.pallas_call(
      functools.partial(_kernel, rows=rows, m=m, d=d, config=cfg),
      interpret=interpret, num_warps=cfg.num_warps, num_stages=1,
      name="nvfp4_gather_rows", grid=grid,
      in_specs=[pl.BlockSpec((cfg.block_rows,), lambda i, j: (i,)),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((cfg.block_rows, cfg.block_cols),
                             lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((m, d), x.dtype),
  )(index, x)
