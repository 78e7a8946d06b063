"""Random Hadamard Transform (RHT) of the Wgrad operands (NVFP4_SPEC section 4)."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax.core.tile import hadamard_rows

# TransformerEngine's default sign vector for 16x16 RHT, shared by all layers.
TE_SIGN_VECTOR_16 = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def default_sign_vector(size: int) -> tuple[int, ...]:
  """The fixed sign vector used for `size`.

  For 16 it is TE's vector. For other sizes (the paper also tried 4 and 128)
  there is no TE default; this returns a fixed vector drawn once from
  `numpy.random.default_rng(size)` (PCG64, stable across numpy versions).

  Args:
    size: the RHT size, a power of two.

  Returns:
    A tuple of `size` entries, each +1 or -1.
  """
  _check_size(size)
  if size == 16:
    return TE_SIGN_VECTOR_16
  rng = np.random.default_rng(size)
  return tuple(int(v) for v in rng.choice([-1, 1], size=size))


def _check_size(size: int) -> None:
  if not isinstance(size, int) or size < 2 or size & (size - 1):
    raise ValueError(
        f"RHT size must be a power of two >= 2 (16 is the recipe's default), "
        f"got {size!r}.")


def sylvester_hadamard(size: int) -> np.ndarray:
  """The `size x size` Sylvester Hadamard matrix of +-1 (float32)."""
  _check_size(size)
  idx = np.arange(size)
  parity = np.bitwise_count(idx[:, None] & idx[None, :]) & 1
  return np.where(parity == 1, -1.0, 1.0).astype(np.float32)


def rht_matrix(sign_vector: Sequence[int] | None = None,
               size: int = 16) -> np.ndarray:
  """`H = diag(s) @ H_size / sqrt(size)` as float32 (orthogonal).

  Exact for sizes that are powers of 4 (4, 16, 64, ...), whose entries are
  powers of two.

  Args:
    sign_vector: the `size` signs (+1/-1) of `diag(s)`; None takes
      `default_sign_vector(size)`.
    size: the Hadamard size.

  Returns:
    A float32 `numpy` array `[size, size]`.

  Raises:
    ValueError: a sign vector that is not `size` entries of +1/-1.
  """
  s = default_sign_vector(size) if sign_vector is None else tuple(sign_vector)
  if len(s) != size or any(v not in (1, -1) for v in s):
    raise ValueError(
        f"sign_vector must hold {size} entries of +1/-1, got {s!r}.")
  h = np.asarray(s, np.float32)[:, None] * sylvester_hadamard(size)
  return (h / np.sqrt(np.float32(size))).astype(np.float32)


def rht(x: jax.Array, *, sign_vector: Sequence[int] | None = None,
        size: int = 16) -> jax.Array:
  """Random Hadamard Transform along the last axis, in tiles of `size`.

  Each tile `v` (a row vector of `size` elements) becomes `v @ H`, accumulated
  in FP32 and rounded to bfloat16, as TE does before taking the amax and
  quantizing. `rht(x.T)` is TE's Wgrad operand for `x: [tokens, features]`.

  Because `H` is orthogonal, `rht(a) @ rht(b).T == a @ b.T` up to the bf16
  rounding: the Wgrad GEMM is unchanged except for quantization.

  The FP32 arithmetic is defined, so the result is the same on every CPU and
  on the GPU: subnormal inputs, products and partial sums are flushed to
  zeros of their sign, and the sums are added in the fast Walsh-Hadamard
  transform's order (`tile.hadamard_rows`; where every sum is exact, any
  order gives the same values). An implementation that sums in another
  order (TE's tensor cores) can differ where a sum is inexact or a product
  or partial sum is subnormal; where a sum is zero only by cancellation or
  of zeros, by the sign of that zero alone, which changes an FP4 code from
  0 to 8 (both decode to 0), never a scale byte.

  Args:
    x: floating array `[..., K]`, `K` a multiple of `size`.
    sign_vector: the diagonal of random signs; defaults to
      `default_sign_vector(size)` (TE's vector for 16).
    size: the Hadamard size, a power of two.

  Returns:
    bfloat16 array of `x`'s shape.
  """
  rht_matrix(sign_vector, size)  # Validates `size` and `sign_vector`.
  s = default_sign_vector(size) if sign_vector is None else tuple(sign_vector)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"rht needs a floating array, got dtype {x.dtype}.")
  if x.ndim == 0 or x.shape[-1] % size:
    raise ValueError(
        f"rht transforms the last axis in tiles of {size}; got shape "
        f"{x.shape}. Pad that axis to a multiple of {size}.")
  y = hadamard_rows(x.reshape(-1, size), s)
  return y.reshape(x.shape).astype(jnp.bfloat16)
