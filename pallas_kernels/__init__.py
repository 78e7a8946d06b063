"""The Pallas plumbing every op's GPU kernel shares (`common`).

Each op's kernels live in its folder, `nvfp4_jax/ops/<op>/pallas_triton.py`
(and `pallas_mosaic_gpu.py`, `triton.py`), beside the op's reference; what
they share sits here, below every op: backend checks, exact division,
NaN-propagating maxima, inline-PTX E2M1 encoders and decoders, masked loads
and the launch helper. It imports only `nvfp4_jax.core`.
"""
