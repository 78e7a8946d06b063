"""The smallest "replace nn.Dense" example: a multi-layer perceptron."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

import nvfp4_jax


class MLP(nn.Module):
  """`Dense -> ReLU -> ... -> Dense`, every layer an `NVFP4Dense`.

  The layers are named `dense_0 ... dense_{n-1}` (the last one is the output
  layer). With `recipe=None` each layer takes its recipe from the active
  `nvfp4_jax.PrecisionRules`; pass a `Recipe` to fix one for all layers.
  Widths (and the batch, for the Wgrad GEMM) must be multiples of 16 for
  NVFP4, of 32 for MX formats.

  Attributes:
    features: output width of each layer, e.g. `(256, 256, 16)`.
    recipe: a fixed `nvfp4_jax.Recipe` for every layer, or None for the rules.
    dtype: compute dtype.
  """

  features: Sequence[int]
  recipe: nvfp4_jax.Recipe | None = None
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i, width in enumerate(self.features):
      x = nvfp4_jax.NVFP4Dense(width, dtype=self.dtype, recipe=self.recipe,
                               name=f"dense_{i}")(x)
      if i < len(self.features) - 1:
        x = nn.relu(x)
    return x
