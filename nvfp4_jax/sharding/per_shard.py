"""How a linear layer's GEMMs run on one device's shard: the strategies
`dot_general`'s forward and backward passes take.

The same per-shard code runs the whole layer (`WHOLE`: whole tensors, no
collectives) and one device's part of a sharded one (`Shard`, inside
`jax.shard_map`, from the layer's `LinearSharding`): where each shard sits
(its stochastic-rounding placement), the mesh axes each tensor's amax
reduces over, the FSDP weight gathered quantized, row-parallel outputs and
column-parallel input gradients summed across `model` in FP32, sequence
parallelism's gathers and reduce-scatters (by rings beside the GEMM under
`collective_matmul`), and the weight gradient reduce-scattered across
`fsdp` and summed across the other batch axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax.core import spmd
from nvfp4_jax.sharding.mesh import LinearSharding


class Whole:
  """The unsharded layer: whole tensors, no collectives."""

  x_axes = y_axes = w_axes = ()
  reduces_y = reduces_dx = False
  # Sequence parallelism: X gathered (column-parallel), dY gathered and Y
  # reduce-scattered (row-parallel), over `model`.
  gathers_x = scatters_y = False
  f32_sums = True

  def y_dtype(self, out_dtype):
    """The dtype Fprop's GEMM writes: FP32 where the shards' partial sums
    add up in FP32 (one rounding after the sum, as the whole GEMM)."""
    return jnp.float32 if self.reduces_y and self.f32_sums else out_dtype

  def dx_dtype(self, out_dtype):
    """The same for Dgrad's GEMM."""
    return jnp.float32 if self.reduces_dx and self.f32_sums else out_dtype

  # The dtype Wgrad's GEMM writes: FP32, unless the weight gradient is
  # summed across token shards in bf16 (`LinearSharding.wgrad_sums`).
  dw_dtype = jnp.float32
  # Every device holds the whole weight (no axis splits it; the tokens may
  # be split): the weight's quantization needs no collective.
  whole_w = True

  def place_x(self, x):
    del x

  place_y = place_w = place_x

  def gather_w(self, q, transposed: bool):
    del transposed
    return q

  def gather_x(self, q, axis: int):
    del axis
    return q

  gather_dy = gather_x

  def sum_y(self, y):
    return y

  sum_dx = sum_y

  def fprop_product(self, mm, a):
    """Fprop's product `mm(a)` (`a`: X or its quantized operand, rows are
    tokens), gathered and summed across shards as the layer is split."""
    return mm(a)

  dgrad_product = fprop_product  # The same for Dgrad's `mm(dY)`.

  def sum_dw(self, dx, dw):
    return dx, dw


WHOLE = Whole()


class Shard(Whole):
  """One device's part of a sharded layer, inside `shard_map`: where its
  shards sit, the mesh axes that split each tensor, and the collectives."""

  def __init__(self, s: LinearSharding):
    self.s = s
    # The axes X's and dY's amaxes reduce over (`LinearSharding.amax`).
    scope = ((lambda axes: tuple(a for a in axes if a not in s.tokens))
             if s.amax == "local" else tuple)
    self.x_axes = scope(spmd.spec_axes(s.x_spec))
    self.y_axes = scope(spmd.spec_axes(s.y_spec))
    self.w_axes = spmd.spec_axes(s.kernel_spec)
    self.whole_w = spmd.num_shards(s.sizes, self.w_axes) == 1
    self.reduces_y = bool(s.k_axes)
    self.reduces_dx = bool(s.n_axes)
    self.gathers_x, self.scatters_y = s.gathers_x, s.scatters_y
    self.f32_sums = s.partial_sums == "float32"
    if (s.wgrad_sums == "bfloat16"
        and spmd.num_shards(s.sizes, s.tokens) > 1):
      # Each shard's gradient rounded once, by the GEMM's epilogue.
      self.dw_dtype = jnp.bfloat16

  def place_x(self, x):
    return spmd.placement(self.s.x_spec, x.shape)

  def place_y(self, y):
    return spmd.placement(self.s.y_spec, y.shape)

  def place_w(self, w):
    return spmd.placement(self.s.kernel_spec, w.shape)

  def gather_w(self, q, transposed: bool):
    """The weight in use from its stored shard (quantized or not), along
    the dimension `fsdp` splits; `transposed`: `q` is `[out, in]`."""
    axis = 1 - self.s.fsdp_dim if transposed else self.s.fsdp_dim
    return spmd.all_gather(q, self.s.fsdp, axis)

  def gather_x(self, q, axis: int):
    """X (quantized or not) over all tokens from this device's token shard
    (a column-parallel layer under sequence parallelism; `axis`: the tokens'
    dimension of `q`)."""
    return self._gather_tokens(q, axis, self.gathers_x)

  def gather_dy(self, q, axis: int):
    """dY the same way (a row-parallel layer under sequence parallelism)."""
    return self._gather_tokens(q, axis, self.scatters_y)

  def _gather_tokens(self, q, axis: int, split: bool):
    if q is None or not split:  # None: an operand in BF16.
      return q
    return spmd.all_gather(q, self.s.model, axis)

  def sum_y(self, y):
    """Row-parallel: Y's partial sums over `in`, all-reduced or (sequence
    parallelism) reduce-scattered into token shards."""
    return self._sum(y, self.s.k_axes, self.scatters_y)

  def sum_dx(self, dx):
    """Column-parallel: dX's partial sums over `out`, the same way."""
    return self._sum(dx, self.s.n_axes, self.gathers_x)

  def _sum(self, a, axes, scatter: bool):
    if scatter:
      return jax.lax.psum_scatter(a, self.s.model, scatter_dimension=0,
                                  tiled=True)
    return jax.lax.psum(a, axes) if axes else a

  def fprop_product(self, mm, a):
    # Column-parallel: X split by tokens over `model`; row-parallel: Y's
    # partial sums leave split by tokens.
    return self._product(mm, a, self.gathers_x, self.scatters_y, self.sum_y)

  def dgrad_product(self, mm, a):
    # Row-parallel: dY split by tokens; column-parallel: dX's sums split.
    return self._product(mm, a, self.scatters_y, self.gathers_x, self.sum_dx)

  def _product(self, mm, a, a_split: bool, out_split: bool, total):
    """`mm(a)` with `a`'s rows gathered over `model` (`a_split`), or its
    partial sums reduce-scattered over `model` (`out_split`), by rings
    beside the GEMM under `collective_matmul`; otherwise `total(mm(a))`."""
    ring = self.s.collective_matmul
    if a_split:
      return (self._ring_gather(mm, a) if ring
              else mm(self._gather_tokens(a, 0, True)))
    if out_split and ring:
      return self._ring_scatter(mm, a)
    return total(mm(a))

  def _ring_gather(self, mm, a):
    """`mm` of all tokens' rows of `a` (this device holds its own shard
    over `model`), in shard order: each step multiplies the chunk at hand
    while the next travels one device on."""
    axis, n = self.s.model, self.s.sizes[self.s.model]
    me = jax.lax.axis_index(axis)
    outs, chunk = [], a
    for i in range(n):
      nxt = (spmd.ppermute(chunk, axis, [(j, (j + 1) % n) for j in range(n)])
             if i < n - 1 else None)
      outs.append(mm(chunk))  # The rows of shard (me - i) mod n.
      chunk = nxt
    order = (me - jnp.arange(n)) % n
    y = jnp.stack(outs)[order]
    return y.reshape(n * y.shape[1], *y.shape[2:])

  def _ring_scatter(self, mm, a):
    """This device's token shard of `mm(a)` summed over `model` (a
    reduce-scatter along the rows): at step `i` each device adds its
    partial product for the chunk of shard `(me + i + 1) mod n` to the sum
    it received, and sends it one device back; the last step's chunk is
    its own."""
    axis, n = self.s.model, self.s.sizes[self.s.model]
    me = jax.lax.axis_index(axis)
    rows = a.shape[0] // n
    acc = None
    for i in range(n):
      part = mm(spmd.slice_rows(a, ((me + i + 1) % n) * rows, rows))
      acc = part if acc is None else acc + part
      if i < n - 1:
        acc = jax.lax.ppermute(acc, axis, [(j, (j - 1) % n) for j in range(n)])
    return acc

  def sum_dw(self, dx, dw):
    """`(dx, dw)` with the weight gradient summed over the token shards:
    reduce-scattered into the stored shard across `fsdp`, all-reduced
    across the other axes (in `dw`'s dtype: `dw_dtype`).

    Under FSDP with `wgrad_schedule="layer"` the reduce-scattered shard is
    tied to `dx` by an optimization barrier: the layers below cannot start
    their backward pass before it exists, so this layer's Wgrad GEMM and
    reduce-scatter run in its turn and its activations are freed there.
    The all-reduce over the other token axes (`data`) comes after the
    barrier, free to overlap the layers below: its operand is already the
    small shard, so holding it costs what the sharded gradient does."""
    s = self.s
    if s.fsdp is not None:
      dw = jax.lax.psum_scatter(dw, s.fsdp, scatter_dimension=s.fsdp_dim,
                                tiled=True)
      if s.ties_wgrad:
        dx, dw = jax.lax.optimization_barrier((dx, dw))
    rest = tuple(a for a in s.tokens if a != s.fsdp)
    return dx, (jax.lax.psum(dw, rest) if rest else dw)
