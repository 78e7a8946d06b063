"""The row gather kernel's tiles."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GatherConfig:
  """Rows and columns a program copies, and its warps."""
  block_rows: int = 32
  block_cols: int = 512
  num_warps: int = 4


def default_config(d: int) -> GatherConfig:
  """Tiles of 32 rows x up to 512 columns (a power of two: Triton's
  blocks), 4 warps: 16-byte loads and stores of bf16 rows (32 KiB a
  program)."""
  cols = 1 << max(0, (min(d, 512) - 1).bit_length())
  return GatherConfig(block_cols=cols)
