"""The grouped (mixture-of-experts) GEMMs per shard under `jax.jit`
shardings (auto mode).

A grouped GEMM kernel (opaque to XLA's SPMD partitioner) runs on each
device's rows or contraction through `custom_partitioning`
(`spmd.partitioned`), as the dense GEMM does
(`ops/block_scaled_matmul/sharded.py`): each output element's sum stays on
one device, in the kernel's order, and each row shard meets its own groups'
weights.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax.core import spmd


def local_group_sizes(group_sizes: jax.Array, axes: Sequence[str],
                      rows: int) -> jax.Array:
  """The group sizes of this device's `rows` rows of a row-sorted grouped
  operand split over `axes` (inside `shard_map` or a per-shard function):
  each contiguous group clipped to the shard, so the shard's rows fall in
  the same groups as in the whole array (rows past the groups stay
  past them)."""
  gs = group_sizes.astype(jnp.int32)
  end = jnp.cumsum(gs)
  off = spmd.shard_index(axes) * rows
  hi = jnp.clip(end - off, 0, rows)
  lo = jnp.clip(end - gs - off, 0, rows)
  return (hi - lo).astype(group_sizes.dtype)


def grouped_matmul_per_shard(fn: Callable, a: Any, b: Any, rest: Any, *,
                             a_dim: int, b_dim: int, contract_tokens: bool,
                             fallback: Callable | None = None,
                             **kwargs) -> Any:
  """`fn(*a, *b, *rest, **kwargs)`, a grouped (mixture-of-experts) GEMM
  kernel, run per shard under `jax.jit` shardings.

  Two forms (`contract_tokens` False, True):

  - rows (Fprop, Dgrad): `a`'s leaves are `[M, .]` tokens sorted by group,
    `b`'s `[E, ., .]` with N on `b_dim`, the result `[M, N]`. The result's
    rows are split as `a`'s rows (`a_dim` = 0), its columns as `b`'s N
    (less axes already splitting the rows); the experts and K are
    gathered. `rest[0]` (the group sizes) becomes each shard's own
    (`local_group_sizes`), so every row meets its own group's weight.
  - contraction (Wgrad): `a`'s leaves are 2-D with K on `a_dim`, `b`'s
    with N on `b_dim`, the tokens on the other dimension of both; the
    result `[E, K, N]` is split as K and N are, and the tokens are
    gathered where split (each output element's sum stays on one device,
    in the kernel's order: no partial sums cross devices).

  A mesh axis whose shards would not divide its dimension is dropped from
  it (gathered there).

  `rest` (group sizes, alpha; a pytree, None leaves absent) is replicated.
  A shard the kernel turns down (`NotImplementedError` on its local shape)
  runs `fallback` (same signature). Eagerly, inside `shard_map`, under
  Explicit mesh axes, with one device or `AUTO_PARTITION` off this is
  `fn(*a, *b, *rest, **kwargs)`.
  """
  a_leaves, b_leaves = list(a), list(b)
  rest_leaves, rest_tree = jax.tree.flatten(rest)
  b_rank = 2 if contract_tokens else 3
  if (any(jnp.ndim(l) != 2 for l in a_leaves)
      or any(jnp.ndim(l) != b_rank for l in b_leaves)
      or not spmd.auto_partitions((a_leaves, b_leaves, rest_leaves))):
    return fn(*a_leaves, *b_leaves, *rest, **kwargs)
  na, nb = len(a_leaves), len(b_leaves)

  def flat_call(g: Callable) -> Callable:
    def run(*flat):
      r = jax.tree.unflatten(rest_tree, flat[na + nb:])
      return g(*flat[:na + nb], *r, **kwargs)
    return run

  def shardings(mesh, arg_shapes):
    shapes = jax.tree.leaves(arg_shapes)

    def dim(shape, d, used=()):
      """The axes splitting dimension `d`, less minor ones until their
      shard count divides it (whole shards, no padding)."""
      spec = getattr(shape.sharding, "spec", None) or ()
      axes = [x for x in (spmd.entry_axes(spec[d]) if d < len(spec) else ())
              if x in mesh.shape and x not in used]
      while axes and shape.shape[d] % spmd.num_shards(dict(mesh.shape), axes):
        axes.pop()
      return axes
    m = spmd.entry(dim(shapes[0], a_dim))
    n = spmd.entry(dim(shapes[na], b_dim, spmd.entry_axes(m)))

    def spec(rank, d, e):
      return P(*(e if i == d else None for i in range(rank)))
    args_sh = tuple(
        NamedSharding(mesh, spec(2, a_dim, m) if i < na
                      else spec(b_rank, b_dim, n))
        for i in range(na + nb)) + tuple(
            NamedSharding(mesh, P()) for _ in rest_leaves)
    out = P(m, n) if not contract_tokens else P(None, m, n)
    m_axes = spmd.entry_axes(m)
    local = None
    if not contract_tokens and m_axes:
      # The first of `rest` is the group sizes: the shard's own.
      def local(flat):
        flat = list(flat)
        flat[na + nb] = local_group_sizes(flat[na + nb], m_axes,
                                          flat[0].shape[0])
        return tuple(flat)
    return args_sh, NamedSharding(mesh, out), local

  # `m` and `n` pass through; every other dimension is replicated.
  rule = spmd.pass_through_rule(
      [(l, "m", a_dim) for l in a_leaves] + [(l, "n", b_dim) for l in b_leaves]
      + [(l, None, 0) for l in rest_leaves],
      (("e", "m", "n"),) if contract_tokens else (("m", "n"),),
      ("e",) if contract_tokens else ())
  return spmd.partitioned(flat_call(fn), [*a_leaves, *b_leaves, *rest_leaves],
                     shardings=shardings, rule=rule,
                     fallback=None if fallback is None else flat_call(fallback))
