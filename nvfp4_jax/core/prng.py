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

Keys. A layer draws all its operands' seed words with one threefry call
(`operand_seeds`) and hands each quantizer a *seeds key*: a typed JAX key
(`jax.random.wrap_key_data(words, impl=SEEDS)`) whose data are the stream's
two seed words, so `seeds_from_key` returns them without hashing again. Any
threefry key works too (its seeds are `jax.random.bits(key, (2,), uint32)`).
One call per layer instead of one per operand and split: the threefry rounds
were half of an NVFP4 step's optimized instructions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend.random  # noqa: F401 - jax.extend.random.define_prng_impl.
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


def _seeds_bits(data: jax.Array, bit_width: int, shape) -> jax.Array:
  if bit_width != 32 or tuple(shape) != (2,):
    raise TypeError(
        f"A stochastic-rounding seeds key holds its stream's two uint32 seed "
        f"words and draws nothing else (asked for {tuple(shape)} of "
        f"{bit_width}-bit values): draw other random numbers from a "
        f"jax.random.key.")
  return data


_THREEFRY = jax.extend.random.threefry_prng_impl

SEEDS = jax.extend.random.define_prng_impl(
    key_shape=(2,), seed=_THREEFRY.seed, split=_THREEFRY.split,
    random_bits=_seeds_bits, fold_in=_THREEFRY.fold_in,
    name="nvfp4_sr_seeds", tag="sr")
"""The PRNG implementation of seeds keys: `jax.random.bits(key, (2,),
uint32)` is the key's data itself (split and fold_in are threefry's)."""


def seeds_key(words: jax.Array) -> jax.Array:
  """The seeds key whose stream has the seed words `words` (uint32 `[2]`)."""
  return jax.random.wrap_key_data(words.astype(jnp.uint32), impl=SEEDS)


def operand_seeds(key: jax.Array, n: int) -> list[jax.Array]:
  """`n` seeds keys drawn from `key` with one threefry call: the `i`-th
  streams with the seed words `jax.random.bits(key, (n, 2), uint32)[i]`."""
  words = computed_once(jax.random.bits(key, (n, 2), jnp.uint32))
  return [seeds_key(words[i]) for i in range(n)]


def computed_once(key: jax.Array) -> jax.Array:
  """`key` (or seed words) unchanged, behind an optimization barrier.

  Threefry is elementwise integer arithmetic, so XLA's GPU fusion copies a
  key's whole derivation (flax's fold_ins of the layer path, the layer's
  draw: ~500 instructions) into every consumer rather than compute it once;
  in a GPT step that made priority fusion the largest pass of the compile
  (BENCHMARKS.md, start-up). Fusion does not cross the barrier: the key is
  computed once and its consumers read it. Anything but a JAX array (a
  bad key the quantizer names) passes through as it is.
  """
  if not isinstance(key, jax.Array):
    return key
  return jax.lax.optimization_barrier(key)


def pair_keys(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The keys of a tensor's two quantized operands, `(k_row, k_rht_t)`:
  `operand_seeds(key, 2)`.

  A tensor quantized twice (dY: along its rows for Dgrad and, after the RHT,
  along tokens for Wgrad) rounds each copy with its own stream.
  """
  k_row, k_t = operand_seeds(key, 2)
  return k_row, k_t


def seeds_from_key(key: jax.Array) -> jax.Array:
  """The two uint32 seeds of the stream, `jax.random.bits(key, (2,), uint32)`.

  Works for typed keys (`jax.random.key`), raw `uint32[2]` keys and seeds
  keys (`seeds_key`: their data, no hashing) alike.
  """
  return jax.random.bits(key, (2,), jnp.uint32)


def tile_words(row0: jax.Array | int, rows: int, blk0: jax.Array | int,
               nb: int, words_per_row: int, seed0: jax.Array,
               seed1: jax.Array, *, block: int = 16) -> jax.Array:
  """The stream's hash words for a `[rows, nb, block]` tile of the quantized
  tensor, uint32 `[rows, nb, block // 4]`: word `w` holds the bytes of the
  tile's elements `4w .. 4w + 3` of each block (`tile_bytes` splits them).

  The one definition of which byte each element gets; the reference applies it
  to the whole tensor, the kernels to their tiles. The tile starts at row
  `row0` and block `blk0` of a tensor with `4 * words_per_row` elements per
  row: element `(r, c)` has the row-major index `n = r * 4 * words_per_row +
  c` and rounds with byte `n % 4` of hash word `n // 4`.
  """
  shape = (rows, nb, block // 4)
  r = row0 + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  blk = blk0 + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  lane = jax.lax.broadcasted_iota(jnp.uint32, shape, 2)
  return sr_hash(block_word_base(r, blk, words_per_row, block=block) + lane,
                 seed0, seed1)


def block_word_base(row: jax.Array, blk: jax.Array, words_per_row: int, *,
                    block: int = 16) -> jax.Array:
  """The index of the first hash word of block `blk` of row `row` (`block`
  elements along the row, `4 * words_per_row` elements per row): its word
  `w` is this plus `w` (`tile_words` takes every block's words at once,
  `block_words` one word of a block at a time)."""
  return (row.astype(jnp.uint32) * jnp.uint32(words_per_row)
          + blk.astype(jnp.uint32) * jnp.uint32(block // 4))


def block_words(base: jax.Array, seed0: jax.Array, seed1: jax.Array, *,
                block: int = 16) -> list[jax.Array]:
  """The hash words of blocks, one array per word: word `w` of every block
  whose first word index is in `base` (`block_word_base`), as `tile_words`
  gives them. For kernels that hold a block's elements in separate arrays."""
  return [sr_hash(base + jnp.uint32(w), seed0, seed1)
          for w in range(block // 4)]


def tile_bytes(row0: jax.Array | int, rows: int, blk0: jax.Array | int,
               nb: int, words_per_row: int, seed0: jax.Array,
               seed1: jax.Array, *, block: int = 16) -> jax.Array:
  """The stream's bytes for a `[rows, nb, block]` tile: `tile_words` split
  into bytes, uint8 `[rows, nb, block]`."""
  return word_bytes(tile_words(row0, rows, blk0, nb, words_per_row, seed0,
                               seed1, block=block))


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a shard sits in the whole 2-D tensor it is a block of.

  A tensor split over a device mesh is quantized shard by shard; with this,
  each shard draws the whole tensor's stream bytes for its elements (its
  element `(r, c)` is the tensor's `(row0 + r, col0 + c)`), so the shards'
  codes are the whole tensor's, bit for bit.

  Attributes:
    row0, col0: the global row and column of the shard's first element (ints,
      or int32 scalars traced from `jax.lax.axis_index`).
    rows, cols: static; the whole tensor's shape.
  """

  row0: jax.Array | int
  col0: jax.Array | int
  rows: int
  cols: int

  @property
  def T(self) -> "Placement":  # noqa: N802 - numpy's name.
    """The same shard's placement in the transposed tensor."""
    return Placement(self.col0, self.row0, self.cols, self.rows)


jax.tree_util.register_dataclass(
    Placement, data_fields=["row0", "col0"], meta_fields=["rows", "cols"])


def stream_origin(placement: Placement | None, cols: int, *,
                  block: int = 16) -> tuple[jax.Array, int]:
  """The `tile_bytes` origin of a `[rows, cols]` shard at `placement`.

  Args:
    placement: the shard's `Placement`; None for a whole tensor.
    cols: the shard's row length (elements).
    block: elements per scale block (the stream is addressed by blocks).

  Returns:
    `(origin, words_per_row)`: int32 `[2]` holding the shard's first global
    row and block (`tile_bytes`' `row0` and `blk0` for its first tile; a
    kernel adds its tile's own offset), and the whole tensor's 32-bit words
    per row.
  """
  if placement is None:
    return jnp.zeros((2,), jnp.int32), cols // 4
  origin = jnp.stack([jnp.asarray(placement.row0, jnp.int32),
                      jnp.asarray(placement.col0, jnp.int32) // block])
  return origin, placement.cols // 4


def random_bytes(seeds: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The stream's bytes for a whole tensor of `shape` (row-major), as uint8.

  Args:
    seeds: uint32[2] from `seeds_from_key`.
    shape: the quantized tensor's shape; its size a multiple of 4, at most
      2^34.

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
  return tile_bytes(0, 1, 0, 1, n // 4, seeds[0], seeds[1],
                    block=n).reshape(shape)


def word_bytes(words: jax.Array) -> jax.Array:
  """Splits uint32 words `[..., W]` into their bytes `[..., 4W]`, low byte first."""
  shifts = jax.lax.broadcasted_iota(jnp.uint32, (*words.shape, 4),
                                    words.ndim) * 8
  b = (words[..., None] >> shifts) & 0xFF
  return b.astype(jnp.uint8).reshape(*words.shape[:-1], -1)
