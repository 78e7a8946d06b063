"""Tiles of the 1x16 / 16x16 quantize kernel, with the heuristic default.
"""

from __future__ import annotations

import dataclasses

from nvfp4_jax.core import numerics as nm
from pallas_kernels import launch

B = nm.NVFP4_BLOCK


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeConfig:
  """Tile sizes of the quantize/dequantize kernels.

  Attributes:
    block_rows: rows per program (a power of two; a multiple of 16 for 16x16).
    block_cols: elements of the quantized axis per program (a power of two,
      at least 16).
    num_warps: Triton warps per program.
  """

  block_rows: int = 16
  block_cols: int = 256
  num_warps: int = 4

  def __post_init__(self):
    launch.check_powers_of_two(self, ("block_rows", "block_cols", "num_warps"))
    if self.block_cols < B:
      raise ValueError(
          f"QuantizeConfig.block_cols={self.block_cols} must be >= {B}.")


def default_config(rows: int, cols: int, block_2d: bool = False, *,
                   wide: bool = False) -> QuantizeConfig:
  """4K elements per program (16 x 256 at full size, 4 warps); `wide`: 8K
  (16 x 512), for the kernels whose per-block work is the larger part (the
  round-to-nearest codes with Blackwell's E2M1 conversion: each thread's
  fixed and per-block instructions spread over 64 elements instead of 32).

  Measured on H100 at 8192^2 bf16 (BENCHMARKS.md, tile sweep): 16x256 and
  8x256 were fastest; 8K-element tiles were ~20% slower, 32K spilled. The
  8K tiles on Blackwell are chosen by instruction count (offline
  `nvfp4_jax.tools.sass_report --arch sm_100`), not measured on the device.
  """
  bc = min(512 if wide else 256, launch.next_pow2(cols))
  br = max(B if block_2d else 1, min(16, launch.next_pow2(rows),
                                     (8192 if wide else 4096) // bc))
  return QuantizeConfig(block_rows=br, block_cols=bc, num_warps=4)
