"""Pallas-Triton kernels for the Wgrad operand `quantize(rht(x.T))`.

Two passes over `x: [tokens, features]`, as the data flow needs (the amax of
the transformed tensor must be complete before any block is encoded):

1. `_amax_kernel`: each program transforms one tile (transpose + 16-point
   Hadamard on the tensor cores + bf16 rounding) and writes the tile's amax;
   optionally the amax of `x` itself from the same read.
2. `_quantize_kernel`: transforms the tile again and quantizes it along the
   token axis (RTNE or SR), writing `[features, tokens/2]` codes and
   `[features, tokens/16]` scales. With `fused_x=True` the same read of `x` also
   produces the Fprop operand, `x` quantized 1x16 along `features` (TE's fused
   cast + transpose).

The RHT matrix is an input (closed-over constants do not lower) and the tile
math is `pallas_kernels.tile`, i.e. `nvfp4_jax.hadamard.rht` + the reference
quantizer's numerics.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from nvfp4_jax import numerics as nm
from nvfp4_jax import prng
from nvfp4_jax.hadamard import rht_matrix
from nvfp4_jax.nvfp4 import NVFP4Array, check_rounding
from pallas_kernels import common
from pallas_kernels import tile

B = nm.NVFP4_BLOCK
SUPPORTED_SIZES = (16, 32, 64, 128)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RHTConfig:
  """Tile sizes of the RHT kernels (powers of two).

  Attributes:
    block_tokens: tokens per program (a multiple of the Hadamard size).
    block_features: features per program (>= 16).
    num_warps: Triton warps per program.
  """

  block_tokens: int = 64
  block_features: int = 64
  num_warps: int = 4

  def __post_init__(self):
    for name in ("block_tokens", "block_features", "num_warps"):
      v = getattr(self, name)
      if v < 1 or v & (v - 1):
        raise ValueError(f"RHTConfig.{name}={v} must be a power of two.")
    if self.block_tokens < B or self.block_features < B:
      raise ValueError(f"RHTConfig tiles must be at least {B}x{B}; got {self}.")


def default_config(tokens: int, features: int, size: int = 16) -> RHTConfig:
  bt = max(size, min(64, common.next_pow2(tokens)))
  bf = max(B, min(64, common.next_pow2(features)))
  return RHTConfig(block_tokens=bt, block_features=bf, num_warps=4)


def _check(x: jax.Array, size: int, fused_x: bool, what: str) -> jax.Array:
  x = jnp.asarray(x)
  if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64):
    raise TypeError(f"{what} needs a float32/bfloat16/float16 array, got "
                    f"{x.dtype}.")
  if x.ndim != 2:
    raise ValueError(f"{what} takes x as [tokens, features]; got shape "
                     f"{x.shape}. Flatten the leading axes first.")
  if size not in SUPPORTED_SIZES:
    raise NotImplementedError(
        f"{what}: the Pallas RHT kernel supports Hadamard sizes "
        f"{SUPPORTED_SIZES}, got {size}; use implementation='xla'.")
  t, f = x.shape
  if t % size or t % B:
    raise ValueError(
        f"{what}: the token count {t} must be a multiple of {max(size, B)} "
        f"(RHT tiles and 16-element blocks run along tokens); pad it.")
  if fused_x and f % B:
    raise ValueError(
        f"{what}: the feature count {f} must be a multiple of {B} to quantize "
        f"x along it; pad it.")
  return x.astype(jnp.float32) if x.dtype == jnp.float64 else x


def _amax_kernel(h_ref, x_ref, *out_refs, size: int, with_x: bool,
                 tokens: int, features: int):
  bt, bf = x_ref.shape
  mask = common.bounds_mask((bt, bf), (0, pl.program_id(0) * bt, tokens, bt),
                            (1, pl.program_id(1) * bf, features, bf))
  x = common.load(x_ref, mask)  # Out-of-bounds elements read as 0.
  z = tile.rht_transposed(x, h_ref[...], size)
  out_refs[0][...] = jnp.full((1, 1), common.abs_max_bits(z), jnp.uint32)
  if with_x:
    xf = nm.ftz(x.astype(jnp.float32))
    out_refs[1][...] = jnp.full((1, 1), common.abs_max_bits(xf), jnp.uint32)


def rht_amax(x: jax.Array, *, sign_vector: Sequence[int] | None = None,
             size: int = 16, with_x: bool = False,
             config: RHTConfig | None = None):
  """`max |rht(x.T)|` (and `max |x|` with `with_x`) from one read of `x`.

  Returns:
    FP32 scalar amax of `rht(x.T)`, or `(amax_x, amax_rht)` with `with_x`.
  """
  x = _check(x, size, False, "rht_amax")
  interpret = common.check_backend("rht_amax")
  t, f = x.shape
  cfg = config or default_config(t, f, size)
  bt, bf = cfg.block_tokens, cfg.block_features
  grid = (common.cdiv(t, bt), common.cdiv(f, bf))
  h = jnp.asarray(rht_matrix(sign_vector, size))
  part = jax.ShapeDtypeStruct(grid, jnp.uint32)
  n_out = 2 if with_x else 1
  kernel = functools.partial(_amax_kernel, size=size, with_x=with_x,
                             tokens=t, features=f)
  outs = common.pallas_call(
      kernel, interpret=interpret, num_warps=cfg.num_warps, num_stages=1,
      name="nvfp4_rht_amax", grid=grid,
      in_specs=[pl.BlockSpec((size, size), lambda i, j: (0, 0)),
                pl.BlockSpec((bt, bf), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((1, 1), lambda i, j: (i, j))] * n_out,
      out_shape=[part] * n_out)(h, x)
  amax_t = common.combine_partial_amax(outs[0])
  if with_x:
    return common.combine_partial_amax(outs[1]), amax_t
  return amax_t


def _quantize_kernel(*refs, size: int, fused_x: bool, stochastic: bool,
                     interpret: bool, tokens: int, features: int):
  refs = list(refs)
  amax_ref = refs.pop(0)
  seeds_ref = refs.pop(0) if stochastic else None
  h_ref, x_ref = refs.pop(0), refs.pop(0)
  divide = common.exact_divide(interpret)
  # Shape (1,), not scalars: the inline-asm division needs tensor operands.
  consts = lambda k: nm.nvfp4_scale_constants(amax_ref[pl.ds(k, 1)],
                                              divide=divide)
  bt, bf = x_ref.shape
  i, j = pl.program_id(0), pl.program_id(1)  # token tile, feature tile
  tok = lambda axis, n: (axis, i * n, tokens // (bt // n), n)
  feat = lambda axis, n: (axis, j * n, features // (bf // n), n)
  x = common.load(x_ref, common.bounds_mask((bt, bf), tok(0, bt),
                                            feat(1, bf)))

  # Wgrad operand: rht(x.T), [features, tokens], blocks along tokens.
  z = nm.ftz(tile.rht_transposed(x, h_ref[...], size)).reshape(bf, bt // B, B)
  rbits = None
  if stochastic:
    rbits = tile.sr_bytes(j * bf, bf, i * (bt // B), bt // B, tokens // 4,
                          seeds_ref[0], seeds_ref[1])
  packed, scales, _ = tile.encode_blocks(
      z, common.abs_max(z, axis=-1), *consts(0), divide=divide, rbits=rbits)
  dims = (feat(0, bf), tok(1, bt // B))
  common.store(refs[0], packed, common.bounds_mask(packed.shape, *dims))
  common.store(refs[1], scales, common.bounds_mask(scales.shape, *dims))

  if fused_x:  # Fprop operand: x, [tokens, features], blocks along features.
    xf = nm.ftz(x.astype(jnp.float32)).reshape(bt, bf // B, B)
    rbits = None
    if stochastic:
      rbits = tile.sr_bytes(i * bt, bt, j * (bf // B), bf // B, features // 4,
                            seeds_ref[2], seeds_ref[3])
    packed, scales, _ = tile.encode_blocks(
        xf, common.abs_max(xf, axis=-1), *consts(1), divide=divide,
        rbits=rbits)
    dims = (tok(0, bt), feat(1, bf // B))
    common.store(refs[2], packed, common.bounds_mask(packed.shape, *dims))
    common.store(refs[3], scales, common.bounds_mask(scales.shape, *dims))


def _quantize_call(x, amax_t, key_t, amax_x, key_x, *, size, sign_vector,
                   fused_x, stochastic, config):
  interpret = common.check_backend("quantize_rht_t")
  t, f = x.shape
  cfg = config or default_config(t, f, size)
  bt, bf = cfg.block_tokens, cfg.block_features
  if bt % size:
    raise ValueError(f"block_tokens={bt} must be a multiple of the Hadamard "
                     f"size {size}.")
  # The per-tensor constants are computed in the kernel, with its exact
  # division (XLA:GPU's FP32 division is not correctly rounded).
  amaxes = [amax_t]
  seeds = [prng.seeds_from_key(key_t)] if stochastic else []
  if fused_x:
    amaxes.append(amax_x)
    if stochastic:
      seeds.append(prng.seeds_from_key(key_x))
  args = [jnp.stack(amaxes).astype(jnp.float32)]
  in_specs = [common.scalar_spec(len(amaxes))]
  if stochastic:
    args.append(jnp.concatenate(seeds))
    in_specs.append(common.scalar_spec(2 * len(seeds)))
  args += [jnp.asarray(rht_matrix(sign_vector, size)), x]
  in_specs += [pl.BlockSpec((size, size), lambda i, j: (0, 0)),
               pl.BlockSpec((bt, bf), lambda i, j: (i, j))]
  out_shape = [jax.ShapeDtypeStruct((f, t // B, B // 2), jnp.uint8),
               jax.ShapeDtypeStruct((f, t // B), jnp.float8_e4m3fn)]
  out_specs = [pl.BlockSpec((bf, bt // B, B // 2), lambda i, j: (j, i, 0)),
               pl.BlockSpec((bf, bt // B), lambda i, j: (j, i))]
  if fused_x:
    out_shape += [jax.ShapeDtypeStruct((t, f // B, B // 2), jnp.uint8),
                  jax.ShapeDtypeStruct((t, f // B), jnp.float8_e4m3fn)]
    out_specs += [pl.BlockSpec((bt, bf // B, B // 2), lambda i, j: (i, j, 0)),
                  pl.BlockSpec((bt, bf // B), lambda i, j: (i, j))]
  kernel = functools.partial(
      _quantize_kernel, size=size, fused_x=fused_x, stochastic=stochastic,
      interpret=interpret, tokens=t, features=f)
  outs = common.pallas_call(
      kernel, interpret=interpret, num_warps=cfg.num_warps, num_stages=1,
      name="nvfp4_quantize_x_and_rht_t" if fused_x else "nvfp4_quantize_rht_t",
      grid=(common.cdiv(t, bt), common.cdiv(f, bf)), in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape)(*args)
  q_t = NVFP4Array(codes=outs[0].reshape(f, t // 2), scales=outs[1],
                   amax=amax_t)
  if not fused_x:
    return q_t
  q_x = NVFP4Array(codes=outs[2].reshape(t, f // 2), scales=outs[3],
                   amax=amax_x)
  return q_x, q_t


def quantize_rht_t(x: jax.Array, *, rounding: str = "nearest",
                   key: jax.Array | None = None, amax: jax.Array | None = None,
                   sign_vector: Sequence[int] | None = None, size: int = 16,
                   config: RHTConfig | None = None) -> NVFP4Array:
  """`quantize(rht(x.T))` for `x: [tokens, features]`: the Wgrad operand.

  Args:
    x: `[tokens, features]`, tokens a multiple of 16 and of `size`.
    rounding, key: as `nvfp4_jax.quantize` (the SR stream runs over the
      `[features, tokens]` result).
    amax: the already reduced amax of `rht(x.T)`; computed by a kernel pass
      over `x` when None.
    sign_vector, size: as `nvfp4_jax.rht`.
    config: tile sizes.

  Returns:
    NVFP4Array of logical shape `[features, tokens]`.
  """
  x = _check(x, size, False, "quantize_rht_t")
  check_rounding(rounding, key)
  if amax is None:
    amax = rht_amax(x, sign_vector=sign_vector, size=size, config=config)
  amax = jnp.asarray(amax, jnp.float32)
  return _quantize_call(x, amax, key, None, None, size=size,
                        sign_vector=sign_vector, fused_x=False,
                        stochastic=rounding == "stochastic", config=config)


def quantize_x_and_rht_t(x: jax.Array, *, key_x: jax.Array | None = None,
                         key_t: jax.Array | None = None,
                         sign_vector: Sequence[int] | None = None,
                         size: int = 16, config: RHTConfig | None = None
                         ) -> tuple[NVFP4Array, NVFP4Array]:
  """`(quantize(x), quantize(rht(x.T)))` from two reads of `x` (amax, encode).

  With `key_x`/`key_t` both operands round stochastically with those keys
  (e.g. for dY); without, both round to nearest (X).
  """
  x = _check(x, size, True, "quantize_x_and_rht_t")
  if (key_x is None) != (key_t is None):
    raise ValueError("pass both key_x and key_t, or neither.")
  amax_x, amax_t = rht_amax(x, sign_vector=sign_vector, size=size,
                            with_x=True, config=config)
  return _quantize_call(x, amax_t, key_t, amax_x, key_x, size=size,
                        sign_vector=sign_vector, fused_x=True,
                        stochastic=key_x is not None, config=config)
