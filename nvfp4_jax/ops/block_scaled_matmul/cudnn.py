"""The native block-scaled GEMM through cuDNN: `jax.nn.scaled_matmul`
(Blackwell): NVFP4 (E2M1, E4M3 scales per 16), MXFP4 (E2M1) and MXFP8 (E4M3),
both with UE8M0 scales per 32.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from nvfp4_jax.core import dispatch
from nvfp4_jax.core.arrays import MXArray
from nvfp4_jax.core.arrays import NVFP4Array

from nvfp4_jax.ops.block_scaled_matmul.reference import gemm_alpha


def _require_same_format(a, b, what):
  """NotImplementedError unless both operands are NVFP4, or both MX of one
  format (what cuDNN's block-scaled dot multiplies)."""
  if isinstance(a, NVFP4Array) and isinstance(b, NVFP4Array):
    return
  if (isinstance(a, MXArray) and isinstance(b, MXArray) and a.fmt == b.fmt):
    return
  raise NotImplementedError(
      f"implementation={what!r} multiplies two NVFP4Arrays or two MXArrays "
      f"of one format, got {type(a).__name__}"
      f"{'(' + a.fmt + ')' if isinstance(a, MXArray) else ''} and "
      f"{type(b).__name__}"
      f"{'(' + b.fmt + ')' if isinstance(b, MXArray) else ''}; use 'xla'.")


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
# K multiples that need no padding of the scales (four scale columns):
# 64 for NVFP4's 16-blocks, 128 for MX's 32-blocks.
K_MULTIPLE = 64
K_MULTIPLE_MX = 128
ROW_MULTIPLE = 128


def native(cc: tuple[int, int] | None, cudnn: tuple[int, int] | None) -> bool:
  """Whether XLA hands `jax.nn.scaled_matmul` to cuDNN's block-scaled dot
  on compute capability `cc` with cuDNN `cudnn` (None: unknown, taken as
  recent); elsewhere it decomposes it (dequantize, FP32 GEMM)."""
  return (cc is not None and tuple(cc) >= MIN_CC
          and (cudnn is None or tuple(cudnn) >= MIN_CUDNN))


def unsupported(m: int, n: int, k: int, mx: bool = False) -> str | None:
  """Why cuDNN's block-scaled dot has no engine for `[m, k] x [n, k]`
  (`mx`: MX operands, 32-blocks), or None where it has."""
  multiple = K_MULTIPLE_MX if mx else K_MULTIPLE
  if k % multiple:
    return f"K={k} is not a multiple of {multiple}"
  if m % ROW_MULTIPLE or n % ROW_MULTIPLE:
    return f"rows M={m}, N={n} are not multiples of {ROW_MULTIPLE}"
  return None


def _matmul_scaled_matmul(a, b, *, out_dtype):
  _require_same_format(a, b, "scaled_matmul")
  if isinstance(a, MXArray) and a.fmt == "mxfp4":
    # XLA (jax 0.10.2, 0.11.2) hands E2M1 with E4M3 scales (NVFP4) and E4M3
    # with UE8M0 scales (MXFP8) to cuDNN, not E2M1 with UE8M0 scales: it
    # decomposes MXFP4, and for sm_12x its decomposition aborts the process
    # (compiled ahead of time for a B200 and an RTX PRO 6000).
    raise NotImplementedError(
        "implementation='scaled_matmul': XLA does not hand MXFP4 (E2M1 with "
        "UE8M0 scales) to cuDNN; use 'triton' (tl.dot_scaled) or 'xla'.")
  if dispatch.platform() != "gpu":
    raise NotImplementedError(
        "jax.nn.scaled_matmul has no lowering on this platform "
        f"({dispatch.platform()}); use implementation='xla'.")
  # Where XLA decomposes the dot (no FP4 MMA, or cuDNN < 9.10) any shape
  # runs; where cuDNN runs it, only the shapes it has an engine for.
  if native(dispatch.compute_capability(), dispatch.cudnn_version()):
    why = unsupported(a.shape[0], b.shape[0], a.shape[1],
                      mx=isinstance(a, MXArray))
    if why is not None:
      raise NotImplementedError(
          f"implementation='scaled_matmul': cuDNN's block-scaled dot: {why}. "
          f"Use 'triton' or 'pallas'.")
  return scaled_matmul(a, b, out_dtype=out_dtype)


def _elements(q):
  """`q`'s elements as `jax.nn.scaled_matmul` takes them: `[1, rows, K]`
  float4_e2m1fn (packed bytes, low nibble first) or float8_e4m3fn."""
  if isinstance(q, MXArray) and q.fmt == "mxfp8":
    return q.data[None]
  codes = q.codes if isinstance(q, NVFP4Array) else q.data
  v = jax.lax.bitcast_convert_type(codes, jnp.float4_e2m1fn)
  return v.reshape(q.shape)[None]


def scaled_matmul(a, b, *, out_dtype=jnp.float32) -> jax.Array:
  """`a @ b.T` through `jax.nn.scaled_matmul`, on any platform: cuDNN's
  block-scaled dot on Blackwell; XLA decomposes it elsewhere (dequantize,
  FP32 dot; XLA:CPU runs that). NVFP4's tensor scales are applied to the
  FP32 result (`gemm_alpha`); MX has none. Operands as
  `_require_same_format` takes them.
  """
  acc = jax.nn.scaled_matmul(_elements(a), _elements(b), a.scales[None],
                             b.scales[None],
                             preferred_element_type=jnp.float32)[0]
  if isinstance(a, MXArray):
    return acc.astype(out_dtype)
  return (acc * gemm_alpha(a, b)).astype(out_dtype)
