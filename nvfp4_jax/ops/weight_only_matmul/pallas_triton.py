"""Pallas-Triton kernel of `nvfp4_jax.weight_only_matmul` (decode shapes).

`(x @ dequantize(w).T)` for activations `x: [M, K]` (M small: decoding) and a
packed NVFP4 weight `w: [N, K]`, reading the packed codes and E4M3 scales
(0.5625 bytes per weight) and never a bf16 copy of the weight. Each program
owns `block_n` output features and walks K in chunks of `block_k`; a chunk's
bytes are decoded in registers to the exact bf16 block values of their low
and of their high nibbles (`nvfp4_jax.core.tile.block_value_pairs`, through its
byte-permutation lowering `e2m1_decode.block_value_pairs` on the GPU: no nibble
unpacking), which multiply the chunk's even and odd activations in two dots
with FP32 accumulation on the tensor cores. With `swap_ab` (the default at
decode shapes) the decoded tile is the dot's left operand (`values @ x^T`,
Hopper's `wgmma` takes it from registers) and the tile is stored
transposed. M is padded to the tensor cores' 16 rows with masked loads.

Decoding has few output tiles (N / block_n programs for one M tile), fewer
than the GPU has SMs for most layers, so K is also split over `split_k`
programs whose FP32 partial sums XLA adds before applying the tensor factor
(the order of an FP32 sum of K terms changes, within the reference's bound:
tests/tools/test_export.py). Unsplit, the kernel applies the factor (computed from
the amax with `numerics.global_decode_scale_div_rn`, the reference's
division) and writes `out_dtype` itself: one kernel per matmul.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core.arrays import NVFP4Array
from pallas_kernels import e2m1_decode
from pallas_kernels import launch
from nvfp4_jax.ops.weight_only_matmul.config import WeightOnlyConfig
from nvfp4_jax.ops.weight_only_matmul.config import default_config

B = nm.NVFP4_BLOCK


def _kernel(x_ref, codes_ref, scales_ref, amax_ref, o_ref, *, bk: int, m: int,
            n: int, steps: int, swap_ab: bool, denominator: float | None,
            interpret: bool):
  bm, bn = o_ref.shape
  i, j = pl.program_id(0), pl.program_id(1)
  first = pl.program_id(2) * steps
  half, nbk = bk // 2, bk // B
  xmask = launch.bounds_mask((bm, half), (0, i * bm, m, bm))
  wdims = (0, j * bn, n, bn)
  cmask = launch.bounds_mask((bn, nbk, B // 2), wdims)
  smask = launch.bounds_mask((bn, nbk), wdims)

  def body(t, acc):
    step = first + t
    codes = launch.load_at(
        codes_ref, (slice(None), pl.ds(step * nbk, nbk), slice(None)), cmask)
    scales = launch.load_at(scales_ref, (slice(None), pl.ds(step * nbk, nbk)),
                            smask)
    # The even and odd elements of the chunk: two dots of half its length.
    for parity, vals in enumerate(
        e2m1_decode.block_value_pairs(codes, scales, interpret)):
      xs = launch.load_at(x_ref, (slice(None), pl.ds(step * half, half),
                                  jnp.int32(parity)), xmask).astype(jnp.bfloat16)
      vals = vals.reshape(bn, half)
      lhs, rhs = (vals, xs) if swap_ab else (xs, vals)
      acc = acc + jax.lax.dot_general(lhs, rhs, (((1,), (1,)), ((), ())),
                                      preferred_element_type=jnp.float32)
    return acc

  acc = jax.lax.fori_loop(
      0, steps, body,
      jnp.zeros((bn, bm) if swap_ab else (bm, bn), jnp.float32))
  if swap_ab:
    acc = acc.T
  if denominator is not None:  # The whole K: the factor and dtype here.
    factor = nm.global_decode_scale_div_rn(amax_ref[...],
                                           denominator=denominator)
    acc = (acc * factor).astype(o_ref.dtype)
  launch.store(o_ref, acc, launch.bounds_mask(
      (bm, bn), (0, i * bm, m, bm), (1, j * bn, n, bn)))


def weight_only_matmul(x: jax.Array, w: NVFP4Array, *,
                       out_dtype=jnp.float32,
                       config: WeightOnlyConfig | None = None) -> jax.Array:
  """`(x @ values(w).T) * tensor_factor(w)` in `out_dtype`, `x: [M, K]`.

  The same arithmetic as `nvfp4_jax.weight_only_matmul`'s XLA path: FP32
  products of bf16 values summed in FP32 (in another order), times the FP32
  tensor factor, then cast.

  Raises:
    NotImplementedError: a backend without Pallas-Triton.
    ValueError: a `config` whose tiles do not divide K.
  """
  interpret = launch.check_backend("weight_only_matmul")
  m, k = x.shape
  n = w.shape[0]
  codes, scales = w.codes.reshape(n, k // B, B // 2), w.scales
  if k % (2 * B):
    # An odd number of blocks: the chunks' even and odd halves are dots of
    # >= 16, so K is padded by a block of zero codes with a zero scale (its
    # values are +0: the sums do not change). A copy of the weight, for K
    # that no transformer uses.
    x = jnp.pad(x, ((0, 0), (0, B)))
    codes = jnp.pad(codes, ((0, 0), (0, 1), (0, 0)))
    scales = jnp.pad(scales, ((0, 0), (0, 1)))
    k += B
  cfg = config or default_config(m, n, k)
  bm, bn, bk, split = cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k
  if k % (bk * split):
    raise ValueError(f"block_k={bk} x split_k={split} must divide K={k}.")
  nb = k // B
  factor = split == 1
  out = launch.pallas_call(
      functools.partial(_kernel, bk=bk, m=m, n=n, steps=k // (bk * split),
                        swap_ab=cfg.swap_ab, interpret=interpret,
                        denominator=w.tensor_denominator if factor else None),
      interpret=interpret, num_warps=cfg.num_warps,
      num_stages=cfg.num_stages, name="nvfp4_weight_only_matmul",
      grid=(launch.cdiv(m, bm), launch.cdiv(n, bn), split),
      in_specs=[pl.BlockSpec((bm, k // 2, 2), lambda i, j, s: (i, 0, 0)),
                pl.BlockSpec((bn, nb, B // 2), lambda i, j, s: (j, 0, 0)),
                pl.BlockSpec((bn, nb), lambda i, j, s: (j, 0)),
                pl.BlockSpec((1,), lambda i, j, s: (0,))],
      out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
      out_shape=jax.ShapeDtypeStruct(
          (split, m, n), out_dtype if factor else jnp.float32),
  )(x.reshape(m, k // 2, 2), codes, scales,
    jnp.reshape(w.amax, (1,)).astype(jnp.float32))
  if factor:
    return out[0]
  # Split K: the FP32 partial sums are added here, then the factor applied.
  return (jnp.sum(out, axis=0) * w.tensor_scale).astype(out_dtype)
