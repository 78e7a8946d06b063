"""The native block-scaled GEMM through cuDNN (Blackwell): XLA's block-scaled
dot, as `jax.nn.scaled_matmul` emits it, for NVFP4 (E2M1, E4M3 scales per 16)
with alpha as its global scale (applied in cuDNN's graph), and MXFP8 (E4M3,
UE8M0 scales per 32).
"""

from __future__ import annotations

import json

import jax
import jax.extend.core  # pylint: disable=unused-import
from jax.interpreters import batching  # pylint: disable=unused-import
from jax.interpreters import mlir
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
  """`a @ b.T` through XLA's block-scaled dot: cuDNN's on Blackwell; XLA
  decomposes it on other GPUs (dequantize, FP32 dot). CUDA only (XLA:CPU
  has no lowering for it). Operands as `_require_same_format` takes them.

  NVFP4's tensor scales multiply the FP32 product as one factor `alpha`
  (`gemm_alpha`), then one cast to `out_dtype`. Where cuDNN applies a
  global scale (`fuses_alpha`: cuDNN >= 9.13, or unknown) alpha is the
  dot's global scale, applied inside cuDNN's graph (no pass over the
  output for it); below, `jax.nn.scaled_matmul` and `acc * alpha` after it
  (one elementwise pass, fused with the cast). MX has no tensor scale.
  """
  if isinstance(a, NVFP4Array) and fuses_alpha(dispatch.cudnn_version()):
    acc = _BLOCK_SCALED_DOT.bind(_elements(a), _elements(b), a.scales[None],
                                 b.scales[None], gemm_alpha(a, b))
    return acc[0].astype(out_dtype)
  acc = jax.nn.scaled_matmul(_elements(a), _elements(b), a.scales[None],
                             b.scales[None],
                             preferred_element_type=jnp.float32)[0]
  if isinstance(a, MXArray):
    return acc.astype(out_dtype)
  return (acc * gemm_alpha(a, b)).astype(out_dtype)


# XLA passes a block-scaled dot's global scale into cuDNN's graph from
# cuDNN 9.13 (`kCudnnSupportsBlockScaledDotWithGlobalScale` in XLA's
# block_scaling_rewriter.h; before, "the graph is compiled, but the scaling
# factor is not applied", openxla/xla#32525, so XLA multiplies after it).
GLOBAL_SCALE_CUDNN = (9, 13)


def fuses_alpha(cudnn: tuple[int, int] | None) -> bool:
  """Whether `scaled_matmul` hands alpha to cuDNN as the dot's global scale
  with cuDNN `cudnn` (None: unknown, taken as recent). Below 9.13 XLA would
  multiply after the call, inside its own call computation, where the
  multiply no longer fuses with the cast to a BF16 output: two passes
  instead of the one of `acc * alpha` fused with the cast."""
  return cudnn is None or tuple(cudnn) >= GLOBAL_SCALE_CUDNN


# --- `__op$block_scaled_dot` with a global scale -----------------------------
#
# `jax.nn.scaled_matmul` (jax 0.10, 0.11) emits XLA's block-scaled dot custom
# call with four operands; XLA's `BlockScalingRewriter` also takes a fifth,
# the global scale (a scalar of the result's type: here FP32), and from cuDNN
# 9.13 (`kCudnnSupportsBlockScaledDotWithGlobalScale`) passes it to
# `__cudnn$blockScaledDot`, whose cuDNN graph multiplies the FP32 result by
# it: one kernel, no FP32 pass over the output for alpha. Below 9.13 (and in
# its decomposition: dequantize, FP32 dot) XLA multiplies the FP32 result by
# it after the call, as `acc * alpha` did here before. The result is FP32
# (the spec's one rounding, to `out_dtype`, stays the cast above): a BF16
# result would need a BF16 global scale, i.e. alpha rounded to BF16.

_CUSTOM_CALL = "__op$block_scaled_dot"


def _block_scaled_dot_abstract(a, b, sa, sb, alpha):
  del sa, sb
  if alpha.shape != () or alpha.dtype != jnp.float32:
    raise TypeError(f"block-scaled dot: the global scale must be an FP32 "
                    f"scalar, got {alpha.dtype}{list(alpha.shape)}.")
  return jax.core.ShapedArray((a.shape[0], a.shape[1], b.shape[1]),
                              jnp.float32)


def _block_scaled_dot_lowering(ctx, a, b, sa, sb, alpha):
  from jax._src.interpreters import mlir as mlir_internal  # pylint: disable=g-import-not-at-top
  ir = mlir.ir
  (out,) = ctx.avals_out
  shapes = [tuple(ir.RankedTensorType(v.type).shape)
            for v in (a, b, sa, sb, alpha)]
  layouts = lambda *ss: [tuple(range(len(s) - 1, -1, -1)) for s in ss]
  # As `jax.nn.scaled_matmul` writes it (the rewriter reads the operand
  # count, shapes and types).
  config = json.dumps({"scaled_dot_backend_config": {
      "lhs_batch_dimensions": [0], "rhs_batch_dimensions": [0],
      "dequantize_type": "F32"}})
  return [mlir_internal.custom_call(
      _CUSTOM_CALL,
      result_types=[ir.RankedTensorType.get(out.shape, ir.F32Type.get())],
      operands=[a, b, sa, sb, alpha], backend_config=config,
      operand_layouts=layouts(*shapes),
      result_layouts=layouts(out.shape)).result]


def _block_scaled_dot_impl(*args):
  return jax.jit(_BLOCK_SCALED_DOT.bind)(*args)


def _block_scaled_dot_batch(args, dims):
  """vmap: one call per batch element (`lax.map`), each with its own
  alpha (the custom call takes one scalar global scale)."""
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  args = [jnp.moveaxis(a, d, 0) if d is not None else
          jnp.broadcast_to(a, (size, *a.shape)) for a, d in zip(args, dims)]
  return jax.lax.map(lambda xs: _BLOCK_SCALED_DOT.bind(*xs), args), 0


_BLOCK_SCALED_DOT = jax.extend.core.Primitive("nvfp4_block_scaled_dot")
_BLOCK_SCALED_DOT.def_impl(_block_scaled_dot_impl)
_BLOCK_SCALED_DOT.def_abstract_eval(_block_scaled_dot_abstract)
batching.primitive_batchers[_BLOCK_SCALED_DOT] = (
    _block_scaled_dot_batch)
mlir.register_lowering(_BLOCK_SCALED_DOT, _block_scaled_dot_lowering,
                       platform="cuda")
