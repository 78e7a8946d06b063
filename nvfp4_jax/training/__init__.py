"""The training ops: the NVFP4 linear layer's `custom_vjp` (three GEMMs, their
operands and residuals, `remat_policy`), the same for a mixture of experts'
grouped GEMM (`ragged_dot`), the mixture-of-experts layer's framework-free
math (`moe`: routing, dispatch, the expert-parallel exchange) and the FP32
master weights."""
