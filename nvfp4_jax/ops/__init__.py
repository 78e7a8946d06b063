"""The ops, one folder each: API and validation (`api.py`), the pure-jnp
reference (`reference.py`), one file per backend (`pallas_triton.py`,
`pallas_mosaic_gpu.py`, `triton.py`, `cudnn.py`), the tile config
(`config.py`) and the sharded form (`sharded.py`).

They import only `nvfp4_jax.core` and `pallas_kernels` (the shared Pallas
plumbing) and each other's API; nothing above (training, flax, parallel,
tools). The training op's old path (`nvfp4_jax.ops.dot_general`) is
served from above, with a DeprecationWarning (`nvfp4_jax._compat`).
"""
