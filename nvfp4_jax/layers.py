"""Drop-in NVFP4 layers for flax: linen `NVFP4Dense`, `NVFP4DotGeneral`, and
NNX `NVFP4Linear`.

Each layer runs its GEMMs through `nvfp4_jax.dot_general` with the recipe it is
given or, by default, the one the active `precision_rules` assign to its module
path.

Stochastic-rounding keys. A linen layer draws its key from the RNG stream named
"nvfp4" (`model.apply(..., rngs={"nvfp4": jax.random.fold_in(key, step)})`);
linen folds the module path in, so every layer gets its own key. Without that
stream, a `step` given to `precision_rules` seeds it instead (key = fold of the
path's CRC32 and the step). An NNX layer draws from its `rngs.nvfp4` stream,
advanced on every call.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen.dtypes import promote_dtype

from nvfp4_jax import ops
from nvfp4_jax.recipe import Recipe
from nvfp4_jax.rules import PrecisionRules
from nvfp4_jax.rules import current_scope

RNG_STREAM = "nvfp4"

default_kernel_init = nn.initializers.lecun_normal()

# Outside any `precision_rules` block every layer runs the paper's recipe.
_DEFAULT_RULES = PrecisionRules()


def _step_key(path: str, step: Any) -> jax.Array:
  key = jax.random.fold_in(jax.random.key(0), zlib.crc32(path.encode()))
  return jax.random.fold_in(key, step)


def layer_dot_general(lhs, rhs, dimension_numbers, *, recipe: Recipe | None,
                      path: str, key: jax.Array | None, precision=None,
                      preferred_element_type=None) -> jax.Array:
  """`dot_general` of the layer at `path`, under the rules in scope.

  The explicit `recipe` wins over the rules; the rules' late switch applies to
  every quantized layer, selected by `lax.cond` on the traced step so the
  switch does not recompile.
  """
  scope = current_scope()
  rules = scope.rules if scope is not None else _DEFAULT_RULES
  step = scope.step if scope is not None else None
  if key is None and step is not None:
    key = _step_key(path, step)

  def run(r: Recipe):
    return ops.dot_general(lhs, rhs, dimension_numbers, precision,
                           preferred_element_type, recipe=r, key=key,
                           name=path or "<root>")

  switch = rules.late_switch
  before = rules.recipe_at(path, recipe=recipe)
  if switch is None or not before.quantized:
    return run(before)
  if step is None:
    raise ValueError(
        f"layer {path!r}: the precision rules have a late switch at step "
        f"{switch.step}; pass step= to nvfp4_jax.precision_rules.")
  if isinstance(step, int):
    return run(rules.recipe_at(path, step, recipe=recipe))
  after = rules.recipe_at(path, switch.step, recipe=recipe)
  return jax.lax.cond(step >= switch.step, lambda: run(after),
                      lambda: run(before))


def _linen_path(module: nn.Module) -> str:
  return "/".join(str(p) for p in module.scope.path)


def _linen_key(module: nn.Module) -> jax.Array | None:
  return module.make_rng(RNG_STREAM) if module.has_rng(RNG_STREAM) else None


class NVFP4Dense(nn.Module):
  """`nn.Dense` whose GEMMs follow the NVFP4 recipe.

  Same constructor arguments and parameter tree as `nn.Dense` (`kernel`
  `[in, out]`, `bias` `[out]`), so checkpoints interchange.

  Attributes:
    features, use_bias, dtype, param_dtype, precision, kernel_init, bias_init:
      as `nn.Dense`.
    recipe: the layer's `Recipe`; None (default) takes it from the active
      `precision_rules` by module path, else `Recipe.nvfp4()`.
  """

  features: int
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Callable = default_kernel_init
  bias_init: Callable = nn.initializers.zeros_init()
  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    kernel = self.param("kernel", self.kernel_init,
                        (jnp.shape(inputs)[-1], self.features), self.param_dtype)
    bias = (self.param("bias", self.bias_init, (self.features,),
                       self.param_dtype) if self.use_bias else None)
    # The kernel goes in its parameter dtype: quantized GEMMs read it directly
    # (FP32 master weights give FP32 weight gradients) and bf16 GEMMs cast it
    # to the compute dtype exactly as nn.Dense does.
    inputs, _, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    y = layer_dot_general(
        inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
        recipe=self.recipe, path=_linen_path(self), key=_linen_key(self),
        precision=self.precision, preferred_element_type=inputs.dtype)
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


class NVFP4DotGeneral(nn.Module):
  """A `dot_general` module for `nn.Dense(dot_general_cls=...)` and
  `nn.DenseGeneral(dot_general_cls=...)`: switches existing layers to NVFP4
  without editing them (`NVFP4Einsum` does the same for `nn.Einsum`).

      dense = nn.Dense(1024, dot_general_cls=nvfp4_jax.NVFP4DotGeneral)

  Its path (for the rules) is the enclosing layer's path.

  Attributes:
    recipe: as `NVFP4Dense.recipe`.
  """

  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, **kwargs):
    path = "/".join(str(p) for p in self.scope.path[:-1])
    return layer_dot_general(
        lhs, rhs, dimension_numbers, recipe=self.recipe, path=path,
        key=_linen_key(self), precision=precision,
        preferred_element_type=preferred_element_type)


class NVFP4Einsum(nn.Einsum):
  """`nn.Einsum` whose contraction with the kernel follows the NVFP4 recipe.

  Same arguments and parameters as `nn.Einsum` plus `recipe` (as
  `NVFP4Dense.recipe`). The equation must contract the input with the kernel
  without batch axes shared between them (a linear layer).
  """

  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, inputs: jax.Array, einsum_str: str | None = None):
    einsum_str = nn.merge_param("einsum_str", self.einsum_str, einsum_str)
    einsum_str = einsum_str.replace(" ", "")
    if "->" not in einsum_str or einsum_str.count(",") != 1:
      raise ValueError(
          f"einsum_str must be explicit with exactly two operands, got "
          f"{einsum_str!r}.")
    kernel = self.param("kernel", self.kernel_init, self.shape,
                        self.param_dtype)
    bias = None
    if self.use_bias:
      bias_shape, broadcast_shape = self._get_bias_shape(einsum_str, inputs,
                                                         kernel)
      bias = self.param("bias", self.bias_init, bias_shape, self.param_dtype)
    inputs, _, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    path, key = _linen_path(self), _linen_key(self)

    def dot_general(lhs, rhs, dimension_numbers, precision=None,
                    preferred_element_type=None, **kwargs):
      return layer_dot_general(
          lhs, rhs, dimension_numbers, recipe=self.recipe, path=path, key=key,
          precision=precision,
          preferred_element_type=preferred_element_type or inputs.dtype)

    y = jnp.einsum(einsum_str, inputs, kernel, precision=self.precision,
                   preferred_element_type=self.preferred_element_type,
                   _dot_general=dot_general)
    if bias is not None:
      y += jnp.reshape(bias, broadcast_shape)
    return y


def nvfp4_layer_paths(model: nn.Module, *args, **kwargs) -> list[str]:
  """Paths of the NVFP4 layers `model.init(*args, **kwargs)` creates.

  Traces abstractly (no FLOPs); pass the result to
  `PrecisionRules.resolve(params, layer_paths=...)`.
  """
  paths = []

  def interceptor(next_fun, fargs, fkwargs, context):
    m = context.module
    if context.method_name == "__call__":
      if isinstance(m, (NVFP4Dense, NVFP4Einsum)):
        paths.append(_linen_path(m))
      elif isinstance(m, NVFP4DotGeneral):
        paths.append("/".join(str(p) for p in m.scope.path[:-1]))
    return next_fun(*fargs, **fkwargs)

  with nn.intercept_methods(interceptor):
    jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))
  return sorted(set(paths))


class NVFP4Linear(nnx.Module):
  """`nnx.Linear` whose GEMMs follow the NVFP4 recipe (same arguments and state).

  Args:
    in_features, out_features, use_bias, dtype, param_dtype, precision,
      kernel_init, bias_init, rngs: as `nnx.Linear`. If `rngs` has an "nvfp4"
      stream, the layer forks it and draws a new stochastic-rounding key on
      every call.
    recipe: the layer's `Recipe`; None uses the default of the active
      `precision_rules` (NNX modules do not know their path: set per-layer
      recipes with `apply_rules`).
  """

  def __init__(self, in_features: int, out_features: int, *,
               use_bias: bool = True, dtype=None, param_dtype=jnp.float32,
               precision=None, kernel_init=default_kernel_init,
               bias_init=nnx.initializers.zeros_init(),
               recipe: Recipe | None = None, rngs: nnx.Rngs):
    self.kernel = nnx.Param(kernel_init(rngs.params(),
                                        (in_features, out_features),
                                        param_dtype))
    self.bias = (nnx.Param(bias_init(rngs.params(), (out_features,),
                                     param_dtype))
                 if use_bias else nnx.data(None))
    self.in_features = in_features
    self.out_features = out_features
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.recipe = recipe
    self.path = ""
    self.sr_rngs = (rngs[RNG_STREAM].fork() if RNG_STREAM in rngs
                    else nnx.data(None))

  def __call__(self, inputs: jax.Array) -> jax.Array:
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    inputs, _, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    key = self.sr_rngs() if self.sr_rngs is not None else None
    y = layer_dot_general(
        inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
        recipe=self.recipe, path=self.path, key=key, precision=self.precision,
        preferred_element_type=inputs.dtype)
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


def apply_rules(model: nnx.Module, rules) -> dict[str, Recipe]:
  """Sets every `NVFP4Linear` in `model` to the recipe `rules` give its path.

  Paths are the attribute names joined by "/", e.g. "blocks/0/mlp/up".

  Returns:
    The resolved `{path: Recipe}` of every NVFP4 layer.

  Raises:
    ValueError: naming rules that matched no layer.
  """
  layers = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, NVFP4Linear):
      layers["/".join(str(p) for p in path)] = node
  unused = rules.unused_rules(layers)
  if unused:
    raise ValueError(f"precision rules matched no layer: {unused}; layer paths "
                     f"are {sorted(layers)[:4]}...")
  resolved = {}
  for path, node in layers.items():
    node.recipe = rules.recipe_for(path)
    node.path = path
    resolved[path] = node.recipe
  return resolved
