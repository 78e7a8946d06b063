"""Plumbing shared by the Pallas-Triton kernels: backend checks, exact division,
NaN-propagating maxima and the launch helper.

The numerics live in `nvfp4_jax.numerics` (and `nvfp4_jax.prng`); the kernels
apply those same jnp functions to their tiles. What is here only makes them
lower to Triton with the same results:

- Triton lowers FP32 `/` to the approximate `div.full.f32`; `exact_divide`
  returns an IEEE `div.rn.f32` (inline PTX) on GPU and plain division in
  interpret mode, where XLA's division is already correctly rounded.
- Pallas-Triton does not mask `ref[...]` of a partial tile: out-of-bounds
  loads read other rows' (or other buffers') memory and out-of-bounds stores
  corrupt them. `bounds_mask` + `load`/`store` mask partial tiles explicitly
  (interpret mode pads instead, which hid this on CPU).
- Per-program partial amaxes travel as uint32 bit patterns (the form
  `nvfp4_jax.tile.abs_max` reduces, NaN-propagating in Triton too).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from nvfp4_jax import dispatch
from nvfp4_jax import tile


def backend() -> str:
  """The platform the kernels will run on: "gpu", "cpu", "tpu", ..."""
  return jax.default_backend()


def check_backend(what: str) -> bool:
  """Raises NotImplementedError where Pallas-Triton cannot run.

  Returns:
    Whether to run in interpret mode (True on CPU).
  """
  b = backend()
  if b == "cpu":
    return True
  if b != "gpu":
    raise NotImplementedError(
        f"{what}: the Pallas kernels target NVIDIA GPUs through Triton (and run "
        f"interpreted on CPU); backend {b!r} is not supported. Use "
        f"implementation='xla'.")
  cc = compute_capability()
  if cc is not None and cc < (8, 9):
    raise NotImplementedError(
        f"{what}: the kernels cast to float8_e4m3fn, which Triton supports from "
        f"compute capability 8.9; this GPU is {cc}. Use implementation='xla'.")
  return False


def compute_capability() -> tuple[int, int] | None:
  """`(major, minor)` of the first GPU, or None (`dispatch.compute_capability`)."""
  return dispatch.compute_capability()


def exact_divide(interpret: bool) -> Callable[[jax.Array, jax.Array],
                                              jax.Array]:
  """Correctly rounded FP32 division for use inside a kernel."""
  if interpret:
    return jnp.divide

  def div_rn(a, b):
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32),
                                jnp.asarray(b, jnp.float32))
    [out] = plt.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return out
  return div_rn


def abs_max_bits(x: jax.Array) -> jax.Array:
  """`tile.abs_max` of all of FP32 `x`, as its uint32 bit pattern (a partial)."""
  return jax.lax.bitcast_convert_type(tile.abs_max(x), jnp.uint32)


def combine_partial_amax(bits: jax.Array) -> jax.Array:
  """Reduces per-program amax bit patterns (uint32) to the FP32 tensor amax."""
  return jax.lax.bitcast_convert_type(jnp.max(bits), jnp.float32)


def check_powers_of_two(config: Any, fields: tuple[str, ...]) -> None:
  """Raises a ValueError naming a tile-config field that is no power of two."""
  for name in fields:
    v = getattr(config, name)
    if not isinstance(v, int) or v < 1 or v & (v - 1):
      raise ValueError(f"{type(config).__name__}.{name}={v!r} must be a power "
                       f"of two (Triton block shapes are).")


def next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def pallas_call(kernel, *, interpret: bool, num_warps: int, num_stages: int,
                name: str, **kwargs) -> Any:
  """`pl.pallas_call` with Triton compiler parameters (or interpret mode).

  Under `jax.set_mesh` with Explicit axes the kernel runs in `auto_axes`,
  replicated: Pallas gives a kernel's blocks their operand's sharding, and
  the Triton lowering of a reduction rejects an Explicit one ("Length of
  sharding.spec (2) must be equal to aval's ndim (1)", jax 0.11). Sharded
  training goes through `nvfp4_jax.sharding` (shard_map), not this path.
  """
  call = pl.pallas_call(
      kernel, interpret=interpret, name=name,
      compiler_params=plt.CompilerParams(num_warps=num_warps,
                                         num_stages=num_stages),
      **kwargs)
  out_shape = kwargs["out_shape"]

  @functools.wraps(call)
  def run(*args):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not any(t == jax.sharding.AxisType.Explicit
                             for t in mesh.axis_types):
      return call(*args)
    if isinstance(out_shape, (list, tuple)):
      specs = tuple(jax.sharding.PartitionSpec() for _ in out_shape)
      return type(out_shape)(jax.sharding.auto_axes(
          lambda *a: tuple(call(*a)), out_sharding=specs)(*args))
    return jax.sharding.auto_axes(
        call, out_sharding=jax.sharding.PartitionSpec())(*args)
  return run


def scalar_spec(n: int) -> pl.BlockSpec:
  """A whole small 1-D operand (per-tensor constants, seeds) for every program."""
  return pl.BlockSpec((n,), lambda *idx: (0,))


def bounds_mask(shape: tuple[int, ...], *dims) -> jax.Array | None:
  """In-bounds mask of a tile, or None when every listed axis divides evenly.

  Args:
    shape: the tile's shape.
    *dims: `(axis, start, limit, block)`: elements `start + i` along `axis`
      are valid while `< limit`; the axis is skipped when `limit % block == 0`
      (then no tile is partial along it and the fast unmasked path is kept).
  """
  mask = None
  for axis, start, limit, block in dims:
    if limit % block == 0:
      continue
    idx = start + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    m = idx < limit
    mask = m if mask is None else mask & m
  return mask


def load(ref, mask: jax.Array | None) -> jax.Array:
  """`ref[...]`, out-of-bounds elements (`mask` False) not read.

  They come back as 0, except for float8 refs (no constant of that type
  lowers), whose masked elements are undefined: callers must not store them.
  """
  if mask is None:
    return ref[...]
  other = None if jnp.dtype(ref.dtype).itemsize == 1 and jnp.issubdtype(
      ref.dtype, jnp.floating) else 0
  return plt.load(ref, mask=mask, other=other)


def load_at(ref, idx, mask: jax.Array | None) -> jax.Array:
  """`ref[idx]` (a static or `pl.ds` index), masked as `load`."""
  return load(ref.at[idx], mask) if mask is not None else ref[idx]


def store(ref, value: jax.Array, mask: jax.Array | None) -> None:
  """`ref[...] = value`, skipping elements where `mask` is False."""
  if mask is None:
    ref[...] = value
  else:
    plt.store(ref, value, mask=mask)

