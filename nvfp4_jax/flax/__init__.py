"""Flax integration: linen and NNX layers, `inject_linen`/`inject_nnx` for
unmodified models, and the per-layer precision rules."""
