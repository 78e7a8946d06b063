"""Pallas-Triton kernels of `nvfp4_jax.quantize_pair`.

The recipe's NVFP4 pair of a tensor `x: [tokens, features]` — `q(x)` 1x16
along features and `q(rht(x.T))` along tokens — comes from two passes over `x`
(`nvfp4_jax.ops.quantize_rht_t.pallas_triton`: the amaxes of both from one read, then both
encodes from one read; or, when both round stochastically, two encode
kernels, which is faster: see `config.runs_split`; so does a
round-to-nearest pair on sm_100a/sm_103a: see `splits_on_blackwell`). A
Wgrad operand without RHT (the `--no-rht` ablation) is the 1x16 quantizer's kernel on `x.T` (an XLA
transpose), with the one amax both operands share. A pair with only one
quantized operand runs that operand's kernel; either may use Four-over-Six.
The kernels take primitive arguments: `nvfp4_jax.ops.quantize_pair.api`
turns the recipe's `Operand`s into them, and raises `NotImplementedError`
(dispatch then falls back to the reference) for pairs no kernel computes (MX
formats, 16x16 rows); an unsupported Hadamard size raises it here.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng
from nvfp4_jax.core import spmd
from nvfp4_jax.core import tile
from pallas_kernels import e2m1_encode
from nvfp4_jax.ops.quantize import pallas_triton as pallas_quantize
from nvfp4_jax.ops.quantize_rht_t import pallas_triton as pallas_rht
from nvfp4_jax.ops.quantize_rht_t.pallas_triton import RHTConfig
from nvfp4_jax.ops.quantize_pair.config import runs_split
from nvfp4_jax.ops.quantize_rht_t.config import check_size
from nvfp4_jax.ops.quantize_pair.config import pair_config


def splits_on_blackwell(dtype, row_rounding: str | None,
                        t_rounding: str | None, rht_size: int,
                        four_over_six: bool, values_t: bool) -> bool:
  """Whether a round-to-nearest pair runs as two kernels where the E2M1
  conversion exists (`e2m1_encode.hardware_e2m1`, sm_100a/sm_103a): the 1x16
  quantizer's word path for `x` (codes or block values) and the columns
  kernel's packed path for `rht(x.T)` (bf16 `x`, its codes, 16-point RHT),
  with or without Four-over-Six (both word paths take it: 25.6 + 29.4
  SASS per element of `x` where the fused kernel runs 291.8, offline
  `sass_report` for sm_100a, BENCHMARKS.md).

  Together they execute 6.4 + 8.1 = 14.5 SASS instructions per element of
  `x` there (7.2 + 8.1 = 15.3 with `x`'s block values), the fused kernel
  50.8 (39.8) (BENCHMARKS.md, offline `sass_report` for sm_100a), for one
  more read of `x` (2 bytes per element on top of ~3.1, or ~4.6): at
  B200's instruction rate (148 SMs, 4 warp schedulers each) the fused
  kernel is instruction-bound near 2 (3.6) TB/s of traffic and the two
  kernels are bound by HBM bandwidth instead. Not timed on a Blackwell GPU.
  """
  del four_over_six  # Both kernels' word paths take it.
  return (row_rounding == "nearest" and t_rounding == "nearest"
          and dtype == jnp.bfloat16 and rht_size == 16
          and not values_t and e2m1_encode.hardware_e2m1())


def quantize_pair(x: jax.Array, *, row_rounding: str | None,
                  t_rounding: str | None, t_rht: bool,
                  row_four_over_six: bool = False,
                  t_four_over_six: bool = False,
                  key_row: jax.Array | None, key_t: jax.Array | None,
                  rht_size: int = 16,
                  sign_vector: Sequence[int] | None = None,
                  placement: prng.Placement | None = None,
                  amax_axes: Sequence[str] = (),
                  values: tuple[bool, bool] = (False, False),
                  config: RHTConfig | None = None):
  """`(q_row or None, q_t or None)`, as `nvfp4_jax.quantize_pair` for NVFP4
  1x16 operands.

  `row_rounding`, `t_rounding`: each operand's rounding ("nearest" or
  "stochastic"), None where that operand is not quantized; `t_rht`: the
  Wgrad operand takes the RHT. `values`: which operands come back as
  `NVFP4Values` (the kernels then write their bf16 block values instead of
  codes and scales). `amax_axes`: the mesh axes whose shards make the tensor
  (the amaxes are max-reduced across them).
  """
  def sr(rounding, key):
    return key if rounding == "stochastic" else None
  key_row, key_t = sr(row_rounding, key_row), sr(t_rounding, key_t)
  if t_rounding is not None and t_rht:
    check_size(rht_size, "quantize_pair")
  if not (t_rounding is not None and t_rht):
    if row_rounding is None and t_rounding is None:
      return None, None
    # max|x| = max|x.T|: one amax for both operands.
    amax = spmd.reduce_amax(tile.abs_max(nm.ftz(x.astype(jnp.float32))),
                            amax_axes)
    q_row = q_t = None
    if row_rounding is not None:
      q_row = pallas_quantize.quantize(
          x, rounding=row_rounding, key=key_row, amax=amax,
          four_over_six=row_four_over_six, placement=placement,
          with_codes=not values[0])
    if t_rounding is not None:
      q_t = pallas_quantize.quantize(
          x.T, rounding=t_rounding, key=key_t, amax=amax,
          four_over_six=t_four_over_six,
          placement=None if placement is None else placement.T,
          with_codes=not values[1])
    return q_row, q_t
  if row_rounding is None:
    return None, pallas_rht.quantize_rht_t(
        x, rounding=t_rounding, key=key_t,
        sign_vector=sign_vector, size=rht_size, placement=placement,
        amax_axes=amax_axes, config=config,
        four_over_six=t_four_over_six, values=values[1])
  amaxes = pallas_rht.rht_amax(x, sign_vector=sign_vector, size=rht_size,
                               with_x=True, config=config)
  if amax_axes:  # One collective for both.
    amaxes = spmd.reduce_amax(jnp.stack(amaxes), amax_axes)
  if config is None and (runs_split(row_rounding, t_rounding)
                         or splits_on_blackwell(
                             x.dtype, row_rounding, t_rounding, rht_size,
                             row_four_over_six or t_four_over_six,
                             values[1])):
    q_t = pallas_rht.quantize_call(
        x, amax_t=amaxes[1], key_t=key_t, size=rht_size,
        sign_vector=sign_vector, fused_x=False, config=None,
        placement=placement, four_over_six_t=t_four_over_six,
        values_t=values[1])
    q_x = pallas_quantize.quantize(
        x, rounding=row_rounding, key=key_row, amax=amaxes[0],
        four_over_six=row_four_over_six, placement=placement,
        with_codes=not values[0])
    return q_x, q_t
  t, f = x.shape
  return pallas_rht.quantize_call(
      x, amax_t=amaxes[1], key_t=key_t, amax_x=amaxes[0], key_x=key_row, size=rht_size, sign_vector=sign_vector,
      fused_x=True,
      config=config or pair_config(t, f, rht_size, values_x=values[0]),
      placement=placement, four_over_six_t=t_four_over_six,
      four_over_six_x=row_four_over_six, values_t=values[1],
      values_x=values[0])


