"""Expert parallelism's exchange of the token copies between the devices of
an `expert` mesh axis (inside `shard_map`), both ways: "ragged" (the copies
that exist, `jax.lax.ragged_all_to_all`, straight into the receivers' padded
layout) and "buffered" (fixed-size buffers per peer through
`jax.lax.all_to_all`, then row gathers), and the `cond` that picks the
buffered exchange's small buffers when the routing fits them without
keeping the other branch's residuals. Which one runs is the layer's choice
(`nvfp4_jax.training.moe.EXCHANGE`, `EXCHANGE_SLACK`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nvfp4_jax.ops.ragged_quantize.api import padded_length
from nvfp4_jax.training.moe_routing import GROUP_ALIGN
from nvfp4_jax.training.moe_routing import group_starts
from nvfp4_jax.training.moe_routing import inverse_map
from nvfp4_jax.training.moe_routing import permute


def ragged_exchange(xs, group_sizes, n: int, local: int, length: int, me,
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


def buffered_exchange(xs, group_sizes, n: int, local: int, cap: int, me,
                       axis: str, experts):
  """Expert parallelism's exchange of whole buffers (`EXCHANGE`
  "buffered" in `nvfp4_jax.training.moe`, the default on GPUs): each peer gets `[cap, D]` rows (at
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
  sent_at = inverse_map(dst, rows)                      # Copy -> sent row.
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
  row_of = inverse_map(dest, length)                   # Row -> received row.
  xc = permute(recv, row_of, dest)
  back = permute(experts(xc, sizes), dest, row_of)
  ret = jax.lax.all_to_all(back.reshape(n, cap, -1), axis, 0, 0)
  return permute(ret.reshape(n * cap, -1), sent_at, dst)


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
