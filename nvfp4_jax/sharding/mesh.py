"""Training on a device mesh: data, FSDP and tensor parallelism for NVFP4 layers.

    mesh = nvfp4_jax.sharding.make_mesh(data=2, fsdp=2, model=2)
    rules = nvfp4_jax.sharding.MeshRules(mesh=mesh)
    specs = rules.param_specs(params)              # kernels, embeddings...
    with nvfp4_jax.sharding.mesh_rules(rules):     # while tracing the step
      logits = model.apply(params, tokens)

What each mesh axis splits (`MeshRules`):

- `data`: the batch (tokens); parameters and optimizer state are replicated.
- `fsdp`: the batch too, and every parameter and its optimizer state (FP32
  master weights included) along one dimension. A quantized layer gathers
  its weight before each GEMM *quantized*: codes, E4M3 scales and the shared
  amax (4.06 bits per element with 16x16 tiles), ~3.9x fewer bytes than
  bf16; weight gradients are reduce-scattered back.
- `model`: tensor parallelism of the linear layers matched by
  `tensor_parallel` (the GPT's `attn/qkv` and `mlp/up` split by output
  columns, `attn/out` and `mlp/down` by input rows, Megatron-style). A
  column split is contiguous: a fused kernel whose columns a model splits
  further (q, k, v into heads; gate and up) must lay them out so that
  each device's slice is whole units (the GPT's `fused_layout`,
  `models/gpt.py`), or XLA reshards the activations after the layer.

Every NVFP4 layer runs its three GEMMs per shard inside `jax.shard_map`
(`nvfp4_jax.ops`): the quantizers and Pallas kernels see local tensors (a
`pallas_call` cannot be auto-partitioned: XLA would replicate its operands),
and the collectives are explicit. Quantizing a sharded tensor gives the
whole tensor's bytes (`nvfp4_jax.core.spmd`): the amax is reduced across the axes
that split it, blocks never straddle shards, and stochastic rounding draws
the whole tensor's random bytes at each shard's global offset. So a sharded
step equals the single-device step up to the order of FP32 sums.

Under a mesh the library did not make (the user's axis names, JAX's
sharding in types), `linear_sharding_for` derives a layer's
`LinearSharding` from its operands' shardings. In auto mode (`jax.jit`
shardings, no `MeshRules`) the kernels themselves run per shard through
`custom_partitioning` (`nvfp4_jax.core.spmd.blockwise`).

`quantize`, `quantize_rht_t` and `quantize_pair` here are the public
quantizers for a sharded global array; `collectives` lists what a compiled
program communicates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Any, Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax.core import spmd
from nvfp4_jax.core.recipe import Recipe
from nvfp4_jax.core.recipe import rule_pairs
from nvfp4_jax.core.scope import ScopeStack
from nvfp4_jax.ops.quantize.api import block_size

AXES = ("data", "fsdp", "model")
EXPERT_AXIS = "expert"
TENSOR_STYLES = ("column", "row")

# The GPT's projections (models/gpt.py): Megatron's column/row pairs.
GPT_TENSOR_PARALLEL = (
    (r"(^|/)attn/qkv$", "column"),
    (r"(^|/)mlp/up$", "column"),
    (r"(^|/)attn/out$", "row"),
    (r"(^|/)mlp/down$", "row"),
)


def make_mesh(devices: Sequence[jax.Device] | None = None,
              **sizes: int) -> Mesh:
  """A mesh with the axes `("data", "fsdp", "model")`, and `"expert"` last
  when its size is given (expert parallelism of mixture-of-experts layers).

  Args:
    devices: the devices, default `jax.devices()` (all processes' devices
      after `jax.distributed.initialize()`).
    **sizes: `data=`, `fsdp=`, `model=`, `expert=`; missing axes get size 1
      except `data`, which takes the devices left over.

  Returns:
    A `jax.sharding.Mesh` of those axes (all `AxisType.Auto`).

  Raises:
    ValueError: an unknown axis, or sizes that do not multiply to the
      device count.
  """
  devices = list(jax.devices() if devices is None else devices)
  unknown = sorted(set(sizes) - set(AXES) - {EXPERT_AXIS})
  if unknown:
    raise ValueError(f"unknown mesh axes {unknown}; use "
                     f"{AXES + (EXPERT_AXIS,)}.")
  axes = AXES + ((EXPERT_AXIS,) if EXPERT_AXIS in sizes else ())
  for name, v in sizes.items():
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"mesh axis {name}={v!r} must be a positive int.")
  rest = math.prod(v for k, v in sizes.items() if k != "data")
  if "data" not in sizes:
    if len(devices) % rest:
      raise ValueError(
          f"fsdp x model = {rest} does not divide the {len(devices)} "
          f"devices.")
    sizes = dict(sizes, data=len(devices) // rest)
  shape = tuple(sizes.get(a, 1) for a in axes)
  if math.prod(shape) != len(devices):
    raise ValueError(
        f"mesh {dict(zip(axes, shape))} has {math.prod(shape)} devices, but "
        f"there are {len(devices)}; make the sizes multiply to "
        f"{len(devices)}.")
  return Mesh(np.asarray(devices).reshape(shape), axes,
              axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


# How tensor parallelism sums partial results (`LinearSharding.partial_sums`).
PARTIAL_SUMS = ("float32", "output")
# Where activations' and gradients' amaxes reduce (`LinearSharding.amax`).
AMAX_SCOPES = ("global", "local")
# When a layer's weight gradient is computed under FSDP
# (`LinearSharding.wgrad_schedule`).
WGRAD_SCHEDULES = ("layer", "xla")
# The dtype quantized layers' weight gradients are summed in across the token
# shards (`LinearSharding.wgrad_sums`).
WGRAD_SUMS = ("float32", "bfloat16")
_CHOICES = {
    "partial_sums": (PARTIAL_SUMS, "\"float32\": sums in FP32, rounded once; "
                     "\"output\": in the output dtype, half the bytes for "
                     "bf16"),
    "amax": (AMAX_SCOPES, "\"global\": the unsharded layer's tensor "
             "scales; \"local\": each token shard's own, no collective over "
             "the token axes"),
    "wgrad_schedule": (WGRAD_SCHEDULES, "\"layer\": each layer's weight "
                       "gradient with its input gradient; \"xla\": where "
                       "XLA's scheduler puts it"),
    "wgrad_sums": (WGRAD_SUMS, "\"float32\": the weight gradients summed "
                   "in FP32, rounded once; \"bfloat16\": each shard's "
                   "rounded to bf16 and summed in bf16, half the bytes"),
}


def _check_choices(owner) -> None:
  """Raises a ValueError naming the value and the choices where `owner`'s
  `partial_sums`, `amax`, `wgrad_schedule` or `wgrad_sums` is not one of
  them."""
  for name, (choices, meaning) in _CHOICES.items():
    value = getattr(owner, name)
    if value not in choices:
      raise ValueError(f"{type(owner).__name__}({name}={value!r}): use one "
                       f"of {choices} ({meaning}).")


def _check_flags(owner, *names: str) -> None:
  """Raises a TypeError naming the value where one of `owner`'s fields
  `names` is not a bool."""
  for name in names:
    value = getattr(owner, name)
    if not isinstance(value, bool):
      raise TypeError(f"{type(owner).__name__}({name}={value!r}): use True "
                      f"or False.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearSharding:
  """How one linear layer `Y = X @ kernel` (`X: [tokens, in]`, `kernel:
  [in, out]`) is split over a mesh.

  Attributes:
    mesh: the `jax.sharding.Mesh`.
    tokens: mesh axes splitting the tokens of X, Y and dY (major to minor).
    tensor: None, "column" (the kernel's `out` split over `model`: Y split
      by features) or "row" (`in` split over `model`: X split by features,
      Y summed across `model`).
    model: the tensor-parallel mesh axis (with `tensor`).
    fsdp: the mesh axis splitting the kernel's other dimension for storage;
      one of `tokens`. The weight is gathered (quantized, where its GEMM is)
      before use and its gradient reduce-scattered.
    fsdp_dim: the kernel dimension `fsdp` splits (0: `in`, 1: `out`);
      default the one tensor parallelism does not: 0 unless the layer is
      row-parallel on a `model` axis of more than one device. `in` is the
      kernel's major dimension, so its gradient's reduce-scatter writes
      shards in the parameters' layout; split along `out`, XLA transposes
      the FP32 master weights and Adam moments to the gradient's layout
      for the update (compiled ahead of time for 4 H100s, a 15.0B GPT
      under FSDP peaked 3.0 GiB higher in BF16, 2.8 GiB in NVFP4 with
      bf16 weight-gradient sums: BENCHMARKS.md).
      On the dimension `model` splits too, `fsdp` is the minor axis:
      `P(None, ("model", "fsdp"))`.
    partial_sums: the dtype tensor parallelism sums partial results in
      (Y of a row-parallel layer, dX of a column-parallel one): "float32"
      (each device's FP32 accumulator, rounded once after the sum: the
      unsharded GEMM within FP32 reordering) or "output" (each device's
      result rounded to the output dtype, then summed in it, as
      Megatron-style tensor parallelism does: half the bytes for bf16).
    amax: the tensor amax of the activations X and gradients dY: "global"
      (reduced over every axis that splits the tensor: the unsharded
      layer's quantization, one small all-reduce per quantized tensor) or
      "local" (reduced over `model` only: each token shard quantizes as a
      data-parallel micro-batch would, with its own tensor scale, and no
      collective waits on the token axes). Weights always use the global
      amax (every device must hold the same weight).
    wgrad_schedule: under `fsdp`, when the weight gradient (and so its
      reduce-scatter) is computed: "layer" (ties it to the layer's input
      gradient with an optimization barrier, so the backward pass cannot go
      on to the layers below before it) or "xla" (left to XLA's scheduler,
      which on deep models can defer every layer's weight-gradient GEMM
      past the whole backward pass and hold every layer's activations and
      activation gradients until then: 16.6 GiB more per device for a 40-
      layer 12.5B GPT on 4 GPUs, BENCHMARKS.md). In quantized layers the
      barrier holds the reduce-scattered shard, and the all-reduce over the
      other token axes (`data` of a `data x fsdp` mesh) follows it, free
      to overlap the layers below. No effect without `fsdp` or where it
      has one device (`make_mesh(data=n)` carries `fsdp=1`).
    wgrad_sums: the dtype a quantized layer's weight gradient (the
      library's custom VJP, whatever format its Wgrad GEMM) is summed in
      across the token shards (the reduce-scatter over `fsdp`, the
      all-reduce over the other token axes): "float32" (each device's FP32
      Wgrad result, rounded once after the sum: the unsharded GEMM within
      FP32 reordering) or "bfloat16" (each device's result rounded to bf16
      by the GEMM, then summed in bf16, as the gradients of layers kept in
      BF16 are: half the bytes on the wire, and under FSDP bf16 gradient
      shards held until the optimizer update instead of FP32 ones). The
      gradient reaches the master weight in its dtype either way. No effect
      where no axis splits the tokens, or on layers the recipe keeps in
      high precision (XLA sums those in their own dtype).
    sequence: sequence parallelism (Megatron's, with TransformerEngine's
      quantized gathers) for a column- or row-parallel layer: outside the
      layer the tokens are split over `model` too (after `tokens`), so the
      norms and residual adds between layers run on a token shard. A
      column-parallel layer quantizes its token shard (amax over every
      axis splitting it) and all-gathers the quantized bytes over `model`
      before its GEMMs (its Wgrad operand in the backward pass), and
      reduce-scatters dX; a row-parallel layer reduce-scatters Y and
      all-gathers the quantized dY. The same bytes as the all-reduces it
      replaces for the sums, 4.5 bits an element for the gathered operands
      (16 for a bf16 activation), and the same result as without it:
      quantizing a token shard with the tensor's amax gives the tensor's
      blocks. (A layer that `model` does
      not split takes `model` among its `tokens` instead: `MeshRules`.)
    collective_matmul: under `sequence`, each gather and reduce-scatter
      over `model` runs as a ring beside the GEMM, in `model`-size chunks
      of the tokens: each step multiplies the chunk at hand while the next
      one travels (`jax.lax.ppermute`), so the transfer can hide behind the
      GEMM instead of preceding or following it (the collective matmul of
      Megatron and TransformerEngine). The same bytes and quantized
      operands; Y and dX within FP32 reordering of the layer without it (a
      GEMM of a chunk's rows may sum K in another order than the whole
      GEMM, and with more than two devices the partial sums add in ring
      order), dW bit for bit.
  """

  mesh: Mesh
  tokens: tuple[str, ...] = ()
  tensor: str | None = None
  model: str | None = None
  fsdp: str | None = None
  fsdp_dim: int | None = None
  partial_sums: str = "float32"
  amax: str = "global"
  wgrad_schedule: str = "layer"
  wgrad_sums: str = "float32"
  sequence: bool = False
  collective_matmul: bool = False

  def __post_init__(self):
    object.__setattr__(self, "tokens", tuple(self.tokens))
    _check_flags(self, "sequence", "collective_matmul")
    if self.collective_matmul and not self.sequence:
      raise ValueError("LinearSharding(collective_matmul=True) needs "
                       "sequence=True: the ring runs over token chunks.")
    if self.sequence and self.tensor is None:
      raise ValueError(
          "LinearSharding(sequence=True) needs tensor= and model=: a layer "
          "that `model` does not split takes it among its `tokens` instead.")
    _check_choices(self)
    if self.fsdp_dim is None:
      object.__setattr__(self, "fsdp_dim", 1 if self.model_splits_in else 0)
    if self.fsdp_dim not in (0, 1):
      raise ValueError(f"LinearSharding.fsdp_dim must be 0 (in) or 1 (out), "
                       f"got {self.fsdp_dim!r}.")
    names = set(self.mesh.axis_names)
    for a in self.tokens + tuple(x for x in (self.model, self.fsdp) if x):
      if a not in names:
        raise ValueError(f"LinearSharding: {a!r} is not an axis of the mesh "
                         f"{self.mesh.axis_names}.")
    if self.tensor not in (None,) + TENSOR_STYLES:
      raise ValueError(f"LinearSharding.tensor must be None or one of "
                       f"{TENSOR_STYLES}, got {self.tensor!r}.")
    if (self.tensor is None) != (self.model is None):
      raise ValueError("LinearSharding: give `model` exactly when `tensor` "
                       "is set.")
    if self.model is not None and self.model in self.tokens:
      raise ValueError(f"LinearSharding: the model axis {self.model!r} "
                       f"cannot also split the tokens.")
    if self.fsdp is not None and self.fsdp not in self.tokens:
      raise ValueError(
          f"LinearSharding: the fsdp axis {self.fsdp!r} must also split the "
          f"tokens {self.tokens} (FSDP is data parallelism with sharded "
          f"weights).")

  @property
  def sizes(self) -> Mapping[str, int]:
    """The mesh's axis sizes by axis name."""
    return dict(self.mesh.shape)

  @property
  def fsdp_splits(self) -> bool:
    """Whether `fsdp` splits the weight over more than one device (a mesh
    from `make_mesh(data=n)` carries `fsdp` of size 1: nothing to gather or
    reduce-scatter, so no FSDP ordering either)."""
    return self.fsdp is not None and self.sizes[self.fsdp] > 1

  @property
  def ties_wgrad(self) -> bool:
    """Whether the weight gradient is tied to the input gradient
    (`wgrad_schedule="layer"` where `fsdp` splits the weight)."""
    return self.fsdp_splits and self.wgrad_schedule == "layer"

  @property
  def model_splits_in(self) -> bool:
    """Whether tensor parallelism splits the kernel's `in` (a row-parallel
    layer on a `model` axis of more than one device)."""
    return (self.tensor == "row" and self.model is not None
            and self.sizes[self.model] > 1)

  @property
  def seq_tokens(self) -> tuple[str, ...]:
    """The axes splitting the tokens outside the layer: `tokens`, and
    `model` after them under sequence parallelism."""
    return self.tokens + ((self.model,) if self.sequence else ())

  @property
  def gathers_x(self) -> bool:
    """Whether the layer gathers its quantized input over `model` (a
    column-parallel layer under sequence parallelism)."""
    return self.sequence and self.tensor == "column"

  @property
  def scatters_y(self) -> bool:
    """Whether the layer reduce-scatters its output over `model` (a
    row-parallel layer under sequence parallelism)."""
    return self.sequence and self.tensor == "row"

  @property
  def k_axes(self) -> tuple[str, ...]:
    """Axes splitting `in` (K) of X and of the weight in use."""
    return (self.model,) if self.tensor == "row" else ()

  @property
  def n_axes(self) -> tuple[str, ...]:
    """Axes splitting `out` (N) of Y and of the weight in use."""
    return (self.model,) if self.tensor == "column" else ()

  @property
  def kernel_spec(self) -> P:
    """The stored kernel's spec (`[in, out]`)."""
    dims = [list(self.k_axes), list(self.n_axes)]
    if self.fsdp is not None:
      dims[self.fsdp_dim].append(self.fsdp)
    return P(*(spmd.entry(d) for d in dims))

  @property
  def used_kernel_spec(self) -> P:
    """The kernel's spec while its GEMMs run: `kernel_spec` without `fsdp`
    (gathered over it; still split over `model`)."""
    return P(spmd.entry(self.k_axes), spmd.entry(self.n_axes))

  @property
  def x_spec(self) -> P:
    """X's spec outside the layer."""
    tokens = self.seq_tokens if self.gathers_x else self.tokens
    return P(spmd.entry(tokens), spmd.entry(self.k_axes))

  def check(self, recipe: Recipe, tokens: int, k: int, n: int,
            name: str = "") -> None:
    """Raises a ValueError naming the dimension and the mesh axes where this
    split would cut a scale block of an operand of the layer's GEMMs.

    Args:
      recipe: the layer's `Recipe`.
      tokens, k, n: the layer's token count (all the batch's), `in` and
        `out` sizes.
      name: prefix of the message, e.g. "layer 'mlp/up': ".
    """
    tok, kx, ny, kb, nb = _blocks(recipe)
    for spec, shape, blocks, what, dims in (
        (self.x_spec, (tokens, k), (tok, kx), "the input X",
         ("tokens", "in (K)")),
        (self.y_spec, (tokens, n), (tok, ny),
         "the output gradient dY", ("tokens", "out (N)")),
        (self.kernel_spec, (k, n), (kb, nb), "the weight",
         ("in (K)", "out (N)"))):
      spmd.check_blocks(self.sizes, spec, shape, blocks,
                        what=f"{name or 'dot_general: '}{what}",
                        dim_names=dims)

  def fitted(self, recipe: Recipe, tokens: int, k: int,
             n: int) -> LinearSharding:
    """The split closest to this one that cuts no block of the layer's
    operands (so `check` passes): what sharding in types runs a layer on
    when its operands' types ask for a split that would cut one.

    As auto mode's kernels do (`spmd.fit_spec`), a dimension keeps the mesh
    axes that split it into whole blocks and drops the others, minor axes
    first; the operands are then resharded to the result (gathered over the
    dropped axes): correct, at the cost of moving them. The tokens drop
    axes until each shard holds whole Wgrad token blocks (16 tokens, and the
    16-row Hadamard tiles); `fsdp` leaves with the tokens it split, or where
    the weight's dimension it splits would cut a 16x16 tile; tensor
    parallelism leaves where `model` would cut a block of `in` (row) or
    `out` (column), and sequence parallelism where the tokens outside the
    layer would. This split itself where it cuts nothing; with every axis
    dropped, the whole layer on every device.

    Args:
      recipe: the layer's `Recipe`.
      tokens, k, n: the layer's token count (all the batch's), `in` and
        `out` sizes.

    Returns:
      A `LinearSharding` on the same mesh that `check` accepts.
    """
    tok, kx, ny, kb, nb = _blocks(recipe)
    sizes = self.sizes
    fits = lambda axes, size, block: _fits(sizes, axes, size, block)
    tokens_axes = list(self.tokens)
    while tokens_axes and not fits(tokens_axes, tokens, tok):
      tokens_axes.pop()
    changes = {}
    if tuple(tokens_axes) != self.tokens:
      changes["tokens"] = tuple(tokens_axes)
    fsdp = self.fsdp if self.fsdp in tokens_axes else None
    tensor, model = self.tensor, self.model
    if tensor is not None and not fits(
        (model,), *((k, max(kx, kb)) if tensor == "row"
                    else (n, max(ny, nb)))):
      tensor = model = None
    if fsdp is not None:
      model_axes = ([model] if tensor == ("row" if self.fsdp_dim == 0
                                          else "column") else [])
      size, block = (k, max(kx, kb)) if self.fsdp_dim == 0 else (
          n, max(ny, nb))
      if not fits(model_axes + [fsdp], size, block):
        fsdp = None
    if fsdp != self.fsdp:
      changes["fsdp"] = fsdp
    if (tensor, model) != (self.tensor, self.model):
      changes.update(tensor=tensor, model=model)
    sequence = self.sequence and tensor is not None and fits(
        tokens_axes + [model], tokens, tok)
    if sequence != self.sequence:
      changes.update(sequence=sequence, collective_matmul=False)
    if not changes:
      return self
    out = dataclasses.replace(self, **changes)
    out.check(recipe, tokens, k, n)  # Holds by construction.
    return out

  @property
  def y_spec(self) -> P:
    """Y's (and dY's) spec outside the layer."""
    tokens = self.seq_tokens if self.scatters_y else self.tokens
    return P(spmd.entry(tokens), spmd.entry(self.n_axes))


def _blocks(recipe: Recipe) -> tuple[int, int, int, int, int]:
  """The block lengths a layer's split must keep whole, as `(tokens, X's
  in, dY's out, the weight's in, its out)`: the Wgrad operands' token
  blocks (and 16-row Hadamard tiles), Fprop's and Dgrad's 1xB blocks along
  `in` and `out`, and the weight's (16x16 tiles, or 1xB along each GEMM's
  contraction); 1 where the GEMM is in bf16."""
  fmt = recipe.gemm_format

  def blk(gemm):
    return 1 if fmt(gemm) == "bf16" else block_size(fmt(gemm))
  tok = 1
  if fmt("wgrad") != "bf16":
    tok = max(blk("wgrad"), recipe.rht_size if recipe.wgrad_x.rht else 1)
  kb = nb = 1
  for op, gemm in (("fprop_w", "fprop"), ("dgrad_w", "dgrad")):
    if fmt(gemm) == "bf16":
      continue
    b = blk(gemm)
    if getattr(recipe, op).block_2d:
      kb, nb = max(kb, b), max(nb, b)
    elif gemm == "fprop":
      kb = max(kb, b)  # Fprop's weight is blocked along `in`...
    else:
      nb = max(nb, b)  # ... Dgrad's along `out`.
  return tok, blk("fprop"), blk("dgrad"), kb, nb


def _fits(sizes: Mapping[str, int], axes: Sequence[str], size: int,
          block: int) -> bool:
  """Whether `axes` split a dimension of `size` evenly into shards of whole
  `block`s (`spmd.check_blocks`'s condition)."""
  shards = spmd.num_shards(sizes, axes)
  return shards == 1 or size % (shards * block) == 0


def linear_sharding_for(mesh, x_spec: P, kernel_spec: P) -> LinearSharding:
  """The `LinearSharding` a layer's operands' own shardings ask for.

  For a layer under a mesh the library did not make (the user's axis names,
  JAX's sharding in types): `X: [tokens, in]` of sharding `x_spec`, the
  kernel `[in, out]` of `kernel_spec`, both 2-D PartitionSpecs over `mesh`'s
  axes. Every axis splitting the tokens splits them here too (data
  parallelism); an axis splitting X's `in` is the row-parallel `model` axis,
  else an axis splitting the kernel's `out` but not the tokens is the
  column-parallel one; an axis splitting the tokens and the kernel's other
  dimension is `fsdp` (the weight is gathered quantized and its gradient
  reduce-scattered). What the result's `x_spec` and `kernel_spec` do not
  keep of the given specs (a second model axis, a weight split over an
  axis that does not split the tokens, `fsdp` major to `model` on one
  dimension) is resharded by the caller: correct, at the cost of moving it;
  so is a split that would cut a scale block (`LinearSharding.fitted`).

  Args:
    mesh: the mesh (a `Mesh`, or the `AbstractMesh` of an array's type).
    x_spec, kernel_spec: the operands' PartitionSpecs.

  Returns:
    A `LinearSharding` on `mesh`.
  """
  def dim(spec, d):
    return spmd.entry_axes(spec[d]) if d < len(spec) else ()
  tokens, xk = dim(x_spec, 0), dim(x_spec, 1)
  w_dims = (dim(kernel_spec, 0), dim(kernel_spec, 1))
  tensor = model = None
  if xk:
    tensor, model = "row", xk[0]
  else:
    cols = [a for a in w_dims[1] if a not in tokens]
    if cols:
      tensor, model = "column", cols[0]
  fsdp = fsdp_dim = None
  order = (1, 0) if tensor == "row" else (0, 1)
  for d in order:
    hits = [a for a in w_dims[d] if a in tokens]
    if hits:
      fsdp, fsdp_dim = hits[-1], d
      break
  return LinearSharding(mesh=mesh, tokens=tokens, tensor=tensor, model=model,
                        fsdp=fsdp, fsdp_dim=fsdp_dim)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshRules:
  """What each mesh axis shards, for the layers and the training state.

  Attributes:
    mesh: the mesh (e.g. `make_mesh(data=2, fsdp=2, model=2)`).
    batch: axes splitting the batch (data parallel), major to minor.
    fsdp: the axis that also splits parameters and optimizer state.
    model: the tensor-parallel axis.
    expert: the expert-parallel axis: mixture-of-experts layers keep
      `E / n` experts per device along it and exchange tokens with
      all-to-all (`nvfp4_jax.flax.moe`); it also splits the batch (it is
      appended to `batch`), as the other layers are data parallel over it.
    tensor_parallel: ordered `(layer-path regex, "column" | "row")` pairs,
      first match wins (`re.search`); unmatched layers are not split over
      `model`. Default: the GPT's projections.
    partial_sums: the dtype tensor parallelism sums partial results in,
      "float32" (default) or "output" (`LinearSharding.partial_sums`).
    amax: "global" (default) or "local": the activations' and gradients'
      tensor amax over every axis splitting them, or over `model` only
      (`LinearSharding.amax`).
    wgrad_schedule: "layer" (default) or "xla": under `fsdp`, each layer's
      weight gradient computed with its input gradient, or where XLA's
      scheduler puts it (`LinearSharding.wgrad_schedule`).
    wgrad_sums: "float32" (default) or "bfloat16": the dtype quantized
      linear layers' weight gradients are summed in across the token shards
      (`LinearSharding.wgrad_sums`; the stacked experts of mixture-of-
      experts layers are summed by XLA in their gradient's dtype, FP32
      for FP32 weights).
    sequence_parallel: False (default) or True: sequence parallelism over
      `model` (`LinearSharding.sequence`). Between the tensor-parallel
      layers the activations are split over the batch axes and `model`
      (`token_split`), so each device runs the norms, residual adds and
      the layers `model` does not split on its own tokens instead of all
      of them; the column-parallel layers gather their quantized inputs
      and the row-parallel ones reduce-scatter their outputs in place of
      the all-reduces. The same result as without it. No effect without a
      `model` axis of more than one device.
    collective_matmul: False (default) or True: under sequence parallelism,
      the quantized layers' gathers and reduce-scatters over `model` run as
      rings beside their GEMMs (`LinearSharding.collective_matmul`).
      Needs `sequence_parallel=True`.

  Axes named here but absent from the mesh are dropped (a mesh of only
  `data` is plain data parallelism); every mesh axis must have a role.
  """

  mesh: Mesh
  batch: tuple[str, ...] = ("data", "fsdp")
  fsdp: str | None = "fsdp"
  model: str | None = "model"
  expert: str | None = EXPERT_AXIS
  tensor_parallel: tuple[tuple[str, str], ...] = GPT_TENSOR_PARALLEL
  partial_sums: str = "float32"
  amax: str = "global"
  wgrad_schedule: str = "layer"
  wgrad_sums: str = "float32"
  sequence_parallel: bool = False
  collective_matmul: bool = False

  def __post_init__(self):
    _check_choices(self)
    _check_flags(self, "sequence_parallel", "collective_matmul")
    if self.collective_matmul and not self.sequence_parallel:
      raise ValueError("MeshRules(collective_matmul=True) needs "
                       "sequence_parallel=True (the rings run over the "
                       "token shards sequence parallelism makes).")
    names = tuple(self.mesh.axis_names)
    object.__setattr__(self, "batch",
                       tuple(a for a in self.batch if a in names))
    for field in ("fsdp", "model", "expert"):
      if getattr(self, field) not in names:
        object.__setattr__(self, field, None)
    roles = set(self.batch) | {self.fsdp, self.model, self.expert}
    orphans = [a for a in names if a not in roles]
    if orphans:
      raise ValueError(
          f"mesh axes {orphans} have no role; name them in MeshRules(batch=, "
          f"fsdp=, model=) (known roles: batch {self.batch}, fsdp "
          f"{self.fsdp!r}, model {self.model!r}).")
    for axis in (self.fsdp, self.expert):
      if axis is not None and axis not in self.batch:
        object.__setattr__(self, "batch", self.batch + (axis,))
    tp = rule_pairs(self.tensor_parallel, "MeshRules.tensor_parallel",
                    "'column' | 'row'", "((r'attn/qkv$', 'column'),)",
                    is_target=lambda v: v in TENSOR_STYLES)
    for pattern, style in tp:
      try:
        re.compile(pattern)
      except (re.error, TypeError) as e:
        raise ValueError(
            f"MeshRules.tensor_parallel: bad pattern {pattern!r} ({e}); "
            f"write a Python regex searched in layer paths, e.g. "
            f"r'(^|/)attn/qkv$'.") from None
      if style not in TENSOR_STYLES:
        raise ValueError(f"tensor_parallel rule {pattern!r}: style must be "
                         f"one of {TENSOR_STYLES}, got {style!r}.")
    object.__setattr__(self, "tensor_parallel", tp)

  @property
  def sizes(self) -> Mapping[str, int]:
    """The mesh's axis sizes by axis name."""
    return dict(self.mesh.shape)

  @property
  def data_parallel(self) -> int:
    """How many shards the batch is split into."""
    return spmd.num_shards(self.sizes, self.batch)

  def style(self, path: str) -> str | None:
    """The tensor-parallel style of the layer at `path` (None: not split)."""
    if self.model is None:
      return None
    for pattern, style in self.tensor_parallel:
      if re.search(pattern, path):
        return style
    return None

  @property
  def sequence(self) -> bool:
    """Whether sequence parallelism is on: `sequence_parallel` with a
    `model` axis of more than one device."""
    return (self.sequence_parallel and self.model is not None
            and self.sizes[self.model] > 1)

  @property
  def token_axes(self) -> tuple[str, ...]:
    """The axes splitting the activations between layers: `batch`, and
    `model` after them under sequence parallelism."""
    return self.batch + ((self.model,) if self.sequence else ())

  def linear(self, path: str) -> LinearSharding:
    """The `LinearSharding` of the linear layer at `path`."""
    style = self.style(path)
    return LinearSharding(mesh=self.mesh,
                          tokens=self.batch if style else self.token_axes,
                          tensor=style,
                          model=self.model if style else None,
                          fsdp=self.fsdp, partial_sums=self.partial_sums,
                          amax=self.amax, wgrad_schedule=self.wgrad_schedule,
                          wgrad_sums=self.wgrad_sums,
                          sequence=bool(style) and self.sequence,
                          collective_matmul=(bool(style) and self.sequence
                                             and self.collective_matmul))

  def token_split(self, x: jax.Array, axis: int = 0) -> jax.Array:
    """`x` (an activation whose `axis` indexes sequences) split over
    `token_axes` along `axis`, by a sharding constraint: under sequence
    parallelism, the activations between layers. `x` itself without
    sequence parallelism, where `token_axes` do not divide the axis, under
    Explicit mesh axes (the types say where arrays live) and inside a
    `shard_map`. Call it while tracing."""
    if not self.sequence or x.shape[axis] % spmd.num_shards(
        self.sizes, self.token_axes):
      return x
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if (mesh is not None and not mesh.empty
        and jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)):
      return x
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty and abstract.manual_axes:
      return x
    spec = [None] * x.ndim
    spec[axis] = spmd.entry(self.token_axes)
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(self.mesh, P(*spec)))

  def batch_spec(self, ndim: int, axis: int = 0) -> P:
    """The spec of a batch array whose `axis` indexes sequences."""
    dims = [None] * ndim
    dims[axis] = spmd.entry(self.batch)
    return P(*dims)

  def param_spec(self, path: str, shape: Sequence[int]) -> P:
    """The spec of the parameter at `path` ("block_0/mlp/up/kernel").

    A 2-D `kernel` is a linear layer's: split as `linear(layer path)` says.
    A 3-D `.../experts/<name>/kernel` (stacked experts) is split over
    `expert` along the experts.
    Other parameters of 2+ dimensions are split over `fsdp` along their
    first dimension it divides; vectors (norm scales, biases) are
    replicated.

    Raises:
      ValueError: a kernel dimension that its axes do not divide.
    """
    parts = path.split("/")
    if (self.expert is not None and parts[-1] == "kernel" and len(shape) == 3
        and len(parts) >= 3 and parts[-3] == "experts"):
      # A mixture of experts' stacked kernels: the experts split over
      # `expert`, each device holding its own.
      spmd.check_blocks(self.sizes, P(self.expert, None, None), shape,
                        (1, 1, 1), what=f"parameter {path!r}",
                        dim_names=("experts", "in", "out"))
      return P(self.expert, None, None)
    if parts[-1] == "kernel" and len(shape) == 2:
      spec = self.linear("/".join(parts[:-1])).kernel_spec
      spmd.check_blocks(self.sizes, spec, shape, (1, 1),
                        what=f"parameter {path!r}",
                        dim_names=("in", "out"))
      return spec
    if self.fsdp is None or len(shape) < 2:
      return P()
    n = self.sizes[self.fsdp]
    for d, size in enumerate(shape):
      if size % n == 0:
        return P(*([None] * d + [self.fsdp]))
    return P()

  def gathered(self, path: str, x: jax.Array) -> jax.Array:
    """The parameter `x` at `path` as its computation uses it: gathered
    over `fsdp` (a sharding constraint to `param_spec` without that axis;
    `model` splits stay). For parameters that a model's own high-precision
    code contracts with batch-split activations (an embedding table): left
    FSDP-split, XLA's partitioner can compute the gradient's shard from the
    whole batch's activations, gathered, instead of reduce-scattering the
    gradient. Call it while tracing, outside a `shard_map`."""
    spec = self.param_spec(path, np.shape(x))
    if self.fsdp is None:
      return x
    dims = [tuple(a for a in spmd.entry_axes(e) if a != self.fsdp)
            for e in spec]
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(self.mesh, P(*(spmd.entry(d) for d in dims))))

  def param_specs(self, params: Any) -> Any:
    """`param_spec` of every leaf of `params` (a nested dict)."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: self.param_spec(_path(kp), np.shape(x)), params)

  def state_specs(self, state: Any, params: Any) -> Any:
    """Specs for a pytree holding copies of `params` (optimizer moments,
    FP32 master weights, the train state): each leaf whose path ends with a
    parameter's path and has its shape takes that parameter's spec; other
    leaves (step counters) are replicated."""
    by_path = {}
    for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]:
      by_path[_keys(kp)] = (np.shape(x), self.param_spec(_path(kp),
                                                         np.shape(x)))

    def spec(kp, x):
      keys = _keys(kp)
      for i in range(len(keys)):
        hit = by_path.get(keys[i:])
        if hit is not None and hit[0] == np.shape(x):
          return hit[1]
      return P()
    return jax.tree_util.tree_map_with_path(spec, state)

  def shardings(self, specs: Any) -> Any:
    """`NamedSharding`s on this mesh for a pytree of specs.

    Raises:
      ValueError: a spec naming an axis the mesh lacks.
    """
    def sharding(s):
      spmd.check_spec_axes(s, self.mesh.axis_names, "MeshRules.shardings")
      return NamedSharding(self.mesh, s)
    return jax.tree.map(sharding, specs, is_leaf=lambda s: isinstance(s, P))


def _keys(kp) -> tuple:
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
               for k in kp)


def _path(kp) -> str:
  return "/".join(_keys(kp))


_SCOPE: ScopeStack["MeshRules"] = ScopeStack()


@contextlib.contextmanager
def mesh_rules(rules: MeshRules) -> Iterator[MeshRules]:
  """Within the block, NVFP4 layers run sharded as `rules` say.

  Applies while tracing (wrap the model's apply inside the jitted step, as
  `precision_rules`). The layers' inputs are resharded to what the rules
  expect, so the block is correct with any input sharding; shard the batch
  with `rules.batch_spec` and the parameters with `rules.param_specs` to
  avoid the copies.

  Args:
    rules: the `MeshRules`.

  Yields:
    `rules`.

  Raises:
    TypeError: `rules` is not a `MeshRules`.
  """
  if not isinstance(rules, MeshRules):
    raise TypeError(f"mesh_rules takes a MeshRules, got {rules!r}.")
  with _SCOPE.push(rules):
    yield rules


def current_rules() -> MeshRules | None:
  """The innermost `mesh_rules` in force, or None.

  Returns:
    The `MeshRules` of the innermost `mesh_rules` block, or None outside
    one.
  """
  return _SCOPE.current()
