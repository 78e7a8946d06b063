"""Tiles of the grouped quantizers' kernels: the dense kernels' configs.

`quantize_rows` is the dense quantizer's kernel (`quantize_kernel` with
`grouped=True`), tiled by its `QuantizeConfig` (`ops/quantize/config.py`);
`token_block_amax` and `quantize_tokens` are `quantize_rht_t`'s columns
kernels, tiled by its `ColumnsConfig`, clipped here to the tokens and
features of the call.
"""

from __future__ import annotations

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.ops.quantize_rht_t.config import ColumnsConfig
from pallas_kernels import launch

B = nm.NVFP4_BLOCK


def token_tiles(t: int, f: int, config: ColumnsConfig | None):
  """`(config, blocks, features, grid)` of the token kernels on `[t, f]`:
  16-token blocks and features per program (no more than the call has)
  and the grid over them."""
  cfg = config or ColumnsConfig()
  nb = min(cfg.blocks, launch.next_pow2(t // B))
  bf = max(B, min(cfg.block_features, launch.next_pow2(f)))
  return cfg, nb, bf, (launch.cdiv(t // B, nb), launch.cdiv(f, bf))
