"""Tiles of the Mosaic GPU grouped GEMMs (Hopper).
"""

from __future__ import annotations

import dataclasses

from pallas_kernels import mosaic_gemm


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(mosaic_gemm.GemmConfig):
  """Tiles of one compute warpgroup and the pipeline's depth
  (`mosaic_gemm.GemmConfig`'s fields).

  A CTA computes a `[tile_m, 2 * tile_n]` output tile: its two compute
  warpgroups split N (each `[tile_m, tile_n]`) and share the `va` tile.
  `tile_m` is also the M tile of the tile-to-group map of
  `ragged_values_matmul` (a tile whose rows straddle groups is computed once
  per group, each storing its rows). `tile_k` is the contraction step
  (`ragged_values_matmul_t`: tokens per step; the first and last step of a
  group mask the other groups' tokens).
  """

  @property
  def cta_n(self) -> int:
    return 2 * self.tile_n
