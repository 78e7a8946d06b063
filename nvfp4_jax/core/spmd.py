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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax.core import dispatch
from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import prng
from nvfp4_jax.core.arrays import MXArray
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.arrays import NVFP4Values


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
  gather = lambda a: jax.lax.all_gather(a, axis_name, axis=axis, tiled=True)
  if isinstance(q, NVFP4Array) and q.block_2d:
    b = nm.NVFP4_BLOCK
    tiles = _map_bytes(gather, q.scales[..., ::b, :])
    return dataclasses.replace(q, codes=gather(q.codes),
                               scales=jnp.repeat(tiles, b, axis=-2))
  return _map_bytes(gather, q)


def _map_bytes(fn: Callable, q: Any) -> Any:
  """`fn` applied to each array of a quantized (or plain) operand `q`
  (codes, per-row scales, block values; not the amax, the whole tensor's
  already), one-byte floats as their bytes (XLA:CPU widens a float8
  collective to f16). A 16x16-tiled operand's scales repeat along its
  rows: callers that split or move rows handle them (`all_gather`)."""
  def one(a):
    if a.dtype.itemsize == 1 and jnp.issubdtype(a.dtype, jnp.floating):
      return jax.lax.bitcast_convert_type(
          fn(jax.lax.bitcast_convert_type(a, jnp.uint8)), a.dtype)
    return fn(a)
  if isinstance(q, NVFP4Array):
    if q.block_2d:
      raise ValueError("a 16x16-tiled operand (a weight) is not split by "
                       "tokens")
    return dataclasses.replace(q, codes=one(q.codes), scales=one(q.scales))
  if isinstance(q, MXArray):
    return dataclasses.replace(q, data=one(q.data), scales=one(q.scales))
  if isinstance(q, NVFP4Values):
    return dataclasses.replace(q, values=one(q.values))
  return one(q)


def ppermute(q: Any, axis_name: str, perm) -> Any:
  """`jax.lax.ppermute` of a quantized (or plain) activation's bytes over
  `axis_name`, inside `shard_map`."""
  return _map_bytes(lambda a: jax.lax.ppermute(a, axis_name, perm), q)


def slice_rows(q: Any, start, size: int) -> Any:
  """Rows `[start, start + size)` (`start` may be traced) of a quantized
  (or plain) activation whose rows are tokens."""
  return _map_bytes(
      lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=0), q)


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


# ----------------------------------------------------------------------------
# Kernels per shard under `jax.jit` shardings (auto mode).
# ----------------------------------------------------------------------------

# Whether kernels called outside `shard_map` run per shard when their operand
# is split (`blockwise`, through `custom_partitioning`); off, XLA's
# partitioner sees an opaque call and gathers its operands. A switch for
# tests.
AUTO_PARTITION = True


def auto_partitions(tree: Any) -> bool:
  """Whether a kernel call on the arrays of `tree` may be partitioned by
  XLA: traced (under `jit`) in a process with several devices, outside
  `shard_map`, on arrays whose types carry no Explicit mesh axes (sharding
  in types runs per shard in `shard_map` already)."""
  leaves = [l for l in jax.tree.leaves(tree)
            if isinstance(l, (jax.Array, np.ndarray))]
  if (not AUTO_PARTITION or jax.device_count() == 1
      or not any(isinstance(l, jax.core.Tracer) for l in leaves)
      or jax.sharding.get_abstract_mesh().manual_axes):
    return False
  for l in leaves:
    mesh = getattr(getattr(jax.typeof(l), "sharding", None), "mesh", None)
    if mesh is not None and jax.sharding.AxisType.Explicit in tuple(
        getattr(mesh, "axis_types", ())):
      return False
  return True


def _is_key(a: Any) -> bool:
  return (hasattr(a, "dtype")
          and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key))


def _batchable(partitioned: Callable, whole: Callable) -> Callable:
  """`partitioned` (a `custom_partitioning`, which has no batching rule)
  under `jax.vmap` too: batched, the call is `whole` vmapped, unpartitioned
  (a vmapped kernel is already batched work on each device)."""
  from jax.custom_batching import custom_vmap  # pylint: disable=g-import-not-at-top

  @custom_vmap
  def f(*flat):
    return partitioned(*flat)

  @f.def_vmap
  def _(axis_size, in_batched, *flat):
    del axis_size
    out = jax.vmap(whole, in_axes=tuple(0 if b else None
                                        for b in in_batched))(*flat)
    return out, jax.tree.map(lambda _: True, out)
  return f


def fit_spec(sizes: Mapping[str, int], spec: Any, grid: Sequence[int]) -> P:
  """The split of a `grid[0] x grid[1]` grid of blocks closest to `spec`
  that keeps every block inside one shard: along each dimension the mesh
  axes of `spec`, dropping minor axes until their shard count divides the
  blocks (none left: that dimension is replicated)."""
  spec = tuple(spec) if spec is not None else ()
  used, dims = set(), []
  for d, n in enumerate(grid):
    axes = [a for a in (entry_axes(spec[d]) if d < len(spec) else ())
            if a in sizes and a not in used]
    while axes and n % num_shards(sizes, axes):
      axes.pop()
    used.update(axes)
    dims.append(entry(axes))
  return P(*dims)


def _sdy_rule(grid, operand_shapes, other_shapes, out_shapes):
  """Shardy's rule for `blockwise`: each 2-D array is a grid of blocks
  (factors `i`, `j`; transposed outputs `j`, `i`), a block's elements one
  more factor; a 1-D array of the operand or result lies along the rows
  (`i`); other arrays are replicated."""
  from jax.experimental.custom_partitioning import CompoundFactor  # pylint: disable=g-import-not-at-top
  from jax.experimental.custom_partitioning import SdyShardingRule  # pylint: disable=g-import-not-at-top
  sizes, whole, count = {}, set(), [0]

  def factor(name, size):
    count[0] += 1
    extra = f"e{count[0]}"
    sizes[extra] = size
    return CompoundFactor(name, extra)

  def dim(name, n, size):
    if n == 1:  # One block: the dimension stays whole.
      count[0] += 1
      replicated.append(f"r{count[0]}")
      return f"r{count[0]}"
    if size == n:
      whole.add(name)
      return name
    return factor(name, size // n)

  def mapping(shape, transposed=False, other=False):
    if len(shape) == 1 and not other:  # Laid along the grid's rows.
      return (dim("i", grid[0], shape[0]),)
    if len(shape) != 2:
      dims = []
      for size in shape:
        count[0] += 1
        dims.append(f"r{count[0]}")
        replicated.append(f"r{count[0]}")
      return tuple(dims)
    names = ("j", "i") if transposed else ("i", "j")
    ns = (grid[1], grid[0]) if transposed else tuple(grid)
    return tuple(dim(nm_, n, s) for nm_, n, s in zip(names, ns, shape))
  replicated = []
  operands = tuple(mapping(s) for s in operand_shapes) + tuple(
      mapping(s, other=True) for s in other_shapes)
  results = tuple(mapping(s, t) for s, t in out_shapes)
  for name, n in (("i", grid[0]), ("j", grid[1])):
    if name not in whole and n > 1:
      sizes[name] = n
  return SdyShardingRule(operands, results,
                         need_replication_factors=tuple(replicated), **sizes)


def blockwise(fn: Callable, operand: Any, *, grid: Sequence[int],
              transposed_out: Any = False,
              shard_kwargs: Callable[[P, Any], dict] | None = None,
              **kwargs) -> Any:
  """`fn(operand, **kwargs)`, run per shard where `operand` is split.

  For a kernel (a `pallas_call`, opaque to XLA's SPMD partitioner) on a
  tensor made of independent blocks, outside `shard_map`: under `jax.jit`
  with the operand sharded (auto mode), the call is a `custom_partitioning`
  whose per-shard function runs `fn` on the device's shard, so XLA neither
  gathers the operand nor replicates the kernel. `shard_kwargs(spec,
  local_operand)` gives the shard's extra arguments (its `placement` for
  stochastic rounding, the mesh axes its tensor amax is max-reduced over):
  the result is the whole call's, bit for bit.

  The split of the operand is kept where it holds whole blocks; a mesh axis
  whose split would cut a block (a 16-element scale block, a 16x16 weight
  tile, a 16-token Hadamard tile) is dropped from that dimension, which is
  then gathered (`fit_spec`): correct, at the cost of moving it.
  Other array arguments (keys, an amax) are replicated. Eagerly, inside
  `shard_map`, under Explicit mesh axes, in a process with one device or
  with `AUTO_PARTITION` off this is `fn(operand, **kwargs)`.

  Args:
    fn: the kernel's call.
    operand: an array or pytree whose non-scalar leaves are 2-D, each a
      `grid[0] x grid[1]` grid of blocks (its dimensions multiples of the
      grid's), or 1-D along the rows (a value per row or per row block,
      its length a multiple of `grid[0]`: split as the rows are).
    grid: the blocks along each dimension.
    transposed_out: a prefix of `fn`'s output: True for subtrees laid over
      the transposed grid (a transposed operand); scalar leaves (amaxes)
      are replicated, 1-D leaves lie along the rows.
    shard_kwargs: the per-shard extra keyword arguments, from the shard's
      PartitionSpec and its local operand.
    **kwargs: `fn`'s other arguments, static values or replicated arrays.
  """
  leaves, op_tree = jax.tree.flatten(operand)
  big = [l for l in leaves if jnp.ndim(l) == 2]
  if (not big or any(jnp.ndim(l) not in (0, 1, 2) for l in leaves)
      or any(s % n for l in big for s, n in zip(jnp.shape(l), grid))
      or any(jnp.shape(l)[0] % grid[0] for l in leaves if jnp.ndim(l) == 1)
      or not auto_partitions((operand, kwargs))):
    return fn(operand, **kwargs)
  from jax.experimental.custom_partitioning import custom_partitioning  # pylint: disable=g-import-not-at-top
  first_big = next(i for i, l in enumerate(leaves) if jnp.ndim(l) == 2)
  names = sorted(kwargs)
  is_array = [isinstance(kwargs[k], (jax.Array, np.ndarray)) for k in names]
  key_impls = {k: jax.random.key_impl(kwargs[k]) for k in names
               if _is_key(kwargs[k])}
  static = {k: kwargs[k] for k, a in zip(names, is_array) if not a}
  arrays = [k for k, a in zip(names, is_array) if a]
  others = [jax.random.key_data(kwargs[k]) if k in key_impls else kwargs[k]
            for k in arrays]
  box = {}

  def rebuild(flat):
    op = jax.tree.unflatten(op_tree, flat[:len(leaves)])
    kw = dict(static)
    for k, a in zip(arrays, flat[len(leaves):]):
      kw[k] = jax.random.wrap_key_data(a, impl=key_impls[k]) if (
          k in key_impls) else a
    return op, kw

  def whole(*flat):
    op, kw = rebuild(flat)
    return fn(op, **kw)

  def call(*flat):
    # A nested jit keeps the kernel's constants inside its own jaxpr
    # (`custom_partitioning` takes none).
    out = jax.jit(whole)(*flat)
    t_tree = jax.tree.structure(transposed_out)
    flags = []
    for t, sub in zip(jax.tree.leaves(transposed_out),
                      t_tree.flatten_up_to(out)):
      flags += [bool(t)] * len(jax.tree.leaves(sub))
    box["flags"] = flags
    return out

  def specs(mesh, arg_shapes):
    """The operand's split (fitted to its blocks), from its first leaf."""
    first = jax.tree.leaves(arg_shapes)[first_big]
    spec = getattr(first.sharding, "spec", None)
    return fit_spec(dict(mesh.shape), spec, grid)

  def along(spec, ndim):
    """The sharding of a leaf of `ndim` dimensions of the operand."""
    return spec if ndim == 2 else P(*tuple(spec)[:1]) if ndim == 1 else P()

  def out_shardings(mesh, spec, result_shape):
    outs = jax.tree.leaves(result_shape)
    return box["out_tree"].unflatten([
        NamedSharding(mesh, transposed(spec) if t and len(s.shape) == 2
                      else along(spec, len(s.shape)))
        for s, t in zip(outs, box["flags"])])

  def partition(mesh, arg_shapes, result_shape):
    spec = specs(mesh, arg_shapes)
    axes = spec_axes(spec)

    def shard(*flat):
      op, kw = rebuild(flat)
      if axes and shard_kwargs is not None:
        kw.update(shard_kwargs(spec, op))
      return fn(op, **kw)

    def local(*flat):
      return jax.jit(shard)(*flat)
    arg_sh = tuple(NamedSharding(mesh, along(spec, jnp.ndim(l)))
                   for l in leaves) + tuple(
                       NamedSharding(mesh, P()) for _ in others)
    return mesh, local, out_shardings(mesh, spec, result_shape), arg_sh

  def infer(mesh, arg_shapes, result_shape):
    return out_shardings(mesh, specs(mesh, arg_shapes), result_shape)

  def rule(mesh, operand_types, result_types):
    del mesh
    shapes = [tuple(t.shape) for t in operand_types]
    outs = [tuple(t.shape) for t in result_types]
    return _sdy_rule(grid, shapes[:len(leaves)], shapes[len(leaves):],
                     list(zip(outs, box["flags"])))

  cp = custom_partitioning(call)
  cp.def_partition(partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule)
  out = _batchable(cp, whole)(*leaves, *others)
  box["out_tree"] = jax.tree.structure(out)
  return out


def partitioned(fn: Callable, flat: Sequence[Any], *, shardings: Callable,
                rule: Any, fallback: Callable | None = None) -> Any:
  """`fn(*flat)` as a `custom_partitioning` whose every shard runs `fn` on
  its own operands: the scaffolding the per-shard rules share
  (each op's `sharded.py`: the dense and grouped GEMMs', the row
  gather's).

  Args:
    fn: the kernel's call on the flat operands (arrays).
    flat: the operands.
    shardings: `shardings(mesh, arg_shapes)` -> `(arg_shardings,
      out_sharding, local)`: the sharding of each operand and of the result,
      and `local(flat)`, a shard's operands for `fn` from the ones it holds
      (None: as they are).
    rule: Shardy's `SdyShardingRule` for the call (`pass_through_rule`).
    fallback: what a shard the kernel turns down (`NotImplementedError` on
      its local shape) runs instead, called as `fn`; None: the error
      propagates.

  Returns:
    `fn(*flat)`; under `jax.vmap`, `fn` vmapped, unpartitioned
    (`_batchable`).
  """
  from jax.experimental.custom_partitioning import custom_partitioning  # pylint: disable=g-import-not-at-top

  def whole(*flat):
    return fn(*flat)

  def call(*flat):
    # A nested jit keeps the kernel's constants inside its own jaxpr
    # (`custom_partitioning` takes none).
    return jax.jit(whole)(*flat)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    args_sh, out_sh, local_operands = shardings(mesh, arg_shapes)

    def shard(*flat):
      if local_operands is not None:
        flat = local_operands(flat)
      try:
        return fn(*flat)
      except NotImplementedError:
        if fallback is None:
          raise
        return fallback(*flat)

    def local(*flat):
      return jax.jit(shard)(*flat)
    return mesh, local, out_sh, args_sh

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return shardings(mesh, arg_shapes)[1]

  cp = custom_partitioning(call)
  cp.def_partition(partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule)
  return _batchable(cp, whole)(*flat)


def pass_through_rule(operands: Sequence[tuple[Any, str | None, int]],
                      results: tuple, replicated: Sequence[str] = ()) -> Any:
  """Shardy's rule for a `partitioned` call whose operands each pass at
  most one factor through: `(array, factor, dim)` names dimension `dim`'s
  factor (None: none), and every other dimension is a replicated factor of
  its own. `results` are the result's factors (as `SdyShardingRule`'s),
  `replicated` more replicated ones among them."""
  from jax.experimental.custom_partitioning import SdyShardingRule  # pylint: disable=g-import-not-at-top
  factors = []

  def mapping(x, name, d):
    dims = []
    for i in range(jnp.ndim(x)):
      if name is not None and i == d:
        dims.append(name)
      else:
        factors.append(f"r{len(factors)}")
        dims.append(factors[-1])
    return tuple(dims)
  mapped = tuple(mapping(*o) for o in operands)
  return SdyShardingRule(mapped, results, need_replication_factors=tuple(
      factors) + tuple(replicated))
