"""Tiles of the Mosaic GPU grouped GEMMs (Hopper).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Tiles of one compute warpgroup and the pipeline's depth.

  A CTA computes a `[tile_m, 2 * tile_n]` output tile: its two compute
  warpgroups split N (each `[tile_m, tile_n]`) and share the `va` tile.

  Attributes:
    tile_m, tile_n: a warpgroup's output tile. `tile_m` is also the M tile of
      the tile-to-group map of `ragged_values_matmul` (a tile whose rows
      straddle groups is computed once per group, each storing its rows).
    tile_k: the contraction step (`ragged_values_matmul_t`: tokens per step;
      the first and last step of a group mask the other groups' tokens).
    max_concurrent_steps: steps in flight in shared memory; None: 4 with a
      bf16 output, 3 with FP32 (its epilogue tiles take the fourth's room).
    grid_tile_width: width of the planar snake over output tiles.
    epi_tile: square epilogue tile written through shared memory.
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  max_concurrent_steps: int | None = None
  grid_tile_width: int = 8
  epi_tile: int = 64

  @property
  def cta_n(self) -> int:
    return 2 * self.tile_n
