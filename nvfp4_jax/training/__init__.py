"""The training ops: the NVFP4 linear layer's `custom_vjp` (`dot_general`:
three GEMMs, their operands and residuals), the mixture of experts' grouped
GEMM (`ragged_dot`), the names both give their traces (`names`:
`remat_policy`, the layer scope) and the FP32 master weights."""
