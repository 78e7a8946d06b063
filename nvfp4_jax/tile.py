"""Block-level compositions of the numerics: the reference and every kernel call these.

`nvfp4_jax.numerics` defines each elementwise step of NVFP4_SPEC section 2;
this module composes them on a tile of 16-element blocks, `[rows, blocks, 16]`,
in TransformerEngine's order. The pure-jnp reference quantizer applies them to
the whole tensor (one tile), the Pallas kernels to the tiles of their grid, so
"kernel == reference" holds by construction and the kernel tests check the
plumbing (tiling, masks, layouts), not two transcriptions of the spec.

Everything here lowers both to XLA and to Pallas-Triton: elementwise
operations, selects, reductions over a tile's axes and small dots. Steps that
lower differently take the difference as an argument (`divide`, `barrier`,
`split_pack`, `tensor_cores`); none changes a bit of the result.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax import numerics as nm

B = nm.NVFP4_BLOCK


def _identity(x):
  return x


def abs_max(x: jax.Array, axis=None) -> jax.Array:
  """`max |x|` over `axis` of FP32 `x`; a NaN anywhere gives NaN.

  Reduces the magnitudes' bit patterns as unsigned integers: for non-negative
  floats the order is the same, and every NaN sorts above +Inf. (Triton lowers
  a float `max` to `maxnumf`, which drops NaN; XLA's propagates it. The bit
  form behaves the same on both.)
  """
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0x7FFFFFFF)
  return jax.lax.bitcast_convert_type(jnp.max(bits, axis=axis), jnp.float32)


def block_amax(xf: jax.Array, block_2d: bool) -> jax.Array:
  """Block amax `[rows, nb]` of flushed FP32 blocks `[rows, nb, 16]`.

  With `block_2d` the rows hold 16x16 tiles (rows % 16 == 0, a tile's 16 rows
  consecutive): one amax per tile, replicated over its 16 rows, as the
  quantized array reports its scales.
  """
  a = abs_max(xf, axis=-1)
  if not block_2d:
    return a
  rows, nb = a.shape
  t = abs_max(a.reshape(rows // B, B, nb), axis=1)
  return jnp.broadcast_to(t[:, None, :], (rows // B, B, nb)).reshape(rows, nb)


def encode_blocks(xf: jax.Array, bamax: jax.Array, s_enc_over_6: jax.Array,
                  inv_s_enc: jax.Array, *, divide: Callable = nm.divide,
                  rbits: jax.Array | None = None, with_values: bool = False,
                  barrier: Callable = _identity, split_pack: bool = False):
  """NVFP4_SPEC section 2, steps 2-4, on blocks `[rows, nb, 16]`.

  Args:
    xf: flushed FP32 values `[rows, nb, 16]`.
    bamax: block amax `[rows, nb]` (see `block_amax`).
    s_enc_over_6, inv_s_enc: the per-tensor constants
      (`numerics.nvfp4_scale_constants`).
    divide: correctly rounded FP32 division for this backend.
    rbits: uint8 `[rows, nb, 16]` random bytes for stochastic rounding (see
      `prng.tile_bytes`); None rounds to nearest even.
    with_values: also return the exact bf16 block values (`fp4 * f32(d)`).
    barrier: applied to the E4M3 scales; under XLA pass
      `jax.lax.optimization_barrier`, which keeps XLA:GPU from fusing the
      FP32->E4M3->FP32 round trip away. (It does not lower in kernels, which
      need none.)
    split_pack: the packing's lowering (see `numerics.pack_e2m1`).

  Returns:
    `(packed uint8 [rows, nb, 8], scales e4m3 [rows, nb], values or None)`.
  """
  scales = barrier(nm.nvfp4_block_decode_scale(bamax, s_enc_over_6))
  d = scales.astype(jnp.float32)
  enc = nm.nvfp4_block_encode_scale(d, inv_s_enc, divide=divide)
  y = xf * enc[..., None]
  if rbits is None:
    codes = nm.e2m1_encode_nearest(y)
  else:
    codes = nm.e2m1_encode_stochastic(y, rbits)
  values = None
  if with_values:
    values = (nm.e2m1_decode(codes) * d[..., None]).astype(jnp.bfloat16)
  return nm.pack_e2m1(codes, split=split_pack), scales, values


def block_values(packed: jax.Array, scales: jax.Array,
                 dtype=jnp.bfloat16) -> jax.Array:
  """Block values `fp4 * f32(d)` `[rows, nb, 16]` from packed codes
  `[rows, nb, 8]` and E4M3 scales `[rows, nb]`.

  Exact in bfloat16 (at most 6 significant bits, within [2^-10, 2688]), so the
  FP32 and bf16 results are the same numbers.
  """
  vals = nm.e2m1_decode(nm.unpack_e2m1(packed))
  return (vals * scales.astype(jnp.float32)[..., None]).astype(dtype)


def bf16_exact_matrix(h: np.ndarray) -> bool:
  """Whether every entry of the (host) matrix `h` is exact in bfloat16."""
  h = np.asarray(h, np.float32)
  return bool(np.all(h.astype(jnp.bfloat16).astype(np.float32) == h))


def hadamard_rows(v: jax.Array, h: jax.Array, *, bf16_operands: bool
                  ) -> jax.Array:
  """`v @ H` of runs of `size` elements, the RHT step (NVFP4_SPEC section 4).

  Flush, multiply with FP32 accumulation, flush, round to bf16: the result is
  returned in FP32 (holding bf16 values).

  Args:
    v: `[n, size]` FP32 (or narrower) values.
    h: the `[size, size]` RHT matrix, FP32.
    bf16_operands: multiply on bf16 operands (tensor cores). Only a lowering
      choice, allowed when it changes nothing: `v` holds bf16 values and `H`'s
      entries are exact in bf16 (`bf16_exact_matrix`; sizes that are powers of
      4), so every product is exact either way. Otherwise the dot runs in FP32
      (IEEE, not TF32).
  """
  v = nm.ftz(v.astype(jnp.float32))
  if bf16_operands:
    y = jnp.dot(v.astype(jnp.bfloat16), h.astype(jnp.bfloat16),
                preferred_element_type=jnp.float32)
  else:
    y = jnp.dot(v, h.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32)
  return nm.ftz(y).astype(jnp.bfloat16).astype(jnp.float32)
