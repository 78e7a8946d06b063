"""The NVFP4 quantizer's pure-jnp reference, bit-exact with TransformerEngine.

`quantize_reference` follows NVFP4_SPEC section 2 with the block compositions
of `nvfp4_jax.core.tile` (the same functions the kernels apply to their tiles),
on the whole tensor viewed as `[rows, K/16, 16]`. It is the truth the kernels
are tested against and the CPU default. All arithmetic is FP32; a bf16 or fp16
input is widened exactly, so the codes depend only on the values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng
from nvfp4_jax.core import tile
from nvfp4_jax.core.arrays import NVFP4Array


B = nm.NVFP4_BLOCK


def tensor_amax(xf: jax.Array) -> jax.Array:
  """`max |x|` of flushed FP32 `xf`; NaN anywhere gives NaN."""
  return tile.abs_max(xf)


def quantize_reference(x: jax.Array, *, block_2d: bool = False,
                       rounding: str = "nearest",
                       key: jax.Array | None = None,
                       amax: jax.Array | None = None,
                       with_values: bool = False,
                       four_over_six: bool = False,
                       placement: prng.Placement | None = None):
  """The pure-jnp reference of `quantize` (its `implementation="xla"`).

  Trusts its arguments (`quantize` validates them). With `with_values` it
  also returns the exact bf16 block values (see `quantize_with_values`).

  It runs as a `jax.jit` of its own: JAX traces it once per shape and
  setting, and a model's many layers of the same shapes reuse that trace
  (a GPT's train step traces dozens of quantizers; XLA inlines the calls, so
  the compiled program and its bits are those of the quantizer written out
  in place).
  """
  return _quantize(x, key, amax, placement, block_2d=block_2d,
                   rounding=rounding, with_values=with_values,
                   four_over_six=four_over_six)


@functools.partial(jax.jit, static_argnames=(
    "block_2d", "rounding", "with_values", "four_over_six"))
def _quantize(x, key, amax, placement, *, block_2d, rounding, with_values,
              four_over_six):
  # The barrier keeps XLA:GPU from fusing a producer's rounding to `x.dtype`
  # (e.g. the RHT's FP32->bf16) with the widening below and eliding both
  # ("excess precision"): the quantizer must see the rounded values.
  x = jax.lax.optimization_barrier(x)
  shape = x.shape
  k = shape[-1]
  xf = nm.ftz(x.astype(jnp.float32)).reshape(-1, k // B, B)
  if amax is None:
    amax = tensor_amax(xf)
  s_enc_over_6, inv_s_enc = jax.lax.optimization_barrier(
      nm.nvfp4_scale_constants(amax, four_over_six=four_over_six))
  rbits = None
  if rounding == "stochastic":
    seeds = prng.seeds_from_key(key)
    origin, words_per_row = prng.stream_origin(placement, k)
    rbits = prng.tile_bytes(origin[0], xf.shape[0], origin[1], k // B,
                            words_per_row, seeds[0], seeds[1])
  packed, scales, values = tile.encode_blocks(
      xf, tile.block_amax(xf, block_2d), s_enc_over_6, inv_s_enc,
      rbits=rbits, with_values=with_values,
      barrier=jax.lax.optimization_barrier, four_over_six=four_over_six,
      block_2d=block_2d)
  q = NVFP4Array(codes=packed.reshape(*shape[:-1], k // 2),
                 scales=scales.reshape(*shape[:-1], k // B), amax=amax,
                 block_2d=block_2d, four_over_six=four_over_six)
  return (q, values.reshape(shape)) if with_values else q
