"""Dequantization: the exact bf16 block values of a quantized array (the
emulated GEMM's operand) and the FP32 tensor factor."""
