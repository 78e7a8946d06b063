"""Pallas-Triton kernels of `nvfp4_jax.fused.quantize_pair`.

The recipe's NVFP4 pair of a tensor `x: [tokens, features]` — `q(x)` 1x16
along features and `q(rht(x.T))` along tokens — comes from two passes over `x`
(`pallas_kernels.quantize_rht_t`: the amaxes of both from one read, then both
encodes from one read; or, when both round stochastically, two encode
kernels, which is faster: see `_split`). A Wgrad operand without RHT (the
`--no-rht` ablation) is the 1x16 quantizer's kernel on `x.T` (an XLA
transpose), with the one amax both operands share. A pair with only one
quantized operand runs that operand's kernel; either may use Four-over-Six.
Pairs with an operand no kernel computes (MX formats, 16x16 rows, an
unsupported Hadamard size) raise `NotImplementedError`, and dispatch falls
back to the reference. Arguments are validated by
`quantize_pair` before dispatch.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from nvfp4_jax import numerics as nm
from nvfp4_jax import prng
from nvfp4_jax import spmd
from nvfp4_jax import tile
from nvfp4_jax.recipe import Operand
from pallas_kernels import quantize as pallas_quantize
from pallas_kernels import quantize_rht_t as pallas_rht
from pallas_kernels.quantize_rht_t import RHTConfig


def _key(op: Operand, key):
  return key if op.rounding == "stochastic" else None


def quantize_pair(x: jax.Array, row: Operand, wgrad: Operand, *,
                  key_row: jax.Array | None, key_t: jax.Array | None,
                  rht_size: int = 16,
                  sign_vector: Sequence[int] | None = None,
                  placement: prng.Placement | None = None,
                  amax_axes: Sequence[str] = (),
                  values: tuple[bool, bool] = (False, False),
                  config: RHTConfig | None = None):
  """`(q_row or None, q_t or None)`, as `nvfp4_jax.fused.quantize_pair`.

  `values`: which operands come back as `NVFP4Values` (the kernels then
  write their bf16 block values instead of codes and scales).

  Raises:
    NotImplementedError: a quantized operand that no kernel computes.
  """
  row_ok = row.format == "nvfp4" and not row.block_2d
  t_ok = wgrad.format == "nvfp4" and not wgrad.block_2d
  if (row.quantized and not row_ok) or (wgrad.quantized and not t_ok):
    raise NotImplementedError(
        f"the Pallas pair kernels quantize NVFP4 1x16 rows and NVFP4 Wgrad "
        f"operands; got row={row}, wgrad={wgrad}. Use implementation='xla'.")
  if wgrad.quantized and wgrad.rht:
    pallas_rht.check_size(rht_size, "quantize_pair")
  if not (wgrad.quantized and wgrad.rht):
    if not (row.quantized or wgrad.quantized):
      return None, None
    # max|x| = max|x.T|: one amax for both operands.
    amax = spmd.reduce_amax(tile.abs_max(nm.ftz(x.astype(jnp.float32))),
                            amax_axes)
    q_row = q_t = None
    if row.quantized:
      q_row = pallas_quantize.quantize(
          x, rounding=row.rounding, key=_key(row, key_row), amax=amax,
          four_over_six=row.four_over_six, placement=placement,
          with_codes=not values[0])
    if wgrad.quantized:
      q_t = pallas_quantize.quantize(
          x.T, rounding=wgrad.rounding, key=_key(wgrad, key_t), amax=amax,
          four_over_six=wgrad.four_over_six,
          placement=None if placement is None else placement.T,
          with_codes=not values[1])
    return q_row, q_t
  if not row.quantized:
    return None, pallas_rht.quantize_rht_t(
        x, rounding=wgrad.rounding, key=_key(wgrad, key_t),
        sign_vector=sign_vector, size=rht_size, placement=placement,
        amax_axes=amax_axes, config=config,
        four_over_six=wgrad.four_over_six, values=values[1])
  amaxes = pallas_rht.rht_amax(x, sign_vector=sign_vector, size=rht_size,
                               with_x=True, config=config)
  if amax_axes:  # One collective for both.
    amaxes = spmd.reduce_amax(jnp.stack(amaxes), amax_axes)
  if config is None and _split(row, wgrad):
    q_t = pallas_rht.quantize_call(
        x, amax_t=amaxes[1], key_t=_key(wgrad, key_t), size=rht_size,
        sign_vector=sign_vector, fused_x=False, config=None,
        placement=placement, four_over_six_t=wgrad.four_over_six,
        values_t=values[1])
    q_x = pallas_quantize.quantize(
        x, rounding=row.rounding, key=_key(row, key_row), amax=amaxes[0],
        four_over_six=row.four_over_six, placement=placement,
        with_codes=not values[0])
    return q_x, q_t
  t, f = x.shape
  return pallas_rht.quantize_call(
      x, amax_t=amaxes[1], key_t=_key(wgrad, key_t), amax_x=amaxes[0],
      key_x=_key(row, key_row), size=rht_size, sign_vector=sign_vector,
      fused_x=True,
      config=config or pair_config(t, f, rht_size, values_x=values[0]),
      placement=placement, four_over_six_t=wgrad.four_over_six,
      four_over_six_x=row.four_over_six, values_t=values[1],
      values_x=values[0])


def _split(row: Operand, wgrad: Operand) -> bool:
  """Whether the pair runs as two kernels (each reading `x`) rather than one.

  Both operands rounded stochastically: the fused kernel holds two SR
  streams (165 registers per thread) and ran 6% slower than the two
  kernels at its best tile, 31% at the old default (H100, 8192^2 bf16,
  `python -m benchmarks.bench_quantize --pair-sweep`).
  """
  return row.rounding == "stochastic" and wgrad.rounding == "stochastic"


def pair_config(tokens: int, features: int, size: int = 16, *,
                values_x: bool = False) -> RHTConfig:
  """The fused pair kernel's tiles, 4 warps: 64 tokens x 64 features where
  `x` is written as block values (the emulated GEMM's operand), 32 x 64
  where both operands are written as codes.

  Measured on the H100 (RTNE pair, amaxes given):
  - codes for both, 8192^2 (`python -m benchmarks.bench_quantize
    --pair-sweep`): 32x64 243 us, 64x64 260 us; two kernels 243 us;
  - `x` as values (`--used-sweep`, GPU time), 64x64 against 32x64: 83.5 vs
    86.2 us at 8192x4096, 35.6 vs 36.5 at 16384x768, 83.1 vs 86.9 at
    16384x2048, 93.7 vs 97.2 at 16384x2304, 161 vs 167 at 16384x4096.
  """
  cfg = pallas_rht.default_config(tokens, features, size)
  bt = 64 if values_x else 32
  return RHTConfig(block_tokens=max(size, min(bt, cfg.block_tokens)),
                   block_features=cfg.block_features, num_warps=4)
