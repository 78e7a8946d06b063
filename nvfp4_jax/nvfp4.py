"""NVFP4 quantization: the pure-JAX reference, bit-exact with TransformerEngine.

`quantize` follows NVFP4_SPEC section 2 step by step, using the tile math of
`nvfp4_jax.numerics`. It is the truth the kernels are tested against and the
CPU default.

Supported input dtypes: float32, bfloat16 and float16 (float64 is accepted and
first cast to float32). All arithmetic is FP32; a bf16 or fp16 input is widened
exactly, so the codes depend only on the values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from nvfp4_jax import dispatch
from nvfp4_jax import numerics as nm
from nvfp4_jax import prng

ROUNDING_MODES = ("nearest", "stochastic")
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


@dataclasses.dataclass(frozen=True)
class NVFP4Array:
  """An NVFP4-quantized tensor of logical shape `[..., K]`.

  Attributes:
    codes: uint8 `[..., K // 2]`, two E2M1 codes per byte, element `2k` in the
      low nibble.
    scales: float8_e4m3fn `[..., K // 16]`, the block decode scales. With
      `block_2d`, one scale per 16x16 tile, replicated over the tile's 16 rows.
    amax: float32 scalar, the tensor amax the scales were derived from.
    block_2d: static; whether the scales are per 16x16 tile.
  """

  codes: jax.Array
  scales: jax.Array
  amax: jax.Array
  block_2d: bool = False

  @property
  def shape(self) -> tuple[int, ...]:
    return (*self.codes.shape[:-1], 2 * self.codes.shape[-1])

  @property
  def ndim(self) -> int:
    return self.codes.ndim

  @property
  def tensor_scale(self) -> jax.Array:
    """The FP32 tensor factor `amax / 2688` applied after the block scales."""
    return nm.global_decode_scale(self.amax)

  @property
  def T(self) -> "NVFP4Array":  # noqa: N802 - numpy's name.
    """The transpose of a 2D-scaled matrix, without requantizing.

    With 16x16 tiles, quantizing `W.T` gives exactly the transpose of `W`'s codes
    and tile scales; this builds that array from `W`'s bytes.
    """
    if not self.block_2d:
      raise ValueError(
          "only 16x16 (block_2d) NVFP4 arrays can be transposed without "
          "requantizing; quantize x.T instead.")
    codes = nm.unpack_e2m1(self.codes)
    codes_t = nm.pack_e2m1(jnp.swapaxes(codes, -1, -2))
    tiles = self.scales[..., :: nm.NVFP4_BLOCK, :]
    scales_t = jnp.repeat(jnp.swapaxes(tiles, -1, -2), nm.NVFP4_BLOCK, axis=-2)
    return NVFP4Array(codes_t, scales_t, self.amax, block_2d=True)


jax.tree_util.register_dataclass(
    NVFP4Array, data_fields=["codes", "scales", "amax"],
    meta_fields=["block_2d"])


def check_input(x: Any, *, block: int, block_2d: bool, what: str) -> jax.Array:
  """Validates a tensor to be block-quantized; returns it as a jax array."""
  x = jnp.asarray(x)
  if not any(x.dtype == d for d in _FLOAT_DTYPES):
    raise TypeError(
        f"{what} needs a float32, bfloat16 or float16 array; got dtype "
        f"{x.dtype}. Cast it first, e.g. x.astype(jnp.float32).")
  if x.ndim == 0 or x.size == 0:
    raise ValueError(
        f"{what} needs a non-empty array with at least one axis; got shape "
        f"{x.shape}.")
  k = x.shape[-1]
  if k % block:
    pad = -(-k // block) * block
    raise ValueError(
        f"{what}: the quantized (last) axis has size {k}, not a multiple of "
        f"{block}; pad it to {pad} or keep this tensor in high precision.")
  if block_2d:
    if x.ndim < 2 or x.shape[-2] % block:
      raise ValueError(
          f"{what}: 16x16 (block_2d) scaling needs the last two axes to be "
          f"multiples of {block}; got shape {x.shape}. Pad the rows or use "
          f"1x{block} scaling.")
  return x


def check_rounding(rounding: str, key: Any) -> None:
  if rounding not in ROUNDING_MODES:
    raise ValueError(
        f"unknown rounding {rounding!r}; use one of {ROUNDING_MODES}.")
  if rounding == "stochastic" and key is None:
    raise ValueError(
        "rounding='stochastic' needs a key, e.g. key=jax.random.key(0); the "
        "random bits are a deterministic function of it.")


def encode_e2m1_packed(y: jax.Array, shape: tuple[int, ...], rounding: str,
                       key: jax.Array | None) -> jax.Array:
  """Scaled FP32 values (in blocks, `[..., K/b, b]`) to packed E2M1 bytes of
  the tensor of `shape` `[..., K]`: `[..., K//2]`.

  Stochastic rounding draws the `nvfp4_jax.prng` stream over the row-major
  element order. (Encoding before the reshape to `shape`, not after, keeps
  XLA:CPU's fusion ~20x faster.)
  """
  if rounding == "nearest":
    codes = nm.e2m1_encode_nearest(y)
  else:
    rbits = prng.random_bytes(prng.seeds_from_key(key), y.shape)
    codes = nm.e2m1_encode_stochastic(y, rbits)
  return nm.pack_e2m1(codes.reshape(shape))


def tensor_amax(xf: jax.Array) -> jax.Array:
  """`max |x|` in FP32; NaN anywhere gives NaN."""
  return jnp.max(jnp.abs(xf)).astype(jnp.float32)


def _block_amax(xf: jax.Array, block_2d: bool) -> jax.Array:
  """Block amax `[..., M, K/16]` (2D: per tile, replicated over its 16 rows)."""
  b = nm.NVFP4_BLOCK
  if not block_2d:
    return jnp.max(jnp.abs(xf.reshape(*xf.shape[:-1], -1, b)), axis=-1)
  *lead, m, k = xf.shape
  tiles = jnp.abs(xf.reshape(*lead, m // b, b, k // b, b))
  tile_amax = jnp.max(tiles, axis=(-3, -1))
  return jnp.repeat(tile_amax, b, axis=-2)


def quantize(x: jax.Array, *, block_2d: bool = False,
             rounding: str = "nearest", key: jax.Array | None = None,
             amax: jax.Array | None = None,
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
  return dispatch.dispatch(
      "quantize", _QUANTIZE_IMPLEMENTATIONS, implementation,
      {"gpu": ("pallas",)}, x, block_2d=block_2d, rounding=rounding, key=key,
      amax=amax)


def _quantize_pallas(x, **kwargs) -> NVFP4Array:
  from pallas_kernels import quantize as pallas_quantize  # pylint: disable=g-import-not-at-top
  return pallas_quantize.quantize(x, **kwargs)


def quantize_reference(x: jax.Array, *, block_2d: bool = False,
                       rounding: str = "nearest",
                       key: jax.Array | None = None,
                       amax: jax.Array | None = None) -> NVFP4Array:
  """The pure-jnp reference of `quantize` (its `implementation="xla"`)."""
  x = check_input(x, block=nm.NVFP4_BLOCK, block_2d=block_2d, what="quantize")
  check_rounding(rounding, key)
  # The barrier keeps XLA:GPU from fusing a producer's rounding to `x.dtype`
  # (e.g. the RHT's FP32->bf16) with the widening below and eliding both
  # ("excess precision"): the quantizer must see the rounded values.
  x = jax.lax.optimization_barrier(x)
  xf = nm.ftz(x.astype(jnp.float32))
  if amax is None:
    amax = tensor_amax(xf)
  else:
    amax = jnp.asarray(amax, jnp.float32)
    if amax.shape != ():
      raise ValueError(f"amax must be a scalar, got shape {amax.shape}.")
  s_enc_over_6, inv_s_enc = jax.lax.optimization_barrier(
      nm.nvfp4_scale_constants(amax))

  scales = jax.lax.optimization_barrier(
      nm.nvfp4_block_decode_scale(_block_amax(xf, block_2d), s_enc_over_6))
  enc = nm.nvfp4_block_encode_scale(scales.astype(jnp.float32), inv_s_enc)
  b = nm.NVFP4_BLOCK
  y = xf.reshape(*xf.shape[:-1], -1, b) * enc[..., None]
  codes = encode_e2m1_packed(y, x.shape, rounding, key)
  return NVFP4Array(codes=codes, scales=scales, amax=amax, block_2d=block_2d)


_QUANTIZE_IMPLEMENTATIONS = {"xla": quantize_reference,
                             "pallas": _quantize_pallas}


def block_dequantize_nvfp4(q: NVFP4Array) -> tuple[jax.Array, jax.Array]:
  """The exact bf16 block-dequantized values and the FP32 tensor factor.

  `fp4 * f32(block_scale)` needs at most 6 significant bits and lies in
  [2^-10, 2688], so it is exact in bfloat16: this is what a Hopper GEMM
  consumes, with the tensor factors applied to its FP32 output.

  Returns:
    `(values, tensor_scale)`: bfloat16 `[..., K]` and a float32 scalar
    (`amax / 2688`), with `dequantize_nvfp4(q) == values * tensor_scale`.
  """
  return _block_values(q, jnp.bfloat16), q.tensor_scale


def _block_values(q: NVFP4Array, dtype) -> jax.Array:
  codes = nm.unpack_e2m1(q.codes)
  vals = nm.e2m1_decode(codes).reshape(*codes.shape[:-1], -1, nm.NVFP4_BLOCK)
  vals = vals * q.scales.astype(jnp.float32)[..., None]
  return vals.reshape(codes.shape).astype(dtype)


def dequantize_nvfp4(q: NVFP4Array, dtype=jnp.float32) -> jax.Array:
  """`fp4 * f32(d) * (amax / 2688)` in FP32 (TE's form), cast to `dtype`."""
  x = nm.ftz(_block_values(q, jnp.float32) * q.tensor_scale)
  return x.astype(dtype)
