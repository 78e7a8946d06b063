"""The quantized array types (NVFP4, MX) and the validation every quantizer runs once.

Below every op: the references and the kernels (`nvfp4_jax.ops.*`) import it,
and it imports only the shared numerics. The public ops validate their arguments with these functions *before*
dispatching (the tokamax pattern), so every implementation trusts its inputs
and the error a user sees does not depend on which implementation runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng

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
    four_over_six: static; quantized with Four-over-Six (block scales of the
      6-candidate bounded by 256: the tensor factor is `amax / 1536`).
  """

  codes: jax.Array
  scales: jax.Array
  amax: jax.Array
  block_2d: bool = False
  four_over_six: bool = False

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical shape: the codes' with the last axis unpacked (2 per byte)."""
    return (*self.codes.shape[:-1], 2 * self.codes.shape[-1])

  @property
  def ndim(self) -> int:
    """The number of logical axes."""
    return self.codes.ndim

  @property
  def tensor_denominator(self) -> float:
    """2688 (448 * 6), or 1536 (256 * 6) for Four-over-Six."""
    return (nm.FOUR_OVER_SIX_NUMERATOR if self.four_over_six
            else nm.E4M3_MAX_X_E2M1_MAX)

  @property
  def tensor_scale(self) -> jax.Array:
    """The FP32 tensor factor `amax / 2688` (Four-over-Six: `amax / 1536`)
    applied after the block scales."""
    return nm.global_decode_scale(self.amax,
                                  denominator=self.tensor_denominator)

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
    return NVFP4Array(codes_t, scales_t, self.amax, block_2d=True,
                      four_over_six=self.four_over_six)


jax.tree_util.register_dataclass(
    NVFP4Array, data_fields=["codes", "scales", "amax"],
    meta_fields=["block_2d", "four_over_six"])


@dataclasses.dataclass(frozen=True)
class NVFP4Values:
  """An NVFP4-quantized operand held as its exact bf16 block values.

  `values = e2m1 * f32(E4M3 block scale)`, exact in bfloat16 (at most 6
  significant bits: see `nvfp4_jax.block_dequantize`), so it carries the
  codes and scales of its `NVFP4Array` without loss; the tensor factor
  (`amax / 2688`) is applied to the GEMM's FP32 output. This is the form the
  exact emulation of the block-scaled GEMM multiplies (hardware without FP4
  tensor cores): a quantizer writes it instead of codes and scales for an
  operand that is multiplied right away, so no dequantize pass follows.
  Operands that are saved for the backward pass or gathered across devices
  stay `NVFP4Array`s (0.5625 bytes per element instead of 2).

  Attributes:
    values: bfloat16 `[..., K]`, the block values.
    amax: float32 scalar, the tensor amax the scales were derived from.
    four_over_six: static; quantized with Four-over-Six (factor `amax/1536`).
  """

  values: jax.Array
  amax: jax.Array
  four_over_six: bool = False

  shape = property(lambda self: tuple(self.values.shape),
                   doc="The logical shape (the bf16 values').")
  ndim = property(lambda self: self.values.ndim,
                  doc="The number of logical axes.")
  tensor_denominator = NVFP4Array.tensor_denominator
  tensor_scale = NVFP4Array.tensor_scale


jax.tree_util.register_dataclass(
    NVFP4Values, data_fields=["values", "amax"], meta_fields=["four_over_six"])


def check_input(x: Any, *, block: int, block_2d: bool, what: str) -> jax.Array:
  """Validates a tensor to be block-quantized along its last axis.

  Returns:
    `x` as a jax array; float64 is cast to float32 (all arithmetic is FP32).
  """
  x = jnp.asarray(x)
  if not any(x.dtype == d for d in _FLOAT_DTYPES):
    raise TypeError(
        f"{what} needs a float32, bfloat16 or float16 array; got dtype "
        f"{x.dtype}. Cast it first, e.g. x.astype(jnp.float32).")
  if x.ndim == 0 or x.size == 0:
    raise ValueError(
        f"{what} needs a non-empty array with at least one axis; got shape "
        f"{x.shape}. Pass the tensor itself (e.g. x.reshape(1, -1) for a "
        f"vector of 16k elements).")
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
  return x.astype(jnp.float32) if x.dtype == jnp.float64 else x


def _concrete(x: Any) -> bool:
  """Whether `x` holds values now (not a tracer under jit/grad/vmap)."""
  return not isinstance(x, jax.core.Tracer)


def check_key(key: Any, what: str = "quantize") -> None:
  """Validates a stochastic-rounding key: one JAX PRNG key (a typed key of
  shape `()` from `jax.random.key`, or a raw uint32 `[2]` from
  `jax.random.PRNGKey`)."""
  if key is None:
    return
  dtype = getattr(key, "dtype", None)
  shape = getattr(key, "shape", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if shape == ():
      return
  elif dtype == jnp.uint32 and shape in ((2,), (4,)):  # Raw key data.
    return
  got = (f"{type(key).__name__} {key!r}" if dtype is None
         else f"an array of dtype {dtype} and shape {shape}")
  raise TypeError(
      f"{what}: key must be one JAX PRNG key, got {got}; pass e.g. "
      f"key=jax.random.key(0) (split or fold_in it for a new key each "
      f"call, not an int seed or a batch of keys).")


def check_rounding(rounding: str, key: Any, *, size: int = 0,
                   what: str = "quantize") -> None:
  """Validates `rounding` and its key (and the SR stream's element limit)."""
  if not isinstance(rounding, str) or rounding not in ROUNDING_MODES:
    raise ValueError(
        f"{what}: unknown rounding {rounding!r}; use one of {ROUNDING_MODES}.")
  if rounding == "stochastic":
    if key is None:
      raise ValueError(
          f"{what}: rounding='stochastic' needs a key, e.g. "
          f"key=jax.random.key(0); the random bits are a deterministic "
          f"function of it.")
    check_key(key, what)
    if size > prng.MAX_ELEMENTS:
      raise ValueError(
          f"{what}: stochastic rounding supports tensors of at most 2^34 "
          f"elements; got {size}. Split the tensor.")


def check_amax(amax: Any, what: str = "quantize",
               x: jax.Array | None = None) -> jax.Array | None:
  """Validates a caller-given tensor amax: None, or an FP32 scalar.

  A concrete amax must be finite and >= 0, and not 0 while a concrete `x`
  holds a nonzero element (every element would be flushed to zero). A traced
  amax (under `jit`) cannot be checked and is used as given: the result is
  then meaningless (NaN or wrong values for a negative or NaN amax, Inf/NaN
  for an infinite one, all zeros for 0).

  Raises:
    ValueError: a non-scalar amax, or a concrete one that cannot be `x`'s.
  """
  if amax is None:
    return None
  try:
    amax = jnp.asarray(amax, jnp.float32)
  except (TypeError, ValueError):
    raise TypeError(
        f"{what}: amax must be a number (the tensor's max |x| as an FP32 "
        f"scalar), got {amax!r} ({type(amax).__name__}).") from None
  if amax.shape != ():
    raise ValueError(
        f"{what}: amax must be a scalar, got shape {amax.shape}; pass the "
        f"tensor's max |x| as an FP32 scalar (e.g. a pmax over shards).")
  if not _concrete(amax):
    return amax
  value = float(amax)
  if not (value >= 0 and value != float("inf")):
    raise ValueError(
        f"{what}: amax={value} is not a tensor amax (it must be finite and "
        f">= 0: max |x|); pass jnp.max(jnp.abs(x)) of finite data, or leave "
        f"amax=None to compute it.")
  if value == 0 and x is not None and _concrete(x) and bool(jnp.any(x != 0)):
    raise ValueError(
        f"{what}: amax=0.0 but x holds nonzero elements (max |x| = "
        f"{float(jnp.max(jnp.abs(x.astype(jnp.float32))))}): every element "
        f"would be encoded as 0. Pass the tensor's max |x|, or leave "
        f"amax=None to compute it.")
  return amax


def check_nvfp4_array(q: Any, what: str = "dequantize",
                      name: str = "q") -> None:
  """Validates an `NVFP4Array` built by hand (or loaded): uint8 codes
  `[..., K/2]`, float8_e4m3fn scales `[..., K/16]` with the same leading
  shape, a scalar float32 amax."""
  if not isinstance(q, NVFP4Array):
    return
  codes, scales, amax = q.codes, q.scales, q.amax
  problems = []
  if getattr(codes, "dtype", None) != jnp.uint8:
    problems.append(f"codes have dtype {getattr(codes, 'dtype', None)}, "
                    f"not uint8")
  if getattr(scales, "dtype", None) != jnp.float8_e4m3fn:
    problems.append(f"scales have dtype {getattr(scales, 'dtype', None)}, "
                    f"not float8_e4m3fn")
  if getattr(amax, "dtype", None) != jnp.float32 or jnp.shape(amax) != ():
    problems.append(f"amax is {getattr(amax, 'dtype', None)} of shape "
                    f"{jnp.shape(amax)}, not a float32 scalar")
  cs, ss = jnp.shape(codes), jnp.shape(scales)
  if (len(cs) != len(ss) or not cs or cs[:-1] != ss[:-1]
      or 2 * cs[-1] != nm.NVFP4_BLOCK * ss[-1]):
    problems.append(
        f"codes {cs} and scales {ss} do not describe one tensor (codes "
        f"[..., K/2] and scales [..., K/16] with the same leading axes)")
  if problems:
    raise ValueError(
        f"{what}: {name} is not a valid NVFP4Array: {'; '.join(problems)}. "
        f"Build it with nvfp4_jax.quantize (or load it with "
        f"nvfp4_jax.export.load), not by hand.")


MX_FORMATS = ("mxfp4", "mxfp8")


@dataclasses.dataclass(frozen=True)
class MXArray:
  """An MX-quantized tensor of logical shape `[..., K]`.

  Attributes:
    data: MXFP4: uint8 `[..., K // 2]` packed E2M1 codes (element `2k` in the
      low nibble); MXFP8: float8_e4m3fn `[..., K]`.
    scales: float8_e8m0fnu `[..., K // 32]`, the power-of-two block scales.
    fmt: static; "mxfp4" or "mxfp8".
  """

  data: jax.Array
  scales: jax.Array
  fmt: str = "mxfp4"

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical shape: MXFP4's last axis unpacked (2 per byte)."""
    k = self.data.shape[-1] * (2 if self.fmt == "mxfp4" else 1)
    return (*self.data.shape[:-1], k)

  @property
  def ndim(self) -> int:
    """The number of logical axes."""
    return self.data.ndim


jax.tree_util.register_dataclass(
    MXArray, data_fields=["data", "scales"], meta_fields=["fmt"])


QArray = NVFP4Array | MXArray
