"""The training ops: the NVFP4 linear layer's `custom_vjp` (`dot_general`:
three GEMMs, their operands and residuals), the same for a mixture of
experts' grouped GEMM (`ragged_dot`), the mixture-of-experts layer's
framework-free math (`moe`, the layer's forward pass; `moe_routing`:
routing, dispatch and combine; `moe_exchange`: the expert-parallel
exchange), the names the ops give their traces (`names`: `remat_policy`,
the layer scope) and the FP32 master weights."""

# The public names are `nvfp4_jax`'s (`nvfp4_jax.__all__`, the API
# reference); this package's modules are listed for the reference's
# "Subpackages" section and for `from ... import *`.
__all__ = (
    "dot_general",
    "master_weights",
    "moe",
    "moe_exchange",
    "moe_routing",
    "names",
    "ragged_dot",
)
