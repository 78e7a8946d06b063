"""The grouped (mixture-of-experts) GEMMs in pure jnp.

Their operands are ragged (`nvfp4_jax.ops.ragged_quantize.reference`): rows
(tokens) split into `E` contiguous groups (experts) by `group_sizes`; rows
past `sum(group_sizes)` belong to no group. Every function computes, group
by group, exactly what the dense GEMM computes on that group's rows alone
(`block_scaled_matmul`), with the group sizes as traced data: each row
(Fprop, Dgrad) or each group's tokens (Wgrad) multiplied with its group's
weight and its group's `alpha`.

The GEMMs are reference loops over the groups: every group's product is a
dense `lax.dot_general` of the whole operand, masked to the group's rows
(`E` times the FLOPs: the truth and the CPU default, not a fast path; the
GPU kernels in `pallas_mosaic_gpu.py` compute only each group's tiles).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import tile
from nvfp4_jax.core.arrays import MXArray
from nvfp4_jax.ops.block_values.reference import dequantize_mx
from nvfp4_jax.ops.ragged_quantize.reference import group_of


# ----------------------------------------------------------------------------
# GEMMs on exact values (the emulation), one group at a time.
# ----------------------------------------------------------------------------


def _f32_dot(a, b, dims, precision=None):
  return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def ragged_values_matmul(va, vb, group_sizes, alpha=None, *,
                         out_dtype=jnp.float32, vb_layout="kn",
                         precision=None):
  """Row `r` of group `e`: `(va[r] @ vb[e]) * alpha[e]` (`vb[e].T` for
  `vb_layout="nk"`), FP32 accumulation, one cast; rows of no group are 0."""
  m = va.shape[0]
  num_groups = vb.shape[0]
  n = vb.shape[2] if vb_layout == "kn" else vb.shape[1]
  g = group_of(group_sizes, m)
  dims = ((1,), (0,)) if vb_layout == "kn" else ((1,), (1,))

  def body(e, acc):
    y = _f32_dot(va, vb[e], dims, precision)
    if alpha is not None:
      y = y * alpha[e]
    return jnp.where((g == e)[:, None], y, acc)

  acc = jax.lax.fori_loop(0, num_groups, body,
                          jnp.zeros((m, n), jnp.float32))
  return acc.astype(out_dtype)


def ragged_values_matmul_t(va, vb, group_sizes, alpha=None, *,
                           out_dtype=jnp.float32, tokens_last=True,
                           precision=None):
  """Group `e`'s `(va_e^T-contraction vb_e) * alpha[e]`, `[E, K, N]`:
  `va [K, M]`, `vb [N, M]` contracted over group `e`'s tokens (columns), or
  with `tokens_last=False` `va [M, K]`, `vb [M, N]` over its rows. Both
  operands are masked to the group (a non-finite value elsewhere stays
  out); an empty group gives zeros."""
  axis = 1 if tokens_last else 0
  m = va.shape[axis]
  num_groups = group_sizes.shape[0]
  g = group_of(group_sizes, m)

  def one(e):
    mask = g == e
    mask = mask[None, :] if tokens_last else mask[:, None]
    a = jnp.where(mask, va, jnp.zeros((), va.dtype))
    b = jnp.where(mask, vb, jnp.zeros((), vb.dtype))
    y = _f32_dot(a, b, ((axis,), (axis,)), precision)
    if alpha is not None:
      y = y * alpha[e]
    return y.astype(out_dtype)

  return jax.lax.map(one, jnp.arange(num_groups))


# ----------------------------------------------------------------------------
# GEMMs on codes (what the native FP4 kernels multiply), one group at a time.
# ----------------------------------------------------------------------------


CODES_FORMATS = ("nvfp4", "mxfp4", "mxfp8")


def codes_values(codes: jax.Array, scales: jax.Array,
                 fmt: str = "nvfp4") -> jax.Array:
  """An operand's exact bf16 block values `[..., C]` from its codes:
  NVFP4 packed E2M1 `[..., C // 2]` with E4M3 scales `[..., C // 16]`;
  MXFP4 packed E2M1 `[..., C // 2]` or MXFP8 E4M3 `[..., C]` with E8M0
  scales `[..., C // 32]` (`dequantize_mx`: no tensor scale)."""
  if fmt != "nvfp4":
    if fmt not in CODES_FORMATS:
      raise ValueError(f"codes_values: fmt must be one of {CODES_FORMATS}, "
                       f"got {fmt!r}.")
    return dequantize_mx(MXArray(codes, scales, fmt), jnp.bfloat16)
  *lead, half = codes.shape
  nb = half * 2 // nm.NVFP4_BLOCK
  v = tile.block_values(codes.reshape(-1, nb, nm.NVFP4_BLOCK // 2),
                        scales.reshape(-1, nb))
  return v.reshape(*lead, half * 2)


def ragged_codes_matmul(a_codes, a_scales, b_codes, b_scales, group_sizes,
                        alpha=None, *, out_dtype=jnp.float32, fmt="nvfp4"):
  """`ragged_values_matmul` (layout "nk") of the operands' block values:
  row `r` of group `e` times `b[e].T`, `b [E, N, K]` quantized along K
  (`fmt`: both operands' format, see `codes_values`)."""
  return ragged_values_matmul(codes_values(a_codes, a_scales, fmt),
                              codes_values(b_codes, b_scales, fmt),
                              group_sizes, alpha, out_dtype=out_dtype,
                              vb_layout="nk")


def ragged_codes_matmul_t(a_codes, a_scales, b_codes, b_scales, group_sizes,
                          alpha=None, *, out_dtype=jnp.float32, fmt="nvfp4"):
  """`ragged_values_matmul_t` (tokens last) of the operands' block values:
  `a [K, L]`, `b [N, L]` quantized along the tokens."""
  return ragged_values_matmul_t(codes_values(a_codes, a_scales, fmt),
                                codes_values(b_codes, b_scales, fmt),
                                group_sizes, alpha, out_dtype=out_dtype,
                                tokens_last=True)
