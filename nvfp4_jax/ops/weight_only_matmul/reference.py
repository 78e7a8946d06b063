"""The weight-only matmul's reference: block-dequantize the weight, then a dot.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp


from nvfp4_jax.ops.block_values.api import block_dequantize


def _weight_only_xla(x, w, *, out_dtype):
  vals, _ = block_dequantize(w)
  acc = jax.lax.dot_general(x.astype(jnp.bfloat16), vals,
                            (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
  return (acc * w.tensor_scale).astype(out_dtype)
