"""The block-scaled GEMM `a @ b.T` on quantized operands: the exact emulation
(bf16 block values, FP32 accumulation, alpha) and the native FP4 backends."""
