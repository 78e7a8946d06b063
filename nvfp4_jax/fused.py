"""Fused quantizers of the recipe's operands: reference and dispatch.

The recipe quantizes X twice per step: 1x16 along `in` for Fprop and, for
Wgrad, `rht(X.T)` along tokens (and dY likewise, with stochastic rounding).
The references here are plain compositions of `nvfp4_jax.hadamard.rht` and
`nvfp4_jax.nvfp4.quantize`; the Pallas kernels (`pallas_kernels.rht`) compute
the same bytes while reading X once per pass (an amax pass, then an encode
pass that writes both operands), as TransformerEngine's fused
cast-transpose-RHT does.

Each function takes `implementation=`: "xla" (the reference), "pallas" (the
kernels; interpreted on CPU) or None ("pallas" on GPU, "xla" elsewhere;
unsupported calls fall back to "xla").
"""

from __future__ import annotations

from typing import Sequence

import jax

from nvfp4_jax import dispatch
from nvfp4_jax.hadamard import rht
from nvfp4_jax.nvfp4 import NVFP4Array
from nvfp4_jax.nvfp4 import block_dequantize_nvfp4
from nvfp4_jax.nvfp4 import quantize_reference

_PREFERRED = {"gpu": ("pallas",)}


def split_key(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The keys of the two operands of `quantize_x_and_rht_t`: `(k_x, k_rht)`."""
  k_x, k_t = jax.random.split(key)
  return k_x, k_t


def quantize_rht_t(x: jax.Array, *, rounding: str = "nearest",
                   key: jax.Array | None = None,
                   amax: jax.Array | None = None,
                   sign_vector: Sequence[int] | None = None, size: int = 16,
                   implementation: str | None = None) -> NVFP4Array:
  """The Wgrad operand: `quantize(rht(x.T))` for `x: [tokens, features]`.

  Transpose, RHT (bf16-rounded), amax of the transformed tensor, then 1x16
  quantization along tokens with RTNE or SR.

  Args:
    x: `[tokens, features]` float array; tokens a multiple of 16 and `size`.
    rounding: "nearest" (X) or "stochastic" (dY).
    key: PRNG key for stochastic rounding; the SR stream runs over the
      `[features, tokens]` result in row-major order.
    amax: the amax of `rht(x.T)` if already reduced (e.g. a `pmax` across
      shards); computed otherwise.
    sign_vector, size: the RHT's signs and size (see `nvfp4_jax.rht`).
    implementation: "xla", "pallas" or None.

  Returns:
    NVFP4Array of logical shape `[features, tokens]`.
  """
  return dispatch.dispatch(
      "quantize_rht_t", _RHT_T, implementation, _PREFERRED, x,
      rounding=rounding, key=key, amax=amax, sign_vector=sign_vector,
      size=size)


def _quantize_rht_t_xla(x, *, rounding, key, amax, sign_vector, size):
  return quantize_reference(rht(x.T, sign_vector=sign_vector, size=size),
                            rounding=rounding, key=key, amax=amax)


def _quantize_rht_t_pallas(x, **kwargs):
  from pallas_kernels import rht as pallas_rht  # pylint: disable=g-import-not-at-top
  return pallas_rht.quantize_rht_t(x, **kwargs)


def quantize_x_and_rht_t(x: jax.Array, *, key: jax.Array | None = None,
                         sign_vector: Sequence[int] | None = None,
                         size: int = 16, implementation: str | None = None
                         ) -> tuple[NVFP4Array, NVFP4Array]:
  """Both operands of one activation from one read: `(q(x), q(rht(x.T)))`.

  `q(x)` is 1x16 along `features` (the Fprop operand of X, or the Dgrad
  operand of dY); `q(rht(x.T))` is the Wgrad operand. Each has its own amax.

  Args:
    x: `[tokens, features]`; both axes multiples of 16 (tokens of `size`).
    key: None: both round to nearest (the recipe's X). A key: both round
      stochastically (the recipe's dY), with keys `split_key(key)`.
    sign_vector, size: the RHT's signs and size.
    implementation: "xla", "pallas" or None.

  Returns:
    `(q_x [tokens, features], q_rht_xt [features, tokens])`.
  """
  return dispatch.dispatch(
      "quantize_x_and_rht_t", _X_AND_RHT_T, implementation, _PREFERRED, x,
      key=key, sign_vector=sign_vector, size=size)


def _quantize_x_and_rht_t_xla(x, *, key, sign_vector, size):
  rounding = "nearest" if key is None else "stochastic"
  k_x, k_t = (None, None) if key is None else split_key(key)
  return (quantize_reference(x, rounding=rounding, key=k_x),
          _quantize_rht_t_xla(x, rounding=rounding, key=k_t, amax=None,
                              sign_vector=sign_vector, size=size))


def _quantize_x_and_rht_t_pallas(x, *, key, sign_vector, size):
  from pallas_kernels import rht as pallas_rht  # pylint: disable=g-import-not-at-top
  k_x, k_t = (None, None) if key is None else split_key(key)
  return pallas_rht.quantize_x_and_rht_t(
      x, key_x=k_x, key_t=k_t, sign_vector=sign_vector, size=size)


def quantize_with_values(x: jax.Array, *, block_2d: bool = False,
                         rounding: str = "nearest",
                         key: jax.Array | None = None,
                         amax: jax.Array | None = None,
                         implementation: str | None = None
                         ) -> tuple[NVFP4Array, jax.Array]:
  """`quantize(x)` plus its exact bf16 block values, for a Hopper GEMM.

  The values are `fp4 * f32(block scale)` (exact in bf16); a GEMM on them
  with FP32 accumulation times `gemm_alpha` is the exact NVFP4 GEMM
  (`nvfp4_jax.gemm.block_values_matmul`). The Pallas kernel writes them in
  the same pass as the codes, saving the dequantize pass of the GEMM.

  Returns:
    `(NVFP4Array, bf16 values of x's shape)`.
  """
  return dispatch.dispatch(
      "quantize_with_values", _WITH_VALUES, implementation, _PREFERRED, x,
      block_2d=block_2d, rounding=rounding, key=key, amax=amax)


def _quantize_with_values_xla(x, **kwargs):
  q = quantize_reference(x, **kwargs)
  return q, block_dequantize_nvfp4(q)[0]


def _quantize_with_values_pallas(x, **kwargs):
  from pallas_kernels import quantize as pallas_quantize  # pylint: disable=g-import-not-at-top
  return pallas_quantize.quantize(x, with_values=True, **kwargs)


_RHT_T = {"xla": _quantize_rht_t_xla, "pallas": _quantize_rht_t_pallas}
_X_AND_RHT_T = {"xla": _quantize_x_and_rht_t_xla,
                "pallas": _quantize_x_and_rht_t_pallas}
_WITH_VALUES = {"xla": _quantize_with_values_xla,
                "pallas": _quantize_with_values_pallas}
