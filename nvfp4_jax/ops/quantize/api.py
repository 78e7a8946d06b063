"""`quantize` and `quantize_with_values`: NVFP4 along the last axis (1x16 or 16x16).

Each public function validates its arguments once, then dispatches on
`implementation=`: "xla" (`reference.quantize_reference`), "pallas" (the
Pallas-Triton kernel in `pallas_triton.py`; interpreted on CPU) or None (the
kernel on GPU, the reference elsewhere). `quantize_operand` quantizes one
recipe `Operand` (NVFP4 or MX) without RHT.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from nvfp4_jax.core import dispatch
from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng
from nvfp4_jax.core import spmd
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.arrays import QArray
from nvfp4_jax.core.arrays import check_amax
from nvfp4_jax.core.arrays import check_input
from nvfp4_jax.core.arrays import check_rounding
from nvfp4_jax.core.recipe import Operand

from nvfp4_jax.ops.quantize.mx import quantize_mx
from nvfp4_jax.ops.quantize.reference import quantize_reference
from nvfp4_jax.ops.quantize.reference import tensor_amax


B = nm.NVFP4_BLOCK


def quantize(x: jax.Array, *, block_2d: bool = False,
             rounding: str = "nearest", key: jax.Array | None = None,
             amax: jax.Array | None = None, four_over_six: bool = False,
             placement: prng.Placement | None = None,
             implementation: str | None = None) -> NVFP4Array:
  """Quantizes `x` to NVFP4 along its last axis (blocks of 16).

  Args:
    x: float32/bfloat16/float16 array `[..., K]`, `K` a multiple of 16 (and,
      with `block_2d`, the second-to-last axis too).
    block_2d: one scale per 16x16 tile over the last two axes (weights).
    rounding: "nearest" (RTNE, ties to the even code) or "stochastic".
    key: JAX PRNG key, required for stochastic rounding. The random bits are
      the stream of `nvfp4_jax.core.prng` on `x`'s row-major element order.
    amax: an already reduced tensor amax (FP32 scalar), e.g. a `pmax` over the
      shards of a sharded tensor. Defaults to `max |x|`. A concrete amax
      that is negative, NaN or Inf, or 0 while `x` holds a nonzero element,
      is a ValueError; a traced one (under `jit`) cannot be checked and is
      used as given: NaN or wrong values for a negative or NaN amax,
      Inf/NaN for an infinite one, all zeros for 0.
    four_over_six: Four-over-Six adaptive block scaling (Cook et al. 2025):
      each block (16x16 tile) is encoded with its max mapped to 6 and to 4,
      and keeps the candidate with the smaller squared error; the global scale
      bounds the block scales by 256 (tensor factor `amax / 1536`). See
      `nvfp4_jax.core.tile.encode_blocks`.
    placement: where a 2-D `x` sits when it is one shard of a larger tensor
      (`nvfp4_jax.sharding`): stochastic rounding then draws the whole
      tensor's random bytes for its elements. None: `x` is the whole tensor.
    implementation: "xla" (the pure-jnp reference below), "pallas" (the
      Pallas-Triton kernel, `nvfp4_jax.ops.quantize.pallas_triton`; interpreted on CPU), or
      None: "pallas" on GPU, "xla" elsewhere. All give identical bytes.

  Returns:
    An `NVFP4Array`.

  Raises:
    TypeError: `x` is not a floating array.
    ValueError: bad shapes, unknown rounding, stochastic rounding without key,
      an amax that cannot be `x`'s.
    NotImplementedError: the named implementation cannot run here.
  """
  x = check_input(x, block=B, block_2d=block_2d, what="quantize")
  check_rounding(rounding, key, size=x.size)
  amax = check_amax(amax, x=x)
  return QUANTIZE(implementation, x, block_2d=block_2d, rounding=rounding,
                  key=key, amax=amax, four_over_six=bool(four_over_six),
                  placement=placement)


def _per_shard(kernel, x, **kwargs):
  """The kernel on each shard of a 2-D `x` split under `jax.jit` shardings
  (`spmd.blockwise`): the shard's amax max-reduced over the axes that split
  `x` and its stochastic-rounding bytes at its global offset, so the bytes
  are the whole call's. A split that would cut a 16-element block (a 16x16
  tile with `block_2d`) leaves that dimension gathered."""
  if kwargs.get("placement") is not None or jnp.ndim(x) != 2:
    return kernel(x, **kwargs)
  rows = x.shape[0] // B if kwargs.get("block_2d") else x.shape[0]

  def shard_kwargs(spec, x):
    extra = {"placement": spmd.placement(spec, x.shape)}
    if kwargs.get("amax") is None:
      extra["amax"] = _reduced_amax(x, spmd.spec_axes(spec))
    return extra
  return spmd.blockwise(kernel, x, grid=(rows, x.shape[1] // B),
                        shard_kwargs=shard_kwargs, **kwargs)


QUANTIZE = dispatch.Op("quantize", {
    "xla": quantize_reference,
    "pallas": "nvfp4_jax.ops.quantize.pallas_triton:quantize",
}, per_shard=_per_shard)


def block_size(fmt: str) -> int:
  """Elements per scale block of a quantized format."""
  return nm.NVFP4_BLOCK if fmt == "nvfp4" else nm.MX_BLOCK


def _reduced_amax(x: jax.Array, axes: Sequence[str]) -> jax.Array | None:
  """The whole tensor's amax from a shard `x` (None without axes: the
  quantizer takes `max |x|` itself)."""
  if not axes:
    return None
  return spmd.reduce_amax(tensor_amax(nm.ftz(x.astype(jnp.float32))), axes)


def quantize_operand(x: jax.Array, op: Operand, key: jax.Array | None, *,
                     placement: prng.Placement | None = None,
                     amax_axes: Sequence[str] = (),
                     implementation: str | None = None) -> QArray:
  """Quantizes `x` along its last axis as `op` says (no RHT).

  `placement` and `amax_axes`: for a shard (see `quantize_rht_t`).
  """
  if op.format == "nvfp4":
    return quantize(x, block_2d=op.block_2d, rounding=op.rounding, key=key,
                    four_over_six=op.four_over_six,
                    amax=_reduced_amax(x, amax_axes), placement=placement,
                    implementation=implementation)
  return quantize_mx(x, op.format, rounding=op.rounding, key=key,
                    placement=placement)


def quantize_with_values(x: jax.Array, *, block_2d: bool = False,
                         rounding: str = "nearest",
                         key: jax.Array | None = None,
                         amax: jax.Array | None = None,
                         four_over_six: bool = False,
                         implementation: str | None = None
                         ) -> tuple[NVFP4Array, jax.Array]:
  """`quantize(x)` plus its exact bf16 block values, for a Hopper GEMM.

  The values are `fp4 * f32(block scale)` (exact in bf16); a GEMM on them
  with FP32 accumulation times `gemm_alpha` is the exact NVFP4 GEMM
  (`nvfp4_jax.block_values_matmul`). The Pallas kernel writes them in
  the same pass as the codes, saving the dequantize pass of the GEMM.

  Args:
    x: as `quantize`.
    block_2d: as `quantize`.
    rounding: as `quantize`.
    key: as `quantize`.
    amax: as `quantize`.
    four_over_six: as `quantize`.
    implementation: as `quantize`.

  Returns:
    `(NVFP4Array, bf16 values of x's shape)`.
  """
  what = "quantize_with_values"
  x = check_input(x, block=B, block_2d=block_2d, what=what)
  check_rounding(rounding, key, size=x.size, what=what)
  return QUANTIZE_WITH_VALUES(implementation, x, block_2d=block_2d,
                              rounding=rounding, key=key,
                              amax=check_amax(amax, what, x), with_values=True,
                              four_over_six=bool(four_over_six))


QUANTIZE_WITH_VALUES = dispatch.Op("quantize_with_values", {
    "xla": quantize_reference,
    "pallas": "nvfp4_jax.ops.quantize.pallas_triton:quantize",
}, per_shard=_per_shard)
