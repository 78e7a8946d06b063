"""The block-scaled GEMM per shard under `jax.jit` shardings (auto mode).

A GEMM kernel (a `pallas_call` or a Triton call, opaque to XLA's SPMD
partitioner) runs on each device's rows and columns through
`custom_partitioning` (`spmd.partitioned`): no device computes another's
output, and each output element's sum stays on one device, in the kernel's
order.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax.core import spmd


def matmul_per_shard(fn: Callable, a: Any, b: Any, *args: jax.Array,
                     b_kn: bool = False, fallback: Callable | None = None,
                     **kwargs) -> Any:
  """`fn(a, b, *args, **kwargs)`, a GEMM kernel `a @ b.T` (`a @ b` with
  `b_kn`) -> `[M, N]`, run per shard under `jax.jit` shardings.

  `a` and `b` are arrays or quantized arrays (pytrees whose non-scalar
  leaves are 2-D with rows first: codes, scales; `[K, N]` leaves with
  `b_kn`). The result's rows are split as `a`'s rows, its columns as `b`'s
  `N` (less axes already splitting the rows); the contraction K is
  gathered where split (each output element's sum stays on one device, in
  the kernel's order, so no partial sums cross devices). `args` (an alpha)
  and scalar leaves (amaxes) are replicated. A shard the kernel turns down
  (`NotImplementedError` on its local shape) runs `fallback` (same
  signature) instead. Where `spmd.blockwise` calls its kernel as it is,
  this is `fn(a, b, *args, **kwargs)`.
  """
  a_leaves, a_tree = jax.tree.flatten(a)
  b_leaves, b_tree = jax.tree.flatten(b)
  ops = a_leaves + b_leaves
  if (any(jnp.ndim(l) not in (0, 2) for l in ops)
      or not any(jnp.ndim(l) == 2 for l in a_leaves)
      or not any(jnp.ndim(l) == 2 for l in b_leaves)
      or not spmd.auto_partitions((a, b, args))):
    return fn(a, b, *args, **kwargs)
  na, nb = len(a_leaves), len(b_leaves)
  first_a = next(i for i, l in enumerate(a_leaves) if jnp.ndim(l) == 2)
  first_b = na + next(i for i, l in enumerate(b_leaves) if jnp.ndim(l) == 2)
  n_dim = 1 if b_kn else 0

  def flat_call(g: Callable) -> Callable:
    def run(*flat):
      return g(jax.tree.unflatten(a_tree, flat[:na]),
               jax.tree.unflatten(b_tree, flat[na:na + nb]),
               *flat[na + nb:], **kwargs)
    return run

  def shardings(mesh, arg_shapes):
    shapes = jax.tree.leaves(arg_shapes)

    def dim(shape, d):
      spec = getattr(shape.sharding, "spec", None) or ()
      return [x for x in (spmd.entry_axes(spec[d]) if d < len(spec) else ())
              if x in mesh.shape]
    m = spmd.entry(dim(shapes[first_a], 0))
    n = spmd.entry([x for x in dim(shapes[first_b], n_dim)
                    if x not in spmd.entry_axes(m)])
    b_spec = P(None, n) if b_kn else P(n, None)
    args_sh = tuple(
        NamedSharding(mesh, P() if not s.shape else
                      P(m, None) if i < na else b_spec)
        for i, s in enumerate(shapes[:na + nb])) + tuple(
            NamedSharding(mesh, P()) for _ in args)
    return args_sh, NamedSharding(mesh, P(m, n)), None

  # Rows `m` and `n` pass through; every other dimension is replicated.
  rule = spmd.pass_through_rule(
      [(l, "m", 0) for l in a_leaves] + [(l, "n", n_dim) for l in b_leaves]
      + [(x, None, 0) for x in args], (("m", "n"),))
  return spmd.partitioned(
      flat_call(fn), [*ops, *args], shardings=shardings, rule=rule,
      fallback=None if fallback is None else flat_call(fallback))
