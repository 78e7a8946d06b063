"""`quantize_rht_t`: the Wgrad operand `q(rht(x^T))` along tokens.

Transpose, RHT (bf16-rounded), amax of the transformed tensor, then 1x16
quantization along tokens with RTNE or SR. The Pallas kernel
(`pallas_triton.py`) computes the same bytes reading `x` once per pass (an
amax pass, then an encode pass), as TransformerEngine's fused
cast-transpose-RHT does.
"""

from __future__ import annotations

from typing import Sequence

import jax

from nvfp4_jax.core import dispatch
from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import spmd
from nvfp4_jax.core import prng
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.arrays import check_amax
from nvfp4_jax.core.arrays import check_input
from nvfp4_jax.core.arrays import check_rounding
from nvfp4_jax.core.hadamard import rht_matrix
from nvfp4_jax.core.recipe import Operand

from nvfp4_jax.ops.quantize.api import block_size
from nvfp4_jax.ops.quantize_rht_t.reference import _quantize_rht_t_xla


def _check_tokens_x(x, what: str) -> jax.Array:
  x = check_input(x, block=1, block_2d=False, what=what)
  if x.ndim != 2:
    raise ValueError(f"{what} takes x as [tokens, features]; got shape "
                     f"{x.shape}. Flatten the leading axes first.")
  return x


def _check_wgrad_tokens(tokens: int, op: Operand, size: int, what: str):
  need = max(block_size(op.format), size if op.rht else 1)
  if tokens % need:
    raise ValueError(
        f"{what}: the token count {tokens} must be a multiple of {need} (the "
        f"Wgrad operand is quantized along tokens in blocks of "
        f"{block_size(op.format)}{f' after a {size}-point RHT' if op.rht else ''}"
        f"); pad the tokens to {-(-tokens // need) * need} (zero rows change "
        f"neither the amax nor the product).")


def quantize_rht_t(x: jax.Array, *, rounding: str = "nearest",
                   key: jax.Array | None = None,
                   amax: jax.Array | None = None,
                   sign_vector: Sequence[int] | None = None, size: int = 16,
                   placement: prng.Placement | None = None,
                   amax_axes: Sequence[str] = (),
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
    placement: for a shard of a sharded tensor (inside `shard_map`), where
      `x` sits in the whole `[tokens, features]` tensor; the result is then
      the shard of the whole tensor's operand (`nvfp4_jax.sharding`).
    amax_axes: the mesh axes that split the tensor; the amax (when not given)
      is max-reduced across them.
    implementation: "xla", "pallas" or None.

  Returns:
    NVFP4Array of logical shape `[features, tokens]`.
  """
  what = "quantize_rht_t"
  x = _check_tokens_x(x, what)
  rht_matrix(sign_vector, size)  # Validates both.
  _check_wgrad_tokens(x.shape[0], Operand(rht=True), size, what)
  check_rounding(rounding, key, size=x.size, what=what)
  return QUANTIZE_RHT_T(implementation, x, rounding=rounding, key=key,
                        amax=check_amax(amax, what), sign_vector=sign_vector,
                        size=size, placement=placement,
                        amax_axes=tuple(amax_axes))


def _per_shard(kernel, x, **kwargs):
  """The kernel on each shard of `x` split under `jax.jit` shardings
  (`spmd.blockwise`): the shard of the whole tensor's operand, bit for bit
  (amax max-reduced over the axes that split `x`, stochastic rounding at
  the shard's global offset). A token split that would cut a 16-token
  block or Hadamard tile leaves the tokens gathered."""
  if kwargs.get("placement") is not None or kwargs.get("amax_axes"):
    return kernel(x, **kwargs)
  tokens = max(nm.NVFP4_BLOCK, kwargs.get("size", 16))
  return spmd.blockwise(
      kernel, x, grid=(x.shape[0] // tokens, x.shape[1]),
      transposed_out=True,
      shard_kwargs=lambda spec, x: dict(
          placement=spmd.placement(spec, x.shape),
          amax_axes=spmd.spec_axes(spec)), **kwargs)


QUANTIZE_RHT_T = dispatch.Op("quantize_rht_t", {
    "xla": _quantize_rht_t_xla,
    "pallas": "nvfp4_jax.ops.quantize_rht_t.pallas_triton:quantize_rht_t",
}, per_shard=_per_shard)
