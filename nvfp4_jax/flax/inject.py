"""Unmodified third-party flax models on NVFP4: `inject_linen`, `inject_nnx`.

Linen, one `with` around the forward pass (inside the jitted step):

    with nvfp4_jax.inject_linen(rules, step=step, unsupported="high_precision"):
      logits = model.apply(params, images, train=True, rngs=rngs)

NNX, one call after building the model, and the step in the jitted step:

    nvfp4_jax.inject_nnx(model, rules, unsupported="high_precision")
    ...
    with nvfp4_jax.precision_rules(rules, step=step):
      loss, grads = nnx.value_and_grad(loss_fn)(model, batch)

What is switched: `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum` (linen; the
query/key/value/out projections of `nn.MultiHeadDotProductAttention` are
`DenseGeneral`s), `nnx.Linear`, `nnx.LinearGeneral` and `nnx.Einsum` (NNX;
`nnx.MultiHeadAttention`'s projections are `LinearGeneral`s). Parameters and
their names do not change. Attention's batched score/value GEMMs,
convolutions, embeddings and layers given a `dot_general` of their own stay as
they are. Rules address layers by the model's own paths: module paths in
linen ("Transformer/encoderblock_3/MlpBlock_0/Dense_0"), attribute paths in
NNX ("decoder/encoderdecoderblock_3/mlp/linear1").

A layer the recipe cannot quantize (an input or output size that is not a
multiple of 16 -- a 1000-class head, a 50257-entry vocabulary -- or batch axes)
raises with `unsupported="error"` (the default), naming every such layer; with
`unsupported="high_precision"` it runs exactly as the flax layer would and
one warning names them all.

Stochastic rounding keys differ per layer and per step: linen layers draw from
an "nvfp4" RNG stream if `apply` gets one, else (like NNX layers) fold the
CRC32 of their path into the `step`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Any, Iterator

import flax.linen as nn
import flax.linen.dtypes as linen_dtypes
import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from nvfp4_jax.flax import linen as layers
from nvfp4_jax.flax import nnx as nnx_layers
from nvfp4_jax.core.recipe import Recipe
from nvfp4_jax.flax.rules import PrecisionRules
from nvfp4_jax.flax.rules import precision_rules

UNSUPPORTED = ("error", "high_precision")

_NVFP4_LINEN = (layers.NVFP4Dense, layers.NVFP4Einsum, layers.NVFP4DotGeneral)


def _check_args(where: str, rules, unsupported: str) -> PrecisionRules:
  if rules is None:
    rules = PrecisionRules()
  if not isinstance(rules, PrecisionRules):
    raise TypeError(f"{where} needs PrecisionRules, got {rules!r}; build them "
                    f"with nvfp4_jax.PrecisionRules(...) or paper_rules(...).")
  if unsupported not in UNSUPPORTED:
    raise ValueError(f"{where}: unsupported={unsupported!r}; use one of "
                     f"{UNSUPPORTED}.")
  return rules


def _unsupported(where: str, found: dict[str, str], mode: str) -> None:
  """Raises or warns once, naming every layer that cannot be quantized."""
  names = "; ".join(f"{p!r}: {r.rstrip('.')}" for p, r in sorted(found.items()))
  if mode == "error":
    raise ValueError(
        f"{where}: {len(found)} layer(s) cannot be quantized -- {names}. Keep "
        f"them in high precision with unsupported='high_precision', or with a "
        f"rule such as (r'^head$', Recipe.bf16()), or pad their sizes.")
  warnings.warn(f"{where}: {len(found)} layer(s) stay in high precision, "
                f"their shapes cannot be quantized -- {names}.", stacklevel=3)


# ----------------------------------------------------------------------------
# Linen.
# ----------------------------------------------------------------------------


def _keep_kernel(inputs, kernel, bias, *, dtype=None, inexact=True):
  """flax.linen's default `promote_dtype`, minus the kernel's promotion: the
  NVFP4 dot reads the kernel in its parameter dtype (see `NVFP4Dense`)."""
  inputs, _, bias = linen_dtypes.promote_dtype(inputs, kernel, bias,
                                               dtype=dtype, inexact=inexact)
  return [inputs, kernel, bias]


@contextlib.contextmanager
def _with_fields(module: nn.Module, **values) -> Iterator[None]:
  """Sets fields of a (frozen) linen module for the duration of one call.

  The module is bound and in its compact call already; the values are
  restored on exit, so clones, transforms and later calls see the original.
  """
  old = {k: getattr(module, k) for k in values}
  for k, v in values.items():
    object.__setattr__(module, k, v)
  try:
    yield
  finally:
    for k, v in old.items():
      object.__setattr__(module, k, v)


@contextlib.contextmanager
def inject_linen(rules: PrecisionRules | None = None, *, step: Any = None,
                 unsupported: str = "error") -> Iterator[PrecisionRules]:
  """Runs the linear layers of unmodified linen models on the NVFP4 recipe.

  Intercepts (`nn.intercept_methods`) the calls of `nn.Dense`,
  `nn.DenseGeneral` (so attention's q/k/v/out projections) and `nn.Einsum`
  traced inside the block and gives them the NVFP4 `dot_general`, under
  `precision_rules(rules, step=step)`. Use it inside the jitted function,
  around `model.init`/`model.apply`; the parameter tree is the model's own.

  Args:
    rules: `PrecisionRules` on module paths; None means `PrecisionRules()`
      (every layer `Recipe.nvfp4()`).
    step: the training step (traced or int): seeds the stochastic rounding of
      layers when `apply` gets no "nvfp4" RNG stream, and drives a late switch.
    unsupported: "error" or "high_precision", for layers whose shapes the
      recipe cannot quantize (see the module docstring).

  Yields:
    The rules.

  Raises:
    ValueError: on exit, with unsupported="error", naming the layers that
      cannot be quantized.
  """
  rules = _check_args("inject_linen", rules, unsupported)
  found: dict[str, str] = {}

  def record(path: str, reason: str) -> None:
    found.setdefault(path, reason)

  def interceptor(next_fun, args, kwargs, context):
    m = context.module
    if context.method_name != "__call__" or isinstance(m, _NVFP4_LINEN):
      return next_fun(*args, **kwargs)
    if isinstance(m, nn.Einsum):
      return layers.linen_einsum(m, *args, recipe=None, on_unsupported=record,
                                 **kwargs)
    if (not isinstance(m, (nn.Dense, nn.DenseGeneral))
        or m.dot_general is not None or m.dot_general_cls is not None):
      return next_fun(*args, **kwargs)
    path, key = layers._linen_path(m), layers._linen_key(m)  # pylint: disable=protected-access

    def dot_general(lhs, rhs, dimension_numbers, precision=None,
                    preferred_element_type=None, out_sharding=None, **_):
      return layers.layer_dot_general(
          lhs, rhs, dimension_numbers, recipe=None, path=path, key=key,
          precision=precision, preferred_element_type=preferred_element_type,
          out_sharding=out_sharding, on_unsupported=record)
    fields = {"dot_general": dot_general}
    if m.promote_dtype is linen_dtypes.promote_dtype:
      fields["promote_dtype"] = _keep_kernel
    with _with_fields(m, **fields):
      return next_fun(*args, **kwargs)

  with precision_rules(rules, step=step), nn.intercept_methods(interceptor):
    yield rules
  if found:
    _unsupported("inject_linen", found, unsupported)


# ----------------------------------------------------------------------------
# NNX.
# ----------------------------------------------------------------------------


def _nnx_gemm(node) -> str | tuple[int, int] | None:
  """`(K, N)` of an NNX layer's GEMM, a reason it is not a linear layer, or
  None for a layer that is not switchable (a custom dot, another module)."""
  if isinstance(node, nnx.Linear):
    if not (node.dot_general is jax.lax.dot_general
            or isinstance(node.dot_general, nnx_layers.NNXDotGeneral)):
      return None
    return node.in_features, node.out_features
  if isinstance(node, nnx.LinearGeneral):
    if node.dot_general_cls is not None or not (
        node.dot_general is None
        or isinstance(node.dot_general, nnx_layers.NNXDotGeneral)):
      return None
    if node.batch_axis:
      return f"batch axes {dict(node.batch_axis)} (a batched GEMM)"
    return math.prod(node.in_features), math.prod(node.out_features)
  if isinstance(node, nnx.Einsum):
    if not (node.einsum_op is jnp.einsum
            or isinstance(node.einsum_op, nnx_layers.NNXEinsumOp)):
      return None
    lhs = node.einsum_str.split(",")[0]
    plan = layers.einsum_plan(node.einsum_str,
                              len(lhs) - 3 if "..." in lhs else len(lhs),
                              len(node.kernel_shape))
    if isinstance(plan, str):
      return plan
    ((_, rc), _), _ = plan
    k = math.prod(node.kernel_shape[d] for d in rc)
    return k, math.prod(node.kernel_shape) // k
  return None


def inject_nnx(model: nnx.Module, rules: PrecisionRules | None = None, *,
               unsupported: str = "error") -> dict[str, Recipe]:
  """Switches an NNX model's linear layers to the NVFP4 recipe, in place.

  Every `nnx.Linear`, `nnx.LinearGeneral` and `nnx.Einsum` (with flax's own
  dot) gets an `NNXDotGeneral` (`NNXEinsumOp`) holding its attribute path and
  `rules`; `NVFP4Linear` layers get their path and the rules. No state
  changes: `nnx.state(model)` is the same tree before and after. Train under
  `precision_rules(rules, step=step)` (the same rules): the step seeds each
  layer's stochastic rounding and drives a late switch.

  Args:
    model: the model (any graph of NNX modules).
    rules: `PrecisionRules` on attribute paths ("layers/0/mlp/up"); None means
      `PrecisionRules()`.
    unsupported: "error" or "high_precision": what to do with layers whose
      shapes the recipe cannot quantize (with "high_precision" they are left
      untouched and one warning names them).

  Returns:
    `{path: Recipe}` of every switched layer (before any late switch).

  Raises:
    ValueError: naming rules that match no switchable layer, or (with
      unsupported="error") the layers that cannot be quantized; the model is
      then left unchanged.
  """
  rules = _check_args("inject_nnx", rules, unsupported)
  plan, found = {}, {}
  for path, node in nnx.iter_graph(model):
    gemm = _nnx_gemm(node)
    if gemm is None:
      continue
    p = "/".join(str(k) for k in path)
    recipe = rules.recipe_for(p)
    if isinstance(node, nnx_layers.NVFP4Linear) and node.recipe is not None:
      recipe = node.recipe
    reason = gemm if isinstance(gemm, str) else (
        layers._dims_error(recipe, *gemm) if recipe.quantized else None)  # pylint: disable=protected-access
    if reason is not None:
      found[p] = reason
    else:
      plan[p] = (node, recipe)
  unused = rules.unused_rules(plan)
  if unused:
    raise ValueError(
        f"inject_nnx: precision rules matched no layer: {unused}. Layer paths "
        f"look like {sorted(plan)[:4]}; fix the patterns.")
  if found and unsupported == "error":
    _unsupported("inject_nnx", found, unsupported)
  for p, (node, recipe) in plan.items():
    if isinstance(node, nnx.Einsum):
      node.einsum_op = nnx_layers.NNXEinsumOp(path=p, rules=rules)
    elif isinstance(node, nnx_layers.NVFP4Linear):
      node.dot_general = dataclasses.replace(node.dot_general, path=p,
                                             rules=rules)
    else:
      node.dot_general = nnx_layers.NNXDotGeneral(path=p, rules=rules)
    if node.promote_dtype is nnx_dtypes.promote_dtype:
      node.promote_dtype = nnx_layers.KeepKernelDtype()
  if found:
    _unsupported("inject_nnx", found, unsupported)
  return {p: recipe for p, (_, recipe) in plan.items()}
