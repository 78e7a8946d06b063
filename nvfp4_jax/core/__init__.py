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

# The public names are `nvfp4_jax`'s (`nvfp4_jax.__all__`, the API
# reference); this package's modules are listed for the reference's
# "Subpackages" section and for `from ... import *`.
__all__ = (
    "arrays",
    "dispatch",
    "hadamard",
    "numerics",
    "prng",
    "recipe",
    "scope",
    "spmd",
    "tile",
)
