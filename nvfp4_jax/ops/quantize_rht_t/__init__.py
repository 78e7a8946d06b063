"""The Wgrad operand `q(rht(x^T))`: a 16-point Random Hadamard Transform
along tokens, then 1x16 NVFP4 blocks along tokens."""
