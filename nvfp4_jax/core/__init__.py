"""Below every op: the shared numerics and plumbing.

E2M1/E4M3 arithmetic (`numerics`), the block compositions the references and
kernels share (`tile`), the stochastic-rounding stream (`prng`), the Hadamard
transform (`hadamard`), the quantized array types and input checks (`arrays`),
the recipe's configuration (`recipe`), `implementation=` dispatch
(`dispatch`), thread-local scopes (`scope`) and shard helpers (`spmd`:
shard_map, and the `custom_partitioning` scaffolding the ops' per-shard
rules share).
Nothing here imports from `nvfp4_jax.ops` or above.
"""
