"""The grouped GEMMs of a mixture of experts.

`nvfp4_jax.ragged_dot` (`nvfp4_jax.training.ragged_dot`) runs a layer of `E`
experts as three grouped GEMMs. Their operands are ragged (the tokens sorted
by expert and split into contiguous groups by `group_sizes`) and quantized
group by group (`nvfp4_jax.ops.ragged_quantize`: `Grouped`), so that each
expert's operands are what `nvfp4_jax.dot_general` quantizes for that expert
alone.

The GEMMs multiply exact block values with FP32 accumulation and one FP32
factor per group (`group_alpha`), as the dense emulation does:
`ragged_values_matmul` (Fprop and Dgrad: each row times its group's weight)
and `ragged_values_matmul_t` (Wgrad: each group's tokens contracted into its
`[K, N]` gradient). Implementations: "xla" (the reference loop over groups),
"lax" (`jax.lax.ragged_dot_general`, XLA's grouped GEMM) and "pallas" (the
Hopper Mosaic GPU kernels, `pallas_mosaic_gpu.py`). Where a native
block-scaled grouped GEMM runs (Blackwell), `ragged_codes_matmul` and
`ragged_codes_matmul_t` multiply the codes ("triton", `triton.py`).

Under `jax.jit` shardings (auto mode) the kernels run per shard
(`dispatch.Op.per_shard`, through `core.spmd`): Fprop's and Dgrad's GEMMs
on a shard of the rows with that shard's group sizes; Wgrad's with K and N
split and its contraction, the tokens, gathered: see each `_*_per_shard`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax.core import dispatch
from nvfp4_jax.core import numerics as nm
from nvfp4_jax.ops.ragged_dot import reference as ref
from nvfp4_jax.ops.ragged_dot import sharded
from nvfp4_jax.ops.ragged_quantize.api import Grouped
from nvfp4_jax.ops.ragged_quantize.reference import group_of


def group_alpha(a: Grouped, b: Grouped) -> jax.Array | None:
  """Each group's FP32 GEMM factor, `[E]` (`gemm_alpha` group by group:
  `(amax_a * amax_b) * f32(1 / (den_a * den_b))`; None (1) for MX)."""
  if a.fmt != "nvfp4":
    return None
  return nm.ftz((a.amax * b.amax) * jnp.float32(
      1.0 / (a.tensor_denominator * b.tensor_denominator)))


# ----------------------------------------------------------------------------
# The GEMMs.
# ----------------------------------------------------------------------------


def _lax_matmul(va, vb, group_sizes, alpha=None, *, out_dtype=jnp.float32,
                vb_layout="kn", precision=None):
  contract = 1 if vb_layout == "kn" else 2
  dn = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((1,), (contract,)), ((), ())),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
  y = jax.lax.ragged_dot_general(va, vb, group_sizes.astype(jnp.int32), dn,
                                 precision=precision,
                                 preferred_element_type=jnp.float32)
  m = va.shape[0]
  if alpha is not None:
    g = group_of(group_sizes, m)
    a = jnp.concatenate([jnp.broadcast_to(alpha, group_sizes.shape),
                         jnp.zeros((1,), jnp.float32)])
    y = y * a[g][:, None]
  return y.astype(out_dtype)


def _lax_matmul_t(va, vb, group_sizes, alpha=None, *, out_dtype=jnp.float32,
                  tokens_last=True, precision=None):
  axis = 1 if tokens_last else 0
  dn = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((axis,), (axis,)), ((), ())),
      lhs_ragged_dimensions=[axis], rhs_group_dimensions=[])
  y = jax.lax.ragged_dot_general(va, vb, group_sizes.astype(jnp.int32), dn,
                                 precision=precision,
                                 preferred_element_type=jnp.float32)
  if alpha is not None:
    y = y * jnp.broadcast_to(alpha, group_sizes.shape)[:, None, None]
  return y.astype(out_dtype)


def _preference(platform: str) -> tuple[str, ...]:
  # XLA's grouped GEMM on GPUs where the kernel cannot run the call; the
  # reference loop (E dense GEMMs) on the CPU, where it is the truth.
  return ("pallas", "lax") if platform == "gpu" else ()


def _values_per_shard(kernel, va, vb, group_sizes, alpha=None, **kwargs):
  """The grouped GEMM kernel per shard under `jax.jit` shardings
  (`sharded.grouped_matmul_per_shard`): the result's rows split as `va`'s
  (each shard with its own rows' group sizes), its columns as `vb`'s N;
  the experts and K gathered. A shard the kernel turns down runs the
  reference (exact products; only the FP32 summation order differs).
  XLA's grouped GEMM ("lax") is partitioned by XLA itself."""
  if kernel is _lax_matmul:
    return kernel(va, vb, group_sizes, alpha, **kwargs)
  n_dim = 2 if kwargs.get("vb_layout", "kn") == "kn" else 1
  return sharded.grouped_matmul_per_shard(
      kernel, (va,), (vb,), (group_sizes, alpha), a_dim=0, b_dim=n_dim,
      contract_tokens=False, fallback=ref.ragged_values_matmul, **kwargs)


def _values_t_per_shard(kernel, va, vb, group_sizes, alpha=None, **kwargs):
  """The Wgrad grouped GEMM kernel per shard under `jax.jit` shardings
  (`sharded.grouped_matmul_per_shard`): the result `[E, K, N]` split as `va`'s
  K and `vb`'s N; the tokens, the contraction, are gathered where split (a
  sum over shards would change the FP32 summation order: not the whole
  call's bits). A shard the kernel turns down runs the reference. XLA's
  grouped GEMM ("lax") is partitioned by XLA itself."""
  if kernel is _lax_matmul_t:
    return kernel(va, vb, group_sizes, alpha, **kwargs)
  d = 0 if kwargs.get("tokens_last", True) else 1
  return sharded.grouped_matmul_per_shard(
      kernel, (va,), (vb,), (group_sizes, alpha), a_dim=d, b_dim=d,
      contract_tokens=True, fallback=ref.ragged_values_matmul_t, **kwargs)


RAGGED_VALUES_MATMUL = dispatch.Op("ragged_values_matmul", {
    "xla": ref.ragged_values_matmul,
    "lax": _lax_matmul,
    "pallas": "nvfp4_jax.ops.ragged_dot.pallas_mosaic_gpu:"
              "ragged_values_matmul",
}, preferred=_preference, per_shard=_values_per_shard)

RAGGED_VALUES_MATMUL_T = dispatch.Op("ragged_values_matmul_t", {
    "xla": ref.ragged_values_matmul_t,
    "lax": _lax_matmul_t,
    "pallas": "nvfp4_jax.ops.ragged_dot.pallas_mosaic_gpu:"
              "ragged_values_matmul_t",
}, preferred=_preference, per_shard=_values_t_per_shard)


def _hp(implementation: str | None, precision) -> str | None:
  """A GEMM given a `precision` (high-precision operands) runs XLA's: the
  kernels multiply bf16 values at their one precision."""
  if precision is None or implementation is not None:
    return implementation
  return "lax" if dispatch.platform() == "gpu" else "xla"


def _check_groups(group_sizes, num_groups: int, what: str) -> None:
  if (not hasattr(group_sizes, "dtype")
      or not jnp.issubdtype(group_sizes.dtype, jnp.integer)
      or group_sizes.shape != (num_groups,)):
    raise ValueError(
        f"{what}: group_sizes must be an integer array of shape "
        f"({num_groups},) (one size per expert), got "
        f"{getattr(group_sizes, 'dtype', type(group_sizes).__name__)} "
        f"{getattr(group_sizes, 'shape', '')}.")


def ragged_values_matmul(va: jax.Array, vb: jax.Array,
                         group_sizes: jax.Array,
                         alpha: jax.Array | None = None, *,
                         out_dtype=jnp.float32, vb_layout: str = "kn",
                         precision=None,
                         implementation: str | None = None) -> jax.Array:
  """The grouped GEMM of Fprop and Dgrad: row `r` of group `e` times `vb[e]`.

  Args:
    va: `[M, K]`, rows sorted by group.
    vb: `[E, K, N]` (`vb_layout="kn"`: `va[r] @ vb[e]`) or `[E, N, K]`
      (`"nk"`: `va[r] @ vb[e].T`).
    group_sizes: int `[E]`, rows per group; rows past their sum give 0.
    alpha: FP32 `[E]` (or a scalar), each group's factor; None for 1.
    out_dtype: the result's dtype; FP32 accumulation, `* alpha`, one cast.
    precision: of XLA's GEMMs (high-precision operands).
    implementation: "xla" (the reference loop), "lax"
      (`jax.lax.ragged_dot_general`), "pallas" (Hopper), or None.

  Returns:
    `[M, N]`.
  """
  what = "ragged_values_matmul"
  if vb_layout not in ("kn", "nk") or va.ndim != 2 or vb.ndim != 3:
    raise ValueError(
        f"{what}: va [M, K] and vb [E, K, N] (vb_layout='kn') or [E, N, K] "
        f"('nk'), got {va.shape}, {vb.shape}, vb_layout={vb_layout!r}.")
  k = vb.shape[1] if vb_layout == "kn" else vb.shape[2]
  if va.shape[1] != k:
    raise ValueError(f"{what}: contraction sizes differ: va {va.shape} vs vb "
                     f"{vb.shape} ({vb_layout}).")
  _check_groups(group_sizes, vb.shape[0], what)
  extra = {} if precision is None else {"precision": precision}
  return RAGGED_VALUES_MATMUL(_hp(implementation, precision), va, vb,
                              group_sizes, alpha,
                              out_dtype=jnp.dtype(out_dtype),
                              vb_layout=vb_layout, **extra)


def ragged_values_matmul_t(va: jax.Array, vb: jax.Array,
                           group_sizes: jax.Array,
                           alpha: jax.Array | None = None, *,
                           out_dtype=jnp.float32, tokens_last: bool = True,
                           precision=None,
                           implementation: str | None = None) -> jax.Array:
  """The grouped GEMM of Wgrad: each group's tokens contracted, `[E, K, N]`.

  Args:
    va, vb: `[K, M]` and `[N, M]` (`tokens_last`), or `[M, K]` and `[M, N]`.
    group_sizes: int `[E]`, tokens per group, in order; an empty group's
      result is zeros.
    alpha, out_dtype, precision, implementation: as `ragged_values_matmul`.
  """
  what = "ragged_values_matmul_t"
  axis = 1 if tokens_last else 0
  if va.ndim != 2 or vb.ndim != 2 or va.shape[axis] != vb.shape[axis]:
    raise ValueError(
        f"{what}: va and vb must be 2-D with the tokens on axis {axis} of "
        f"both, got {va.shape}, {vb.shape}.")
  num_groups = getattr(group_sizes, "shape", (-1,))[0] if getattr(
      group_sizes, "ndim", 0) == 1 else -1
  _check_groups(group_sizes, num_groups, what)
  extra = {} if precision is None else {"precision": precision}
  return RAGGED_VALUES_MATMUL_T(_hp(implementation, precision), va, vb,
                                group_sizes, alpha,
                                out_dtype=jnp.dtype(out_dtype),
                                tokens_last=tokens_last, **extra)


# ----------------------------------------------------------------------------
# The GEMMs on codes: native FP4 / FP8 (Blackwell).
# ----------------------------------------------------------------------------

# The formats the GEMMs on codes multiply (both operands in one of them).
CODES_FORMATS = ref.CODES_FORMATS


def _codes_preference(platform: str) -> tuple[str, ...]:
  # The Triton kernel where `tl.dot_scaled` compiles to a block-scaled MMA;
  # elsewhere (Hopper) the GEMMs multiply block values (`RAGGED_VALUES_*`).
  from nvfp4_jax.ops.block_scaled_matmul import triton as dense  # pylint: disable=g-import-not-at-top
  if platform == "gpu" and dense.has_fp4_mma(dispatch.compute_capability()):
    return ("triton",)
  return ()


def _codes_per_shard(kernel, a_codes, a_scales, b_codes, b_scales,
                     group_sizes, alpha=None, **kwargs):
  """`_values_per_shard` on codes: `a`'s rows split (their own group
  sizes), `b [E, N, K]`'s N split; the experts and K gathered."""
  return sharded.grouped_matmul_per_shard(
      kernel, (a_codes, a_scales), (b_codes, b_scales), (group_sizes, alpha),
      a_dim=0, b_dim=1, contract_tokens=False,
      fallback=ref.ragged_codes_matmul, **kwargs)


def _codes_t_per_shard(kernel, a_codes, a_scales, b_codes, b_scales,
                       group_sizes, alpha=None, **kwargs):
  """`_values_t_per_shard` on codes (`a [K, L]`, `b [N, L]`): K and N
  split, the tokens gathered."""
  return sharded.grouped_matmul_per_shard(
      kernel, (a_codes, a_scales), (b_codes, b_scales), (group_sizes, alpha),
      a_dim=0, b_dim=0, contract_tokens=True,
      fallback=ref.ragged_codes_matmul_t, **kwargs)


RAGGED_CODES_MATMUL = dispatch.Op("ragged_codes_matmul", {
    "xla": ref.ragged_codes_matmul,
    "triton": "nvfp4_jax.ops.ragged_dot.triton:ragged_codes_matmul",
}, preferred=_codes_preference, per_shard=_codes_per_shard)

RAGGED_CODES_MATMUL_T = dispatch.Op("ragged_codes_matmul_t", {
    "xla": ref.ragged_codes_matmul_t,
    "triton": "nvfp4_jax.ops.ragged_dot.triton:ragged_codes_matmul_t",
}, preferred=_codes_preference, per_shard=_codes_t_per_shard)


def multiplies_codes() -> bool:
  """Whether the grouped NVFP4, MXFP4 and MXFP8 GEMMs multiply codes here,
  so the quantizers write codes: a `default_implementation` naming the
  kernel ("triton"), or by default where it runs (Blackwell with jax-triton
  installed; without it the op keeps the block-values GEMMs rather than the
  reference loop)."""
  if RAGGED_CODES_MATMUL.order()[0] == "xla":
    return False
  if dispatch.current_default() is not None:
    return True
  import importlib.util  # pylint: disable=g-import-not-at-top
  return importlib.util.find_spec("jax_triton") is not None


def _codes_format(what: str, a: Grouped, b: Grouped) -> str:
  if a.fmt != b.fmt or a.fmt not in CODES_FORMATS:
    raise ValueError(
        f"{what}: both operands must hold codes of one format in "
        f"{CODES_FORMATS}, got {a.fmt!r} and {b.fmt!r}.")
  if a.data is None or b.data is None:
    raise ValueError(f"{what}: an operand holds no codes (quantize it with "
                     f"codes=True).")
  return a.fmt


def ragged_codes_matmul(a: Grouped, b: Grouped, group_sizes: jax.Array,
                        alpha: jax.Array | None = None, *,
                        out_dtype=jnp.float32,
                        implementation: str | None = None) -> jax.Array:
  """`ragged_values_matmul` on codes: row `r` of group `e` times `b[e].T`,
  `a` `[M, K]` and `b` `[E, N, K]` quantized along K (`Grouped` with codes,
  both NVFP4, MXFP4 or MXFP8; MX has no `alpha`). implementation: "xla"
  (the reference on the block values), "triton" (`tl.dot_scaled`,
  Blackwell), or None."""
  fmt = _codes_format("ragged_codes_matmul", a, b)
  return RAGGED_CODES_MATMUL(implementation, a.data, a.scales, b.data,
                             b.scales, group_sizes, alpha,
                             out_dtype=jnp.dtype(out_dtype), fmt=fmt)


def ragged_codes_matmul_t(a: Grouped, b: Grouped, group_sizes: jax.Array,
                          alpha: jax.Array | None = None, *,
                          out_dtype=jnp.float32,
                          implementation: str | None = None) -> jax.Array:
  """`ragged_values_matmul_t` (tokens last) on codes: `a [K, L]`,
  `b [N, L]` quantized along the tokens; `[E, K, N]`."""
  fmt = _codes_format("ragged_codes_matmul_t", a, b)
  return RAGGED_CODES_MATMUL_T(implementation, a.data, a.scales, b.data,
                               b.scales, group_sizes, alpha,
                               out_dtype=jnp.dtype(out_dtype), fmt=fmt)
