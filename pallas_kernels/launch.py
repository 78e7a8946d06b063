"""Launching the Pallas-Triton kernels: where they run, their grids, the
call and its partial tiles.

- `check_backend` raises `NotImplementedError` where Pallas-Triton cannot
  run (the dispatch then falls back) and says whether to interpret (CPU).
- `pallas_call` is `pl.pallas_call` with Triton's compiler parameters (or
  interpret mode), `scalar_spec` a small operand every program reads.
- Pallas-Triton does not mask `ref[...]` of a partial tile: out-of-bounds
  loads read other rows' (or other buffers') memory and out-of-bounds stores
  corrupt them. `bounds_mask` + `load`/`store` mask partial tiles explicitly
  (interpret mode pads instead, which hid this on CPU).
- `check_powers_of_two`, `next_pow2` and `cdiv`: the tile configs' checks
  and the grids' arithmetic.
- `register_triton_dialect_module`, run on import: lets MLIR's Python
  bindings find the Triton dialect's module, which they otherwise search
  for again, and fail to import, at every Triton op a kernel's lowering
  builds (below).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from nvfp4_jax.core import dispatch


def register_triton_dialect_module() -> bool:
  """Makes jaxlib's Triton dialect module importable as
  `jaxlib.mlir.dialects.tt`; returns whether it did.

  MLIR's Python bindings look up an op's dialect module by its namespace
  ("tt") under their search prefixes (`jaxlib.mlir.dialects`,
  `jaxlib.mosaic.python`) each time an op is built, and remember only a
  success. jaxlib keeps the Triton dialect in `jaxlib.triton.dialect`, under
  neither, so every Triton op built while lowering a Pallas-Triton kernel
  failed six imports: GPT base's NVFP4 step built 31,512 such ops, 189,073
  failed imports in a 12.3 s lowering (H200, jax 0.11.2, 2026-12-02). The
  module is the one jaxlib already imported (its ops are registered); this
  only tells the lookup where it is. Nothing changes where `jaxlib.triton`
  is absent or the name is taken.
  """
  import sys  # pylint: disable=g-import-not-at-top
  name = "jaxlib.mlir.dialects.tt"
  if name in sys.modules:
    return False
  try:
    from jaxlib.triton import dialect  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  sys.modules[name] = dialect
  return True


register_triton_dialect_module()


def backend() -> str:
  """The platform the kernels will run on: "gpu", "cpu", "tpu", ...
  (a `dispatch.target_device` block's, if any)."""
  return dispatch.target_platform() or jax.default_backend()


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
    if interpret:
      # Interpreted, the kernel is XLA operations: a compile-time constant
      # operand (an amax given as a literal) would be folded into them, and
      # XLA reassociates products of constants (`(b * c1) * c2` as
      # `b * (c1 * c2)`: Four-over-Six's 4-candidate scale off by an E4M3
      # step). Compiled, a kernel's operands are opaque; so here too.
      args = tuple(jax.lax.optimization_barrier(a) if jnp.size(a) <= 16
                   else a for a in args)
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
