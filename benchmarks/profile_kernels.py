"""Runs each Pallas kernel a few times at 8192^2 bf16, for `ncu` to profile:

    ncu --kernel-name regex:nvfp4 --section SpeedOfLight --section Occupancy \\
        --section LaunchStats python -m benchmarks.profile_kernels
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nvfp4_jax import fused
from nvfp4_jax import nvfp4

if __name__ == "__main__":
  x = jax.random.normal(jax.random.key(0), (8192, 8192),
                        jnp.float32).astype(jnp.bfloat16)
  key = jax.random.key(1)
  fns = [
      functools.partial(nvfp4.quantize, implementation="pallas"),
      functools.partial(nvfp4.quantize, rounding="stochastic", key=key,
                        implementation="pallas"),
      functools.partial(fused.quantize_rht_t, implementation="pallas"),
  ]
  for fn in fns:
    jax.block_until_ready(jax.jit(fn)(x))
