"""How the pair kernels run: two kernels or one fused, and the fused kernel's tiles.
"""

from __future__ import annotations

from nvfp4_jax.ops.quantize_rht_t.config import RHTConfig
from nvfp4_jax.ops.quantize_rht_t.config import default_config


def runs_split(row_rounding: str | None, t_rounding: str | None) -> bool:
  """Whether the pair runs as two kernels (each reading `x`) rather than one.

  Both operands rounded stochastically: the fused kernel holds two SR
  streams (165 registers per thread) and ran 6% slower than the two
  kernels at its best tile, 31% at the old default (H100, 8192^2 bf16,
  `python -m benchmarks.bench_quantize --pair-sweep`).
  """
  return row_rounding == "stochastic" and t_rounding == "stochastic"


def pair_config(tokens: int, features: int, size: int = 16, *,
                values_x: bool = False) -> RHTConfig:
  """The fused pair kernel's tiles, 4 warps: 64 tokens x 64 features where
  `x` is written as block values (the emulated GEMM's operand), 32 x 64
  where both operands are written as codes.

  Measured on the H100 (RTNE pair, amaxes given):
  - codes for both, 8192^2 (`python -m benchmarks.bench_quantize
    --pair-sweep`): 32x64 243 us, 64x64 260 us; two kernels 243 us;
  - `x` as values (`--used-sweep`, GPU time), 64x64 against 32x64: 83.5 vs
    86.2 us at 8192x4096, 35.6 vs 36.5 at 16384x768, 83.1 vs 86.9 at
    16384x2048, 93.7 vs 97.2 at 16384x2304, 161 vs 167 at 16384x4096.
  """
  cfg = default_config(tokens, features, size)
  bt = 64 if values_x else 32
  return RHTConfig(block_tokens=max(size, min(bt, cfg.block_tokens)),
                   block_features=cfg.block_features, num_warps=4)
