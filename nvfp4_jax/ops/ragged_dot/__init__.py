"""The grouped GEMMs of a mixture of experts (`jax.lax.ragged_dot`'s three
GEMMs) on the grouped quantizers' operands (`ops/ragged_quantize`)."""
