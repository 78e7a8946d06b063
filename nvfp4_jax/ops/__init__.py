"""The ops, one folder each: API and validation (`api.py`), the pure-jnp
reference (`reference.py`), one file per backend (`pallas_triton.py`,
`pallas_mosaic_gpu.py`, `triton.py`, `cudnn.py`), the tile config
(`config.py`) and the sharded form (`sharded.py`).

They import only `nvfp4_jax.core` and `pallas_kernels` (the shared Pallas
plumbing) and each other's API; nothing above (training, flax, parallel,
tools). The training op's old path (`nvfp4_jax.ops.dot_general`) is
served from above, with a DeprecationWarning (`nvfp4_jax._compat`).
"""

# The public names are `nvfp4_jax`'s (`nvfp4_jax.__all__`, the API
# reference); this package's modules are listed for the reference's
# "Subpackages" section and for `from ... import *`.
__all__ = (
    "block_scaled_matmul",
    "block_values",
    "gather_rows",
    "quantize",
    "quantize_pair",
    "quantize_rht_t",
    "ragged_dot",
    "ragged_quantize",
    "weight_only_matmul",
)
