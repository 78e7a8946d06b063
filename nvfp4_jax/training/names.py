"""The names the training ops give their traces.

`dot_general` and `ragged_dot` share them: each GEMM and quantizer is a
named region of the jaxpr (`named`), the quantized residuals carry one
checkpoint name (`residual`, saved by `remat_policy`), and a layer's GEMMs
run under its name scope (`layer_scope`, parsed back by `nvfp4_jax.report`).
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

from nvfp4_jax.core.recipe import Recipe

RESIDUAL_NAME = "nvfp4_residual"
LAYER_SCOPE = "nvfp4_layer"


def remat_policy():
  """A `jax.checkpoint` policy that saves only the quantized residuals.

  Inside a rematerialized block (`jax.checkpoint(..., policy=remat_policy())`
  or `nn.remat(Block, policy=...)`) the backward pass keeps the NVFP4
  layers' quantized Wgrad operands and weights (4.5 bits per element) and
  recomputes everything else from the block's input.

  Returns:
    The policy, `jax.checkpoint_policies.save_only_these_names` of the
    library's residual name.
  """
  return jax.checkpoint_policies.save_only_these_names(RESIDUAL_NAME)


def residual(tree):
  """Names the leaves of a quantized residual for `remat_policy`."""
  return jax.tree.map(lambda a: checkpoint_name(a, RESIDUAL_NAME), tree)


def named(name: str, fn: Callable) -> Callable:
  """Jits `fn` under `name`, so each GEMM is a named region of the jaxpr."""
  fn.__name__ = fn.__qualname__ = name
  return jax.jit(fn)


def layer_scope(name: str | None, recipe: Recipe) -> str:
  """`nvfp4_layer[<layer path>|<recipe tag>]`, the name scope of a layer's
  GEMMs (parsed back by `nvfp4_jax.report`)."""
  return f"{LAYER_SCOPE}[{name or '?'}|{recipe.tag}]"
