"""Tiles of the Mosaic GPU values GEMM (Hopper), with the heuristic default.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels import mosaic_gemm


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(mosaic_gemm.GemmConfig):
  """Tiles of the values GEMM: a compute warpgroup's tile and the
  pipeline's depth (`mosaic_gemm.GemmConfig`'s fields), and how a CTA's two
  compute warpgroups share its output tile.

  Attributes:
    wg_split_n: the two compute warpgroups of a CTA split N (else M). The
      two were within 1.3% of each other at every shape timed (GPT base's
      Fprop and Dgrad, the 4096² layer: BENCHMARKS.md, 2026-11-26).
  """

  wg_split_n: bool = True

  @property
  def cta_tile(self) -> tuple[int, int]:
    return cta_tile(self)


def cta_tile(config) -> tuple[int, int]:
  """A CTA's output tile `(rows, columns)`: two warpgroup tiles side by side
  along the split dimension. `config` has `tile_m`, `tile_n` and
  `wg_split_n` (`Config`, and the decode probe's)."""
  c = config
  return (c.tile_m * (1 if c.wg_split_n else 2),
          c.tile_n * (2 if c.wg_split_n else 1))


# Output tiles (CTA tiles) a call needs at least, as a multiple of the SMs:
# below one full wave the persistent grid idles SMs, and XLA's split-K GEMM
# wins (GPT base's Wgrad shapes: 18-96 tiles of 256 x 128 on 132 SMs).
MIN_WAVES = 1.0
