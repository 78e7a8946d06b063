"""NVFP4 quantization: the pure-JAX reference, bit-exact with TransformerEngine.

`quantize` follows NVFP4_SPEC section 2 with the block compositions of
`nvfp4_jax.tile` (the same functions the kernels apply to their tiles), on the
whole tensor viewed as `[rows, K/16, 16]`. It is the truth the kernels are
tested against and the CPU default.

Supported input dtypes: float32, bfloat16 and float16 (float64 is accepted and
first cast to float32). All arithmetic is FP32; a bf16 or fp16 input is widened
exactly, so the codes depend only on the values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax import dispatch
from nvfp4_jax import numerics as nm
from nvfp4_jax import prng
from nvfp4_jax import tile
# Re-exported: the array type and checks live in a leaf module that the
# kernels import too.
from nvfp4_jax.qarray import NVFP4Array  # pylint: disable=unused-import
from nvfp4_jax.qarray import NVFP4Values
from nvfp4_jax.qarray import ROUNDING_MODES  # pylint: disable=unused-import
from nvfp4_jax.qarray import check_amax
from nvfp4_jax.qarray import check_input
from nvfp4_jax.qarray import check_rounding

B = nm.NVFP4_BLOCK


def tensor_amax(xf: jax.Array) -> jax.Array:
  """`max |x|` of flushed FP32 `xf`; NaN anywhere gives NaN."""
  return tile.abs_max(xf)


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
      the stream of `nvfp4_jax.prng` on `x`'s row-major element order.
    amax: an already reduced tensor amax (FP32 scalar), e.g. a `pmax` over the
      shards of a sharded tensor. Defaults to `max |x|`.
    four_over_six: Four-over-Six adaptive block scaling (Cook et al. 2025):
      each block (16x16 tile) is encoded with its max mapped to 6 and to 4,
      and keeps the candidate with the smaller squared error; the global scale
      bounds the block scales by 256 (tensor factor `amax / 1536`). See
      `nvfp4_jax.tile.encode_blocks`.
    placement: where a 2-D `x` sits when it is one shard of a larger tensor
      (`nvfp4_jax.sharding`): stochastic rounding then draws the whole
      tensor's random bytes for its elements. None: `x` is the whole tensor.
    implementation: "xla" (the pure-jnp reference below), "pallas" (the
      Pallas-Triton kernel, `pallas_kernels.quantize`; interpreted on CPU), or
      None: "pallas" on GPU, "xla" elsewhere. All give identical bytes.

  Returns:
    An `NVFP4Array`.

  Raises:
    TypeError: `x` is not a floating array.
    ValueError: bad shapes, unknown rounding, stochastic rounding without key.
    NotImplementedError: the named implementation cannot run here.
  """
  x = check_input(x, block=B, block_2d=block_2d, what="quantize")
  check_rounding(rounding, key, size=x.size)
  amax = check_amax(amax)
  return QUANTIZE(implementation, x, block_2d=block_2d, rounding=rounding,
                  key=key, amax=amax, four_over_six=bool(four_over_six),
                  placement=placement)


def quantize_reference(x: jax.Array, *, block_2d: bool = False,
                       rounding: str = "nearest",
                       key: jax.Array | None = None,
                       amax: jax.Array | None = None,
                       with_values: bool = False,
                       four_over_six: bool = False,
                       placement: prng.Placement | None = None):
  """The pure-jnp reference of `quantize` (its `implementation="xla"`).

  Trusts its arguments (`quantize` validates them). With `with_values` it
  also returns the exact bf16 block values (see `fused.quantize_with_values`).
  """
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


QUANTIZE = dispatch.Op("quantize", {
    "xla": quantize_reference,
    "pallas": "pallas_kernels.quantize:quantize",
})


def _blocks(q: NVFP4Array, dtype) -> jax.Array:
  k = q.shape[-1]
  vals = tile.block_values(q.codes.reshape(-1, k // B, B // 2),
                           q.scales.reshape(-1, k // B), dtype)
  return vals.reshape(q.shape)


def block_dequantize_nvfp4(q: NVFP4Array) -> tuple[jax.Array, jax.Array]:
  """The exact bf16 block-dequantized values and the FP32 tensor factor.

  `fp4 * f32(block_scale)` needs at most 6 significant bits and lies in
  [2^-10, 2688], so it is exact in bfloat16: this is what a Hopper GEMM
  consumes, with the tensor factors applied to its FP32 output.

  Returns:
    `(values, tensor_scale)`: bfloat16 `[..., K]` and a float32 scalar
    (`amax / 2688`), with `dequantize_nvfp4(q) == values * tensor_scale`.
  """
  return _blocks(q, jnp.bfloat16), q.tensor_scale


def dequantize_nvfp4(q: NVFP4Array | NVFP4Values, dtype=jnp.float32
                     ) -> jax.Array:
  """`fp4 * f32(d) * (amax / 2688)` in FP32 (TE's form), cast to `dtype`
  (`amax / 1536` for Four-over-Six); of `NVFP4Values`, from the block values
  it holds (the same numbers)."""
  values = (q.values.astype(jnp.float32) if isinstance(q, NVFP4Values)
            else _blocks(q, jnp.float32))
  return nm.ftz(values * q.tensor_scale).astype(dtype)
