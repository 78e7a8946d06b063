"""High-precision activations times a packed NVFP4 weight (inference)."""
