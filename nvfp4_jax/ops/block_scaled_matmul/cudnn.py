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


# cuDNN's block-scaled dot (`__cudnn$blockScaledDot`) exists from cuDNN 9.10
# on compute capability >= 10: below either, XLA decomposes
# `jax.nn.scaled_matmul` into dequantize and an FP32 GEMM without a word (a
# slower emulation than "pallas"), so the default GEMM does not pick it
# there (`api.gemm_preference`); named explicitly it still runs, decomposed.
# Compiled ahead of time for a B200 with cuDNN 9.8 and 9.14.
MIN_CUDNN = (9, 10)
MIN_CC = (10, 0)
# Shapes cuDNN is given as they are: XLA pads the scales' K/16 axis to a
# multiple of 4 but not the codes (K = 48: an operand pair no cuDNN engine
# takes), and pads rows to 128 (M = 40: no engine either). Other shapes
# fall back to the next implementation.
K_MULTIPLE = 64
ROW_MULTIPLE = 128


def native(cc: tuple[int, int] | None, cudnn: tuple[int, int] | None) -> bool:
  """Whether XLA hands `jax.nn.scaled_matmul` to cuDNN's block-scaled dot
  on compute capability `cc` with cuDNN `cudnn` (None: unknown, taken as
  recent); elsewhere it decomposes it (dequantize, FP32 GEMM)."""
  return (cc is not None and tuple(cc) >= MIN_CC
          and (cudnn is None or tuple(cudnn) >= MIN_CUDNN))


def unsupported(m: int, n: int, k: int) -> str | None:
  """Why cuDNN's block-scaled dot has no engine for `[m, k] x [n, k]`, or
  None where it has."""
  if k % K_MULTIPLE:
    return f"K={k} is not a multiple of {K_MULTIPLE}"
  if m % ROW_MULTIPLE or n % ROW_MULTIPLE:
    return f"rows M={m}, N={n} are not multiples of {ROW_MULTIPLE}"
  return None


def _matmul_scaled_matmul(a, b, *, out_dtype):
  _require_nvfp4(a, b, "scaled_matmul")
  if dispatch.platform() != "gpu":
    raise NotImplementedError(
        "jax.nn.scaled_matmul has no lowering on this platform "
        f"({dispatch.platform()}); use implementation='xla'.")
  # Where XLA decomposes the dot (no FP4 MMA, or cuDNN < 9.10) any shape
  # runs; where cuDNN runs it, only the shapes it has an engine for.
  if native(dispatch.compute_capability(), dispatch.cudnn_version()):
    why = unsupported(a.shape[0], b.shape[0], a.shape[1])
    if why is not None:
      raise NotImplementedError(
          f"implementation='scaled_matmul': cuDNN's block-scaled dot: {why}. "
          f"Use 'triton' or 'pallas'.")

  def f4(q):  # Packed bytes -> float4_e2m1fn [rows, K] (low nibble first).
    v = jax.lax.bitcast_convert_type(q.codes, jnp.float4_e2m1fn)
    return v.reshape(q.shape)[None]
  acc = jax.nn.scaled_matmul(f4(a), f4(b), a.scales[None], b.scales[None],
                             preferred_element_type=jnp.float32)[0]
  return (acc * gemm_alpha(a, b)).astype(out_dtype)
