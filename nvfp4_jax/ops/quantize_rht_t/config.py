"""Tiles of the RHT kernels (tensor-core and columns layouts), with the heuristic defaults.
"""

from __future__ import annotations

import dataclasses

from nvfp4_jax.core import numerics as nm
from pallas_kernels import launch

B = nm.NVFP4_BLOCK


# Hadamard sizes with exact bf16 entries (+-1/4, +-1/8) that fill a tensor-core
# dot (Triton's dots need all dimensions >= 16).
SUPPORTED_SIZES = (16, 64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RHTConfig:
  """Tile sizes of the RHT kernels (powers of two).

  Attributes:
    block_tokens: tokens per program (a multiple of the Hadamard size); in
      the amax pass, tokens per step of a program's loop.
    block_features: features per program (>= 16).
    num_warps: Triton warps per program.
    amax_steps: token tiles one program of the amax pass reduces at most
      (fewer where the tokens need fewer, or where the grid would shrink
      below `AMAX_PROGRAMS` programs).
    amax_stages: Triton pipeline stages of the amax pass's loop.
  """

  block_tokens: int = 64
  block_features: int = 64
  num_warps: int = 4
  amax_steps: int = 16
  amax_stages: int = 1

  def __post_init__(self):
    launch.check_powers_of_two(self, ("block_tokens", "block_features",
                                      "num_warps", "amax_steps",
                                      "amax_stages"))
    if self.block_tokens < B or self.block_features < B:
      raise ValueError(f"RHTConfig tiles must be at least {B}x{B}; got {self}.")


def default_config(tokens: int, features: int, size: int = 16) -> RHTConfig:
  bt = max(size, min(64, launch.next_pow2(tokens)))
  bf = max(B, min(64, launch.next_pow2(features)))
  return RHTConfig(block_tokens=bt, block_features=bf, num_warps=4)


def check_size(size: int, what: str) -> None:
  """Raises NotImplementedError for Hadamard sizes the kernels do not run."""
  if size not in SUPPORTED_SIZES:
    raise NotImplementedError(
        f"{what}: the Pallas RHT kernels support Hadamard sizes "
        f"{SUPPORTED_SIZES} (exact in bf16, >= 16 for the tensor-core dot), "
        f"got {size}; use implementation='xla'.")


# Programs the amax pass keeps at least (where the tensor has that many
# tiles): its loop runs one program's tiles one after another, so too few
# programs leave SMs idle (GPT small's 32768 x 768 in 384 programs of 16
# tiles ran slower than 6144 programs of one).
AMAX_PROGRAMS = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class ColumnsConfig:
  """Tile of `_columns_kernel` (powers of two).

  Attributes:
    blocks: 16-token blocks per program (its tokens: 16 x this); in the
      amax pass, per step of a program's loop.
    block_features: features per program.
    num_warps: Triton warps per program.
    amax_steps: tiles one program of the amax pass reduces at most (as
      `RHTConfig.amax_steps`).
  """

  blocks: int = 4
  block_features: int = 128
  num_warps: int = 4
  amax_steps: int = 16

  def __post_init__(self):
    launch.check_powers_of_two(self, ("blocks", "block_features",
                                      "num_warps", "amax_steps"))
