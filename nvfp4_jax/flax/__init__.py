"""Flax integration: linen and NNX layers, `inject_linen`/`inject_nnx` for
unmodified models, and the per-layer precision rules."""

# The public names are `nvfp4_jax`'s (`nvfp4_jax.__all__`, the API
# reference); this package's modules are listed for the reference's
# "Subpackages" section and for `from ... import *`.
__all__ = (
    "inject",
    "linen",
    "moe",
    "nnx",
    "rules",
)
