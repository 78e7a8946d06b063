"""`ragged_dot` with the NVFP4 training recipe: a mixture of experts' GEMM.

`ragged_dot(x, w, group_sizes, recipe=...)` is `jax.lax.ragged_dot` (tokens
`x [M, K]` sorted by expert, expert weights `w [E, K, N]`, `group_sizes [E]`)
whose three GEMMs follow a `Recipe`, as `nvfp4_jax.dot_general` does for one
linear layer. It is defined as that layer applied to every expert:

    y[rows_e] = dot_general(x[rows_e], w[e], recipe=recipe,
                            key=jax.random.fold_in(key, e))

and computes exactly that, with the group sizes as traced data: every
operand of expert `e` is quantized from expert `e`'s tokens alone (its own
tensor amax, after the RHT for the Wgrad operands; 16x16 weight tiles with
the expert's amax; stochastic rounding from the expert's key at the
element's index within the expert's tensor), so the codes, scales and amaxes
are the loop's bit for bit, and so are the outputs and gradients where the
GEMMs accumulate in the same order (the reference on the CPU; elsewhere they
differ by the FP32 summation order only).

Wgrad contracts each expert's tokens. Its operands are quantized along the
tokens in blocks of 16 (32 for MX) and Hadamard tiles of 16, which must not
hold two experts' tokens: by default (`align="pad"`) each expert's tokens are
copied to a layout where every group starts at a multiple of the block, with
zero rows between (the dense layer pads its tokens the same way; the amax and
the product are unchanged). `align="check"` uses the tokens where they are
and fails on a group that does not start aligned; `align="assume"` trusts
the caller (a misaligned group then mixes two experts in a block: wrong
gradients, unchecked).

Residuals are quantized codes: Wgrad's `q(rht(X^T))` and the experts'
quantized weights (Dgrad reuses Fprop's 16x16 codes), 4.5 bits per element.

The NVFP4 and MX GEMMs multiply the exact bf16 block values (the emulation:
Hopper's grouped kernels) or, where a native block-scaled grouped GEMM runs
(`rg.multiplies_codes`: Blackwell), the codes themselves: the quantizers
then write codes only, Fprop multiplies the transpose of the weight's 16x16
codes (the same tiles, code for code; MX: the weight quantized along K)
and Dgrad the codes as quantized. The products are the same; only the
FP32 summation order differs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax.core import dispatch
from nvfp4_jax.core import prng
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.recipe import Recipe
from nvfp4_jax.core.recipe import as_recipe
from nvfp4_jax.ops.quantize.api import block_size
from nvfp4_jax.ops.ragged_dot import api as rg
from nvfp4_jax.ops.ragged_quantize import api as rq
from nvfp4_jax.training.names import layer_scope
from nvfp4_jax.training.names import named
from nvfp4_jax.training.names import residual


ALIGN_MODES = ("pad", "check", "assume")


def per_expert_keys(key: jax.Array, num_experts: int,
                    first_expert=0) -> jax.Array:
  """Each expert's key, `[E]`: expert `e`'s is `fold_in(key, first_expert +
  e)` (`first_expert`: the global index of a device's first expert under
  expert parallelism)."""
  ids = (jnp.asarray(first_expert).astype(jnp.uint32)
         + jnp.arange(num_experts, dtype=jnp.uint32))
  return jax.vmap(lambda e: jax.random.fold_in(key, e))(ids)


def expert_keys(recipe: Recipe, keys: jax.Array | None
                ) -> dict[str, jax.Array | None]:
  """Every operand's keys, `[E]` each, from the experts' keys: expert
  `e`'s are `recipe.operand_keys(keys[e])`, those of the expert's own
  `dot_general` (None where the operand rounds to nearest)."""
  if keys is None or not recipe.needs_key:
    return recipe.operand_keys(None)
  return jax.vmap(recipe.operand_keys)(keys)


def _weight_in_kernel_layout(recipe: Recipe) -> bool:
  """Whether each expert's weight is quantized once in its `[K, N]` layout
  (along N, 16x16 tiles): the Dgrad operand's codes, whose transpose is
  Fprop's `q(w^T)` code for code (as `dot_general` does on the emulation).
  Needs round-to-nearest and no Four-over-Six (their choices follow one
  layout's element order) and Dgrad taking Fprop's weight."""
  w = recipe.fprop_w
  return (w.format == "nvfp4" and w.block_2d and w.rounding == "nearest"
          and not w.four_over_six and recipe.dgrad_w == w)


def _codes(recipe: Recipe, gemm: str) -> bool:
  """Whether `gemm` multiplies codes (NVFP4, MXFP4 or MXFP8 on a native
  grouped GEMM here, `rg.multiplies_codes`) instead of bf16 block values."""
  return (recipe.gemm_format(gemm) in rg.CODES_FORMATS
          and rg.multiplies_codes())


def _codes_t(q: rq.Grouped) -> rq.Grouped:
  """Each expert's 16x16-tiled codes transposed (`NVFP4Array.T`: the codes
  of the transposed weight's quantization, code for code)."""
  t = NVFP4Array(q.data, q.scales, q.amax, block_2d=True).T
  return dataclasses.replace(q, data=t.codes, scales=t.scales, values=None)


def _layout(recipe: Recipe, group_sizes, m: int, align: str):
  """`(sources, sizes, length)` of the Wgrad operands' token layout (see
  `rq.padded_layout`); with "check"/"assume" the tokens stay in place."""
  need = rq.alignment(recipe.wgrad_x, recipe.rht_size)
  if align == "pad":
    return rq.padded_layout(group_sizes, m, need)
  length = -(-m // need) * need
  return None, group_sizes.astype(jnp.int32), length


def _tokens(x, sources, length, align):
  return rq.to_padded(x, sources) if align == "pad" else jnp.pad(
      x, ((0, length - x.shape[0]), (0, 0)))


@dataclasses.dataclass(frozen=True)
class RaggedCall:
  """What one call of the grouped layer's `custom_vjp` runs with, decided
  at `ragged_dot`: its one static (hashable) argument.

  Attributes:
    recipe: the layer's `Recipe`.
    precision: the high-precision GEMMs' `precision`.
    out_dtype: the result's dtype.
    x_dtype: the input's dtype (dX's).
    name: the prefix of error messages ("layer 'moe/up': ", or
      "ragged_dot: "); not compared, so that layers of one configuration
      share one traced program (`_layer`), whose errors then name the first
      of them traced.
    impl: the `default_implementation` in force when the layer was called
      (the backward pass may be traced outside its block).
    align: how the groups are aligned to the recipe's blocks, "pad" or
      "check".
  """

  recipe: Recipe
  precision: Any
  out_dtype: Any
  x_dtype: Any
  name: str = dataclasses.field(compare=False)
  impl: str | None
  align: str


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ragged(x, w, group_sizes, key, call: RaggedCall):
  y, _ = _ragged_fwd(x, w, group_sizes, key, call)
  return y


# The grouped layer as one jitted function of its static `RaggedCall`, as
# `dot_general`'s `_layer`: traced, differentiated and lowered once per
# configuration, however many MoE blocks share it.
_layer = jax.jit(_ragged, static_argnums=(4,))


def _ragged_fwd(x, w, group_sizes, key, call: RaggedCall):
  with dispatch.maybe_default_implementation(call.impl):
    return _fprop(x, w, group_sizes, key, call.recipe, call.precision,
                  call.out_dtype, call.align)


def _fprop(x, w, gs, key, recipe: Recipe, precision, out_dtype, align):
  keys = expert_keys(recipe, key)
  qw_dgrad = None
  if recipe.fprop_x.quantized and _codes(recipe, "fprop"):
    # Native FP4: the GEMM multiplies codes (`[E, N, K]` for Fprop).
    qx = named("nvfp4_quantize_x", lambda x, k: rq.quantize_rows(
        x, gs, recipe.fprop_x, k, values=False, codes=True))(
            x, keys["fprop_x"])
    if _weight_in_kernel_layout(recipe):
      qw = named("nvfp4_quantize_w", lambda w: rq.quantize_experts(
          w, recipe.fprop_w, None, values=False))(w)
      qw_dgrad, qw_nk = qw, _codes_t(qw)
    else:
      qw_nk = named("nvfp4_quantize_w", lambda w, k: rq.quantize_experts(
          jnp.swapaxes(w, 1, 2), recipe.fprop_w, k, values=False))(
              w, keys["fprop_w"])
      if recipe.dgrad_w == recipe.fprop_w and recipe.fprop_w.block_2d:
        qw_dgrad = _codes_t(qw_nk)
    y = named("nvfp4_fprop", lambda a, b, alpha: rg.ragged_codes_matmul(
        a, b, gs, alpha, out_dtype=out_dtype))(qx, qw_nk,
                                               rg.group_alpha(qx, qw_nk))
  elif recipe.fprop_x.quantized:
    qx = named("nvfp4_quantize_x", lambda x, k: rq.quantize_rows(
        x, gs, recipe.fprop_x, k))(x, keys["fprop_x"])
    if _weight_in_kernel_layout(recipe):
      qw = named("nvfp4_quantize_w", lambda w: rq.quantize_experts(
          w, recipe.fprop_w, None))(w)
      vb, layout = qw.values, "kn"
      qw_dgrad = qw.without_values()
    else:
      qw = named("nvfp4_quantize_w", lambda w, k: rq.quantize_experts(
          jnp.swapaxes(w, 1, 2), recipe.fprop_w, k))(w, keys["fprop_w"])
      vb, layout = qw.values, "nk"
      if recipe.dgrad_w == recipe.fprop_w and recipe.fprop_w.block_2d:
        qw_dgrad = qw.without_values()  # `[E, N, K]`: transposed in Dgrad.
    y = named("nvfp4_fprop", lambda a, b, alpha: rg.ragged_values_matmul(
        a, b, gs, alpha, out_dtype=out_dtype, vb_layout=layout))(
            qx.values, vb, rg.group_alpha(qx, qw))
  else:
    y = named("bf16_fprop", lambda x, w: rg.ragged_values_matmul(
        x.astype(out_dtype), w.astype(out_dtype), gs, out_dtype=out_dtype,
        precision=precision))(x, w)
  saved_x = x
  if recipe.gemm_format("wgrad") != "bf16":
    sources, sizes, length = _layout(recipe, gs, x.shape[0], align)
    saved_x = residual(named(
        "nvfp4_quantize_x", lambda x, k: rq.quantize_tokens(
            _tokens(x, sources, length, align), sizes, recipe.wgrad_x, k,
            rht_size=recipe.rht_size, sign_vector=recipe.rht_sign_vector,
            values=False, codes=True))(x, keys["wgrad_x"]))
  return y, (saved_x, w, None if qw_dgrad is None else residual(qw_dgrad),
             gs, key)


def _ragged_bwd(call: RaggedCall, res, dy):
  recipe, name, x_dtype = call.recipe, call.name, call.x_dtype
  _, w, _, _, key = res
  if recipe.needs_key and key is None:
    raise ValueError(
        f"{name}this recipe uses stochastic rounding in the backward pass but "
        f"no key was given: pass key= to nvfp4_jax.ragged_dot, or "
        f"rngs={{'nvfp4': key}} to the MoE layer's apply (a new key every "
        f"step).")
  with dispatch.maybe_default_implementation(call.impl):
    dx, dw = _backward(recipe, call.precision, call.out_dtype, x_dtype,
                       call.align, res, dy)
  return dx.astype(x_dtype), dw.astype(w.dtype), None, None


def _backward(recipe: Recipe, precision, out_dtype, x_dtype, align, res, dy):
  saved_x, w, qw_dgrad, gs, key = res
  m = dy.shape[0]
  keys = expert_keys(recipe, key)
  if recipe.gemm_format("dgrad") != "bf16" and _codes(recipe, "dgrad"):
    qdy = named("nvfp4_quantize_dy", lambda dy, k: rq.quantize_rows(
        dy, gs, recipe.dgrad_dy, k, values=False, codes=True))(
            dy, keys["dgrad_dy"])
    qw = qw_dgrad  # Fprop's `[E, K, N]` codes: Dgrad contracts N.
    if qw is None:
      qw = named("nvfp4_quantize_w", lambda w, k: rq.quantize_experts(
          w, recipe.dgrad_w, k, values=False))(w, keys["dgrad_w"])
    dx = named("nvfp4_dgrad", lambda a, b, alpha: rg.ragged_codes_matmul(
        a, b, gs, alpha, out_dtype=x_dtype))(qdy, qw, rg.group_alpha(qdy, qw))
  elif recipe.gemm_format("dgrad") != "bf16":
    qdy = named("nvfp4_quantize_dy", lambda dy, k: rq.quantize_rows(
        dy, gs, recipe.dgrad_dy, k))(dy, keys["dgrad_dy"])
    if qw_dgrad is not None:
      qw = qw_dgrad
      vw = qw.block_values()
      # `[E, K, N]` (the kernel layout: contract its last axis), or Fprop's
      # `[E, N, K]` read as it is (contract its first): no transpose pass.
      layout = "nk" if _weight_in_kernel_layout(recipe) else "kn"
    else:
      qw = named("nvfp4_quantize_w", lambda w, k: rq.quantize_experts(
          w, recipe.dgrad_w, k, codes=False))(w, keys["dgrad_w"])
      vw, layout = qw.values, "nk"
    # dX in x's dtype straight from the FP32 accumulator, as the dense layer.
    dx = named("nvfp4_dgrad", lambda a, b, alpha: rg.ragged_values_matmul(
        a, b, gs, alpha, out_dtype=x_dtype, vb_layout=layout))(
            qdy.values, vw, rg.group_alpha(qdy, qw))
  else:
    dx = named("bf16_dgrad", lambda dy, w: rg.ragged_values_matmul(
        dy.astype(out_dtype), w.astype(out_dtype), gs, out_dtype=out_dtype,
        vb_layout="nk", precision=precision))(dy, w)
  if recipe.gemm_format("wgrad") != "bf16":
    sources, sizes, length = _layout(recipe, gs, m, align)
    codes = _codes(recipe, "wgrad")
    qdyt = named("nvfp4_quantize_dy", lambda dy, k: rq.quantize_tokens(
        _tokens(dy, sources, length, align), sizes, recipe.wgrad_dy, k,
        rht_size=recipe.rht_size, sign_vector=recipe.rht_sign_vector,
        values=not codes, codes=codes))(dy, keys["wgrad_dy"])
    if codes:  # Native FP4: both operands' codes, `[K, L]` and `[N, L]`.
      gemm = lambda a, b, alpha: rg.ragged_codes_matmul_t(
          a, b, sizes, alpha, out_dtype=jnp.float32)
      operands = (saved_x, qdyt)
    else:
      gemm = lambda a, b, alpha: rg.ragged_values_matmul_t(
          a, b, sizes, alpha, out_dtype=jnp.float32)
      operands = (saved_x.block_values(), qdyt.values)
    dw = named("nvfp4_wgrad", gemm)(*operands,
                                     rg.group_alpha(saved_x, qdyt))
  else:
    # FP32 accumulation of the operands' own products (widening bf16 to
    # FP32 first, as the dense layer does, gives the same exact products),
    # so bf16 operands reach the bf16 grouped kernel.
    common = jnp.result_type(saved_x, dy)
    dw = named("bf16_wgrad", lambda x, dy: rg.ragged_values_matmul_t(
        x.astype(common), dy.astype(common), gs, out_dtype=jnp.float32,
        tokens_last=False, precision=precision))(saved_x, dy)
  return dx, dw


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def _concrete(a) -> np.ndarray | None:
  try:
    return np.asarray(a)
  except (jax.errors.TracerArrayConversionError,
          jax.errors.ConcretizationTypeError):
    return None


def _misaligned(sizes: np.ndarray, need: int) -> list[tuple[int, int]]:
  """`(expert, first row)` of each non-empty group that does not start at a
  multiple of `need`."""
  starts = np.cumsum(sizes) - sizes
  return [(int(e), int(s)) for e, (s, n) in enumerate(zip(starts, sizes))
          if n and s % need]


def _raise_misaligned(sizes, need: int, prefix: str) -> None:
  bad = _misaligned(np.asarray(sizes), need)
  if bad:
    e, s = bad[0]
    raise ValueError(
        f"{prefix}align='check': expert {e}'s tokens start at row {s}, not a "
        f"multiple of {need} (the Wgrad block), so a block would hold two "
        f"experts' tokens; {len(bad)} group(s) misaligned. Pad every group "
        f"to a multiple of {need} tokens, or use align='pad' (the default) "
        f"to let the op pad them.")


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
               precision=None, preferred_element_type=None, *,
               recipe: Recipe | str, key: jax.Array | None = None,
               align: str = "pad", name: str | None = None,
               first_expert=0) -> jax.Array:
  """`jax.lax.ragged_dot` whose three GEMMs follow `recipe`, per expert.

  Args:
    lhs: tokens `[M, K]`, sorted by expert (expert 0's first).
    rhs: expert weights `[E, K, N]`; float32 weights are quantized directly
      and their gradient is FP32.
    group_sizes: int `[E]`, tokens per expert, summing to at most `M`; rows
      past the sum give zeros (and zero gradients).
    precision: of the high-precision GEMMs.
    preferred_element_type: output dtype; default the promoted input dtype.
    recipe: a `Recipe` or a preset's name ("nvfp4", "bf16", "mxfp4", ...).
      Each expert is quantized as `nvfp4_jax.dot_general` quantizes a layer
      (see the module docstring): the result equals that loop over experts.
      "bf16" (every GEMM in high precision) runs the library's grouped GEMM
      (FP32 accumulation): `jax.lax.ragged_dot`'s result up to the FP32
      summation order.
    key: PRNG key for stochastic rounding (expert `e` uses
      `jax.random.fold_in(key, e)`); a new one every step and layer.
    align: "pad" (default), "check" or "assume": how the Wgrad operands'
      token blocks are kept inside one expert (module docstring).
    name: the layer's path, for error messages and `nvfp4_jax.report`.
    first_expert: the global index of `rhs[0]` (an int, or a traced int32
      under expert parallelism, where a device holds experts
      `first_expert ... first_expert + E - 1`): expert `e` rounds with
      `fold_in(key, first_expert + e)`, as on one device.

  Returns:
    `[M, N]`.

  Raises:
    TypeError: a bad recipe, non-floating operands, non-integer group sizes.
    ValueError: shapes that do not match, K or N not a multiple of the
      recipe's block, concrete group sizes that are negative or sum past
      `M`, a misaligned group under `align="check"`, a missing key.
  """
  recipe = as_recipe(recipe, "ragged_dot: ")
  prefix = f"layer {name!r}: " if name else "ragged_dot: "
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
    raise ValueError(
        f"{prefix}expected lhs [M, K] and rhs [E, K, N] with the same K, got "
        f"lhs {lhs.shape} and rhs {rhs.shape}; flatten the tokens to 2-D "
        f"(x.reshape(-1, K)) and stack the experts' kernels on axis 0.")
  num_experts, k, n = rhs.shape
  group_sizes = jnp.asarray(group_sizes)
  if (not jnp.issubdtype(group_sizes.dtype, jnp.integer)
      or group_sizes.shape != (num_experts,)):
    raise TypeError(
        f"{prefix}group_sizes must be integers of shape ({num_experts},), one "
        f"count per expert, got {group_sizes.dtype} {group_sizes.shape}; e.g. "
        f"jnp.bincount(expert_ids, length={num_experts}).")
  if align not in ALIGN_MODES:
    raise ValueError(f"{prefix}align must be one of {ALIGN_MODES}, got "
                     f"{align!r}.")
  for arg, a in (("lhs", lhs), ("rhs", rhs)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise TypeError(
          f"{prefix}{arg} must be floating, got {a.dtype}; cast it (e.g. "
          f"{arg}.astype(jnp.float32)).")
  sizes = _concrete(group_sizes)
  if sizes is not None and (np.any(sizes < 0) or sizes.sum() > lhs.shape[0]):
    raise ValueError(
        f"{prefix}group_sizes {sizes.tolist()} must be non-negative and sum to "
        f"at most the {lhs.shape[0]} rows of lhs (they sum to {sizes.sum()}).")
  for gemm, dims in (("fprop", ((k, "contraction (in) dim K"),)),
                     ("dgrad", ((n, "output dim N"),)),
                     ("wgrad", ((k, "in dim K"), (n, "output dim N")))):
    fmt = recipe.gemm_format(gemm)
    b = block_size(fmt) if fmt != "bf16" else 1
    for size, what in dims:
      if size % b:
        raise ValueError(
            f"{prefix}{gemm} GEMM in {fmt}: the {what} is {size}, not a "
            f"multiple of {b}; pad it to {-(-size // b) * b} or keep this "
            f"layer in bf16 with a precision rule.")
  if recipe.fprop_w.block_2d and (k % 16 or n % 16):
    raise ValueError(
        f"{prefix}16x16 weight scaling needs both weight dims to be multiples "
        f"of 16, got in={k}, out={n}; pad them or disable two_d_weights.")
  if recipe.forward_needs_key and key is None:
    raise ValueError(
        f"{prefix}the recipe rounds a forward operand stochastically but no "
        f"key was given: pass key= (a new one every step and layer).")
  out_dtype = jnp.dtype(preferred_element_type
                        or jnp.result_type(lhs, rhs))
  if align == "check" and recipe.gemm_format("wgrad") != "bf16":
    need = rq.alignment(recipe.wgrad_x, recipe.rht_size)
    if sizes is not None:
      _raise_misaligned(sizes, need, prefix)
    else:
      jax.debug.callback(functools.partial(_raise_misaligned, need=need,
                                           prefix=prefix), group_sizes)
  with jax.named_scope(layer_scope(name, recipe)):
    keys = None
    if key is not None and recipe.needs_key:
      keys = prng.computed_once(
          per_expert_keys(key, num_experts, first_expert))
    return _layer(lhs, rhs, group_sizes.astype(jnp.int32), keys, RaggedCall(
        recipe=recipe, precision=precision, out_dtype=out_dtype,
        x_dtype=lhs.dtype, name=prefix, impl=dispatch.current_default(),
        align=align))
