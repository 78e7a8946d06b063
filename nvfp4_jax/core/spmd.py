"""Quantizing a sharded tensor shard by shard, with the whole tensor's bytes.

A tensor split over the axes of a device mesh is quantized inside
`jax.shard_map`, each device on its own shard, and the result is bit for bit
the quantization of the whole tensor:

- the tensor amax is each shard's amax, max-reduced (`reduce_amax`) across
  exactly the mesh axes that split the tensor (a max is exact in any order);
- block scales stay local, which needs every 16-element block (a 16x16 tile
  for weights) inside one shard: `check_blocks` raises an error naming the
  dimension and the mesh axes when a sharding would split one;
- stochastic rounding draws the whole tensor's random bytes for each shard's
  elements: `placement` gives the shard's global offsets from
  `jax.lax.axis_index` (a `prng.Placement`, which the quantizers take).

Specs are `jax.sharding.PartitionSpec`s of 2-D tensors; an entry is None, a
mesh axis name, or a tuple of names (major to minor), as in shard_map.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from nvfp4_jax.core import dispatch
from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng
from nvfp4_jax.core.arrays import MXArray
from nvfp4_jax.core.arrays import NVFP4Array


def entry_axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple)."""
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def spec_axes(spec: P) -> tuple[str, ...]:
  """Every mesh axis that splits a tensor of sharding `spec`, in order."""
  return tuple(a for e in spec for a in entry_axes(e))


def entry(axes: Sequence[str]) -> Any:
  """The PartitionSpec entry for `axes`: None, one name, or a tuple."""
  axes = tuple(axes)
  return None if not axes else axes[0] if len(axes) == 1 else axes


def transposed(spec: P) -> P:
  """The spec of the transpose of a 2-D tensor of sharding `spec`."""
  return P(*reversed(tuple(spec) + (None,) * (2 - len(spec))))


def num_shards(sizes: Mapping[str, int], axes: Iterable[str]) -> int:
  """How many pieces `axes` cut a dimension into (`sizes`: the mesh shape)."""
  n = 1
  for a in axes:
    n *= sizes[a]
  return n


def check_spec_axes(spec: P, axis_names: Sequence[str], what: str) -> None:
  """Raises a ValueError if `spec` names an axis the mesh lacks."""
  unknown = [a for e in spec for a in entry_axes(e) if a not in axis_names]
  if unknown:
    raise ValueError(
        f"{what}: PartitionSpec {spec} names {unknown[0]!r}, not an axis of "
        f"the mesh (axes {tuple(axis_names)}); use those names, or None for "
        f"a dimension that is not split.")


def check_blocks(sizes: Mapping[str, int], spec: P, shape: Sequence[int],
                 blocks: Sequence[int], *, what: str,
                 dim_names: Sequence[str] = ("rows", "cols")) -> None:
  """Raises a ValueError if `spec` splits a dimension unevenly or a block.

  Args:
    sizes: the mesh shape, `{axis name: size}`.
    spec: the tensor's PartitionSpec.
    shape: the whole tensor's shape.
    blocks: the block length along each dimension (1: anywhere), e.g.
      `(1, 16)` for 1x16 blocks along the last axis, `(16, 16)` for tiles.
    what: the tensor, for the message ("layer 'mlp/up': the weight").
    dim_names: a name for each dimension ("tokens", "in (K)", ...).
  """
  if not isinstance(spec, P):
    raise TypeError(f"{what}: the sharding must be a "
                    f"jax.sharding.PartitionSpec, e.g. P('data', None); got "
                    f"{spec!r}.")
  if len(spec) > len(shape):
    raise ValueError(f"{what}: PartitionSpec {spec} has {len(spec)} entries "
                     f"for a tensor of shape {tuple(shape)}; give one entry "
                     f"(an axis name or None) per dimension.")
  check_spec_axes(spec, tuple(sizes), what)
  for d, (size, block) in enumerate(zip(shape, blocks)):
    axes = entry_axes(spec[d]) if d < len(spec) else ()
    n = num_shards(sizes, axes)
    if n == 1:
      continue
    on = f"mesh axes {axes}" if len(axes) > 1 else f"mesh axis {axes[0]!r}"
    if size % n:
      raise ValueError(
          f"{what}: its {dim_names[d]} dimension ({size}) does not split "
          f"evenly into {n} shards over {on}; use sizes divisible by {n} or a "
          f"mesh whose {on} divides {size}.")
    if (size // n) % block:
      raise ValueError(
          f"{what}: its {dim_names[d]} dimension ({size}) split {n} ways over "
          f"{on} gives shards of {size // n}, not a multiple of {block}: a "
          f"{block}-element scale block would straddle two shards. Use a "
          f"shard count that divides its {size // block} blocks (fewer "
          f"devices on {on}), pad the dimension to {n * block}k, or do not "
          f"split it.")


def shard_index(axes: Sequence[str]) -> jax.Array:
  """This device's shard number along a dimension split over `axes` (major
  to minor), inside `shard_map`."""
  idx = jnp.zeros((), jnp.int32)
  for a in axes:
    idx = idx * jax.lax.axis_size(a) + jax.lax.axis_index(a).astype(jnp.int32)
  return idx


def placement(spec: P, local_shape: Sequence[int]) -> prng.Placement:
  """Where this device's shard of a 2-D tensor sits, inside `shard_map`.

  Args:
    spec: the tensor's PartitionSpec (as given to shard_map).
    local_shape: the shard's shape `[rows, cols]`.

  Returns:
    A `prng.Placement` with traced offsets and the whole tensor's shape.
  """
  offsets, whole = [], []
  for d, size in enumerate(local_shape):
    axes = entry_axes(spec[d]) if d < len(spec) else ()
    n = 1
    for a in axes:
      n *= jax.lax.axis_size(a)
    offsets.append(shard_index(axes) * size if axes else 0)
    whole.append(size * n)
  return prng.Placement(offsets[0], offsets[1], whole[0], whole[1])


def reduce_amax(amax: jax.Array, axes: Sequence[str]) -> jax.Array:
  """The tensor amax from a shard's amax: a max across mesh `axes`.

  Reduces the bit patterns as unsigned integers (the form of
  `tile.abs_max`): amaxes are non-negative, so the order is the same, and a
  NaN on any shard (whose pattern sorts above +Inf) reaches every shard.
  """
  axes = tuple(axes)
  if not axes:
    return amax
  bits = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.uint32)
  return jax.lax.bitcast_convert_type(jax.lax.pmax(bits, axes), jnp.float32)


def all_gather(q: Any, axis_name: str | None, axis: int) -> Any:
  """Concatenates the shards of a quantized (or plain) array across
  `axis_name` along `axis`, inside `shard_map`; None: no-op.

  Moves the quantized bytes: packed codes and block scales (for 16x16 tiles
  only one scale per tile: 1/16 of the per-row scales, replicated again
  after the gather), all as bytes (uint8). The amax is already the whole tensor's
  (`reduce_amax`). So an FSDP weight travels in 4.5 bits per element (4.06
  with tiles) instead of 16 for bf16.
  """
  if axis_name is None:
    return q

  def gather(a):
    # One-byte floats (E4M3, E8M0 scales) travel as their bytes: XLA:CPU
    # widens a float8 all-gather to f16.
    if a.dtype.itemsize == 1 and jnp.issubdtype(a.dtype, jnp.floating):
      raw = jax.lax.bitcast_convert_type(a, jnp.uint8)
      return jax.lax.bitcast_convert_type(
          jax.lax.all_gather(raw, axis_name, axis=axis, tiled=True), a.dtype)
    return jax.lax.all_gather(a, axis_name, axis=axis, tiled=True)
  if isinstance(q, NVFP4Array):
    if q.block_2d:
      b = nm.NVFP4_BLOCK
      tiles = gather(q.scales[..., ::b, :])
      scales = jnp.repeat(tiles, b, axis=-2)
    else:
      scales = gather(q.scales)
    return dataclasses.replace(q, codes=gather(q.codes), scales=scales)
  if isinstance(q, MXArray):
    return dataclasses.replace(q, data=gather(q.data),
                               scales=gather(q.scales))
  return gather(q)


def _is_spec(s) -> bool:
  return isinstance(s, P)


def _split(specs: Any, tree: Any):
  """The leaves of `tree` under each spec of the prefix `specs`, non-scalar
  and scalar apart, and how to put them back together."""
  sdef = jax.tree.structure(specs, is_leaf=_is_spec)
  big, small, defs = [], [], []
  for sub in sdef.flatten_up_to(tree):
    leaves, tdef = jax.tree.flatten(sub)
    scalar = tuple(jnp.ndim(l) == 0 for l in leaves)
    big.append([l for l, z in zip(leaves, scalar) if not z])
    small.append([l for l, z in zip(leaves, scalar) if z])
    defs.append((tdef, scalar))
  return big, small, (sdef, defs)


def _join(big, small, how) -> Any:
  sdef, defs = how
  subs = []
  for b, s, (tdef, scalar) in zip(big, small, defs):
    bi, si = iter(b), iter(s)
    subs.append(tdef.unflatten([next(si) if z else next(bi) for z in scalar]))
  return sdef.unflatten(subs)


def shard_map(f: Callable, *, mesh, in_specs: tuple, out_specs: Any
              ) -> Callable:
  """`jax.shard_map` whose specs stand for whole quantized arrays.

  A spec applies to the non-scalar leaves of its subtree (codes, scales,
  activations); 0-d leaves (tensor amaxes, PRNG keys) travel replicated, as
  they are by construction (`reduce_amax`). So one `P("data", None)` covers
  an `NVFP4Array`, whatever its static fields.

  Args:
    f: the per-shard function.
    mesh: the `jax.sharding.Mesh`.
    in_specs: a tuple with one PartitionSpec prefix per argument.
    out_specs: a PartitionSpec prefix of `f`'s output.

  Returns:
    The sharded function. It runs without shard_map's replication checks
    (`check_vma=False`: Pallas calls carry no replication types); the callers
    reduce across mesh axes explicitly.
  """
  def call(*args):
    ib, ismall, ihow = _split(in_specs, args)
    box = {}

    def body(ib, ismall):
      out = f(*_join(ib, ismall, ihow))
      ob, osmall, box["how"] = _split(out_specs, out)
      return ob, osmall
    ob, osmall = jax.shard_map(
        body, mesh=mesh,
        in_specs=(jax.tree.leaves(in_specs, is_leaf=_is_spec), P()),
        out_specs=(jax.tree.leaves(out_specs, is_leaf=_is_spec), P()),
        check_vma=False)(ib, ismall)
    return _join(ob, osmall, box["how"])
  return call


def check_2d(x: Any, what: str) -> None:
  """The sharded quantizers take a 2-D global array."""
  if np.ndim(x) != 2:
    raise ValueError(f"{what} takes a 2-D array, got shape {np.shape(x)}.")


def resolve_implementation(implementation: str | None) -> str | None:
  """`implementation`, or the `default_implementation` block's name.

  Resolved before a jit cache sees it: a `default_implementation` block must
  not reuse another block's trace.
  """
  return (implementation if implementation is not None
          else dispatch.current_default())


# The static arguments every sharded quantizer's jitted body takes.
STATIC = ("mesh", "spec", "implementation")
