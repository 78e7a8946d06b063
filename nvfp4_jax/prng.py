"""The random-bit stream of stochastic rounding.

A counter-based stream, defined so that a GPU kernel reproduces it bit for bit
from the same key: each element of the quantized tensor gets 8 random bits, and
one 32-bit hash feeds 4 consecutive elements.

Definition. Let the quantized tensor (after any transpose or Hadamard transform)
have `N` elements in row-major order, and `(seed0, seed1) =
jax.random.bits(key, (2,), uint32)`. Element `n` rounds with the byte

    byte(n) = (sr_hash(n // 4, seed0, seed1) >> (8 * (n % 4))) & 0xFF

where `sr_hash(w, s0, s1) = mix32(mix32(w ^ s0) + s1)` on uint32 with
wrap-around, and `mix32` is the `lowbias32` integer finaliser
(xor-shift 16, multiply 0x7FEB352D, xor-shift 15, multiply 0x846CA68B,
xor-shift 16). Both steps are bijections of the counter, so no two words of one
tensor share a hash input; tensors must hold fewer than 2^34 elements.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_M1 = 0x7FEB352D
_M2 = 0x846CA68B
MAX_ELEMENTS = 4 * 2**32


def mix32(h: jax.Array) -> jax.Array:
  """The `lowbias32` finaliser on uint32 (a bijection)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(_M1)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(_M2)
  return h ^ (h >> 16)


def sr_hash(word: jax.Array, seed0: jax.Array, seed1: jax.Array) -> jax.Array:
  """The 32 random bits of word `word` (= element index // 4), uint32."""
  word = word.astype(jnp.uint32)
  return mix32(mix32(word ^ seed0) + seed1)


def seeds_from_key(key: jax.Array) -> jax.Array:
  """The two uint32 seeds of the stream, `jax.random.bits(key, (2,), uint32)`.

  Works for typed keys (`jax.random.key`) and raw `uint32[2]` keys alike.
  """
  return jax.random.bits(key, (2,), jnp.uint32)


def random_bytes(seeds: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The stream's bytes for a tensor of `shape` (row-major), as uint8.

  Args:
    seeds: uint32[2] from `seeds_from_key`.
    shape: the quantized tensor's shape; its size must be a multiple of 4.

  Returns:
    uint8 array of `shape`.
  """
  n = 1
  for d in shape:
    n *= d
  if n % 4:
    raise ValueError(f"random_bytes needs a size divisible by 4, got {shape}.")
  if n > MAX_ELEMENTS:
    raise ValueError(
        f"stochastic rounding supports tensors of at most 2^34 elements; got "
        f"{n}. Split the tensor.")
  words = sr_hash(jnp.arange(n // 4, dtype=jnp.uint32), seeds[0], seeds[1])
  return word_bytes(words).reshape(shape)


def word_bytes(words: jax.Array) -> jax.Array:
  """Splits uint32 words `[..., W]` into their bytes `[..., 4W]`, low byte first."""
  shifts = jnp.arange(4, dtype=jnp.uint32) * 8
  b = (words[..., None] >> shifts) & 0xFF
  return b.astype(jnp.uint8).reshape(*words.shape[:-1], -1)
