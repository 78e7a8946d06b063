"""A mixture of experts' routing, dispatch and combine, framework-free.

    router      logits = x @ router (FP32), top-k, weights = softmax of the
                top-k logits; load-balancing loss (Switch Transformer):
                E * sum_e f_e * P_e, f_e the fraction of token copies routed
                to e, P_e the mean router probability of e.
    dispatch    the T*k token copies sorted by expert (stable): group sizes
                per expert; with `capacity_factor`, each expert keeps its
                first C = ceil(cf * T * k / E) copies in token order and the
                rest are dropped (zero output); without, nothing is dropped.
    combine     y[t] = sum_j weight[t, j] * out[copy (t, j)].

The permutations are gathers with a custom VJP: the transpose of gathering
by a permutation is gathering by its inverse (no scatter-add). The dispatch
writes each expert's copies padded to 16 rows (`GROUP_ALIGN`, zero rows), the
layout the grouped GEMM's Wgrad operands need, so the op copies nothing.
The layer that runs them is `nvfp4_jax.training.moe`; its expert-parallel
exchange is `nvfp4_jax.training.moe_exchange`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from nvfp4_jax.ops.gather_rows.api import gather_rows
from nvfp4_jax.ops.ragged_quantize.api import padded_layout


@jax.custom_vjp
def permute(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
  """`x[order]` (rows), for a one-to-one `order` and `inverse` its inverse;
  an index out of range (in either) stands for no row: it reads zeros. The
  gradient is the gather `g[inverse]` (no scatter-add). Both gathers are
  `nvfp4_jax.ops.gather_rows` (a Pallas kernel on GPUs)."""
  return gather_rows(x, order.astype(jnp.int32))


def _permute_fwd(x, order, inverse):
  return permute(x, order, inverse), (order, inverse)


def _permute_bwd(res, g):
  order, inverse = res
  return gather_rows(g, inverse.astype(jnp.int32)), None, None


permute.defvjp(_permute_fwd, _permute_bwd)


@dataclasses.dataclass(frozen=True)
class Routing:
  """Where each token copy goes.

  Attributes:
    order: int32 `[T * k]`, the copies (index `t * k + j`) sorted by expert,
      kept copies first (dropped ones, under a capacity, after all groups).
    inverse: the inverse permutation.
    group_sizes: int32 `[E]`, kept copies per expert.
    weights: FP32 `[T, k]`, the combine weights.
    experts: int32 `[T, k]`, each copy's expert.
    aux_loss: FP32 scalar, the load-balancing loss.
  """

  order: jax.Array
  inverse: jax.Array
  group_sizes: jax.Array
  weights: jax.Array
  experts: jax.Array
  aux_loss: jax.Array


jax.tree_util.register_dataclass(
    Routing, data_fields=["order", "inverse", "group_sizes", "weights",
                          "experts", "aux_loss"], meta_fields=[])


ROUTER_SCOPE = "moe_router"


def router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
  """FP32 logits `[T, E]` of the router `[D, E]`, never quantized (named
  `ROUTER_SCOPE` for `nvfp4_jax.report`)."""
  with jax.named_scope(ROUTER_SCOPE):
    return jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)


def capacity(tokens: int, num_experts: int, top_k: int,
             capacity_factor: float | None) -> int | None:
  """Copies an expert keeps: `ceil(cf * T * k / E)`, or None (dropless)."""
  if capacity_factor is None:
    return None
  return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def route(logits: jax.Array, top_k: int,
          capacity_factor: float | None = None, *,
          token_axes: tuple[str, ...] = ()) -> Routing:
  """Top-k routing of FP32 `logits [T, E]` and the sort that dispatches it.

  `token_axes`: inside `shard_map`, the mesh axes that split the tokens
  (major to minor, in token order): the load-balancing loss and the
  capacity then count every shard's tokens, as one device would.
  """
  t, num_experts = logits.shape
  logits = logits.astype(jnp.float32)
  top_logits, experts = jax.lax.top_k(logits, top_k)
  weights = jax.nn.softmax(top_logits, axis=-1)
  probs = jax.nn.softmax(logits, axis=-1)
  flat = experts.reshape(-1)
  counts = jnp.bincount(flat, length=num_experts)
  prob_sums = jnp.sum(probs, axis=0)
  total = t
  if token_axes:
    counts_all = jax.lax.all_gather(counts, token_axes, tiled=False)
    counts_all = counts_all.reshape(-1, num_experts)
    shard = jax.lax.axis_index(token_axes)
    earlier = jnp.sum(jnp.where(
        (jnp.arange(counts_all.shape[0]) < shard)[:, None], counts_all, 0),
        axis=0)
    global_counts = jnp.sum(counts_all, axis=0)
    prob_sums = jax.lax.psum(prob_sums, token_axes)
    total = t * counts_all.shape[0]
  else:
    earlier = jnp.zeros_like(counts)
    global_counts = counts
  fraction = global_counts.astype(jnp.float32) / (total * top_k)
  aux = num_experts * jnp.sum(fraction * (prob_sums / total))
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  group_sizes = counts.astype(jnp.int32)
  cap = capacity(total, num_experts, top_k, capacity_factor)
  if cap is not None:
    sorted_experts = flat[order]
    start = jnp.cumsum(counts) - counts
    # Each copy's rank among its expert's copies of all shards, in token
    # order: an expert keeps its first `cap` copies, as on one device.
    rank = (jnp.arange(t * top_k, dtype=jnp.int32) - start[sorted_experts]
            + earlier[sorted_experts])
    kept = rank < cap
    # Kept copies stay grouped by expert; dropped ones move past the groups.
    order = order[jnp.argsort(jnp.where(kept, sorted_experts, num_experts),
                              stable=True)]
    group_sizes = jnp.clip(cap - earlier, 0, group_sizes).astype(jnp.int32)
  inverse = jnp.argsort(order).astype(jnp.int32)
  return Routing(order=order, inverse=inverse, group_sizes=group_sizes,
                 weights=weights, experts=experts.astype(jnp.int32),
                 aux_loss=aux)


# Rows each expert's group of copies is padded to by the layer's dispatch
# (zero rows): the NVFP4 block and the 16-point RHT's tile along the tokens,
# so the grouped GEMM's Wgrad operands need no layout of their own
# (`ragged_dot(..., align="assume")`; a recipe that needs more is padded
# again by the op). Zero rows change no amax, code, product or sum.
GROUP_ALIGN = 16


@dataclasses.dataclass(frozen=True)
class Layout:
  """The copies in expert order, each group padded to `GROUP_ALIGN` rows.

  Attributes:
    src: int32 `[L]`, the copy at each row (`T * k`, none, for padding).
    pos: int32 `[T * k]`, each copy's row (`L` for a dropped copy).
    group_sizes: int32 `[E]`, the padded group sizes.
  """

  src: jax.Array
  pos: jax.Array
  group_sizes: jax.Array


jax.tree_util.register_dataclass(
    Layout, data_fields=["src", "pos", "group_sizes"], meta_fields=[])


def group_starts(sizes: jax.Array, align: int) -> tuple[jax.Array, jax.Array]:
  """`(padded sizes, padded starts)` of groups of `sizes` rows padded to
  multiples of `align`."""
  padded = -(-sizes.astype(jnp.int32) // align) * align
  return padded, jnp.cumsum(padded) - padded


def layout(routing: Routing, top_k: int, align: int = GROUP_ALIGN) -> Layout:
  """`routing`'s expert order with every group padded to `align` rows
  (`ops.ragged_quantize.api.padded_layout`, composed with the sort)."""
  del top_k
  rows = routing.order.shape[0]
  sources, padded, _ = padded_layout(routing.group_sizes, rows, align)
  src = jnp.take(routing.order, sources, mode="fill", fill_value=rows)
  pos = inverse_map(sources, rows)[routing.inverse]
  return Layout(src=src, pos=pos, group_sizes=padded)


def dispatch(x: jax.Array, routing: Routing, top_k: int,
             lay: Layout | None = None) -> jax.Array:
  """The token copies in expert order (`x [T, D]`): `[T * k, D]`, or in the
  padded layout `lay` (`[L, D]`, zero rows between groups)."""
  copies = jnp.repeat(x, top_k, axis=0)
  if lay is None:
    return permute(copies, routing.order, routing.inverse)
  return permute(copies, lay.src, lay.pos)


def combine(out: jax.Array, routing: Routing, top_k: int,
            lay: Layout | None = None) -> jax.Array:
  """`y [T, D]` from the experts' outputs in expert order (or `lay`)."""
  if lay is None:
    copies = permute(out, routing.inverse, routing.order)
  else:
    copies = permute(out, lay.pos, lay.src)
  t = copies.shape[0] // top_k
  copies = copies.reshape(t, top_k, -1)
  # A weighted sum, not a batched dot: the k copies of a token.
  return jnp.sum(copies * routing.weights.astype(copies.dtype)[..., None],
                 axis=1)


def inverse_map(index: jax.Array, length: int) -> jax.Array:
  """The inverse of a one-to-one row map `index` (`[n]`, entries past
  `length` for no row): `[length]`, the source of each row, `n` for none.
  An integer scatter of `n` indices (the rows themselves are gathered)."""
  n = index.shape[0]
  return jnp.full((length,), n, jnp.int32).at[index].set(
      jnp.arange(n, dtype=jnp.int32), mode="drop")
