"""Runs each Pallas kernel a few times at 8192^2 bf16, for `ncu` to profile:

    ncu --kernel-name regex:nvfp4 --section SpeedOfLight --section Occupancy \\
        --section LaunchStats python -m benchmarks.profile_kernels
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nvfp4_jax.ops.quantize_rht_t import api as rht_t_api
from nvfp4_jax.ops.quantize import api as quantize_api

if __name__ == "__main__":
  x = jax.random.normal(jax.random.key(0), (8192, 8192),
                        jnp.float32).astype(jnp.bfloat16)
  key = jax.random.key(1)
  fns = [
      functools.partial(quantize_api.quantize, implementation="pallas"),
      functools.partial(quantize_api.quantize, rounding="stochastic", key=key,
                        implementation="pallas"),
      functools.partial(rht_t_api.quantize_rht_t, implementation="pallas"),
  ]
  for fn in fns:
    jax.block_until_ready(jax.jit(fn)(x))
