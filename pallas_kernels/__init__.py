"""Pallas-Triton kernels for NVFP4 (see nvfp4_jax for the reference)."""
