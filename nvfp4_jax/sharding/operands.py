"""A linear layer's operands and result on a device mesh, outside `shard_map`.

Under JAX's sharding in types (`jax.set_mesh` with Explicit axes) the
operands' types say how a layer is split: `explicit_operands` flattens them
to the 2-D operands of the per-shard computation with the `LinearSharding`
they run with (`linear_sharding_for`, or the one given), and says how the
result splits back; `apply_out_sharding` gives a result the sharding a
caller asks for.

In auto mode (`jax.jit` shardings) XLA partitions a high-precision layer's
product as the rest of the program; sharding constraints say where its
weight (`gathered_weight`, under FSDP) and, under sequence parallelism,
its activations (`sequence_constraint`) live.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import AbstractMesh
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax.core import spmd
from nvfp4_jax.core.recipe import Recipe
from nvfp4_jax.sharding.mesh import LinearSharding
from nvfp4_jax.sharding.mesh import linear_sharding_for


def apply_out_sharding(y: jax.Array, out_sharding) -> jax.Array:
  """`y` with the sharding `out_sharding` (None: as it is): resharded
  where its type carries Explicit axes, else a sharding constraint."""
  if out_sharding is None:
    return y
  if explicit_mesh(y) is not None:
    return jax.sharding.reshard(y, out_sharding)
  return jax.lax.with_sharding_constraint(y, out_sharding)


def explicit_mesh(*arrays) -> AbstractMesh | None:
  """The mesh of the first operand whose sharding type has Explicit axes
  (JAX's sharding in types: `jax.set_mesh` with `AxisType.Explicit`), else
  None (no mesh, Auto axes, or inside a `shard_map`)."""
  for a in arrays:
    mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
    if (mesh is not None and not mesh.empty
        and AxisType.Explicit in tuple(mesh.axis_types)):
      return mesh
  return None


def _dims_entry(spec: P, dims, keep=None):
  """One PartitionSpec entry for the merge of `dims` (major to minor) of a
  tensor of sharding `spec`, keeping only the axes in `keep` if given."""
  axes = [a for d in dims
          for a in spmd.entry_axes(spec[d] if d < len(spec) else None)
          if keep is None or a in keep]
  return spmd.entry(axes)


def explicit_operands(x, w, n_free, n_contract, mesh: AbstractMesh,
                       shard: LinearSharding | None, recipe: Recipe,
                       prefix: str):
  """`x: [..free, ..contracting]` and `w: [..contracting, ..free]` as the
  2-D operands of `_linear` under sharding in types, the `LinearSharding`
  they run with, the sharding of the result `[..lhs free, ..rhs free]`,
  and the 2-D spec the result is resharded to before its reshape (None:
  as it comes).

  The layer's split is what the operands' types say
  (`sharding.linear_sharding_for`), or `shard` (from `sharding=` or the
  `mesh_rules` in force) if given; each operand is resharded to it (a
  no-op where its type says the same). A split the types ask for that
  would cut a block of an operand (a token shard that is not a multiple of
  the Wgrad operands' 16-token blocks, a 16x16 weight tile cut by `in` or
  `out`) runs on the closest split that cuts none
  (`LinearSharding.fitted`), and the result is resharded back to the
  types' split: correct, at the cost of moving the operands, as auto mode
  does. A split that is given keeps its check (`LinearSharding.check`).
  The flattening reshapes carry their `out_sharding`: the merged
  dimensions keep every axis that split them.
  """
  xs, ws = jax.typeof(x).sharding.spec, jax.typeof(w).sharding.spec
  x_spec = P(_dims_entry(xs, range(n_free)),
             _dims_entry(xs, range(n_free, x.ndim)))
  w_spec = P(_dims_entry(ws, range(n_contract)),
             _dims_entry(ws, range(n_contract, w.ndim)))
  typed = shard is None
  if typed:
    shard = linear_sharding_for(mesh, x_spec, w_spec)
  else:
    if dict(shard.mesh.shape) != dict(mesh.shape):
      raise ValueError(
          f"{prefix}the layer's LinearSharding is on a mesh "
          f"{dict(shard.mesh.shape)}, but its operands' sharding types are "
          f"on {dict(mesh.shape)}; give it the operands' mesh "
          f"(jax.typeof(x).sharding.mesh), or leave sharding=None to follow "
          f"the operands' types.")
    shard = dataclasses.replace(shard, mesh=mesh)
  # The result splits back as the operands' free dimensions were split.
  lhs_free, rhs_free = range(n_free), range(n_contract, w.ndim)
  y_lhs = ([_dims_entry(xs, (d,)) for d in lhs_free]
           if spmd.entry_axes(_dims_entry(xs, lhs_free)) == shard.tokens else
           [spmd.entry(shard.tokens)] + [None] * (n_free - 1))
  n_axes = set(shard.n_axes)
  y_rhs = [_dims_entry(ws, (d,), keep=n_axes) for d in rhs_free]
  if (spmd.entry_axes(_dims_entry(ws, rhs_free, keep=n_axes))
      != shard.n_axes):
    y_rhs = [spmd.entry(shard.n_axes)] + [None] * (len(rhs_free) - 1)
  tokens, k = math.prod(x.shape[:n_free]), math.prod(x.shape[n_free:])
  x = jax.lax.reshape(x, (tokens, k), out_sharding=NamedSharding(mesh, x_spec))
  w = jax.lax.reshape(w, (k, math.prod(w.shape[n_contract:])),
                      out_sharding=NamedSharding(mesh, w_spec))
  y_sharding = NamedSharding(mesh, P(*y_lhs, *y_rhs))
  y_spec = None
  if typed:
    fit = shard.fitted(recipe, tokens, k, w.shape[1])
    if fit != shard:
      shard, y_spec = fit, shard.y_spec
  sizes = dict(mesh.shape)
  if all(sizes[a] == 1 for a in spmd.spec_axes(shard.x_spec)
         + spmd.spec_axes(shard.kernel_spec)):
    # Nothing split (one device, or axes of size 1): the whole layer.
    shard, x_spec, w_spec = None, P(), P()
  else:
    x_spec, w_spec = shard.x_spec, shard.kernel_spec
  x = jax.sharding.reshard(x, NamedSharding(mesh, x_spec))
  w = jax.sharding.reshard(w, NamedSharding(mesh, w_spec))
  return x, w, shard, y_sharding, y_spec


def gathered_weight(lhs, rhs, rc, batched, shard: LinearSharding | None):
  """A high-precision layer's 2-D weight, gathered over its `fsdp` axis
  before XLA partitions its product (a sharding constraint to
  `shard.used_kernel_spec`).

  Left to itself, XLA's partitioner carries the stored weight's FSDP split
  onto the weight gradient's GEMM: it then gathers the whole batch's
  activation gradient (`[tokens, out]`, per layer) to compute each shard's
  rows, instead of summing each device's full-size weight gradient with a
  reduce-scatter. Gathering the weight itself (what the quantized path does
  explicitly) makes the gradient's cotangent replicated over `fsdp`, so it
  is reduced where the parameters' sharding asks: a reduce-scatter of
  weight-sized bytes. A no-op without an `fsdp` axis of several devices,
  for weights of other ranks, inside a `shard_map` and under Explicit axes
  (there the types say where the operands live)."""
  if not gathers_weight(lhs, rhs, batched, shard):
    return rhs
  spec = shard.used_kernel_spec
  if tuple(rc) == (1,):  # The weight stored `[out, in]`.
    spec = P(spec[1], spec[0])
  return jax.lax.with_sharding_constraint(
      rhs, NamedSharding(shard.mesh, spec))


def sequence_parallel(lhs, rhs, batched, shard: LinearSharding | None
                       ) -> bool:
  """Whether a high-precision layer's product runs under sequence
  parallelism (`LinearSharding.sequence`, in auto mode, outside a
  `shard_map`): XLA partitions it, and `sequence_constraint` says where
  its activations live."""
  return (shard is not None and shard.sequence
          and xla_partitions(lhs, rhs, batched))


def sequence_constraint(a, shard: LinearSharding, axes, contracting
                         ) -> jax.Array:
  """An activation of a high-precision layer under sequence parallelism,
  split over `axes` along its first free (token) dimension and whole along
  the others, by a sharding constraint: a column-parallel layer's X over
  its `tokens` (XLA all-gathers it over `model`), a row-parallel layer's Y
  over `seq_tokens` (XLA reduce-scatters the partial sums). `a` itself
  where the axes do not divide that dimension."""
  free = [d for d in range(a.ndim) if d not in contracting]
  if not free or a.shape[free[0]] % spmd.num_shards(shard.sizes, axes):
    return a
  spec = [None] * a.ndim
  spec[free[0]] = spmd.entry(axes)
  return jax.lax.with_sharding_constraint(a, NamedSharding(shard.mesh,
                                                           P(*spec)))


def gathers_weight(lhs, rhs, batched, shard: LinearSharding | None) -> bool:
  """Whether `gathered_weight` gathers `rhs` (a 2-D weight of a layer
  whose `fsdp` axis splits it, in auto mode, outside a `shard_map`)."""
  return (shard is not None and shard.fsdp_splits
          and xla_partitions(lhs, rhs, batched))


def xla_partitions(lhs, rhs, batched) -> bool:
  """Whether XLA's partitioner places a high-precision layer's 2-D product
  from sharding constraints: auto mode (no Explicit axes) outside a
  `shard_map`."""
  if batched or rhs.ndim != 2 or explicit_mesh(lhs, rhs) is not None:
    return False
  abstract = jax.sharding.get_abstract_mesh()
  return abstract.empty or not abstract.manual_axes
