"""`weight_only_matmul`: bf16 activations times a packed NVFP4 weight (inference).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from nvfp4_jax.core import dispatch
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.arrays import check_nvfp4_array

from nvfp4_jax.ops.weight_only_matmul.reference import _weight_only_xla


def weight_only_matmul(x: jax.Array, w: NVFP4Array, *, out_dtype=None,
                       implementation: str | None = None) -> jax.Array:
  """`x @ dequantize(w).T` with a packed NVFP4 weight: inference decoding.

  Activations stay in high precision (cast to bf16 for the tensor cores);
  the weight is read packed (0.5625 bytes per weight), decoded to its exact
  bf16 block values, multiplied with FP32 accumulation, and the tensor factor
  is applied to the FP32 result.

  Args:
    x: `[..., K]` activations.
    w: `NVFP4Array [N, K]` (e.g. a layer's `W = kernel^T`, see
      `nvfp4_jax.export`).
    out_dtype: the result's dtype (default `x.dtype`).
    implementation: "xla" (block-dequantize, dot) or "pallas" (a kernel that
      decodes the packed weight in registers: memory-bound decode shapes
      read ~3.5x fewer bytes than a bf16 weight); None: "pallas" on GPU.

  Returns:
    `[..., N]` in `out_dtype`.
  """
  if not isinstance(w, NVFP4Array) or w.ndim != 2:
    raise TypeError(f"weight_only_matmul: w must be a 2-D NVFP4Array [N, K], "
                    f"got {type(w).__name__}"
                    f"{getattr(w, 'shape', '')}.")
  check_nvfp4_array(w, "weight_only_matmul", "w")
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating) or x.shape[-1] != w.shape[1]:
    raise ValueError(
        f"weight_only_matmul: x must be floating [..., K={w.shape[1]}], got "
        f"{x.dtype}{x.shape}; pass activations whose last axis is the "
        f"weight's K.")
  out_dtype = out_dtype or x.dtype
  lead = x.shape[:-1]
  y = WEIGHT_ONLY_MATMUL(implementation, x.reshape(-1, x.shape[-1]), w,
                         out_dtype=out_dtype)
  return y.reshape(*lead, w.shape[0])


WEIGHT_ONLY_MATMUL = dispatch.Op("weight_only_matmul", {
    "xla": _weight_only_xla,
    "pallas": "nvfp4_jax.ops.weight_only_matmul.pallas_triton:weight_only_matmul",
})
