"""The mixture-of-experts layer's math, framework-free: routing, dispatch and
combine, capacity, and the expert-parallel exchange.

The linen and NNX modules (`nvfp4_jax.flax.moe`: `NVFP4MoE`, `NNXMoE`) hold
the router and the stacked expert kernels and run `moe_forward` here:

    router      logits = x @ router (FP32), top-k, weights = softmax of the
                top-k logits; load-balancing loss (Switch Transformer):
                E * sum_e f_e * P_e, f_e the fraction of token copies routed
                to e, P_e the mean router probability of e.
    dispatch    the T*k token copies sorted by expert (stable): group sizes
                per expert; with `capacity_factor`, each expert keeps its
                first C = ceil(cf * T * k / E) copies in token order and the
                rest are dropped (zero output); without, nothing is dropped.
    experts     h = silu(xs @ up[e][:, :H]) * (xs @ up[e][:, H:]),
                out = h @ down[e]: two grouped GEMMs, "experts/up" (gate
                and up fused, [E, D, 2H]) and "experts/down" ([E, H, D]).
    combine     y[t] = sum_j weight[t, j] * out[copy (t, j)].

The permutations are gathers with a custom VJP: the transpose of gathering
by a permutation is gathering by its inverse (no scatter-add). The dispatch
writes each expert's copies padded to 16 rows (`GROUP_ALIGN`, zero rows), the
layout the grouped GEMM's Wgrad operands need, so the op copies nothing.

Under `mesh_rules` with an `expert` mesh axis the layer runs expert parallel
(`moe_forward`): the token copies move between devices as `EXCHANGE` and
`EXCHANGE_SLACK` (module-level settings, read while tracing) choose.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from nvfp4_jax.core import spmd
from nvfp4_jax.ops.gather_rows.api import gather_rows
from nvfp4_jax.ops.ragged_quantize.api import padded_layout
from nvfp4_jax.ops.ragged_quantize.api import padded_length
from nvfp4_jax.sharding import current_rules
from nvfp4_jax.sharding.operands import explicit_mesh


# ----------------------------------------------------------------------------
# Routing and dispatch (the one-device and the expert-parallel forms share
# them).
# ----------------------------------------------------------------------------


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
  pos = _inverse(sources, rows)[routing.inverse]
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


def swiglu_experts(xs: jax.Array, group_sizes: jax.Array, gemm) -> jax.Array:
  """SwiGLU experts on sorted copies: `gemm(x, group_sizes, name)` runs each
  grouped GEMM ("up": gate and up fused, `[.., 2H]`; "down")."""
  h = gemm(xs, group_sizes, "up")
  gate, lin = jnp.split(h, 2, axis=-1)
  return gemm(jax.nn.silu(gate) * lin, group_sizes, "down")


# ----------------------------------------------------------------------------
# The layer's forward pass, one device or expert parallel.
# ----------------------------------------------------------------------------


def _experts(xs, group_sizes, weights, keys, gemms, first_expert=0,
             aligned=GROUP_ALIGN):
  """SwiGLU experts on sorted copies with the stacked `weights` (each group
  padded to `aligned` rows): `gemms["up"]`, `gemms["down"]` are the
  projections' grouped GEMMs, `gemm(x, w, group_sizes, *, key,
  first_expert, aligned)` (the layers' `nvfp4_jax.flax.moe.ExpertGemm`)."""
  return swiglu_experts(xs, group_sizes, lambda x, gs, n: gemms[n](
      x, weights[n], gs, key=keys[n], first_expert=first_expert,
      aligned=aligned))


def _local_experts(x, routing: Routing, top_k: int, weights, keys, gemms):
  """Every expert here on `x`'s routed copies (the padded layout): `(y,
  aux loss)`."""
  lay = layout(routing, top_k)
  out = _experts(dispatch(x, routing, top_k, lay), lay.group_sizes, weights,
                 keys, gemms)
  return combine(out, routing, top_k, lay), routing.aux_loss


def moe_forward(x, router, weights, keys, gemms, *, top_k: int,
                capacity_factor: float | None):
  """The MoE layer on tokens `x [T, D]`: `(y [T, D], aux loss)`.

  Without `mesh_rules` (or with mesh rules whose batch axes are all of
  size 1) every expert runs here, on the whole (XLA-partitioned) arrays.
  With batch axes (`data`, `fsdp`) and no `expert` axis, each token shard
  routes its own tokens to its own copy of the experts inside `shard_map`
  (a data-parallel micro-batch's numerics: each expert quantizes the
  shard's copies), so no token crosses devices; XLA partitioning the
  whole-batch sort and gathers instead all-reduced every layer's `[T k, D]`
  copies (2069 MiB a `moe-small` step on two devices against 149 now,
  compiled ahead of time). With an `expert` axis of
  `n` devices it runs expert parallel inside `shard_map`: each device routes
  its tokens, sends each copy to the device holding its expert
  (all-to-all), runs its `E / n` experts on the copies it receives (from
  every device of its expert group, in token order) and sends the outputs
  back. An expert then sees exactly the copies it sees on one device, in
  the same order, so its quantization is one device's bit for bit (amax,
  SR positions). `EXCHANGE` chooses how the copies move, and
  `EXCHANGE_SLACK` how large the buffered exchange's buffers are when the
  routing fits them (else every copy a peer could send: dropless, `n x
  T_local * k` rows); the passes over the received rows (the padded layout
  and back) are that long.
  """
  rules = current_rules()
  n = 1 if rules is None or rules.expert is None else rules.sizes[
      rules.expert]
  if rules is None or (n == 1 and spmd.num_shards(rules.sizes,
                                                  rules.batch) == 1):
    routing = route(router_logits(x, router), top_k, capacity_factor)
    return _local_experts(x, routing, top_k, weights, keys, gemms)
  num_experts = router.shape[1]
  if num_experts % n:
    raise ValueError(
        f"MoE layer: {num_experts} experts do not split over the "
        f"{rules.expert!r} mesh axis of {n} devices; use a number of "
        f"experts divisible by {n}.")
  tokens = rules.batch
  local = num_experts // n
  w_spec = P(rules.expert, None, None)
  platform = rules.mesh.devices.flat[0].platform
  ragged = exchange_for(platform) == "ragged"

  def body(x, router, weights, keys):
    routing = route(router_logits(x, router), top_k, capacity_factor,
                    token_axes=tokens)
    if n == 1:  # Batch axes only: each shard's tokens go to its own experts.
      return _local_experts(x, routing, top_k, weights, keys, gemms)
    xs = dispatch(x, routing, top_k)
    rows = xs.shape[0]
    me = jax.lax.axis_index(rules.expert)
    if ragged:
      # Each local expert's copies from peer 0, then peer 1, ..., its group
      # padded to `GROUP_ALIGN` rows: the layout its grouped GEMMs take.
      length = padded_length(n * rows, local, GROUP_ALIGN)
      xc, sizes, back = _ragged_exchange(xs, routing.group_sizes, n, local,
                                         length, me, rules.expert, platform)
      out = _experts(xc, sizes, weights, keys, gemms, first_expert=me * local)
      out_xs = back(out)
    else:
      def run(cap, diff, fixed):
        return _buffered_exchange(
            diff["xs"], fixed["group_sizes"], n, local, cap, fixed["me"],
            rules.expert,
            lambda xc, sizes: _experts(xc, sizes, diff["weights"],
                                       fixed["keys"], gemms,
                                       first_expert=fixed["me"] * local))
      diff = {"xs": xs, "weights": weights}
      fixed = {"group_sizes": routing.group_sizes, "me": me, "keys": keys}
      cap = exchange_capacity(rows, n)
      if cap < rows:
        # Every device takes the same branch: the largest count any
        # device sends any peer, over every token shard.
        sent = jnp.sum(routing.group_sizes.reshape(n, local), axis=1)
        fits = jax.lax.pmax(jnp.max(sent), tokens) <= cap
        out_xs = cond_keeping_first_residuals(
            fits, lambda d, f: run(cap, d, f), lambda d, f: run(rows, d, f),
            diff, fixed)
      else:
        out_xs = run(rows, diff, fixed)
    return combine(out_xs, routing, top_k), routing.aux_loss

  tok = P(spmd.entry(tokens), None)
  return jax.shard_map(
      body, mesh=rules.mesh,
      in_specs=(tok, P(), {k: w_spec for k in weights},
                {k: P() for k in keys}),
      out_specs=(tok, P()), check_vma=False)(x, router, weights, keys)


def _ragged_exchange(xs, group_sizes, n: int, local: int, length: int, me,
                     axis: str, platform: str):
  """Expert parallelism's exchange of the copies that exist, straight into
  the receivers' padded layout: `(xc [length, D], padded group sizes,
  back)`, `back(out)` returning the experts' outputs to the copies' places
  in `xs`.

  `xs` holds this device's copies sorted by (global) expert, `group_sizes`
  `[E]` of them per expert; expert `e` lives on device `e // local`. Every
  device learns every device's counts (an all-gather of `[E]` integers),
  so each computes every receiver's layout: one ragged all-to-all slice per
  expert, from the expert's rows in `xs` to their rows in the receiver's
  padded layout (after the copies of the devices before it), and back. No
  row is gathered or scattered on either side.
  """
  counts = jax.lax.all_gather(group_sizes.astype(jnp.int32), axis)  # [n, E]
  totals = jnp.sum(counts, axis=0).reshape(n, local)
  padded, first = jax.vmap(lambda t: group_starts(t, GROUP_ALIGN))(totals)
  first = first.reshape(-1)                    # [E], in the owner's layout.
  before = jnp.cumsum(counts, axis=0) - counts           # Earlier devices'.
  starts = jnp.cumsum(counts, axis=1) - counts           # In each `xs`.
  mine = me * local + jnp.arange(local, dtype=jnp.int32)
  from_each = jnp.take(counts, mine, axis=1).reshape(-1)     # [n * local]
  d = xs.shape[1]
  xc = ragged_all_to_all(
      xs, jnp.zeros((length, d), xs.dtype), starts[me], counts[me],
      first + before[me], from_each, axis, platform)

  def back(out):
    at = jnp.take(first, mine)[None, :] + jnp.take(before, mine, axis=1)
    return ragged_all_to_all(
        out, jnp.zeros((xs.shape[0], d), out.dtype), at.reshape(-1),
        from_each, jnp.take(starts, mine, axis=1).reshape(-1), counts[me],
        axis, platform)
  return xc, padded[me], back


@functools.cache
def _vjp_is_a_pytree() -> bool:
  """Whether `jax.vjp`'s function flattens to its residual arrays (a
  `tree_util.Partial`, so that it can leave a `jit`), which
  `cond_keeping_first_residuals` relies on; else it is a plain `cond`."""
  leaves = jax.tree.leaves(jax.vjp(jnp.sin, jnp.float32(1.0))[1])
  return bool(leaves) and all(hasattr(x, "dtype") for x in leaves)


def cond_keeping_first_residuals(pred, first, second, diff, fixed):
  """`lax.cond(pred, first, second, diff, fixed)`, differentiable in
  `diff`, whose forward pass keeps only `first`'s residuals: where
  `second` runs (the rare branch), the backward pass runs its forward
  again and differentiates that.

  JAX differentiates a `cond` by returning every branch's residuals from
  the forward `cond`, each branch filling the others' with zeros. For the
  buffered exchange that meant the fast branch writing zeros for all the
  whole-buffer branch's residuals (`moe-small`, two devices: six `[131136,
  704]` bf16 arrays a layer, 0.86 GiB, 161 copies moving 11.2 GiB in the
  compiled step against 0.02 GiB without the `cond`; BENCHMARKS.md,
  "Expert parallelism"). Here the forward `cond` returns `first`'s
  residuals from `first` and zeros of their shapes from `second`, and the
  residuals that are `first`'s own inputs are not returned at all.

  `fixed` (integer tables, PRNG keys) gets no cotangent. Both branches
  compute the same function, so the results are a plain `cond`'s bit for
  bit (`second`'s recomputed forward is deterministic: same inputs, same
  keys).
  """
  if not _vjp_is_a_pytree():
    return jax.lax.cond(pred, first, second, diff, fixed)
  cell = {}  # The pullback's structure, from tracing `first_res`.

  def first_res(d, f):
    out, vjp = jax.vjp(lambda d: first(d, f), d)
    # `jax.vjp`'s function is a pytree (`tree_util.Partial`), so that it
    # can pass from a custom VJP's forward pass to its backward pass (as
    # JAX's own comment on it says): its leaves are the residuals, its
    # structure the pullback.
    leaves, tree = jax.tree.flatten(vjp)
    inputs = jax.tree.leaves((d, f))
    at = [next((i for i, x in enumerate(inputs) if x is leaf), None)
          for leaf in leaves]
    cell["tree"], cell["at"] = tree, at
    return out, [leaf for leaf, i in zip(leaves, at) if i is None]

  @jax.custom_vjp
  def run(pred, d, f):
    return jax.lax.cond(pred, first, second, d, f)

  def fwd(pred, d, f):
    shapes = jax.eval_shape(first_res, d, f)[1]

    def second_res(d, f):
      return second(d, f), [jnp.zeros(s.shape, s.dtype) for s in shapes]
    out, kept = jax.lax.cond(pred, first_res, second_res, d, f)
    return out, (pred, d, f, kept)

  def bwd(res, ct):
    pred, d, f, kept = res
    tree, at = cell["tree"], cell["at"]
    inputs = jax.tree.leaves((d, f))
    kept = iter(kept)
    leaves = [next(kept) if i is None else inputs[i] for i in at]
    pullback = lambda: tree.unflatten(leaves)(ct)[0]
    again = lambda: jax.vjp(lambda d: second(d, f), d)[1](ct)[0]
    return None, jax.lax.cond(pred, pullback, again), None

  run.defvjp(fwd, bwd)
  return run(pred, diff, fixed)


def exchange_capacity(rows: int, n: int) -> int:
  """Rows per peer of the buffered exchange's fast path: `EXCHANGE_SLACK`
  times an even share of a device's `rows` copies (`rows` itself where
  that is no smaller, or `EXCHANGE_SLACK` is None)."""
  if EXCHANGE_SLACK is None:
    return rows
  if not EXCHANGE_SLACK > 0:
    raise ValueError(
        f"nvfp4_jax.training.moe.EXCHANGE_SLACK = {EXCHANGE_SLACK!r}: use a "
        "positive number (1.25: a quarter above an even share) or None.")
  return min(rows, max(1, math.ceil(rows / n * EXCHANGE_SLACK)))


def _buffered_exchange(xs, group_sizes, n: int, local: int, cap: int, me,
                       axis: str, experts):
  """Expert parallelism's exchange of whole buffers (`EXCHANGE`
  "buffered", the default on GPUs): each peer gets `[cap, D]` rows (at
  least the copies this device sends it: the caller checks), through
  `all_to_all`, then a gather into the padded layout; `experts(xc, sizes)`
  runs there. The outputs of the copies in `xs`' places."""
  rows = xs.shape[0]
  length = padded_length(n * cap, local, GROUP_ALIGN)
  # Copies to each peer: its experts' groups, contiguous in `xs`.
  sent = group_sizes.reshape(n, local)
  count = jnp.sum(sent, axis=1)
  start = jnp.cumsum(count) - count
  got = jax.lax.all_to_all(sent, axis, 0, 0)                 # [n, local]
  j = jnp.arange(cap, dtype=jnp.int32)
  src = start[:, None] + j[None, :]                           # [n, cap]
  valid = j[None, :] < count[:, None]
  # Every exchange is a gather both ways (`permute`): XLA's row scatters
  # are slow on a GPU.
  dst = jnp.where(valid, src, rows).reshape(-1)      # Sent row -> copy.
  sent_at = _inverse(dst, rows)                      # Copy -> sent row.
  send = permute(xs, dst, sent_at).reshape(n, cap, -1)
  recv = jax.lax.all_to_all(send, axis, 0, 0).reshape(n * cap, -1)
  sizes, first = group_starts(jnp.sum(got, axis=0), GROUP_ALIGN)
  before = jnp.cumsum(got, axis=0) - got                      # [n, local]
  starts = jnp.cumsum(got, axis=1) - got                      # [n, local]
  e = jax.vmap(lambda g: jnp.searchsorted(jnp.cumsum(g), j,
                                          side="right"))(got)
  ok = e < local
  e = jnp.minimum(e, local - 1)
  take = lambda a: jnp.take_along_axis(a, e, axis=1)
  dest = jnp.where(ok, first[e] + take(before) + j[None, :] - take(starts),
                   length).reshape(-1)              # Received row -> row.
  row_of = _inverse(dest, length)                   # Row -> received row.
  xc = permute(recv, row_of, dest)
  back = permute(experts(xc, sizes), dest, row_of)
  ret = jax.lax.all_to_all(back.reshape(n, cap, -1), axis, 0, 0)
  return permute(ret.reshape(n * cap, -1), sent_at, dst)


# How expert parallelism exchanges the token copies between devices:
# - "ragged": only the copies that exist (`jax.lax.ragged_all_to_all`),
#   one slice per expert straight into the receiver's padded layout;
# - "buffered": `jax.lax.all_to_all` of fixed-size buffers per peer
#   (`EXCHANGE_SLACK` times an even share of the copies where the routing
#   fits, else every copy a device could send each peer: then twice the
#   bytes that exist on two devices), then row gathers into the padded
#   layout;
# - "auto": "buffered" on GPUs, "ragged" elsewhere (TPUs have the ragged
#   collective; CPU devices build it from an all-gather).
# Why not "ragged" on GPUs: on one host, jax 0.11.2's XLA runs the ragged
# all-to-all as a peer-copy kernel (`RaggedAllToAllKernelImpl`) that moved
# `moe-small`'s exchange at ~10 GB/s (105 ms a step on 2 H100s: 0.17 of
# one GPU's throughput per GPU, against 0.55 buffered; BENCHMARKS.md,
# "Expert parallelism"); its NCCL form
# (`--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false
# --xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true`) hung,
# and `--xla_gpu_experimental_ragged_all_to_all_use_device_kernel=true`
# left the same kernel. Set "ragged" where XLA's collective is fast.
EXCHANGE = "auto"
_EXCHANGES = ("auto", "ragged", "buffered")
# The buffered exchange's fast path, opt-in: with a number (1.25: a
# quarter above an even share), each device sends each peer a buffer of
# `EXCHANGE_SLACK` times an even share of its copies (`T_local k / n`),
# and the experts run on `n` such buffers, when no device sends any peer
# more (checked on every device: a `cond` on the largest count, one
# `pmax`); otherwise the whole-buffer exchange runs. Balanced routing
# moves and computes on `slack / n` of the whole buffers. The `cond`
# keeps only the fast path's residuals (`cond_keeping_first_residuals`):
# the whole-buffer branch runs its forward again in the backward pass.
# None (the default): always whole buffers, no `cond`. Why not on by
# default: XLA:GPU runs each conditional by blocking the host on its
# predicate (two a MoE layer and step), and the one timed run of the fast
# path (before its residuals were fixed) was slower than whole buffers
# (BENCHMARKS.md, "Expert parallelism"). `EXCHANGE` and `EXCHANGE_SLACK`
# are read while tracing: set them before a step is first traced (JAX
# reuses its traces; `jax.clear_caches()` after a change).
EXCHANGE_SLACK = None


def exchange_for(platform: str) -> str:
  """The exchange `EXCHANGE` selects on devices of `platform` ("gpu",
  "cuda", "rocm", "tpu", "cpu"): "ragged" or "buffered"."""
  if EXCHANGE not in _EXCHANGES:
    raise ValueError(
        f"nvfp4_jax.training.moe.EXCHANGE = {EXCHANGE!r}: use one of "
        f"{', '.join(map(repr, _EXCHANGES))}.")
  if EXCHANGE != "auto":
    return EXCHANGE
  return "buffered" if platform in ("gpu", "cuda", "rocm") else "ragged"


def ragged_all_to_all(operand, output, input_offsets, send_sizes,
                      output_offsets, recv_sizes, axis_name: str,
                      platform: str):
  """`jax.lax.ragged_all_to_all` over `axis_name` (inside `shard_map`):
  slice `i` (rows `[input_offsets[i], + send_sizes[i])` of `operand`) to
  device `i // per` (`per` slices per device), at row `output_offsets[i]`
  of its `output`; `recv_sizes` are the sizes of the slices received, in
  the same order; rows nobody writes keep `output`'s.

  XLA:CPU has no ragged all-to-all: there (`platform` "cpu") the same
  result is built from an all-gather of every device's rows and
  placements, a gather per output row (what tests on CPU devices run; a
  GPU runs the collective itself).
  """
  if platform != "cpu":
    return jax.lax.ragged_all_to_all(
        operand, output, input_offsets, send_sizes, output_offsets,
        recv_sizes, axis_name=axis_name)
  del recv_sizes  # Implied by the senders' sizes.
  me = jax.lax.axis_index(axis_name)
  n = jax.lax.axis_size(axis_name)
  per = input_offsets.shape[0] // n                 # Slices per receiver.
  gather = lambda a: jax.lax.all_gather(a, axis_name)
  ops = gather(operand)                             # [n, R, D]
  # The slices every device sends this one: `[n (from), per]`.
  mine = lambda a: jax.lax.dynamic_slice_in_dim(gather(a), me * per, per,
                                                axis=1)
  offs, sizes, lo = mine(input_offsets), mine(send_sizes), mine(
      output_offsets)
  src = jnp.repeat(jnp.arange(n, dtype=jnp.int32), per)
  offs, sizes, lo = offs.reshape(-1), sizes.reshape(-1), lo.reshape(-1)
  r = jnp.arange(output.shape[0], dtype=jnp.int32)
  hit = (r[None, :] >= lo[:, None]) & (r[None, :] < (lo + sizes)[:, None])
  c = jnp.argmax(hit, axis=0)
  row = jnp.clip(offs[c] + r - lo[c], 0, operand.shape[0] - 1)
  return jnp.where(jnp.any(hit, axis=0)[:, None], ops[src[c], row], output)


def _inverse(index: jax.Array, length: int) -> jax.Array:
  """The inverse of a one-to-one row map `index` (`[n]`, entries past
  `length` for no row): `[length]`, the source of each row, `n` for none.
  An integer scatter of `n` indices (the rows themselves are gathered)."""
  n = index.shape[0]
  return jnp.full((length,), n, jnp.int32).at[index].set(
      jnp.arange(n, dtype=jnp.int32), mode="drop")


def whole(a: jax.Array):
  """Under sharding in types (Explicit mesh axes), `a` replicated, and a
  function that gives a result `a`'s sharding back; else `a` as it is.

  The routing sorts every token of the layer, and each expert is quantized
  from all of its tokens, so under Explicit axes the layer runs on the whole
  arrays (its tokens gathered): the one-device result. Expert parallelism
  runs under `mesh_rules` with an `expert` axis (`moe_forward`).
  """
  if explicit_mesh(a) is None:
    return a, lambda y: y
  spec = jax.typeof(a).sharding.spec
  return jax.sharding.reshard(a, P()), lambda y: jax.sharding.reshard(y,
                                                                      spec)


def check_moe(num_experts: int, top_k: int, capacity_factor, path: str
              ) -> None:
  """A clear error for a configuration the MoE layer cannot run."""
  where = f"MoE layer {path or '<root>'!r}: "
  if not isinstance(num_experts, int) or num_experts < 1:
    raise ValueError(f"{where}num_experts must be a positive int, got "
                     f"{num_experts!r}.")
  if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
    raise ValueError(f"{where}top_k must be an int in [1, num_experts="
                     f"{num_experts}], got {top_k!r}.")
  if capacity_factor is not None and not capacity_factor > 0:
    raise ValueError(f"{where}capacity_factor must be positive or None "
                     f"(dropless), got {capacity_factor!r}.")
