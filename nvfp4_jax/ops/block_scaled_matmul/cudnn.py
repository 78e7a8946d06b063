"""The native FP4 GEMM through cuDNN: `jax.nn.scaled_matmul` (Blackwell).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from nvfp4_jax.core import dispatch
from nvfp4_jax.core.arrays import NVFP4Array

from nvfp4_jax.ops.block_scaled_matmul.reference import gemm_alpha


def _require_nvfp4(a, b, what):
  if not (isinstance(a, NVFP4Array) and isinstance(b, NVFP4Array)):
    raise NotImplementedError(
        f"implementation={what!r} takes NVFP4Arrays only; use 'xla' for MX.")


def _matmul_scaled_matmul(a, b, *, out_dtype):
  _require_nvfp4(a, b, "scaled_matmul")
  if dispatch.platform() != "gpu":
    raise NotImplementedError(
        "jax.nn.scaled_matmul has no lowering on this platform "
        f"({dispatch.platform()}); use implementation='xla'.")

  def f4(q):  # Packed bytes -> float4_e2m1fn [rows, K] (low nibble first).
    v = jax.lax.bitcast_convert_type(q.codes, jnp.float4_e2m1fn)
    return v.reshape(q.shape)[None]
  acc = jax.nn.scaled_matmul(f4(a), f4(b), a.scales[None], b.scales[None],
                             preferred_element_type=jnp.float32)[0]
  return (acc * gemm_alpha(a, b)).astype(out_dtype)
