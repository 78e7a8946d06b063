"""NVFP4 quantization along the last axis: 1x16 blocks, or 16x16 tiles
(weights); with its bf16 block values (`quantize_with_values`); the MX
formats' reference (`mx.py`)."""
