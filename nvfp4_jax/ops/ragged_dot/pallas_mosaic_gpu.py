"""Pallas Mosaic GPU kernels of the grouped GEMMs (`ragged_values_matmul`,
`ragged_values_matmul_t`) on Hopper.

The exact emulation's grouped GEMMs on bf16 block values: FP32 accumulation
by wgmma, each group's `alpha` multiplied into the FP32 accumulator in the
epilogue, one cast. Every product of two bf16 values is exact in FP32, so
the result differs from the reference (`lax.dot_general` per group) only in
the order of the FP32 summation. With `alpha=None` they are the library's
bf16 grouped GEMM (the MoE model's BF16 baseline).

Adapted from JAX's Hopper kernels (Apache-2.0):
`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu` (the tile-to-group map,
tiles straddling two groups computed once per group and stored row-masked
through a ladder of power-of-two TMA stores) and
`transposed_ragged_dot_mgpu` (the ragged contraction, the other groups'
tokens masked in the first and last step of a group), on the pipeline the
project's dense kernel shares (`pallas_kernels.mosaic_gemm`, from JAX's
`hopper_matmul_mgpu`): TMA loads into swizzled shared memory, a
warp-specialized pipeline (one memory warpgroup, two wgmma warpgroups
splitting N), a persistent grid, TMA-stored epilogue.

`ragged_values_matmul` (Fprop, Dgrad): a tile-to-group map is computed
before the call (a few small XLA ops on `group_sizes`): one entry per
(M tile, group) pair that shares rows, plus the rows past the groups' sum
(stored as zeros, no GEMM). The persistent grid walks (map entry, N tile);
a full tile is stored through swizzled 64 x 64 pieces, a partial one
through unswizzled `[tile_m, 64]` pieces (the same shared memory) and a
ladder of TMA stores of 64, 32, ..., 1 rows.

`ragged_values_matmul_t` (Wgrad): the persistent grid walks (group, output
tile of `[K, N]`); each runs a pipeline over its group's token steps (a
dynamic grid); in a step that holds other groups' tokens, each compute
warpgroup zeroes those tokens of its half of `vb`'s tile in shared memory
before its wgmma. An empty group stores zeros.

Requirements (else `NotImplementedError`, the dispatch then falls back):
bf16 operands; FP32 or bf16 output; the contraction size (K of
`ragged_values_matmul`) a multiple of `tile_k` (64); the output's N a
multiple of 64 and, for `ragged_values_matmul_t`, K too (a CTA tile
running past N or K is read as zeros by TMA and its store clipped); M (the
tokens) a multiple of 8 (TMA's 8-row tiles; M tiles running past M are read
as zeros), except `ragged_values_matmul_t` with `tokens_last`, which pads
the tokens to a multiple of 64 (a copy of both operands) when they are not. Token rows outside every group must be finite in
`ragged_values_matmul_t` (they are multiplied by zero).

On the H100 (jax 0.11.2, `python -m benchmarks.bench_moe`, bf16 output),
against XLA's dense bf16 GEMM of the same FLOPs: Fprop 0.87-1.08, Fprop +
Dgrad + Wgrad 0.69-1.04 over Mixtral-, DeepSeek- and Qwen-like layers
(E = 8, 64, 128) at 16k and 64k tokens, balanced and skewed routing;
`jax.lax.ragged_dot` ran at 0.01-0.17 (or out of memory). The weakest:
Wgrad with long groups (Mixtral, 64k tokens: 0.49-0.64), where cuBLAS's
dense Wgrad reaches ~750 TFLOP/s and this kernel 360-450.

Mosaic GPU has no interpret mode: on the CPU these raise
`NotImplementedError`; the kernels are lowered for CUDA in the CPU tests
and compiled and compared with a reference in the GPU tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from nvfp4_jax.ops.ragged_dot.config import Config
from pallas_kernels import mosaic_gemm


def _check_dtypes(what, va, vb, out_dtype, group_sizes):
  mosaic_gemm.check_operands(what, va, vb, out_dtype)
  if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype,
                                                 jnp.integer):
    raise ValueError(f"{what}: group_sizes must be an integer [E] array, got "
                     f"{group_sizes.dtype} {group_sizes.shape}.")


def _alpha(alpha, num_groups):
  if alpha is None:
    return None
  return jnp.broadcast_to(jnp.asarray(alpha, jnp.float32), (num_groups,))


def _out_smem(plgpu, c: Config, out_dtype, with_rows: bool):
  """The epilogue's shared memory: per compute warpgroup, two swizzled
  `[e, e]` slots (`mosaic_gemm.store_output`); with `with_rows`, aliased by
  an unswizzled `[tile_m, e]` buffer per warpgroup for row-masked stores.
  Both views hold warpgroup 0's part in their first half (equal sizes), so
  a warpgroup waiting on its own stores never races the other's."""
  e = c.epi_tile
  slots = mosaic_gemm.epilogue_slots(c)
  swz = mosaic_gemm.output_smem(slots, e, out_dtype)
  if not with_rows:
    return swz
  if slots * e != c.tile_m:
    raise NotImplementedError(
        f"ragged_values_matmul: tile_m {c.tile_m} must be 2 x epi_tile {e}.")
  rows = plgpu.SMEM((2, c.tile_m, e), out_dtype)
  return plgpu.RefUnion(swz, rows)


def _zeros(plgpu, shape, dtype):
  return plgpu.layout_cast(jnp.zeros(shape, dtype), plgpu.Layout.WGMMA)


def _store_rows(plgpu, acc, rows_smem, wg_idx, out_tile, start, size):
  """Stores rows `[start, start + size)` (0 <= size < tile_m) of a
  warpgroup's output tile `acc` to `out_tile` (its `[tile_m, tile_n]` view
  of the output): per 64-column piece, through unswizzled shared memory and
  TMA stores of 64, 32, ..., 1 rows (the bits of `size`)."""
  _, tile_m, e = rows_smem.shape
  tile_n = acc.shape[1]
  for ni in range(tile_n // e):
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    rows_smem[wg_idx] = acc[:, ni * e:(ni + 1) * e]
    plgpu.commit_smem()
    off = start
    p = tile_m // 2
    while p >= 1:
      @pl.when((size & p) != 0)
      def _store(off=off, p=p, ni=ni):
        plgpu.copy_smem_to_gmem(
            rows_smem.at[wg_idx].at[pl.ds(off, p)],
            out_tile.at[pl.ds(off, p), pl.ds(ni * e, e)])
      off = off + (size & p)
      p //= 2


def _tile_map(group_sizes, m: int, tile: int):
  """The tile-to-group map of `ragged_values_matmul`: for each entry
  `t < cdiv(m, tile) + E` (E groups, then the rows past their sum as a
  segment E), `(segment, first row of its M tile, first row, end row)` of
  the rows of that segment in that tile; unused entries have no rows."""
  e = group_sizes.shape[0]
  gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(gs), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  seg_lo = jnp.concatenate([starts, ends[-1:]])
  seg_hi = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
  first = seg_lo // tile
  count = jnp.where(seg_hi > seg_lo, (seg_hi - 1) // tile - first + 1, 0)
  cum = jnp.cumsum(count)
  t = jnp.arange(pl.cdiv(m, tile) + e, dtype=jnp.int32)
  seg = jnp.sum((cum[None, :] <= t[:, None]).astype(jnp.int32), axis=1)
  segc = jnp.minimum(seg, e)
  row0 = (first[segc] + t - (cum[segc] - count[segc])) * tile
  lo = jnp.maximum(seg_lo[segc], row0)
  hi = jnp.where(seg <= e, jnp.minimum(seg_hi[segc], row0 + tile), lo)
  return segc, row0, lo, hi


def ragged_values_matmul(va: jax.Array, vb: jax.Array, group_sizes: jax.Array,
                         alpha: jax.Array | None = None, *,
                         out_dtype=jnp.float32, vb_layout: str = "kn",
                         config: Config | None = None,
                         num_sms: int | None = None) -> jax.Array:
  """Row `r` of group `e`: `(va[r] @ vb[e]) * alpha[e]` (`vb[e].T` for "nk").

  Args:
    va: bf16 `[M, K]`, rows sorted by group.
    vb: bf16 `[E, K, N]` (`vb_layout="kn"`) or `[E, N, K]` ("nk").
    group_sizes: int `[E]` (traced); rows past their sum give zeros.
    alpha: FP32 `[E]` (or scalar), or None for 1.
    out_dtype: float32 or bfloat16.
    config: tiles (default `Config()`).
    num_sms: the persistent grid's size; the device's SM count when None
      (given only to lower the kernel without a GPU).

  Raises:
    NotImplementedError: not on a Hopper GPU, other dtypes, K off the
      `tile_k` step or N off 64.
  """
  what = "ragged_values_matmul"
  c = config or Config()
  if num_sms is None:
    num_sms = mosaic_gemm.check_device(what)
  _check_dtypes(what, va, vb, out_dtype, group_sizes)
  if vb_layout not in ("kn", "nk"):
    raise ValueError(f"{what}: vb_layout 'kn' or 'nk', got {vb_layout!r}.")
  m, k = va.shape
  e, kb, n = vb.shape if vb_layout == "kn" else (vb.shape[0], vb.shape[2],
                                                 vb.shape[1])
  if kb != k or group_sizes.shape != (e,):
    raise ValueError(f"{what}: va {va.shape}, vb {vb.shape} ({vb_layout}) "
                     f"and group_sizes {group_sizes.shape} do not match.")
  if k % c.tile_k or n % 64 or m % 8:
    raise NotImplementedError(
        f"{what}: K={k} must be a multiple of {c.tile_k}, N={n} of 64 and "
        f"M={m} of 8 (the kernel's tiles); the reference runs it.")
  seg, row0, lo, hi = _tile_map(group_sizes, m, c.tile_m)
  return _fprop_call(seg, row0, lo, hi, va, vb, _alpha(alpha, e),
                     out_dtype=jnp.dtype(out_dtype), vb_kn=vb_layout == "kn",
                     config=c, num_sms=num_sms)


# Jitted so that identical calls (every layer of a model) trace and lower
# the kernel once: JAX reuses one lowered function for them.
@functools.partial(jax.jit, static_argnames=("out_dtype", "vb_kn", "config", "num_sms"))
def _fprop_call(seg, row0, lo, hi, va, vb, alpha, *, out_dtype, vb_kn,
                config: Config, num_sms):
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  c = config
  m, k = va.shape
  num_groups = vb.shape[0]
  n = vb.shape[2] if vb_kn else vb.shape[1]
  tile_m, tile_n, tile_k = c.tile_m, c.tile_n, c.tile_k
  cta_n = c.cta_n
  t_iters, n_iters, k_iters = seg.shape[0], pl.cdiv(n, cta_n), k // tile_k
  a_transforms = mosaic_gemm.swizzled(tile_k * 2, "operand")
  b_transforms = mosaic_gemm.swizzled((tile_n if vb_kn else tile_k) * 2,
                                      "operand")
  steps = mosaic_gemm.concurrent_steps(c, out_dtype)
  has_alpha = alpha is not None

  def kernel(seg_gmem, row0_gmem, lo_gmem, hi_gmem, a_gmem, b_gmem, *rest,
             out_smem):
    if has_alpha:
      alpha_gmem, out_gmem = rest
    else:
      alpha_gmem, (out_gmem,) = None, rest
    swz_smem, rows_smem = out_smem

    def get_pipeline(body, compute_context):
      if vb_kn:
        b_spec = plgpu.BlockSpec((tile_k, cta_n), lambda s: (s, 0),
                                 transforms=b_transforms)
      else:
        b_spec = plgpu.BlockSpec((cta_n, tile_k), lambda s: (0, s),
                                 transforms=b_transforms)
      return mosaic_gemm.pipeline(
          body, compute_context, grid=(k_iters,),
          in_specs=[plgpu.BlockSpec((tile_m, tile_k), lambda s: (0, s),
                                    transforms=a_transforms),
                    b_spec],
          steps=steps)

    @mosaic_gemm.with_allocations(
        get_pipeline, a_gmem.at[pl.ds(0, tile_m), :],
        b_gmem.at[0, :, pl.ds(0, cta_n)] if vb_kn
        else b_gmem.at[0, pl.ds(0, cta_n), :])
    def _scope(pipeline_allocs):
      wg_idx = lax.axis_index("wg")

      @plgpu.nd_loop((t_iters * n_iters,), collective_axes="cluster_grid")
      def _mn_loop(info):
        (lin,) = info.index
        t_idx, n_idx = plgpu.planar_snake(lin, (t_iters, n_iters), 1,
                                          c.grid_tile_width)
        g = seg_gmem[t_idx]
        row_0 = pl.multiple_of(row0_gmem[t_idx], tile_m)
        start = lo_gmem[t_idx] - row_0
        size = hi_gmem[t_idx] - lo_gmem[t_idx]
        cta_m = pl.ds(row_0, tile_m)
        cta_n_ds = pl.ds(n_idx * cta_n, cta_n)
        wg_n = pl.ds(wg_idx * tile_n, tile_n)

        def store(acc):
          out_tile = out_gmem.at[cta_m, cta_n_ds].at[:, wg_n]

          @pl.when(size == tile_m)
          def _full():
            mosaic_gemm.store_output(acc, swz_smem, wg_idx, out_tile)

          @pl.when(size < tile_m)
          def _rows():
            _store_rows(plgpu, acc, rows_smem, wg_idx, out_tile, start, size)

        def epilogue(acc):
          if has_alpha:
            acc = acc * alpha_gmem[g]
          store(acc.astype(out_dtype))

        def mma_body(_, a_smem, b_smem, acc_ref):
          if vb_kn:
            b = b_smem.at[:, wg_n]
          else:
            b = b_smem.at[wg_n, :].transpose((1, 0))
          return mosaic_gemm.mma(acc_ref, a_smem, b)

        @pl.when((size > 0) & (g < num_groups))
        def _gemm():
          gc = jnp.minimum(g, num_groups - 1)
          get_pipeline(mma_body, mosaic_gemm.accumulate((tile_m, tile_n),
                                                        epilogue))(
              a_gmem.at[cta_m, :],
              b_gmem.at[gc, :, cta_n_ds] if vb_kn else b_gmem.at[gc, cta_n_ds,
                                                                :],
              allocations=pipeline_allocs)

        # Rows past the groups' sum: zeros, stored by the compute warpgroups.
        @pl.when((size > 0) & (g >= num_groups) & (wg_idx < 2))
        def _zero():
          store(_zeros(plgpu, (tile_m, tile_n), out_dtype))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  f = mosaic_gemm.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      num_sms=num_sms, out_smem=_out_smem(plgpu, c, out_dtype, True))
  args = (seg, row0, lo, hi, va, vb) + ((alpha,) if has_alpha else ())
  return f(*args)


def ragged_values_matmul_t(va: jax.Array, vb: jax.Array,
                           group_sizes: jax.Array,
                           alpha: jax.Array | None = None, *,
                           out_dtype=jnp.float32, tokens_last: bool = True,
                           config: Config | None = None,
                           num_sms: int | None = None) -> jax.Array:
  """Group `e`'s tokens contracted: `[E, K, N]`, times `alpha[e]`.

  `tokens_last`: `va [K, M]`, `vb [N, M]`, `out[e] = va[:, rows_e] @
  vb[:, rows_e].T`; else `va [M, K]`, `vb [M, N]`, `out[e] = va[rows_e].T
  @ vb[rows_e]`. An empty group gives zeros.

  Raises:
    NotImplementedError: not on a Hopper GPU, other dtypes, K or N off 64.
  """
  what = "ragged_values_matmul_t"
  c = config or Config()
  if num_sms is None:
    num_sms = mosaic_gemm.check_device(what)
  _check_dtypes(what, va, vb, out_dtype, group_sizes)
  if tokens_last:
    (k, m), (n, m2) = va.shape, vb.shape
  else:
    (m, k), (m2, n) = va.shape, vb.shape
  if m != m2:
    raise ValueError(f"{what}: token counts differ: va {va.shape}, vb "
                     f"{vb.shape} (tokens_last={tokens_last}).")
  if k % 64 or n % 64 or (m % 8 and not tokens_last):
    raise NotImplementedError(
        f"{what}: K={k} and N={n} must be multiples of 64 and M={m} of 8 "
        "(the kernel's tiles); the reference runs it.")
  e = group_sizes.shape[0]
  gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(gs), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  pad = -m % c.tile_k
  if tokens_last and pad:
    # TMA tiles the tokens (the minor dimension) by `tile_k`: pad them (a
    # copy of both operands; callers avoid it with M a multiple of 64).
    va = jnp.pad(va, ((0, 0), (0, pad)))
    vb = jnp.pad(vb, ((0, 0), (0, pad)))
  return _wgrad_call(starts, ends, va, vb, _alpha(alpha, e),
                     out_dtype=jnp.dtype(out_dtype), tokens_last=tokens_last,
                     config=c, num_sms=num_sms)


# Jitted so that identical calls (every layer of a model) trace and lower
# the kernel once: JAX reuses one lowered function for them.
@functools.partial(jax.jit, static_argnames=("out_dtype", "tokens_last", "config", "num_sms"))
def _wgrad_call(starts, ends, va, vb, alpha, *, out_dtype, tokens_last,
                config: Config, num_sms):
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  c = config
  num_groups = starts.shape[0]
  if tokens_last:
    (k, _), (n, _) = va.shape, vb.shape
  else:
    (_, k), (_, n) = va.shape, vb.shape
  tile_m, tile_n, tk = c.tile_m, c.tile_n, c.tile_k
  cta_n = c.cta_n
  m_iters, n_iters = pl.cdiv(k, tile_m), pl.cdiv(n, cta_n)
  # Token-major tiles ([tk, tile]) are swizzled along their long side.
  a_transforms = mosaic_gemm.swizzled((tk if tokens_last else tile_m) * 2,
                                      "operand")
  b_transforms = mosaic_gemm.swizzled((tk if tokens_last else tile_n) * 2,
                                      "operand")
  steps = mosaic_gemm.concurrent_steps(c, out_dtype)
  has_alpha = alpha is not None

  def specs(first, m_idx, n_idx):
    if tokens_last:
      return [plgpu.BlockSpec((tile_m, tk), lambda s: (m_idx, first + s),
                              transforms=a_transforms),
              plgpu.BlockSpec((cta_n, tk), lambda s: (n_idx, first + s),
                              transforms=b_transforms)]
    return [plgpu.BlockSpec((tk, tile_m), lambda s: (first + s, m_idx),
                            transforms=a_transforms),
            plgpu.BlockSpec((tk, cta_n), lambda s: (first + s, n_idx),
                            transforms=b_transforms)]

  def kernel(starts_gmem, ends_gmem, a_gmem, b_gmem, *rest, out_smem):
    if has_alpha:
      alpha_gmem, out_gmem = rest
    else:
      alpha_gmem, (out_gmem,) = None, rest

    def get_pipeline(body, compute_context, grid, first, m_idx, n_idx):
      return mosaic_gemm.pipeline(
          body, compute_context, grid=grid,
          in_specs=specs(first, m_idx, n_idx),
          steps=steps)

    zero = jnp.int32(0)

    @mosaic_gemm.with_allocations(
        lambda body, context: get_pipeline(body, context, (steps,), zero,
                                           zero, zero), a_gmem, b_gmem)
    def _scope(pipeline_allocs):
      wg_idx = lax.axis_index("wg")

      @plgpu.nd_loop((num_groups * m_iters * n_iters,),
                     collective_axes="cluster_grid")
      def _loop(info):
        (lin,) = info.index
        g = lin // (m_iters * n_iters)
        m_idx, n_idx = plgpu.planar_snake(lin % (m_iters * n_iters),
                                          (m_iters, n_iters), 1,
                                          c.grid_tile_width)
        start = starts_gmem[g]
        end = ends_gmem[g]
        first = start // tk
        num_steps = (end + tk - 1) // tk - first
        wg_n = pl.ds(wg_idx * tile_n, tile_n)
        out_tile = out_gmem.at[g, pl.ds(m_idx * tile_m, tile_m),
                               pl.ds(n_idx * cta_n, cta_n)].at[:, wg_n]

        def epilogue(acc):
          if has_alpha:
            acc = acc * alpha_gmem[g]
          mosaic_gemm.store_output(acc.astype(out_dtype), out_smem, wg_idx,
                                   out_tile)

        def mask_tokens(b_smem, s):
          """Zeroes the tokens outside [start, end) of this warpgroup's half
          of the `vb` tile (a group's first and last step only)."""
          tok0 = (first + s) * tk
          lo, hi = start - tok0, end - tok0

          @pl.when((lo > 0) | (hi < tk))
          def _mask():
            for w in range(2):
              cols = slice(w * tile_n, (w + 1) * tile_n)
              ref = b_smem.at[cols, :] if tokens_last else b_smem.at[:, cols]
              shape = (tile_n, tk) if tokens_last else (tk, tile_n)

              @pl.when(wg_idx == w)
              def _half(ref=ref, shape=shape):
                idx = plgpu.layout_cast(
                    lax.broadcasted_iota(jnp.int32, shape,
                                         1 if tokens_last else 0),
                    plgpu.Layout.WGMMA)
                keep = (idx >= lo) & (idx < hi)
                ref[...] = ref[...] * keep.astype(ref.dtype)
                plgpu.commit_smem()

        def mma_body(idx, a_smem, b_smem, acc_ref):
          (s,) = idx
          mask_tokens(b_smem, s)
          a = a_smem if tokens_last else a_smem.transpose((1, 0))
          if tokens_last:
            b = b_smem.at[wg_n, :].transpose((1, 0))
          else:
            b = b_smem.at[:, wg_n]
          return mosaic_gemm.mma(acc_ref, a, b)

        @pl.when(end > start)
        def _gemm():
          get_pipeline(mma_body,
                       mosaic_gemm.accumulate((tile_m, tile_n), epilogue),
                       (num_steps,), first, m_idx, n_idx)(
                           a_gmem, b_gmem, allocations=pipeline_allocs)

        @pl.when((end <= start) & (wg_idx < 2))
        def _empty():
          mosaic_gemm.store_output(_zeros(plgpu, (tile_m, tile_n), out_dtype),
                                   out_smem, wg_idx, out_tile)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  f = mosaic_gemm.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
      num_sms=num_sms, out_smem=_out_smem(plgpu, c, out_dtype, False))
  args = (starts, ends, va, vb) + ((alpha,) if has_alpha else ())
  return f(*args)
