"""The pure-jnp reference of `gather_rows`."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """`x[index]` along rows, zeros where `index` is outside `[0, rows)`."""
  rows = x.shape[0]
  # `jnp.take` wraps negative indices even with a fill: none here.
  index = jnp.where(index < 0, rows, index)
  return jnp.take(x, index, axis=0, mode="fill", fill_value=0)
