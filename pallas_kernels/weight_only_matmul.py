"""Pallas-Triton kernel of `nvfp4_jax.weight_only_matmul` (decode shapes).

`x @ dequantize(w).T` for activations `x: [M, K]` (M small: decoding) and a
packed NVFP4 weight `w: [N, K]`, reading the packed codes and E4M3 scales
(0.5625 bytes per weight) and never a bf16 copy of the weight: each program
owns `block_n` output features, walks K in chunks of `block_k`, decodes the
chunk to its exact bf16 block values in registers (`nvfp4_jax.tile.
block_values`, the reference's decode, through its byte-permutation lowering
`common.block_values` on the GPU), and accumulates `x @ values.T` in FP32
on the tensor cores; the tensor factor is applied to the FP32 result. M is
padded to the tensor cores' 16 rows with masked loads.

Decoding has few output tiles (N / block_n programs for one M tile), fewer
than the GPU has SMs for most layers, so K is also split over `split_k`
programs whose FP32 partial sums XLA adds (the order of an FP32 sum of K
terms changes, within the reference's bound: tests/test_export.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from nvfp4_jax import numerics as nm
from nvfp4_jax import tile
from nvfp4_jax.qarray import NVFP4Array
from pallas_kernels import common

B = nm.NVFP4_BLOCK


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightOnlyConfig:
  """Tile sizes (powers of two).

  Attributes:
    block_m: activation rows per program (>= 16, the dot's minimum).
    block_n: output features per program.
    block_k: contraction elements per loop step (a multiple of 16).
    num_warps: Triton warps per program.
    num_stages: software pipelining depth of the K loop.
    split_k: programs sharing one output tile's K (each walks K / split_k;
      must divide K / block_k).
  """

  block_m: int = 16
  block_n: int = 64
  block_k: int = 256
  num_warps: int = 4
  num_stages: int = 3
  split_k: int = 1

  def __post_init__(self):
    common.check_powers_of_two(
        self, ("block_m", "block_n", "block_k", "num_warps", "split_k"))
    if self.block_m < 16 or self.block_k < B:
      raise ValueError(f"WeightOnlyConfig needs block_m >= 16 and block_k >= "
                       f"{B}; got {self}.")


# Programs to aim for: many per SM of a large GPU (132 on the H100), so that
# the short K walks of decoding overlap their load latency.
TARGET_PROGRAMS = 2048


def default_config(m: int, n: int, k: int) -> WeightOnlyConfig:
  """Tiles for `x [m, k] @ w [n, k].T`, from the decode sweep on the H100
  (`python -m benchmarks.bench_gemm --weight-only-sweep`, 16 distinct
  weights per timed program):

  - up to 64 tokens: 64 features x 256 of K per program, K split until
    about `TARGET_PROGRAMS` programs run (down to one K step each): the
    fastest of 18 tilings at 1 x 4096 x 4096 (20 us, split 16; the former
    default, split 8, 29 us) and at 16 x 14336 x 4096 (48 vs 63 us);
  - more tokens: one 128-row M tile, 32 features, K not split: fastest at
    128 x 4096 x 14336 (118 us; two 64-row tiles, split 4: 155 us).
  """
  bk = min(256, common.next_pow2(k))
  while k % bk:
    bk //= 2
  bk = max(B, bk)
  bm = max(16, min(128, common.next_pow2(m)))
  if bm > 64:
    return WeightOnlyConfig(block_m=bm, block_n=32, block_k=bk)
  bn = min(64, max(16, common.next_pow2(n)))
  tiles = common.cdiv(m, bm) * common.cdiv(n, bn)
  split, steps = 1, k // bk  # bk divides K (a multiple of 16).
  while tiles * split < TARGET_PROGRAMS and steps % (2 * split) == 0:
    split *= 2
  return WeightOnlyConfig(block_m=bm, block_n=bn, block_k=bk, split_k=split)


def _kernel(x_ref, codes_ref, scales_ref, o_ref, *, bk: int, m: int, n: int,
            steps: int, interpret: bool):
  bm, bn = o_ref.shape
  i, j = pl.program_id(0), pl.program_id(1)
  first = pl.program_id(2) * steps
  xmask = common.bounds_mask((bm, bk), (0, i * bm, m, bm))
  wdims = (0, j * bn, n, bn)

  def body(t, acc):
    step = first + t
    xs = x_ref[:, pl.ds(step * bk, bk)] if xmask is None else common.load_at(
        x_ref, (slice(None), pl.ds(step * bk, bk)), xmask)
    cmask = common.bounds_mask((bn, bk // B, B // 2), wdims)
    smask = common.bounds_mask((bn, bk // B), wdims)
    codes = common.load_at(codes_ref, (slice(None), pl.ds(step * (bk // B),
                                                          bk // B),
                                       slice(None)), cmask)
    scales = common.load_at(scales_ref, (slice(None),
                                         pl.ds(step * (bk // B), bk // B)),
                            smask)
    vals = common.block_values(codes, scales, interpret).reshape(bn, bk)
    return acc + jax.lax.dot_general(
        xs.astype(jnp.bfloat16), vals, (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
  common.store(o_ref, acc, common.bounds_mask(
      (bm, bn), (0, i * bm, m, bm), (1, j * bn, n, bn)))


def weight_only_matmul(x: jax.Array, w: NVFP4Array, *,
                       config: WeightOnlyConfig | None = None) -> jax.Array:
  """FP32 `x @ values(w).T` (before the tensor factor), `x: [M, K]`.

  Raises:
    NotImplementedError: a backend without Pallas-Triton.
    ValueError: a `config` whose tiles do not divide K.
  """
  interpret = common.check_backend("weight_only_matmul")
  m, k = x.shape
  n = w.shape[0]
  cfg = config or default_config(m, n, k)
  bm, bn, bk, split = cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k
  if k % (bk * split):
    raise ValueError(f"block_k={bk} x split_k={split} must divide K={k}.")
  nb = k // B
  out = common.pallas_call(
      functools.partial(_kernel, bk=bk, m=m, n=n, steps=k // (bk * split),
                        interpret=interpret),
      interpret=interpret, num_warps=cfg.num_warps,
      num_stages=cfg.num_stages, name="nvfp4_weight_only_matmul",
      grid=(common.cdiv(m, bm), common.cdiv(n, bn), split),
      in_specs=[pl.BlockSpec((bm, k), lambda i, j, s: (i, 0)),
                pl.BlockSpec((bn, nb, B // 2), lambda i, j, s: (j, 0, 0)),
                pl.BlockSpec((bn, nb), lambda i, j, s: (j, 0))],
      out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
      out_shape=jax.ShapeDtypeStruct((split, m, n), jnp.float32),
  )(x, w.codes.reshape(n, nb, B // 2), w.scales)
  return out[0] if split == 1 else jnp.sum(out, axis=0)
