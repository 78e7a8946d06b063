"""Drop-in NVFP4 layers for flax linen (`NVFP4Dense`, `NVFP4DotGeneral`,
`NVFP4Einsum`) and `layer_dot_general`, the GEMM of every NVFP4 layer.

Each layer runs its GEMMs through `nvfp4_jax.dot_general` with the recipe it is
given or, by default, the one the active `precision_rules` assign to its path.
The NNX layers (`nvfp4_jax.flax.nnx`) and `inject_linen`/`inject_nnx`
(`nvfp4_jax.flax.inject`) switch flax's own layers onto the same function.

Stochastic-rounding keys. A linen layer draws its key from the RNG stream named
"nvfp4" (`model.apply(..., rngs={"nvfp4": jax.random.fold_in(key, step)})`);
linen folds the module path in, so every layer gets its own key. Without that
stream, a `step` given to `precision_rules` seeds it instead (key = fold of the
path's CRC32 and the step). NNX layers take the step's key the same way, from
the path `inject_nnx`/`apply_rules` gave them, or draw from an "nvfp4" stream
passed to `NVFP4Linear`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import zlib
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from nvfp4_jax.training import dot_general as ops
from nvfp4_jax.core.recipe import Recipe
from nvfp4_jax.core.recipe import as_recipe
from nvfp4_jax.flax.rules import PrecisionRules
from nvfp4_jax.flax.rules import current_scope
from nvfp4_jax.sharding.operands import apply_out_sharding

RNG_STREAM = "nvfp4"

default_kernel_init = nn.initializers.lecun_normal()

# Outside any `precision_rules` block every layer runs the paper's recipe.
_DEFAULT_RULES = PrecisionRules()

_RECORDER = threading.local()
_OBSERVER = threading.local()


@contextlib.contextmanager
def observe_inputs(fn: Callable[[str, jax.Array, jax.Array | None], None]):
  """Calls `fn(path, x, group_sizes)` with the input of every NVFP4 layer's
  GEMM traced inside the block, before its recipe is chosen: `x` as the
  GEMM receives it (`[..., in]` in the compute dtype) and `group_sizes`
  None, or, for a mixture of experts' grouped GEMM, the sorted token copies
  `[rows, in]` and the rows of each expert (`[E]`, groups in order from row
  0, zero rows past them).

  For calibration (e.g. the activation amax of each layer for a serving
  checkpoint's static input scales): `fn` sees the values of the trace the
  layer runs in, so apply the model without `nn.remat`/`nn.scan` around
  its layers (whose inner traces the values would leak out of).
  """
  outer = getattr(_OBSERVER, "fn", None)
  _OBSERVER.fn = fn
  try:
    yield
  finally:
    _OBSERVER.fn = outer


def observe_input(path: str, x: jax.Array,
                  group_sizes: jax.Array | None = None) -> None:
  """Reports a layer's GEMM input to the `observe_inputs` block in scope
  (nothing outside one)."""
  fn = getattr(_OBSERVER, "fn", None)
  if fn is not None:
    fn(path, x, group_sizes)


def _step_key(path: str, step: Any) -> jax.Array:
  key = jax.random.fold_in(jax.random.key(0), zlib.crc32(path.encode()))
  return jax.random.fold_in(key, step)


# ----------------------------------------------------------------------------
# Which GEMMs a recipe can quantize.
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _dims_error(recipe: Recipe, k: int, n: int) -> str | None:
  """Why `recipe` cannot run a `[tokens, k] x [k, n]` layer, or None.

  Asks the op itself (an abstract forward and backward pass), so the answer is
  the op's own shape rules and never drifts from them.
  """
  def fwd_bwd(x, w):
    y, vjp = jax.vjp(lambda x, w: ops.dot_general(
        x, w, (((1,), (0,)), ((), ())), recipe=recipe,
        key=jax.random.key(0)), x, w)
    return vjp(y)
  try:
    jax.eval_shape(fwd_bwd, jax.ShapeDtypeStruct((16, k), jnp.float32),
                   jax.ShapeDtypeStruct((k, n), jnp.float32))
  except ValueError as e:
    return str(e).removeprefix("dot_general: ")
  return None


def gemm_unsupported(recipe: Recipe, lhs_shape, rhs_shape,
                     dimension_numbers) -> str | None:
  """Why `recipe` cannot quantize this linear GEMM, or None if it can.

  Args:
    recipe: the layer's recipe.
    lhs_shape, rhs_shape: activation and kernel shapes.
    dimension_numbers: as for `jax.lax.dot_general`.

  Returns:
    None, or a sentence naming the dimension (or the batch axes) at fault.
  """
  if not recipe.quantized:
    return None
  (lc, rc), (lb, rb) = dimension_numbers
  if lb or rb:
    return (f"a batched GEMM (batch axes {tuple(lb)} x {tuple(rb)}) is not a "
            f"linear layer")
  k = math.prod(lhs_shape[d] for d in lc)
  n = math.prod(s for d, s in enumerate(rhs_shape) if d not in tuple(rc))
  return _dims_error(recipe, k, n)


# ----------------------------------------------------------------------------
# The dot_general every layer calls.
# ----------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _needs_key(y, path):
  del path
  return y


def _needs_key_fwd(y, path):
  del path
  return y, None


def _no_key(path: str) -> ValueError:
  return ValueError(
      f"layer {path!r}: the recipe rounds stochastically but the layer got no "
      f"key. Give every train step its own: `with nvfp4_jax.precision_rules("
      f"rules, step=step):` (or `inject_linen(rules, step=step)`) around the "
      f"step, or, in linen, apply(..., rngs={{'nvfp4': "
      f"jax.random.fold_in(key, step)}}).")


def _needs_key_bwd(path, _, dy):
  raise _no_key(path)


_needs_key.defvjp(_needs_key_fwd, _needs_key_bwd)


def _plain_dot(lhs, rhs, dimension_numbers, precision, preferred_element_type,
               out_sharding):
  """What flax's layer computes: the kernel in the input's dtype, XLA's dot."""
  return jax.lax.dot_general(lhs, rhs.astype(lhs.dtype), dimension_numbers,
                             precision=precision,
                             preferred_element_type=preferred_element_type,
                             out_sharding=out_sharding)


def layer_dot_general(lhs, rhs, dimension_numbers, *, recipe: Recipe | None,
                      path: str, key: jax.Array | None, precision=None,
                      preferred_element_type=None, out_sharding=None,
                      rules: PrecisionRules | None = None,
                      on_unsupported: Callable[[str, str], None] | None = None
                      ) -> jax.Array:
  """`dot_general` of the layer at `path`, under the rules in scope.

  The explicit `recipe` wins over the rules; the rules' late switch applies to
  every quantized layer, selected by `lax.cond` on the traced step so the
  switch does not recompile.

  Args:
    lhs, rhs, dimension_numbers, precision, preferred_element_type,
      out_sharding: as `jax.lax.dot_general`; `preferred_element_type`
      defaults to `lhs`' dtype (the kernel may be in a wider one).
    recipe: the layer's own recipe (a `Recipe` or a preset's name: "nvfp4",
      "bf16", "bf16_forward", "mxfp4", "mxfp8"), or None for the rules'
      choice.
    path: the layer's path, for the rules, its key and error messages.
    key: its stochastic-rounding key; None derives one from the step in scope.
    rules: rules of the layer itself (NNX layers switched with them); None
      takes the active `precision_rules`' (the step always comes from there).
    on_unsupported: if given, a GEMM the recipe cannot quantize (see
      `gemm_unsupported`) calls it with `(path, reason)` and runs exactly as
      the flax layer would, in high precision; otherwise the op raises.
  """
  recipe = as_recipe(recipe, f"layer {path or '<root>'!r}: ")
  observe_input(path, lhs)
  if on_unsupported is not None:
    scope = current_scope()
    layer_rules = rules or (scope.rules if scope is not None
                            else _DEFAULT_RULES)
    before = layer_rules.recipe_at(path, recipe=recipe)
    reason = gemm_unsupported(before, lhs.shape, rhs.shape, dimension_numbers)
    if reason is not None:
      on_unsupported(path, reason)
      return _plain_dot(lhs, rhs, dimension_numbers, precision,
                        preferred_element_type, out_sharding)

  def run(r: Recipe, key):
    dtype = preferred_element_type or lhs.dtype
    a, b = lhs, rhs
    if not r.quantized:  # As flax's layer: both operands in the GEMM dtype.
      a, b = lhs.astype(dtype), rhs.astype(dtype)
    return ops.dot_general(a, b, dimension_numbers, precision,
                           dtype, recipe=r, key=key,
                           out_sharding=out_sharding, name=path or "<root>")
  return _layer_call(run, recipe=recipe, path=path, key=key, rules=rules)


def layer_call(run: Callable[[Recipe, jax.Array | None], Any], *,
               recipe: Recipe | str | None, path: str,
               key: jax.Array | None,
               rules: PrecisionRules | None = None) -> Any:
  """Runs the op of the layer at `path`, `run(recipe, key)`, under the rules
  in scope: the layer's recipe (its own, else the rules'), its
  stochastic-rounding key (given, else derived from the step in scope) and
  the rules' late switch (`lax.cond` on the traced step, no recompile).

  The one place a layer's recipe and key are decided: `layer_dot_general`
  (every linear layer) and the mixture-of-experts layers'
  expert GEMMs (`nvfp4_jax.flax.moe`) call it.
  """
  return _layer_call(run, recipe=as_recipe(
      recipe, f"layer {path or '<root>'!r}: "), path=path, key=key,
                     rules=rules)


def _layer_call(run: Callable[[Recipe, jax.Array | None], Any], *,
                recipe: Recipe | None, path: str, key: jax.Array | None,
                rules: PrecisionRules | None) -> Any:
  """`layer_call` with the layer's own recipe resolved (a `Recipe` or
  None)."""
  scope = current_scope()
  if rules is None:
    rules = scope.rules if scope is not None else _DEFAULT_RULES
  step = scope.step if scope is not None else None
  before = rules.recipe_at(path, recipe=recipe)
  recorder = getattr(_RECORDER, "paths", None)
  if recorder is not None:
    recorder.append(path)
  if key is None and step is not None:
    key = _step_key(path, step)

  def go(r: Recipe):
    if key is None and r.forward_needs_key:
      raise _no_key(path)
    y = run(r, key)
    return _needs_key(y, path) if key is None and r.needs_key else y

  switch = rules.late_switch
  if switch is None or not before.quantized:
    return go(before)
  if step is None:
    raise ValueError(
        f"layer {path!r}: the precision rules have a late switch at step "
        f"{switch.step}; pass step= to nvfp4_jax.precision_rules.")
  if isinstance(step, int):
    return go(rules.recipe_at(path, step, recipe=recipe))
  after = rules.recipe_at(path, switch.step, recipe=recipe)
  return jax.lax.cond(step >= switch.step, lambda: go(after),
                      lambda: go(before))


# ----------------------------------------------------------------------------
# Linen.
# ----------------------------------------------------------------------------


def _linen_path(module: nn.Module) -> str:
  return "/".join(str(p) for p in module.scope.path)


def _linen_key(module: nn.Module) -> jax.Array | None:
  return module.make_rng(RNG_STREAM) if module.has_rng(RNG_STREAM) else None


class NVFP4Dense(nn.Dense):
  """`nn.Dense` whose GEMMs follow the NVFP4 recipe.

  A subclass of `nn.Dense` taking the same arguments, building the same
  parameter tree (`kernel` `[in, out]`, `bias` `[out]`) under the same
  automatic name: flax names an unnamed submodule after its class's
  `__name__`, which is "Dense" here, so replacing `nn.Dense` by `NVFP4Dense`
  in a model keeps `Dense_0`, `Dense_1`, ... and pretrained checkpoints load
  (`repr(NVFP4Dense)` still shows the qualified name `NVFP4Dense`).

  Attributes:
    features, use_bias, dtype, param_dtype, precision, kernel_init, bias_init,
      promote_dtype: as `nn.Dense`. The kernel enters the GEMM in its
      parameter dtype (quantized GEMMs read FP32 master weights directly and
      give FP32 weight gradients); high-precision GEMMs cast it as `nn.Dense`.
    dot_general, dot_general_cls: must stay None (the layer's dot is the
      NVFP4 one; use `nn.Dense` for another).
    recipe: the layer's `Recipe`, or a preset's name ("nvfp4", "bf16",
      "bf16_forward", "mxfp4", "mxfp8"; anything else raises when the
      layer is called); None (default) takes it from the active
      `precision_rules` by module path, else `Recipe.nvfp4()`.
  """

  recipe: Recipe | str | None = None

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    if self.dot_general is not None or self.dot_general_cls is not None:
      raise ValueError(
          f"NVFP4Dense at {_linen_path(self)!r} got dot_general="
          f"{self.dot_general or self.dot_general_cls!r}; its dot is the "
          f"NVFP4 one. Use nn.Dense for a custom dot_general.")
    kernel = self.param("kernel", self.kernel_init,
                        (jnp.shape(inputs)[-1], self.features), self.param_dtype)
    bias = (self.param("bias", self.bias_init, (self.features,),
                       self.param_dtype) if self.use_bias else None)
    inputs, _, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    y = layer_dot_general(
        inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
        recipe=self.recipe, path=_linen_path(self), key=_linen_key(self),
        precision=self.precision, preferred_element_type=inputs.dtype)
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


# Flax derives auto-names ("Dense_0") from the class `__name__`.
NVFP4Dense.__name__ = "Dense"


class NVFP4DotGeneral(nn.Module):
  """A linen `dot_general` module for `nn.Dense(dot_general_cls=...)` and
  `nn.DenseGeneral(dot_general_cls=...)`: switches existing layers to NVFP4
  without editing them (`NVFP4Einsum` does the same for `nn.Einsum`).

      dense = nn.Dense(1024, dot_general_cls=nvfp4_jax.NVFP4DotGeneral)

  Its path (for the rules) is the enclosing layer's path. It works only inside
  a linen model; NNX layers take `NNXDotGeneral` (see `inject_nnx`).

  Attributes:
    recipe: as `NVFP4Dense.recipe`.
  """

  recipe: Recipe | None = None

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None, **kwargs):
    if self.scope is None:
      raise TypeError(
          "NVFP4DotGeneral is a flax.linen module: it runs only inside a "
          "linen model (nn.Dense(..., dot_general_cls=NVFP4DotGeneral)). For "
          "NNX, switch the model with nvfp4_jax.inject_nnx(model, rules), or "
          "build layers with nvfp4_jax.NVFP4Linear or "
          "nnx.Linear(..., dot_general=nvfp4_jax.NNXDotGeneral()).")
    path = "/".join(str(p) for p in self.scope.path[:-1])
    return layer_dot_general(
        lhs, rhs, dimension_numbers, recipe=self.recipe, path=path,
        key=_linen_key(self), precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding)


def einsum_plan(equation: str, lhs_ndim: int, rhs_ndim: int):
  """The `dot_general` of a linear two-operand einsum `input,kernel->out`.

  Returns:
    `(dimension_numbers, perm)`: `jnp.transpose(dot_general(input, kernel,
    dimension_numbers), perm)` is the einsum; or a string saying why the
    equation is not a linear layer (shared batch axes, an axis summed in one
    operand, an ellipsis in the kernel, a repeated index).
  """
  eq = equation.replace(" ", "")
  if "->" not in eq or eq.count(",") != 1:
    return f"einsum {equation!r} is not an explicit two-operand equation"
  ins, out = eq.split("->")
  a, b = ins.split(",")
  if "..." in b:
    return f"einsum {equation!r} has an ellipsis in the kernel's subscripts"
  if "..." in a:
    free = [c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
            if c not in eq][:lhs_ndim - len(a) + 3]
    a, out = a.replace("...", "".join(free)), out.replace("...", "".join(free))
  if (len(a), len(b)) != (lhs_ndim, rhs_ndim) or any(
      len(set(s)) != len(s) for s in (a, b, out)) or not set(out) <= set(a + b):
    return f"einsum {equation!r} does not fit operands of rank {lhs_ndim}, " \
           f"{rhs_ndim} as a linear layer"
  shared = set(a) & set(b)
  if shared & set(out):
    return (f"einsum {equation!r} shares batch axes "
            f"{''.join(sorted(shared & set(out)))} between input and kernel")
  if (set(a) | set(b)) - set(out) - shared:
    return f"einsum {equation!r} sums an axis of one operand alone"
  contract = [c for c in a if c in shared]
  dims = ((tuple(a.index(c) for c in contract),
           tuple(b.index(c) for c in contract)), ((), ()))
  names = [c for c in a if c not in shared] + [c for c in b if c not in shared]
  return dims, tuple(names.index(c) for c in out)


def einsum_layer(inputs, kernel, equation: str, *, recipe, path: str, key,
                 precision, preferred_element_type, out_sharding=None,
                 rules=None, on_unsupported=None) -> jax.Array:
  """`jnp.einsum(equation, inputs, kernel)` through `layer_dot_general`.

  An equation that is not a linear layer raises, or with `on_unsupported`
  runs `jnp.einsum` in high precision.
  """
  plan = einsum_plan(equation, inputs.ndim, kernel.ndim)
  if isinstance(plan, str):
    if on_unsupported is None:
      raise ValueError(f"layer {path!r}: {plan}; use nn.Einsum/nnx.Einsum for "
                       f"it, or a linear equation such as 'btd,dh->bth'.")
    on_unsupported(path, plan)
    return jnp.einsum(equation, inputs, kernel.astype(inputs.dtype),
                      precision=precision,
                      preferred_element_type=preferred_element_type,
                      out_sharding=out_sharding)
  dims, perm = plan
  y = layer_dot_general(
      inputs, kernel, dims, recipe=recipe, path=path, key=key,
      precision=precision,
      preferred_element_type=preferred_element_type,
      rules=rules, on_unsupported=on_unsupported)
  if perm != tuple(range(y.ndim)):
    y = jnp.transpose(y, perm)
  return apply_out_sharding(y, out_sharding)


def linen_einsum(module: nn.Einsum, inputs, einsum_str=None, *, recipe,
                 on_unsupported=None) -> jax.Array:
  """The body of `nn.Einsum.__call__` with the NVFP4 dot (bound `module`)."""
  einsum_str = nn.merge_param("einsum_str", module.einsum_str, einsum_str)
  einsum_str = einsum_str.replace(" ", "")
  if "->" not in einsum_str or einsum_str.count(",") != 1:
    raise ValueError(
        f"einsum_str must be explicit with exactly two operands, got "
        f"{einsum_str!r}.")
  kernel = module.param("kernel", module.kernel_init, module.shape,
                        module.param_dtype)
  bias = None
  if module.use_bias:
    bias_shape, broadcast_shape = module._get_bias_shape(  # pylint: disable=protected-access
        einsum_str, inputs, kernel)
    bias = module.param("bias", module.bias_init, bias_shape,
                        module.param_dtype)
  inputs, _, bias = module.promote_dtype(inputs, kernel, bias,
                                         dtype=module.dtype)
  y = einsum_layer(inputs, kernel, einsum_str, recipe=recipe,
                   path=_linen_path(module), key=_linen_key(module),
                   precision=module.precision,
                   preferred_element_type=module.preferred_element_type,
                   on_unsupported=on_unsupported)
  if bias is not None:
    y += jnp.reshape(bias, broadcast_shape)
  return y


class NVFP4Einsum(nn.Einsum):
  """`nn.Einsum` whose contraction with the kernel follows the NVFP4 recipe.

  Same arguments, parameters and automatic names ("Einsum_0") as `nn.Einsum`,
  plus `recipe` (as `NVFP4Dense.recipe`). The equation must be a linear
  layer: it contracts the input with the kernel and shares no batch axes.

  Attributes:
    shape, einsum_str, use_bias, dtype, param_dtype, precision, kernel_init,
      bias_init, promote_dtype, preferred_element_type: as `nn.Einsum`
      (`einsum_str` explicit, with "->" and exactly two operands).
    recipe: the layer's `Recipe`, or a preset's name; None (default) takes
      it from the active `precision_rules` by module path.
  """

  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, inputs: jax.Array, einsum_str: str | None = None):
    return linen_einsum(self, inputs, einsum_str, recipe=self.recipe)


NVFP4Einsum.__name__ = "Einsum"


def nvfp4_layer_paths(model: nn.Module, *args, **kwargs) -> list[str]:
  """Paths of the NVFP4 layers `model.init(*args, **kwargs)` creates.

  Traces abstractly (no FLOPs) and lists every layer whose GEMM runs through
  the library: `NVFP4Dense`, `NVFP4Einsum`, `NVFP4DotGeneral`, and, inside an
  `inject_linen` block, the flax layers it switches (not those kept in high
  precision because their shapes cannot be quantized, nor convolutions,
  embeddings or attention's batched GEMMs). Pass the result to
  `PrecisionRules.resolve`/`summary(params, layer_paths=...)`.

  Args:
    model: the linen model.
    *args: `model.init`'s inputs (arrays or `jax.ShapeDtypeStruct`s).
    **kwargs: `model.init`'s keyword arguments.

  Returns:
    The sorted, distinct module paths ("block_0/mlp/Dense_0").
  """
  outer = getattr(_RECORDER, "paths", None)
  _RECORDER.paths = paths = []
  try:
    jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))
  finally:
    _RECORDER.paths = outer
  return sorted(set(paths))
