"""Both GEMM operands of one tensor (the recipe's X or dY): `q(x)` along
features and `q(rht(x^T))` along tokens, from one read per pass."""
