"""NVFP4 layers for flax NNX: `NVFP4Linear`, `NNXDotGeneral`, `NNXEinsumOp`.

NNX layers are attribute graphs, so the NVFP4 GEMM is a static, hashable
value stored on the layer (no state): `NNXDotGeneral` is the `dot_general` of
`nnx.Linear`/`nnx.LinearGeneral`, `NNXEinsumOp` the `einsum_op` of
`nnx.Einsum`, and `NVFP4Linear` is `nnx.Linear` built with one.
`nvfp4_jax.inject_nnx` switches an unmodified model's layers onto them.

Stochastic-rounding keys fold the CRC32 of the layer's attribute path (set by
`inject_nnx`/`apply_rules`) into the step of the active `precision_rules`;
`NVFP4Linear` draws from an "nvfp4" RNG stream instead if given one.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from nvfp4_jax.flax.linen import RNG_STREAM
from nvfp4_jax.flax.linen import einsum_layer
from nvfp4_jax.flax.linen import layer_dot_general
from nvfp4_jax.core.recipe import Recipe
from nvfp4_jax.core.recipe import as_recipe
from nvfp4_jax.flax.rules import PrecisionRules
from nvfp4_jax.flax.rules import current_scope

@dataclasses.dataclass(frozen=True, kw_only=True)
class NNXDotGeneral:
  """The NVFP4 `dot_general` of an NNX layer (`nnx.Linear(dot_general=...)`,
  `nnx.LinearGeneral(dot_general=...)`).

  A static, hashable value (no state): `inject_nnx` sets one with the layer's
  path and rules on every layer it switches. The stochastic-rounding key of a
  call is derived from the step of the active `precision_rules` and the path.

  Attributes:
    path: the layer's attribute path ("layers/0/mlp/up"); None until
      `inject_nnx`/`apply_rules` sets it.
    recipe: the layer's own recipe, overriding the rules' choice.
    rules: the `PrecisionRules` the layer was switched with; None takes the
      active `precision_rules`'. With rules set, a `precision_rules` block
      around the call must hold the same rules (it gives the step).
  """

  path: str | None = None
  recipe: Recipe | None = None
  rules: PrecisionRules | None = None

  def __post_init__(self):
    # A preset's name ("bf16", ...) becomes its Recipe here, once.
    object.__setattr__(self, "recipe",
                       as_recipe(self.recipe, f"{type(self).__name__}: "))

  def _rules_and_path(self, key) -> tuple[PrecisionRules | None, str]:
    scope = current_scope()
    if (self.rules is not None and scope is not None
        and scope.rules is not self.rules and scope.rules != self.rules):
      raise ValueError(
          f"NNX layer {self.path!r} was switched with other rules than the "
          f"precision_rules in scope; pass the same rules to both, or call "
          f"nvfp4_jax.inject_nnx(model, new_rules) again.")
    if (self.path is None and key is None and scope is not None
        and scope.step is not None):
      raise ValueError(
          "an NNX NVFP4 layer has no path, so its stochastic-rounding key "
          "would be shared with every other unnamed layer: call "
          "nvfp4_jax.inject_nnx(model, rules) (or apply_rules) once after "
          "building the model, or give NVFP4Linear rngs with an 'nvfp4' "
          "stream.")
    return self.rules, self.path or ""

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None, *, key=None):
    rules, path = self._rules_and_path(key)
    return layer_dot_general(
        lhs, rhs, dimension_numbers, recipe=self.recipe, path=path, key=key,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding, rules=rules)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NNXEinsumOp(NNXDotGeneral):
  """The NVFP4 `einsum_op` of an `nnx.Einsum` (same attributes as
  `NNXDotGeneral`; called like `jnp.einsum(equation, inputs, kernel)`).

  An equation that is not a linear layer runs `jnp.einsum` in high precision
  with a warning.

  Attributes:
    path: the layer's attribute path; None until `inject_nnx`/`apply_rules`
      sets it.
    recipe: the layer's own recipe, overriding the rules' choice.
    rules: the `PrecisionRules` the layer was switched with; None takes the
      active `precision_rules`'.
  """

  def __call__(self, equation, inputs, kernel, precision=None,
               preferred_element_type=None, out_sharding=None):
    rules, path = self._rules_and_path(None)

    def warn(path, reason):
      warnings.warn(f"NNX einsum layer {path!r} stays in high precision: "
                    f"{reason}.", stacklevel=3)
    return einsum_layer(inputs, kernel, equation, recipe=self.recipe,
                        path=path, key=None, precision=precision,
                        preferred_element_type=preferred_element_type,
                        out_sharding=out_sharding, rules=rules,
                        on_unsupported=warn)


class NVFP4Linear(nnx.Linear):
  """`nnx.Linear` whose GEMMs follow the NVFP4 recipe.

  A subclass of `nnx.Linear` taking its arguments with the same meaning and
  holding the same state (`kernel` `[in, out]`, `bias`), so checkpoints
  interchange. Differences:

  - `dot_general` must be None (or `jax.lax.dot_general`): the layer's dot is
    an `NNXDotGeneral`, stored as `layer.dot_general`.
  - The kernel enters the GEMM in its parameter dtype, as in `NVFP4Dense`.
  - `rngs` with an "nvfp4" stream: the layer forks it into `sr_rngs` (extra
    RNG state, not `nnx.Param`) and draws a new stochastic-rounding key on
    every call. Without one, keys come from the step of `precision_rules` and
    the path `inject_nnx`/`apply_rules` set.

  Args:
    in_features: as `nnx.Linear`.
    out_features: as `nnx.Linear`.
    recipe: the layer's `Recipe` or a preset's name ("nvfp4", "bf16",
      "bf16_forward", "mxfp4", "mxfp8"); None uses the rules
      (`apply_rules`, or the active `precision_rules`).
    dot_general: see above.
    rngs: as `nnx.Linear`; an "nvfp4" stream seeds stochastic rounding
      (above).
    **kwargs: the other arguments of `nnx.Linear` (`use_bias`, `dtype`,
      `param_dtype`, `precision`, `kernel_init`, `bias_init`,
      `promote_dtype`, `preferred_element_type`, `kernel_metadata`,
      `bias_metadata`), with its meaning.

  Raises:
    ValueError: a `dot_general` other than `jax.lax.dot_general`.
  """

  def __init__(self, in_features: int, out_features: int, *,
               recipe: Recipe | str | None = None, dot_general=None,
               rngs: nnx.Rngs, **kwargs):
    if dot_general is not None and dot_general is not jax.lax.dot_general:
      raise ValueError(
          f"NVFP4Linear got dot_general={dot_general!r}; its dot is the "
          f"NVFP4 one. Use nnx.Linear for a custom dot_general.")
    super().__init__(in_features, out_features, rngs=rngs, **kwargs)
    self.dot_general = NNXDotGeneral(
        recipe=as_recipe(recipe, "NVFP4Linear: "))
    if RNG_STREAM in rngs:
      self.sr_rngs = rngs[RNG_STREAM].fork()

  @property
  def recipe(self) -> Recipe | None:
    """The recipe the layer was built with (None: the rules in scope decide)."""
    return self.dot_general.recipe

  @property
  def path(self) -> str | None:
    """The layer's path, the name precision rules match (None: unnamed)."""
    return self.dot_general.path

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    inputs, _, bias = self.promote_dtype((inputs, kernel, bias),
                                         dtype=self.dtype)
    key = self.sr_rngs() if hasattr(self, "sr_rngs") else None
    y = self.dot_general(
        inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
        precision=self.precision,
        preferred_element_type=self.preferred_element_type,
        out_sharding=out_sharding, key=key)
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


@dataclasses.dataclass(frozen=True)
class KeepKernelDtype:
  """An NNX `promote_dtype` that promotes inputs and bias but leaves the
  kernel in its parameter dtype, for the NVFP4 dot to read directly."""

  promote: Callable = nnx_dtypes.promote_dtype

  def __call__(self, args, /, *, dtype=None, **kwargs):
    inputs, kernel, bias = args
    inputs, _, bias = self.promote(args, dtype=dtype, **kwargs)
    return inputs, kernel, bias


def apply_rules(model: nnx.Module, rules) -> dict[str, Recipe]:
  """Sets every `NVFP4Linear` in `model` to the recipe `rules` give its path,
  and every `NNXMoE`'s expert GEMMs (".../experts/up", ".../experts/down").

  Paths are the attribute names joined by "/", e.g. "blocks/0/mlp/up". (To
  switch an unmodified model's `nnx.Linear` layers, use `inject_nnx`.)

  Args:
    model: the NNX model; its layers are updated in place.
    rules: the `PrecisionRules` (`recipe_for(path)` picks each layer's
      recipe; a rule that matches no layer is an error).

  Returns:
    The resolved `{path: Recipe}` of every NVFP4 layer.

  Raises:
    ValueError: naming rules that matched no layer.
  """
  from nvfp4_jax.flax.moe import NNXMoE  # pylint: disable=g-import-not-at-top
  layers, experts = {}, {}
  for path, node in nnx.iter_graph(model):
    name = "/".join(str(p) for p in path)
    if isinstance(node, NVFP4Linear):
      layers[name] = node
    elif isinstance(node, NNXMoE):
      for which in ("up", "down"):
        experts[f"{name}/experts/{which}"] = (node, f"{which}_gemm")
  unused = rules.unused_rules([*layers, *experts])
  if unused:
    raise ValueError(f"precision rules matched no layer: {unused}; layer paths "
                     f"are {sorted(layers)[:4]}...")
  resolved = {}
  for path, node in layers.items():
    node.dot_general = dataclasses.replace(
        node.dot_general, path=path, recipe=rules.recipe_for(path))
    resolved[path] = node.recipe
  for path, (node, attr) in experts.items():
    op = dataclasses.replace(getattr(node, attr), path=path,
                             recipe=rules.recipe_for(path))
    setattr(node, attr, op)
    resolved[path] = op.recipe
  return resolved
