"""The grouped quantizers of a mixture of experts: the ragged operands of the
grouped GEMMs (`ops/ragged_dot`), each group (expert) quantized as its own
tensor (`Grouped`)."""
