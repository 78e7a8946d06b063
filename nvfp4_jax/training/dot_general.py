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
layer call (`LinearCall`): the GEMM op says what its backend multiplies
(`gemm_plan`, from the platform) and the layer what it saves
(`saved_residuals`). Where the GEMM is the exact emulation (Hopper, CPU),
the operands used at once (Fprop's X, Dgrad's dY, Wgrad's `rht(dY^T)`) come from their quantizer
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
same code with explicit collectives (`sharding.per_shard`): quantizers
reduce their amax across the axes that split their tensor and take the
shard's stochastic-rounding bytes at its global offset (the whole tensor's
bytes), the FSDP weight is gathered quantized, row-parallel outputs and
column-parallel input gradients are summed across `model` in FP32, and the
weight gradient is reduce-scattered across `fsdp` and summed across the
other batch axes.

Under a mesh the library did not make, with JAX's sharding in types
(`jax.set_mesh` with Explicit axes), the operands' types say how the layer
is split (`sharding.linear_sharding_for`, `sharding.operands`): the same
per-shard computation, with reshapes that carry their `out_sharding` and a
result of a sharded type. In auto mode (`jax.jit` shardings) XLA
partitions the op as the rest of the program, and its Pallas kernels
(quantizers, block values, the GEMMs) run per shard through
`custom_partitioning`
(`core.spmd.blockwise`: amax reduced over the axes that split each tensor,
stochastic rounding at the shard's offset, so the quantized operands are
the whole tensor's; `ops.block_scaled_matmul.sharded`); the library's
`MeshRules` (any axis names) run the whole layer per shard there too.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax.core import dispatch
from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng
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
from nvfp4_jax.sharding import operands
from nvfp4_jax.sharding import per_shard
from nvfp4_jax.sharding.mesh import LinearSharding
from nvfp4_jax.sharding.mesh import current_rules
from nvfp4_jax.training.names import layer_scope
from nvfp4_jax.training.names import named
from nvfp4_jax.training.names import residual


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



def _residual_specs(shard: LinearSharding, recipe: Recipe):
  """shard_map specs of `_fprop`'s residuals: `(q(rht(X^T)) or X, the
  stored weight, its quantized transpose or None, key)`."""
  wgrad_q = recipe.gemm_format("wgrad") != "bf16"
  return (spmd.transposed(shard.x_spec) if wgrad_q else shard.x_spec,
          shard.kernel_spec, spmd.transposed(shard.kernel_spec), P())


@dataclasses.dataclass(frozen=True)
class LinearCall:
  """What one call of the layer's `custom_vjp` runs with, decided at
  `dot_general`: its one static (hashable) argument.

  JAX caches custom_vjp traces by their static arguments, and the backward
  pass is traced later, maybe outside the `default_implementation` block
  the layer was called in: so the GEMM plan and the split travel here.

  Attributes:
    recipe: the layer's `Recipe`.
    precision: the high-precision GEMMs' `precision`.
    out_dtype: the result's dtype.
    x_dtype: the input's dtype (dX's).
    name: the prefix of error messages ("layer 'mlp/up': ", or ""); not
      compared, so that layers of one configuration share one traced
      program (`_layer`), whose errors then name the first of them traced.
    plan: the GEMM backend and the `default_implementation` in force when
      the layer was called (`gemm_plan`).
    residuals: how the backward pass's NVFP4 operands are saved, "codes" or
      "values" (`saved_residuals`).
    shard: the layer's split over a mesh, or None (the whole layer).
  """

  recipe: Recipe
  precision: Any
  out_dtype: Any
  x_dtype: Any
  # Not compared: layers that differ only by name share one traced program.
  name: str = dataclasses.field(compare=False)
  plan: GemmPlan
  residuals: str
  shard: LinearSharding | None


def saved_residuals(residuals: str, plan: GemmPlan) -> str:
  """How the backward pass's NVFP4 operands are saved: the recipe's choice
  (`Recipe.residuals`, "codes" or "values"), where the GEMM multiplies
  bf16 block values (`plan.values`, the exact emulation).

  "values" where a native FP4 GEMM runs saves codes, since that GEMM
  multiplies codes; a `UserWarning` says so, once per call site.
  """
  if residuals == "values" and not plan.values:
    warnings.warn(
        f"Recipe(residuals='values') saves codes here: the GEMM runs "
        f"{plan.backend!r}, a native FP4 GEMM that multiplies codes, not bf16 "
        f"block values. Use residuals='codes' on this device (it saves "
        f"memory and is what runs).", UserWarning, stacklevel=3)
    return "codes"
  return residuals


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _linear(x, w, key, call: LinearCall):
  y, _ = _linear_fwd(x, w, key, call)
  return y


# The layer as one jitted function of its static `LinearCall`: JAX traces it,
# differentiates it (`jvp`, partial evaluation and transposition of a
# `jit` are cached by its jaxpr) and lowers it (one MLIR function per
# distinct jaxpr in a module) once per configuration, however many layers
# share it: a GPT's blocks are one program, not one per block. XLA inlines
# the calls before it optimizes, so the compiled program is the same.
_layer = jax.jit(_linear, static_argnums=(3,))


def _gemm(name: str, out_dtype):
  """A named block-scaled GEMM region taking quantized operands."""
  return named(name, lambda a, b: block_scaled_matmul(a, b,
                                                       out_dtype=out_dtype))


def _linear_fwd(x, w, key, call: LinearCall):
  recipe, name, shard = call.recipe, call.name, call.shard
  k, n = w.shape
  _check_dims(recipe, "fprop", ((k, "contraction (in) dim K"),), name)
  if recipe.gemm_format("fprop") != "bf16":
    _weight_dims(recipe, "fprop_w", k, n, name)
  with dispatch.maybe_default_implementation(call.plan.impl):
    if shard is None:
      return _fprop(x, w, key, call, per_shard.WHOLE)
    shard.check(recipe, x.shape[0], k, n, name)
    ctx = per_shard.Shard(shard)
    return spmd.shard_map(
        lambda x, w, key: _fprop(x, w, key, call, ctx),
        mesh=shard.mesh, in_specs=(shard.x_spec, shard.kernel_spec, P()),
        out_specs=(shard.y_spec, _residual_specs(shard, recipe)))(x, w, key)


def _fprop(x, w, key, call: LinearCall, ctx: per_shard.Whole):
  recipe, plan, precision = call.recipe, call.plan, call.precision
  out_dtype = call.out_dtype
  keys = recipe.operand_keys(key)
  wgrad_q = recipe.gemm_format("wgrad") != "bf16"
  # A sum across shards runs in FP32 and rounds once, as the whole GEMM
  # (unless `partial_sums="output"`: each shard's result rounded, summed in
  # the output dtype).
  acc_dtype = ctx.y_dtype(out_dtype)
  # Fprop's X is multiplied at once; Wgrad's q(rht(X^T)) is the residual
  # (codes: 4.5 bits per element; or its values, see `_saves_values`).
  qx, qxt = named("nvfp4_quantize_x", lambda x, kr, kt: _pair(
      x, recipe.fprop_x, recipe.wgrad_x, recipe, kr, kt, ctx.place_x(x),
      ctx.x_axes, values=(_as_values(recipe.fprop_x, plan)
                          and not ctx.gathers_x,
                          _saves_values(recipe.wgrad_x, call))))(
          x, keys["fprop_x"], keys["wgrad_x"])
  vw = None
  if _weight_in_kernel_layout(recipe, plan, ctx):
    # One pass over the kernel: the Dgrad operand's codes (saved) and the
    # block values Fprop multiplies as `x @ V`.
    qw, vw = named("nvfp4_quantize_w", lambda w: quantize_with_values(
        w, block_2d=True))(w)
    # `qw_vals`: the weight's values in the kernel layout with its amax
    # (alpha needs the amax only; the codes stay out of this region).
    wop = NVFP4Values(vw, qw.amax)
    mm = lambda qx: named("nvfp4_fprop", lambda qx, qw_vals: (
        block_values_matmul(qx.values, qw_vals.values,
                            gemm_alpha(qx, qw_vals), out_dtype=acc_dtype,
                            vb_kn=True)))(qx, wop)
  elif _weight_kernel_layout_native(recipe, plan, ctx):
    # `q(kernel)`, Dgrad's operand (saved); Fprop multiplies its transpose.
    qw = named("nvfp4_quantize_w", lambda w, k: quantize_operand(
        w, recipe.fprop_w, k))(w, keys["fprop_w"])
    wop = qw.T
    mm = lambda qx: _gemm("nvfp4_fprop", acc_dtype)(qx, wop)
  elif recipe.fprop_x.quantized:
    # The stored weight shard is quantized (amax across its shards) and the
    # quantized bytes are gathered.
    qw = named("nvfp4_quantize_w", lambda w, k: quantize_operand(
        w.T, recipe.fprop_w, k, placement=_t(ctx.place_w(w)),
        amax_axes=ctx.w_axes))(w, keys["fprop_w"])
    wop = ctx.gather_w(qw, True)
    mm = lambda qx: _gemm("nvfp4_fprop", acc_dtype)(qx, wop)
  else:
    qw, qx, wop = None, x, ctx.gather_w(w, False)
    mm = lambda x: named("bf16_fprop", functools.partial(
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
  if vw is not None and _saves_values(recipe.dgrad_w, call):
    # `vw` (the kernel-layout pass, which implies `reuse_w`) are `qw`'s
    # block values in its own `[in, out]` layout: Dgrad's operand as it is.
    qw = NVFP4Values(vw, qw.amax, four_over_six=qw.four_over_six)
  return y, (residual(qxt) if wgrad_q else x, w,
             residual(qw) if reuse_w else None, key)


def _saves_values(op, call: LinearCall) -> bool:
  """Whether the residual of operand `op` is saved as its block values.

  `Recipe(residuals="values")` where the backward GEMM is the exact
  emulation (`call.residuals`, resolved by `saved_residuals`) and `op` is
  NVFP4: the bf16 block values the
  GEMM multiplies, 2 bytes per element against 0.5625 for codes and scales,
  and no dequantize pass before Wgrad (X's operand) and Dgrad (the weight,
  where it is Fprop's quantized in the kernel layout). The numbers are
  those of the codes.
  """
  return call.residuals == "values" and _as_values(op, call.plan)


def _weight_in_kernel_layout(recipe: Recipe, plan: GemmPlan,
                             ctx: per_shard.Whole) -> bool:
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
                                 ctx: per_shard.Whole) -> bool:
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


def _linear_bwd(call: LinearCall, res, dy):
  recipe, name, shard = call.recipe, call.name, call.shard
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
  with dispatch.maybe_default_implementation(call.plan.impl):
    if shard is None:
      dx, dw = _backward(res, dy, call, per_shard.WHOLE)
    else:
      ctx = per_shard.Shard(shard)
      dx, dw = spmd.shard_map(
          lambda res, dy: _backward(res, dy, call, ctx),
          mesh=shard.mesh,
          in_specs=(_residual_specs(shard, recipe), shard.y_spec),
          out_specs=(shard.x_spec, shard.kernel_spec))(res, dy)
  return dx.astype(call.x_dtype), dw.astype(w.dtype), None


def _ordered_wgrad(dx, dw, shard: LinearSharding | None):
  """`(dx, dw)` of a high-precision layer's product, tied by an
  optimization barrier under FSDP with `wgrad_schedule="layer"`: the
  layers below cannot start their backward pass before this layer's
  weight gradient exists, so its GEMM (and its reduce-scatter, issued
  right after it) runs in this layer's turn. (The quantized layers tie
  the reduce-scattered shard inside their `shard_map`:
  `per_shard.Shard.sum_dw`.)"""
  if shard is None or not shard.ties_wgrad:
    return dx, dw
  return jax.lax.optimization_barrier((dx, dw))


def _backward(res, dy, call: LinearCall, ctx: per_shard.Whole):
  recipe, plan, precision = call.recipe, call.plan, call.precision
  out_dtype, x_dtype = call.out_dtype, call.x_dtype
  x_saved, w, qw_fprop, key = res
  dgrad_q = recipe.gemm_format("dgrad") != "bf16"
  wgrad_q = recipe.gemm_format("wgrad") != "bf16"
  keys = recipe.operand_keys(key)
  # Both operands of dY are multiplied at once.
  qdy, qdyt = named("nvfp4_quantize_dy", lambda dy, kr, kt: _pair(
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
      qw = named("nvfp4_quantize_w", lambda w, k: quantize_operand(
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
    dx = ctx.dgrad_product(lambda dy: named("bf16_dgrad", lambda dy, w: (
        _hp_matmul(dy, w.T, ctx.dx_dtype(out_dtype), precision)))(dy, wd), dy)
  if wgrad_q:
    dw = _gemm("nvfp4_wgrad", ctx.dw_dtype)(x_saved, qdyt)
  else:
    dw = named("bf16_wgrad", lambda x, dy: _hp_matmul(
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
    if sharding is None and (rules := current_rules()):
      sharding = rules.linear(name or "")
    return _dot_general(lhs, rhs, dimension_numbers, precision,
                        preferred_element_type, recipe, key, out_sharding,
                        name, sharding)


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
    sequence = operands.sequence_parallel(lhs, rhs, lb or rb, shard)
    if sequence and shard.gathers_x:
      # Split, then gathered: XLA gathers X in its own dtype (left to
      # itself it gathered the norm's FP32 output before the cast, twice
      # the bytes), and in the backward pass it reduce-scatters dX.
      lhs = operands.sequence_constraint(lhs, shard, shard.seq_tokens, lc)
      lhs = operands.sequence_constraint(lhs, shard, shard.tokens, lc)
    if (operands.gathers_weight(lhs, rhs, lb or rb, shard) and shard.ties_wgrad
        and out_sharding is None):
      y = _hp_fsdp_dot(lhs, rhs, (tuple(lc), tuple(rc)), precision,
                       preferred_element_type, shard)
    else:
      rhs = operands.gathered_weight(lhs, rhs, rc, lb or rb, shard)
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
      y = operands.sequence_constraint(y, shard, shard.tokens, ())
      y = operands.sequence_constraint(y, shard, shard.seq_tokens, ())
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
  mesh = operands.explicit_mesh(lhs, rhs)
  if mesh is None:
    x, w, y_sharding = x.reshape(-1, k), w.reshape(k, -1), None
  else:
    x, w, shard, y_sharding, y_spec = operands.explicit_operands(
        x, w, len(lhs_free), len(lc), mesh, shard, recipe, prefix)
  plan = gemm_plan(platform=dispatch.platform(),
                   cc=dispatch.compute_capability(),
                   impl=dispatch.current_default(),
                   cudnn=dispatch.cudnn_version())
  key = prng.computed_once(key)  # Forward and backward draw from it.
  y = _layer(x, w, key, LinearCall(
      recipe=recipe, precision=precision, out_dtype=out_dtype,
      x_dtype=x.dtype, name=f"layer {name!r}: " if name else "", plan=plan,
      residuals=saved_residuals(recipe.residuals, plan), shard=shard))
  if y_sharding is None:
    y = y.reshape(free_shape)
  else:
    if y_spec is not None:  # Run on a fitted split: back to the types'.
      y = jax.sharding.reshard(y, NamedSharding(mesh, y_spec))
    y = jax.lax.reshape(y, tuple(free_shape), out_sharding=y_sharding)
  return operands.apply_out_sharding(y, out_sharding)


def _hp_product(lhs, rhs, dims, precision, preferred_element_type, shard):
  lc, rc = dims
  rhs = operands.gathered_weight(lhs, rhs, rc, False, shard)
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


