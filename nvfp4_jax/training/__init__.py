"""The training op: the NVFP4 linear layer's `custom_vjp` (three GEMMs, their
operands and residuals, `remat_policy`) and the FP32 master weights."""
