"""Pallas Mosaic GPU kernel of `nvfp4_jax.block_values_matmul` (Hopper).

The exact emulation's GEMM: `(va @ vb.T) * alpha` (or `va @ vb` with
`vb_kn`) on bf16 block values, FP32 accumulation, `alpha` multiplied into
the FP32 accumulator in the epilogue, then one cast. The same arithmetic as
the reference (`lax.dot_general` with FP32 accumulation, then `* alpha` and
the cast): every product is exact in FP32, and only the summation order of
the accumulation can differ.

The pipeline is JAX's Hopper matmul
(`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`, Apache-2.0), shared
with the grouped GEMMs (`pallas_kernels.mosaic_gemm`): TMA loads into
128-byte-swizzled shared memory, a warp-specialized pipeline (one memory
warpgroup, two wgmma warpgroups), a persistent grid walking the output
tiles in a planar snake, and a TMA-stored epilogue. Added here: the
`alpha` epilogue and `vb` in either layout (`[N, K]`, read transposed by
wgmma, or `[K, N]`). On the H100 it ran 0-12% faster than XLA's GEMM at the
Fprop and Dgrad shapes of GPT base and at 8192 x 4096 x 4096, and slower
where K is long and the output small (Wgrad: XLA splits K). `supported`
keeps it to the calls it is measured to win (BENCHMARKS.md); the dispatch
falls back to XLA's GEMM for the rest.

Mosaic GPU has no interpret mode: on the CPU this raises
`NotImplementedError` (the dispatch then runs the reference); the kernel is
lowered for CUDA in the CPU tests and compiled and compared with the
reference in the GPU tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from nvfp4_jax.ops.block_scaled_matmul.config import Config
from nvfp4_jax.ops.block_scaled_matmul.config import MIN_WAVES
from nvfp4_jax.ops.block_scaled_matmul.config import cta_tile
from pallas_kernels import mosaic_gemm


H100_SMS = 132


def supported(m: int, n: int, k: int, config: Config | None = None,
              num_sms: int = H100_SMS) -> bool:
  """Whether the kernel runs `[m, k] x [k, n]` and is expected to win."""
  c = config or Config()
  tm, tn = c.cta_tile
  if m % tm or n % tn or k % c.tile_k:
    return False
  return (m // tm) * (n // tn) >= MIN_WAVES * num_sms


def values_matmul(va: jax.Array, vb: jax.Array, alpha: jax.Array, *,
                  out_dtype=jnp.float32, vb_kn: bool = False,
                  config: Config | None = None,
                  num_sms: int | None = None) -> jax.Array:
  """`(va @ vb.T) * alpha` (`va @ vb` with `vb_kn`), FP32 accumulation.

  Args:
    va: bf16 `[M, K]`.
    vb: bf16 `[N, K]`, or `[K, N]` with `vb_kn`.
    alpha: FP32 scalar, multiplied into the FP32 accumulator.
    out_dtype: float32 or bfloat16.
    config: tiles (default `Config()`).
    num_sms: the persistent grid's size; the device's SM count when None
      (given only to lower the kernel without a GPU).

  Raises:
    NotImplementedError: not on a Hopper GPU, or a call `supported` turns
      down (other dtypes, shapes off the tiles, too few output tiles).
  """
  c = config or Config()
  if num_sms is None:
    num_sms = mosaic_gemm.check_device("values_matmul")
  m, k = va.shape
  n = vb.shape[1] if vb_kn else vb.shape[0]
  mosaic_gemm.check_operands("values_matmul", va, vb, out_dtype)
  if not supported(m, n, k, c, num_sms):
    raise NotImplementedError(
        f"values_matmul: [{m}, {k}] x [{k}, {n}] is off the {c.cta_tile} x "
        f"{c.tile_k} tiles or has fewer than {MIN_WAVES} x {num_sms} output "
        "tiles; XLA's GEMM runs it.")
  return _call(va, vb, jnp.reshape(alpha, ()).astype(jnp.float32),
               out_dtype=jnp.dtype(out_dtype), vb_kn=vb_kn, config=c,
               num_sms=num_sms)


def output_tile(lin, grid, minor, config, wg_idx):
  """The persistent grid's `lin`-th output tile, walked in a planar snake
  over `grid` (M tiles, N tiles) with `minor` (a `MatmulDimension`) the
  minor dimension: `(cta_m, cta_n, wg_m, wg_n)`, the CTA's rows and columns
  of the output and warpgroup `wg_idx`'s within them. `config` has
  `tile_m`, `tile_n` (a warpgroup's tile), `wg_split_n` and
  `grid_tile_width` (`Config`, and the decode probe's)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  c = config
  cta_m_size, cta_n_size = cta_tile(c)
  m_idx, n_idx = plgpu.planar_snake(lin, grid, minor, c.grid_tile_width)
  cta_m = pl.ds(m_idx * cta_m_size, cta_m_size)
  cta_n = pl.ds(n_idx * cta_n_size, cta_n_size)
  if c.wg_split_n:
    return cta_m, cta_n, slice(None), pl.ds(wg_idx * c.tile_n, c.tile_n)
  return cta_m, cta_n, pl.ds(wg_idx * c.tile_m, c.tile_m), slice(None)


# Jitted so that identical calls (every layer of a model) trace and lower
# the kernel once: JAX reuses one lowered function for them.
@functools.partial(jax.jit, static_argnames=("out_dtype", "vb_kn", "config", "num_sms"))
def _call(va, vb, alpha, *, out_dtype, vb_kn, config: Config, num_sms):
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  c = config
  m, k = va.shape
  n = vb.shape[1] if vb_kn else vb.shape[0]
  tile_m, tile_n, tile_k, e = c.tile_m, c.tile_n, c.tile_k, c.epi_tile
  cta_m_size, cta_n_size = c.cta_tile
  m_iters, n_iters, k_iters = m // cta_m_size, n // cta_n_size, k // tile_k
  transforms = mosaic_gemm.swizzled(tile_k * 2, "operands")
  b_transforms = mosaic_gemm.swizzled((tile_n if vb_kn else tile_k) * 2, "vb")
  slots = mosaic_gemm.epilogue_slots(c)
  steps = mosaic_gemm.concurrent_steps(c, out_dtype)
  if vb_kn:
    b_spec = plgpu.BlockSpec((tile_k, cta_n_size), lambda s: (s, 0),
                             transforms=b_transforms,
                             memory_space=plgpu.SMEM)
  else:
    b_spec = plgpu.BlockSpec((cta_n_size, tile_k), lambda s: (0, s),
                             transforms=b_transforms,
                             memory_space=plgpu.SMEM)

  def kernel(a_gmem, b_gmem, alpha_gmem, out_gmem, out_smem):
    def get_pipeline(body, compute_context):
      return mosaic_gemm.pipeline(
          body, compute_context, grid=(k_iters,),
          in_specs=[plgpu.BlockSpec((cta_m_size, tile_k), lambda s: (0, s),
                                    transforms=transforms,
                                    memory_space=plgpu.SMEM),
                    b_spec],
          steps=steps)

    @mosaic_gemm.with_allocations(get_pipeline, a_gmem, b_gmem)
    def _scope(pipeline_allocs):
      wg_idx = lax.axis_index("wg")

      @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
      def _mn_loop(info):
        (lin,) = info.index
        # N minor (JAX's MatmulDimension.N).
        cta_m, cta_n, wg_m, wg_n = output_tile(lin, (m_iters, n_iters), 1, c,
                                               wg_idx)

        def epilogue(acc):
          # alpha: one scalar load from GMEM (a 0-d operand; no copy into
          # SMEM, no broadcast kernel before the call).
          mosaic_gemm.store_output((acc * alpha_gmem[...]).astype(out_dtype),
                                   out_smem, wg_idx,
                                   out_gmem.at[cta_m, cta_n].at[wg_m, wg_n])

        def mma_body(_, a_smem, b_smem, acc_ref):
          if vb_kn:
            b = b_smem.at[:, wg_n]
          else:
            b = b_smem.at[wg_n, :].transpose((1, 0))
          return mosaic_gemm.mma(acc_ref, a_smem.at[wg_m], b)

        get_pipeline(mma_body, mosaic_gemm.accumulate((tile_m, tile_n),
                                                      epilogue))(
            a_gmem.at[cta_m, :],
            b_gmem.at[:, cta_n] if vb_kn else b_gmem.at[cta_n, :],
            allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  f = mosaic_gemm.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      num_sms=num_sms,
      out_smem=mosaic_gemm.output_smem(slots, e, out_dtype))
  return f(va, vb, alpha)
