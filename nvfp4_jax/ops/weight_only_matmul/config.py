"""Tiles of the weight-only decode kernel, with the heuristic default.
"""

from __future__ import annotations

import dataclasses

from nvfp4_jax.core import numerics as nm
from pallas_kernels import launch

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
    swap_ab: compute the transposed product, the decoded weight tile as the
      dot's left operand (`values @ x^T`), stored transposed.
  """

  block_m: int = 16
  block_n: int = 64
  block_k: int = 256
  num_warps: int = 4
  num_stages: int = 3
  split_k: int = 1
  swap_ab: bool = False

  def __post_init__(self):
    launch.check_powers_of_two(
        self, ("block_m", "block_n", "block_k", "num_warps", "split_k"))
    if self.block_m < 16 or self.block_k < 2 * B:
      raise ValueError(f"WeightOnlyConfig needs block_m >= 16 and block_k >= "
                       f"{2 * B} (two dots of >= 16); got {self}.")


# Programs to aim for: many per SM of a large GPU (132 on the H100), so that
# the short K walks of decoding overlap their load latency.
TARGET_PROGRAMS = 2048


def default_config(m: int, n: int, k: int) -> WeightOnlyConfig:
  """Tiles for `x [m, k] @ w [n, k].T`, from the decode sweep on the H100
  (`python -m benchmarks.bench_gemm --weight-only-sweep`, 16 distinct
  weights per timed program, ~50 tilings per shape):

  - up to 64 tokens: the weights as the left operand, 64 features x 256 of
    K per program, K split until about `TARGET_PROGRAMS` programs run (down
    to one K step each, split 16 at these shapes): the fastest at 1 x 4096
    x 4096 (19.8 us wall; unswapped 38.5 us) and within 4% at 16 x 14336 x
    4096 (42.2 vs 40.7 us); at 16 x 4096 x 4096 the fastest had 32 features
    (23.6 us) and 64 was not among the three best (> 27.2 us) in that wall-
    time sweep, not re-measured since;
  - more tokens: one 128-row M tile, 128 features, 8 warps, K split 4:
    fastest at 128 x 4096 x 14336 (117 us; the former 32-feature unsplit
    tile 240 us).
  """
  k = launch.cdiv(k, 2 * B) * 2 * B  # As `weight_only_matmul` pads it.
  bk = min(256, launch.next_pow2(k))
  while k % bk:
    bk //= 2
  bm = max(16, min(128, launch.next_pow2(m)))
  if bm > 64:
    split = 4 if k % (4 * bk) == 0 else 1
    return WeightOnlyConfig(block_m=bm,
                            block_n=min(128, max(16, launch.next_pow2(n))),
                            block_k=bk, num_warps=8,
                            split_k=split, swap_ab=True)
  bn = min(64, max(16, launch.next_pow2(n)))
  tiles = launch.cdiv(m, bm) * launch.cdiv(n, bn)
  split, steps = 1, k // bk  # bk divides K (a multiple of 16).
  while tiles * split < TARGET_PROGRAMS and steps % (2 * split) == 0:
    split *= 2
  return WeightOnlyConfig(block_m=bm, block_n=bn, block_k=bk, split_k=split,
                          swap_ab=True)
