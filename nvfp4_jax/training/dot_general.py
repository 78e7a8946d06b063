"""`dot_general` with the NVFP4 training recipe: a `jax.custom_vjp` over 3 GEMMs.

The forward pass runs Fprop; the backward pass runs Dgrad and Wgrad; each GEMM
quantizes its two operands as the `Recipe` says and multiplies them with the
block-scaled GEMM (`block_scaled_matmul`: FP32 accumulation, tensor scales
applied as one FP32 `alpha`).

Residuals are saved quantized: the Wgrad operand `q(rht(X^T))` (0.5625 bytes
per element instead of 2 for bf16 X) and the quantized weight, so the
activation memory of a linear layer drops by ~3.5x. With
`Recipe(residuals="values")` the emulation saves them as their bf16 block
values instead (`_saves_values`): the same numbers, no dequantize pass in the
backward pass, and the activation memory of bf16. Both are decided once per
layer call by the GEMM op (`gemm_plan`, from the platform): where the GEMM
is the exact emulation (Hopper, CPU), the operands used at
once (Fprop's X, Dgrad's dY, Wgrad's `rht(dY^T)`) come from their quantizer
as `NVFP4Values`, the bf16 block values the GEMM multiplies, so no
dequantize pass runs between; the numbers are those of the codes. The
16x16-scaled weight is quantized once in its `[in, out]` layout there: one
pass writes Dgrad's codes (saved) and the values Fprop multiplies
(`_weight_in_kernel_layout`).

Layout. The kernel is flax's `[in, out]`; in TE's terms `W = kernel^T`:
Fprop `Y = X @ W^T = bsm(q(X), q(kernel^T))`, Dgrad `dX = dY @ W =
bsm(q(dY), q(kernel))`, Wgrad `dkernel = X^T @ dY = bsm(q(rht(X^T)),
q(rht(dY^T)))`, where `bsm(a, b) = a @ b^T` over the quantized axis.

On a device mesh (`nvfp4_jax.sharding`: a `LinearSharding` per layer) the
forward and backward passes each run per shard inside `jax.shard_map`, the
same code with explicit collectives: quantizers reduce their amax across the
axes that split their tensor and take the shard's stochastic-rounding bytes
at its global offset (the whole tensor's bytes), the FSDP weight is gathered
quantized, row-parallel outputs and column-parallel input gradients are
summed across `model` in FP32, and the weight gradient is reduce-scattered
across `fsdp` and summed across the other batch axes.

Under a mesh the library did not make, with JAX's sharding in types
(`jax.set_mesh` with Explicit axes), the operands' types say how the layer
is split (`sharding.linear_sharding_for`): the same per-shard computation,
with reshapes that carry their `out_sharding` and a result of a sharded
type. In auto mode (`jax.jit` shardings) XLA partitions the op as the rest
of the program, and its Pallas kernels (quantizers, block values, the
GEMMs) run per shard through `custom_partitioning`
(`core.spmd.blockwise`: amax reduced over the axes that split each tensor,
stochastic rounding at the shard's offset, so the quantized operands are
the whole tensor's; `core.spmd.matmul_per_shard`); the library's
`MeshRules` (any axis names) run the whole layer per shard there too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from jax.sharding import AbstractMesh
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax.core import dispatch
from nvfp4_jax.core import numerics as nm
from nvfp4_jax import parallel as sharding_lib
from nvfp4_jax.core import spmd
from nvfp4_jax.ops.quantize.api import block_size
from nvfp4_jax.ops.quantize.api import quantize_operand
from nvfp4_jax.ops.quantize_pair.api import quantize_pair
from nvfp4_jax.ops.quantize.api import quantize_with_values
from nvfp4_jax.ops.block_scaled_matmul.api import block_scaled_matmul
from nvfp4_jax.ops.block_scaled_matmul.api import block_values_matmul
from nvfp4_jax.ops.block_scaled_matmul.api import GemmPlan
from nvfp4_jax.ops.block_scaled_matmul.api import gemm_plan
from nvfp4_jax.ops.block_scaled_matmul.reference import gemm_alpha
from nvfp4_jax.core.arrays import NVFP4Values
from nvfp4_jax.core.recipe import Recipe
from nvfp4_jax.core.recipe import as_recipe
from nvfp4_jax.parallel import LinearSharding


RESIDUAL_NAME = "nvfp4_residual"


def remat_policy():
  """A `jax.checkpoint` policy that saves only the quantized residuals.

  Inside a rematerialized block (`jax.checkpoint(..., policy=remat_policy())`
  or `nn.remat(Block, policy=...)`) the backward pass keeps the NVFP4
  layers' quantized Wgrad operands and weights (4.5 bits per element) and
  recomputes everything else from the block's input.
  """
  return jax.checkpoint_policies.save_only_these_names(RESIDUAL_NAME)


def _residual(tree):
  """Names the leaves of a quantized residual for `remat_policy`."""
  return jax.tree.map(lambda a: checkpoint_name(a, RESIDUAL_NAME), tree)


def _named(name: str, fn: Callable) -> Callable:
  """Jits `fn` under `name`, so each GEMM is a named region of the jaxpr."""
  fn.__name__ = fn.__qualname__ = name
  return jax.jit(fn)


def _hp_matmul(a, b, dtype, precision):
  return jax.lax.dot_general(a.astype(dtype), b.astype(dtype),
                             (((1,), (0,)), ((), ())), precision=precision)


def _check_dims(recipe: Recipe, gemm: str, dims, name: str) -> None:
  """Raises a ValueError naming a dimension the quantized `gemm` cannot block."""
  fmt = recipe.gemm_format(gemm)
  if fmt == "bf16":
    return
  b = block_size(fmt)
  for size, what in dims:
    if size % b:
      raise ValueError(
          f"{name}{gemm} GEMM in {fmt}: the {what} is {size}, not a multiple "
          f"of {b}; pad it to {-(-size // b) * b} or keep this layer in bf16 "
          f"with a precision rule.")


def _weight_dims(recipe: Recipe, op: str, k: int, n: int, name: str) -> None:
  if getattr(recipe, op).block_2d and (k % nm.NVFP4_BLOCK or n % nm.NVFP4_BLOCK):
    raise ValueError(
        f"{name}16x16 weight scaling needs both weight dims to be multiples "
        f"of 16, got in={k}, out={n}; pad them or disable two_d_weights.")


def _pad_tokens(x: jax.Array, recipe: Recipe) -> jax.Array:
  """Zero rows up to the Wgrad operands' token blocking (a no-op if aligned).

  The Wgrad operands are quantized along tokens; zero tokens change neither
  their amax nor the product, and the row operand of the same tensor keeps its
  bytes (its rows are quantized independently and the SR stream's row-major
  index of every real element is unchanged), so callers slice it back.
  """
  fmt = recipe.gemm_format("wgrad")
  if fmt == "bf16":
    return x
  need = block_size(fmt)
  if recipe.wgrad_x.rht:
    need = max(need, recipe.rht_size)
  pad = -x.shape[0] % need
  return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _rows(q, n: int):
  """The first `n` rows of a quantized `[rows, K]` operand (1x16 blocks)."""
  if q is None or q.shape[0] == n:
    return q
  return jax.tree.map(lambda a: a[:n] if a.ndim else a, q)


def _pair(x, row_op, wgrad_op, recipe: Recipe, key_row, key_t,
          placement=None, amax_axes=(), values=(False, False)):
  """Both quantized operands of `x` (see `nvfp4_jax.quantize_pair`), any token
  count (a shard's tokens are aligned: `LinearSharding.check`)."""
  q_row, q_t = quantize_pair(
      _pad_tokens(x, recipe), row_op, wgrad_op, key_row=key_row, key_t=key_t,
      rht_size=recipe.rht_size, sign_vector=recipe.rht_sign_vector,
      placement=placement, amax_axes=amax_axes, values=values)
  return _rows(q_row, x.shape[0]), q_t


def _as_values(op, plan: GemmPlan) -> bool:
  """Whether operand `op`, multiplied right away (neither saved for the
  backward pass nor gathered), is best quantized straight to its bf16 block
  values: NVFP4 where the GEMM is the exact emulation (Hopper, CPU). The
  quantizer then writes the values the GEMM reads and no dequantize pass
  runs; on Blackwell's native FP4 GEMMs the codes are the operand."""
  return op.format == "nvfp4" and plan.values


class _Whole:
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


_WHOLE = _Whole()


class _Shard(_Whole):
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



def _residual_specs(shard: LinearSharding, recipe: Recipe):
  """shard_map specs of `_fprop`'s residuals: `(q(rht(X^T)) or X, the
  stored weight, its quantized transpose or None, key)`."""
  wgrad_q = recipe.gemm_format("wgrad") != "bf16"
  return (spmd.transposed(shard.x_spec) if wgrad_q else shard.x_spec,
          shard.kernel_spec, spmd.transposed(shard.kernel_spec), P())


# `plan` (the GEMM backend and the `default_implementation` in force when the
# layer was called) and `shard` are static arguments: JAX caches custom_vjp
# traces by their static arguments, and the backward pass is traced later,
# maybe outside that block.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8, 9))
def _linear(x, w, key, recipe: Recipe, precision, out_dtype, x_dtype,
            name: str, plan: GemmPlan, shard: LinearSharding | None):
  y, _ = _linear_fwd(x, w, key, recipe, precision, out_dtype, x_dtype, name,
                     plan, shard)
  return y


def _gemm(name: str, out_dtype):
  """A named block-scaled GEMM region taking quantized operands."""
  return _named(name, lambda a, b: block_scaled_matmul(a, b,
                                                       out_dtype=out_dtype))


def _linear_fwd(x, w, key, recipe: Recipe, precision, out_dtype, x_dtype,
                name, plan, shard):
  del x_dtype
  k, n = w.shape
  _check_dims(recipe, "fprop", ((k, "contraction (in) dim K"),), name)
  if recipe.gemm_format("fprop") != "bf16":
    _weight_dims(recipe, "fprop_w", k, n, name)
  with dispatch.maybe_default_implementation(plan.impl):
    if shard is None:
      return _fprop(x, w, key, recipe, precision, out_dtype, plan, _WHOLE)
    shard.check(recipe, x.shape[0], k, n, name)
    ctx = _Shard(shard)
    return spmd.shard_map(
        lambda x, w, key: _fprop(x, w, key, recipe, precision, out_dtype,
                                 plan, ctx),
        mesh=shard.mesh, in_specs=(shard.x_spec, shard.kernel_spec, P()),
        out_specs=(shard.y_spec, _residual_specs(shard, recipe)))(x, w, key)


def _fprop(x, w, key, recipe: Recipe, precision, out_dtype, plan: GemmPlan,
           ctx: _Whole):
  keys = recipe.operand_keys(key)
  wgrad_q = recipe.gemm_format("wgrad") != "bf16"
  # A sum across shards runs in FP32 and rounds once, as the whole GEMM
  # (unless `partial_sums="output"`: each shard's result rounded, summed in
  # the output dtype).
  acc_dtype = ctx.y_dtype(out_dtype)
  # Fprop's X is multiplied at once; Wgrad's q(rht(X^T)) is the residual
  # (codes: 4.5 bits per element; or its values, see `_saves_values`).
  qx, qxt = _named("nvfp4_quantize_x", lambda x, kr, kt: _pair(
      x, recipe.fprop_x, recipe.wgrad_x, recipe, kr, kt, ctx.place_x(x),
      ctx.x_axes, values=(_as_values(recipe.fprop_x, plan)
                          and not ctx.gathers_x,
                          _saves_values(recipe.wgrad_x, plan))))(
          x, keys["fprop_x"], keys["wgrad_x"])
  vw = None
  if _weight_in_kernel_layout(recipe, plan, ctx):
    # One pass over the kernel: the Dgrad operand's codes (saved) and the
    # block values Fprop multiplies as `x @ V`.
    qw, vw = _named("nvfp4_quantize_w", lambda w: quantize_with_values(
        w, block_2d=True))(w)
    # `qw_vals`: the weight's values in the kernel layout with its amax
    # (alpha needs the amax only; the codes stay out of this region).
    wop = NVFP4Values(vw, qw.amax)
    mm = lambda qx: _named("nvfp4_fprop", lambda qx, qw_vals: (
        block_values_matmul(qx.values, qw_vals.values,
                            gemm_alpha(qx, qw_vals), out_dtype=acc_dtype,
                            vb_kn=True)))(qx, wop)
  elif _weight_kernel_layout_native(recipe, plan, ctx):
    # `q(kernel)`, Dgrad's operand (saved); Fprop multiplies its transpose.
    qw = _named("nvfp4_quantize_w", lambda w, k: quantize_operand(
        w, recipe.fprop_w, k))(w, keys["fprop_w"])
    wop = qw.T
    mm = lambda qx: _gemm("nvfp4_fprop", acc_dtype)(qx, wop)
  elif recipe.fprop_x.quantized:
    # The stored weight shard is quantized (amax across its shards) and the
    # quantized bytes are gathered.
    qw = _named("nvfp4_quantize_w", lambda w, k: quantize_operand(
        w.T, recipe.fprop_w, k, placement=_t(ctx.place_w(w)),
        amax_axes=ctx.w_axes))(w, keys["fprop_w"])
    wop = ctx.gather_w(qw, True)
    mm = lambda qx: _gemm("nvfp4_fprop", acc_dtype)(qx, wop)
  else:
    qw, qx, wop = None, x, ctx.gather_w(w, False)
    mm = lambda x: _named("bf16_fprop", functools.partial(
        _hp_matmul, dtype=acc_dtype, precision=precision))(x, wop)
  # Under sequence parallelism a column-parallel layer's X is this device's
  # token shard (quantized with the tensor's amax): its rows over all
  # tokens are gathered; a row-parallel layer's Y is reduce-scattered.
  y = ctx.fprop_product(mm, qx).astype(out_dtype)
  # Dgrad's weight: with identical 16x16 settings it is Fprop's quantized W
  # (transposed, unless quantized in the kernel layout already: exactly what
  # quantizing the kernel along `out` gives); otherwise it is quantized in
  # the backward pass from `w`, alive anyway.
  reuse_w = (qw is not None and recipe.dgrad_w == recipe.fprop_w
             and recipe.fprop_w.block_2d)
  if vw is not None and _saves_values(recipe.dgrad_w, plan):
    # `vw` (the kernel-layout pass, which implies `reuse_w`) are `qw`'s
    # block values in its own `[in, out]` layout: Dgrad's operand as it is.
    qw = NVFP4Values(vw, qw.amax, four_over_six=qw.four_over_six)
  return y, (_residual(qxt) if wgrad_q else x, w,
             _residual(qw) if reuse_w else None, key)


def _saves_values(op, plan: GemmPlan) -> bool:
  """Whether the residual of operand `op` is saved as its block values.

  `Recipe(residuals="values")` where the backward GEMM is the exact
  emulation (`plan.residuals`, resolved by `gemm_plan`) and `op` is NVFP4: the bf16 block values the
  GEMM multiplies, 2 bytes per element against 0.5625 for codes and scales,
  and no dequantize pass before Wgrad (X's operand) and Dgrad (the weight,
  where it is Fprop's quantized in the kernel layout). The numbers are
  those of the codes.
  """
  return plan.residuals == "values" and _as_values(op, plan)


def _weight_in_kernel_layout(recipe: Recipe, plan: GemmPlan,
                             ctx: _Whole) -> bool:
  """Whether the weight is quantized once, in flax's `[in, out]` layout.

  16x16 tiles are symmetric: the kernel quantized in 16x16 tiles along `out`
  is the Dgrad operand `q(kernel)` itself, and its transpose is Fprop's
  `q(kernel^T)`, code for code (the same tiles, amax and scales). Where the
  GEMM is the exact emulation, one kernel then writes the Dgrad operand's
  codes (the residual) and the block values Fprop multiplies as `x @ V`:
  no transpose of the weight or of its codes, and no dequantize pass in
  Fprop. It needs round-to-nearest (a stochastic stream runs over one
  layout's row-major order), no Four-over-Six (its per-tile choice sums
  errors in one layout's order), Dgrad reusing Fprop's weight, and the
  whole weight on the device (a shard gathers codes, not values; data
  parallelism holds it whole).
  """
  w = recipe.fprop_w
  return (ctx.whole_w and not ctx.gathers_x and _as_values(w, plan)
          and _as_values(recipe.fprop_x, plan)
          and w.block_2d and w.rounding == "nearest" and not w.four_over_six
          and recipe.dgrad_w == w)


# Whether native FP4 plans quantize the weight in flax's `[in, out]` layout
# (`_weight_kernel_layout_native`); a switch for tests and benchmarks.
NATIVE_KERNEL_LAYOUT = True


def _weight_kernel_layout_native(recipe: Recipe, plan: GemmPlan,
                                 ctx: _Whole) -> bool:
  """Whether a native FP4 GEMM's weight is quantized once as it is stored.

  The kernel quantized in 16x16 tiles along `out` is Dgrad's operand
  `q(kernel)` as it is, and its transpose is Fprop's `q(kernel^T)` code for
  code (`NVFP4Array.T`): no FP32 transpose of the weight before the
  quantizer, and none of the codes in the backward pass (the one transpose
  of the codes is Fprop's). Same conditions as `_weight_in_kernel_layout`,
  where the GEMM multiplies codes instead of block values.
  """
  w = recipe.fprop_w
  return (NATIVE_KERNEL_LAYOUT and ctx.whole_w
          and recipe.fprop_x.quantized and w.format == "nvfp4"
          and not _as_values(w, plan)
          and w.block_2d and w.rounding == "nearest" and not w.four_over_six
          and recipe.dgrad_w == w)


def _t(placement):
  return None if placement is None else placement.T


def _linear_bwd(recipe: Recipe, precision, out_dtype, x_dtype, name, plan,
                shard, res, dy):
  _, w, qw_fprop, key = res
  k, n = w.shape
  dgrad_q = recipe.gemm_format("dgrad") != "bf16"
  _check_dims(recipe, "dgrad", ((n, "output dim N"),), name)
  if dgrad_q and qw_fprop is None:
    _weight_dims(recipe, "dgrad_w", k, n, name)
  if recipe.needs_key and key is None:
    raise ValueError(
        f"{name}this recipe uses stochastic rounding in the backward pass but "
        f"no key was given: pass key= to nvfp4_jax.dot_general, or "
        f"rngs={{'nvfp4': key}} to the NVFP4 layer's apply (a new key every "
        f"step).")
  with dispatch.maybe_default_implementation(plan.impl):
    if shard is None:
      dx, dw = _backward(recipe, precision, out_dtype, x_dtype, res, dy,
                         plan, _WHOLE)
    else:
      ctx = _Shard(shard)
      dx, dw = spmd.shard_map(
          lambda res, dy: _backward(recipe, precision, out_dtype, x_dtype,
                                    res, dy, plan, ctx),
          mesh=shard.mesh,
          in_specs=(_residual_specs(shard, recipe), shard.y_spec),
          out_specs=(shard.x_spec, shard.kernel_spec))(res, dy)
  return dx.astype(x_dtype), dw.astype(w.dtype), None


def _ordered_wgrad(dx, dw, shard: LinearSharding | None):
  """`(dx, dw)` of a high-precision layer's product, tied by an
  optimization barrier under FSDP with `wgrad_schedule="layer"`: the
  layers below cannot start their backward pass before this layer's
  weight gradient exists, so its GEMM (and its reduce-scatter, issued
  right after it) runs in this layer's turn. (The quantized layers tie
  the reduce-scattered shard inside their `shard_map`: `_Shard.sum_dw`.)"""
  if shard is None or not shard.ties_wgrad:
    return dx, dw
  return jax.lax.optimization_barrier((dx, dw))


def _backward(recipe: Recipe, precision, out_dtype, x_dtype, res, dy,
              plan: GemmPlan, ctx: _Whole):
  x_saved, w, qw_fprop, key = res
  dgrad_q = recipe.gemm_format("dgrad") != "bf16"
  wgrad_q = recipe.gemm_format("wgrad") != "bf16"
  keys = recipe.operand_keys(key)
  # Both operands of dY are multiplied at once.
  qdy, qdyt = _named("nvfp4_quantize_dy", lambda dy, kr, kt: _pair(
      dy, recipe.dgrad_dy, recipe.wgrad_dy, recipe, kr, kt, ctx.place_y(dy),
      ctx.y_axes, values=(_as_values(recipe.dgrad_dy, plan)
                          and not ctx.scatters_y,
                          _as_values(recipe.wgrad_dy, plan)
                          and not ctx.scatters_y)))(
                              dy, keys["dgrad_dy"], keys["wgrad_dy"])
  # Under sequence parallelism dY's token shard (row-parallel, quantized
  # with the tensor's amax) and X's saved token shard (column-parallel) are
  # gathered over all tokens for Wgrad; Dgrad gathers dY or reduce-scatters
  # dX in `ctx.dgrad_product`.
  if wgrad_q:  # q(rht(X^T)) and q(rht(dY^T)): tokens last.
    x_saved, qdyt = ctx.gather_x(x_saved, 1), ctx.gather_dy(qdyt, 1)
  else:
    x_saved, dy_w = ctx.gather_x(x_saved, 0), ctx.gather_dy(dy, 0)

  if dgrad_q:
    if (_weight_in_kernel_layout(recipe, plan, ctx)
        or _weight_kernel_layout_native(recipe, plan, ctx)):
      qw = qw_fprop  # Already `q(kernel)`, `[in, out]` along `out`.
    elif qw_fprop is not None:
      qw = ctx.gather_w(qw_fprop, True).T
    else:
      qw = _named("nvfp4_quantize_w", lambda w, k: quantize_operand(
          w, recipe.dgrad_w, k, placement=ctx.place_w(w),
          amax_axes=ctx.w_axes))(w, keys["dgrad_w"])
      qw = ctx.gather_w(qw, False)
    # dX in x's dtype straight from the FP32 accumulator (one rounding, as
    # the cast after it): the GEMM's epilogue writes it, not an FP32 copy.
    # A sum across shards stays FP32 and rounds once after it.
    dx = ctx.dgrad_product(
        lambda qdy: _gemm("nvfp4_dgrad", ctx.dx_dtype(x_dtype))(qdy, qw), qdy)
  else:
    wd = ctx.gather_w(w, False)
    dx = ctx.dgrad_product(lambda dy: _named("bf16_dgrad", lambda dy, w: (
        _hp_matmul(dy, w.T, ctx.dx_dtype(out_dtype), precision)))(dy, wd), dy)
  if wgrad_q:
    dw = _gemm("nvfp4_wgrad", ctx.dw_dtype)(x_saved, qdyt)
  else:
    dw = _named("bf16_wgrad", lambda x, dy: _hp_matmul(
        x.T, dy, jnp.float32, precision).astype(ctx.dw_dtype))(x_saved, dy_w)
  return ctx.sum_dw(dx, dw)


_linear.defvjp(_linear_fwd, _linear_bwd)


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                precision=None, preferred_element_type=None, *,
                recipe: Recipe, key: jax.Array | None = None,
                out_sharding=None, name: str | None = None,
                sharding: LinearSharding | None = None) -> jax.Array:
  """`jax.lax.dot_general` whose three GEMMs follow `recipe`.

  Supports the contractions of linear layers (`nn.Dense`, `nn.DenseGeneral`,
  `nn.Einsum` with a weight): no batch dimensions; the free dimensions of
  `lhs` are flattened into tokens, those of `rhs` into output features.

  Args:
    lhs: activations, e.g. `[..., in]`.
    rhs: weights, e.g. `[in, out]`; float32 weights are quantized directly, so
      the weight gradient is produced in FP32.
    dimension_numbers: as for `jax.lax.dot_general`: `((lhs_contracting,
      rhs_contracting), (lhs_batch, rhs_batch))`, e.g. `(((1,), (0,)), ((),
      ()))` for `x @ w`.
    precision: precision of the high-precision GEMMs.
    preferred_element_type: output dtype; default the promoted input dtype.
    recipe: the `Recipe` (keyword), or a preset's name ("nvfp4", "bf16",
      "bf16_forward", "mxfp4", "mxfp8"). With every GEMM in bf16 this is
      exactly `jax.lax.dot_general` with the same arguments (same outputs
      and gradients; the operands are not cast). An empty operand (no
      tokens, or K = 0) has nothing to quantize: the result is
      `jax.lax.dot_general`'s too (empty, or zeros).
    key: PRNG key for stochastic rounding; needed where the recipe uses it
      (the backward pass, for the paper's recipe). Split per operand by
      `Recipe.operand_keys`; pass a new key every step and layer.
    out_sharding: as `jax.lax.dot_general` (flax passes it): the result's
      sharding, applied as a sharding constraint (resharded where the
      result's type carries Explicit axes).
    name: the layer's name (its module path), for error messages and the
      active `nvfp4_jax.sharding.mesh_rules`.
    sharding: how to split the layer over a device mesh (see
      `nvfp4_jax.sharding.LinearSharding`); default: what the active
      `mesh_rules` give `name`, else what the operands' sharding types say
      under Explicit mesh axes (`sharding.linear_sharding_for`; operands
      split otherwise are resharded to it, and a split that would cut a
      scale block runs on the closest one that cuts none,
      `LinearSharding.fitted`), else unsharded. The sharded
      layer computes the unsharded one's quantized operands bit for bit;
      results differ only by the order of FP32 sums across shards.

  Returns:
    The result, with `jax.lax.dot_general`'s shape.

  Raises:
    TypeError: a `recipe` that is not a Recipe or a preset name; integer
      operands of a quantized GEMM.
    ValueError: malformed `dimension_numbers`, contracted sizes that differ,
      sizes the recipe cannot block, a missing key.
    NotImplementedError: batch dimensions under a quantized recipe.
  """
  recipe = as_recipe(recipe, "dot_general: ")
  # The traced program names every NVFP4 layer's GEMMs, for
  # `nvfp4_jax.report`: the scope holds the layer and the recipe it traced.
  with jax.named_scope(layer_scope(name, recipe)):
    if sharding is None and (rules := sharding_lib.current_rules()):
      sharding = rules.linear(name or "")
    return _dot_general(lhs, rhs, dimension_numbers, precision,
                        preferred_element_type, recipe, key, out_sharding,
                        name, sharding)


LAYER_SCOPE = "nvfp4_layer"


def layer_scope(name: str | None, recipe: Recipe) -> str:
  """`nvfp4_layer[<layer path>|<recipe tag>]`, the name scope of a layer's
  GEMMs (parsed back by `nvfp4_jax.report`)."""
  return f"{LAYER_SCOPE}[{name or '?'}|{recipe.tag}]"


def _dimension_numbers(dimension_numbers, lhs, rhs, prefix: str):
  """`(lc, rc, lb, rb)`, each a tuple of axes, or a ValueError that names
  the value and its form."""
  def axes(part, ndim):
    if isinstance(part, int):
      part = (part,)
    out = tuple(part)
    if any(not isinstance(a, int) or isinstance(a, bool) or not 0 <= a < ndim
           for a in out) or len(set(out)) != len(out):
      raise ValueError
    return out
  try:
    (lc, rc), (lb, rb) = dimension_numbers
    lc, lb = axes(lc, lhs.ndim), axes(lb, lhs.ndim)
    rc, rb = axes(rc, rhs.ndim), axes(rb, rhs.ndim)
  except (TypeError, ValueError):
    raise ValueError(
        f"{prefix}dimension_numbers must be ((lhs_contracting, "
        f"rhs_contracting), (lhs_batch, rhs_batch)) with distinct axes of "
        f"lhs {lhs.shape} and rhs {rhs.shape}; got {dimension_numbers!r}. "
        f"For x @ w pass (((x.ndim - 1,), (0,)), ((), ())).") from None
  return lc, rc, lb, rb


def _dot_general(lhs, rhs, dimension_numbers, precision,
                 preferred_element_type, recipe, key, out_sharding, name,
                 shard):
  prefix = f"layer {name!r}: " if name else "dot_general: "
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  lc, rc, lb, rb = _dimension_numbers(dimension_numbers, lhs, rhs, prefix)
  if len(lc) != len(rc) or any(lhs.shape[i] != rhs.shape[j]
                               for i, j in zip(lc, rc)):
    raise ValueError(
        f"{prefix}contracting dims do not match: lhs {lhs.shape} on axes "
        f"{lc} vs rhs {rhs.shape} on axes {rc}; pass an input whose "
        f"contracted axes have the kernel's sizes "
        f"{tuple(rhs.shape[j] for j in rc)}.")
  if not recipe.quantized or lhs.size == 0 or rhs.size == 0:
    # Exactly XLA's product of the operands as given (with no elements
    # there is nothing to quantize: an empty result, or zeros for K = 0).
    sequence = _sequence_parallel(lhs, rhs, lb or rb, shard)
    if sequence and shard.gathers_x:
      # Split, then gathered: XLA gathers X in its own dtype (left to
      # itself it gathered the norm's FP32 output before the cast, twice
      # the bytes), and in the backward pass it reduce-scatters dX.
      lhs = _sequence_constraint(lhs, shard, shard.seq_tokens, lc)
      lhs = _sequence_constraint(lhs, shard, shard.tokens, lc)
    if (_gathers_weight(lhs, rhs, lb or rb, shard) and shard.ties_wgrad
        and out_sharding is None):
      y = _hp_fsdp_dot(lhs, rhs, (tuple(lc), tuple(rc)), precision,
                       preferred_element_type, shard)
    else:
      rhs = _gathered_weight(lhs, rhs, rc, lb or rb, shard)
      y = jax.lax.dot_general(lhs, rhs, ((lc, rc), (lb, rb)),
                              precision=precision,
                              preferred_element_type=preferred_element_type,
                              out_sharding=out_sharding)
    if sequence and shard.scatters_y:
      # Summed over all tokens, then split: the backward pass then gathers
      # dY over `model` before the Dgrad GEMM (the transposes run in
      # reverse), which leaves dX split by features as attention and the
      # MLP hold it; in the forward pass XLA fuses the all-reduce and the
      # slice into a reduce-scatter.
      y = _sequence_constraint(y, shard, shard.tokens, ())
      y = _sequence_constraint(y, shard, shard.seq_tokens, ())
    return y
  if lb or rb:
    raise NotImplementedError(
        f"{prefix}nvfp4_jax.dot_general quantizes linear-layer GEMMs; batched "
        f"GEMMs (attention scores and values) stay in high precision by the "
        f"recipe. Use jax.lax.dot_general for them.")
  for arg, a in (("lhs", lhs), ("rhs", rhs)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise TypeError(
          f"{prefix}{arg} must be floating to be quantized, got {a.dtype}; "
          f"cast it (e.g. {arg}.astype(jnp.float32)) or use "
          f"recipe=Recipe.bf16() for an integer GEMM.")
  if recipe.forward_needs_key and key is None:
    raise ValueError(
        f"{prefix}the recipe rounds a forward operand stochastically but no "
        f"key was given: pass key= (a new one every step and layer).")
  out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
  lhs_free = [d for d in range(lhs.ndim) if d not in lc]
  rhs_free = [d for d in range(rhs.ndim) if d not in rc]
  k = 1
  for d in lc:
    k *= lhs.shape[d]
  free_shape = ([lhs.shape[d] for d in lhs_free]
                + [rhs.shape[d] for d in rhs_free])
  x = jnp.transpose(lhs, lhs_free + list(lc))
  w = jnp.transpose(rhs, list(rc) + rhs_free)
  mesh = explicit_mesh(lhs, rhs)
  if mesh is None:
    x, w, y_sharding = x.reshape(-1, k), w.reshape(k, -1), None
  else:
    x, w, shard, y_sharding, y_spec = _explicit_operands(
        x, w, len(lhs_free), len(lc), mesh, shard, recipe, prefix)
  plan = gemm_plan(recipe.residuals, platform=dispatch.platform(),
                   cc=dispatch.compute_capability(),
                   impl=dispatch.current_default(),
                   cudnn=dispatch.cudnn_version())
  y = _linear(x, w, key, recipe, precision, out_dtype, x.dtype,
              f"layer {name!r}: " if name else "", plan, shard)
  if y_sharding is None:
    y = y.reshape(free_shape)
  else:
    if y_spec is not None:  # Run on a fitted split: back to the types'.
      y = jax.sharding.reshard(y, NamedSharding(mesh, y_spec))
    y = jax.lax.reshape(y, tuple(free_shape), out_sharding=y_sharding)
  return apply_out_sharding(y, out_sharding)


def _gathered_weight(lhs, rhs, rc, batched, shard: LinearSharding | None):
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
  if not _gathers_weight(lhs, rhs, batched, shard):
    return rhs
  spec = shard.used_kernel_spec
  if tuple(rc) == (1,):  # The weight stored `[out, in]`.
    spec = P(spec[1], spec[0])
  return jax.lax.with_sharding_constraint(
      rhs, NamedSharding(shard.mesh, spec))


def _sequence_parallel(lhs, rhs, batched, shard: LinearSharding | None
                       ) -> bool:
  """Whether a high-precision layer's product runs under sequence
  parallelism (`LinearSharding.sequence`, in auto mode, outside a
  `shard_map`): XLA partitions it, and `_sequence_constraint` says where
  its activations live."""
  return (shard is not None and shard.sequence
          and _xla_partitions(lhs, rhs, batched))


def _sequence_constraint(a, shard: LinearSharding, axes, contracting
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


def _gathers_weight(lhs, rhs, batched, shard: LinearSharding | None) -> bool:
  """Whether `_gathered_weight` gathers `rhs` (a 2-D weight of a layer
  whose `fsdp` axis splits it, in auto mode, outside a `shard_map`)."""
  return (shard is not None and shard.fsdp_splits
          and _xla_partitions(lhs, rhs, batched))


def _xla_partitions(lhs, rhs, batched) -> bool:
  """Whether XLA's partitioner places a high-precision layer's 2-D product
  from sharding constraints: auto mode (no Explicit axes) outside a
  `shard_map`."""
  if batched or rhs.ndim != 2 or explicit_mesh(lhs, rhs) is not None:
    return False
  abstract = jax.sharding.get_abstract_mesh()
  return abstract.empty or not abstract.manual_axes


def _hp_product(lhs, rhs, dims, precision, preferred_element_type, shard):
  lc, rc = dims
  rhs = _gathered_weight(lhs, rhs, rc, False, shard)
  return jax.lax.dot_general(lhs, rhs, ((lc, rc), ((), ())),
                             precision=precision,
                             preferred_element_type=preferred_element_type)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _hp_fsdp_dot(lhs, rhs, dims, precision, preferred_element_type, shard):
  """A high-precision layer's product under FSDP whose backward pass is
  XLA's own (the VJP of the same product), with the weight gradient tied
  to the input gradient (`_ordered_wgrad`): bit-identical to autodiff of
  the plain product, scheduled layer by layer."""
  return _hp_product(lhs, rhs, dims, precision, preferred_element_type,
                     shard)


def _hp_fsdp_dot_fwd(lhs, rhs, dims, precision, preferred_element_type,
                     shard):
  return _hp_product(lhs, rhs, dims, precision, preferred_element_type,
                     shard), (lhs, rhs)


def _hp_fsdp_dot_bwd(dims, precision, preferred_element_type, shard, res,
                     dy):
  _, vjp = jax.vjp(lambda a, b: _hp_product(
      a, b, dims, precision, preferred_element_type, shard), *res)
  return _ordered_wgrad(*vjp(dy), shard)


_hp_fsdp_dot.defvjp(_hp_fsdp_dot_fwd, _hp_fsdp_dot_bwd)


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


def _explicit_operands(x, w, n_free, n_contract, mesh: AbstractMesh,
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
    shard = sharding_lib.linear_sharding_for(mesh, x_spec, w_spec)
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
