"""The ops, one folder each: API and validation (`api.py`), the pure-jnp
reference (`reference.py`), one file per backend (`pallas_triton.py`,
`pallas_mosaic_gpu.py`, `triton.py`, `cudnn.py`), the tile config
(`config.py`) and the sharded form (`sharded.py`).

They import only `nvfp4_jax.core` and `pallas_kernels` (the shared Pallas
plumbing) and each other's API; nothing above (training, flax, parallel,
tools).
"""


def __getattr__(name):
  # `nvfp4_jax.ops` was the training op's module before this package: its
  # names stay importable from here (nvfp4_jax._compat).
  import importlib  # pylint: disable=g-import-not-at-top
  module = importlib.import_module("nvfp4_jax.training.dot_general")
  try:
    return getattr(module, name)
  except AttributeError:
    raise AttributeError(
        f"module 'nvfp4_jax.ops' has no attribute {name!r}") from None
