"""The Mosaic GPU GEMMs' shared tiles and pipeline (Hopper: wgmma is sm_90).

The dense values GEMM (`ops/block_scaled_matmul/pallas_mosaic_gpu.py`) and
the grouped ones (`ops/ragged_dot/pallas_mosaic_gpu.py`) run one pipeline,
JAX's Hopper matmul's (`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`,
Apache-2.0): TMA loads into swizzled shared memory, a warp-specialized
pipeline (one memory warpgroup, two wgmma warpgroups), a persistent grid and
a TMA-stored epilogue. What they share is here: the tile config's fields
(`GemmConfig`, which each op's `Config` extends), the device and operand
checks, the operand tiles' swizzle, the pipeline and its allocations, the
FP32 accumulator, the epilogue's shared memory and stores, and the kernel's
launch.

Mosaic GPU has no interpret mode: the kernels are lowered for CUDA in the
CPU tests and run on a Hopper GPU. Its module is imported where a kernel is
built, as in the ops' files.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from nvfp4_jax.core import dispatch


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmConfig:
  """Tiles of one compute warpgroup and the pipeline's depth.

  Attributes:
    tile_m, tile_n: a warpgroup's output tile.
    tile_k: the contraction step.
    max_concurrent_steps: steps in flight in shared memory; None: 4 with a
      bf16 output, 3 with FP32 (its epilogue tiles take the fourth's room).
    grid_tile_width: width of the planar snake over output tiles.
    epi_tile: square epilogue tile written through shared memory.
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  max_concurrent_steps: int | None = None
  grid_tile_width: int = 8
  epi_tile: int = 64


def check_device(what: str) -> int:
  """The GPU's SM count; NotImplementedError off Hopper (wgmma is sm_90).
  `what` names the kernel in the message."""
  if dispatch.platform() != "gpu":
    raise NotImplementedError(
        f"{what}: a Mosaic GPU kernel (no interpret mode); the platform is "
        f"{dispatch.platform()}. Use implementation='xla' (None falls back "
        "to it).")
  cc = dispatch.compute_capability()
  if cc is None or cc[0] != 9:
    raise NotImplementedError(
        f"{what}: wgmma needs compute capability 9.x, got {cc}. Use "
        "implementation='xla' (None falls back to it).")
  try:
    return jax.devices("gpu")[0].core_count
  except (RuntimeError, IndexError, AttributeError) as e:
    raise NotImplementedError(f"{what}: no GPU device to run on ({e}).") from e


def check_operands(what: str, va: jax.Array, vb: jax.Array, out_dtype
                   ) -> None:
  """NotImplementedError unless both operands are bf16 and `out_dtype` is
  float32 or bfloat16."""
  if va.dtype != jnp.bfloat16 or vb.dtype != jnp.bfloat16:
    raise NotImplementedError(
        f"{what}: bf16 operands only, got {va.dtype}, {vb.dtype}.")
  if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32),
                                  jnp.dtype(jnp.bfloat16)):
    raise NotImplementedError(
        f"{what}: out_dtype float32 or bfloat16, got {out_dtype}.")


def concurrent_steps(config: GemmConfig, out_dtype) -> int:
  """The pipeline's steps in flight: `config.max_concurrent_steps`, else 4
  with a bf16 output and 3 with FP32."""
  return config.max_concurrent_steps or (
      4 if jnp.dtype(out_dtype).itemsize == 2 else 3)


def swizzled(minor_bytes: int, what: str):
  """The transforms of a bf16 operand tile in shared memory whose minor
  dimension holds `minor_bytes` bytes: 8-row tiles under the largest
  swizzle that divides it (`what` names the operand in an error)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  swizzle = plgpu.find_swizzle(minor_bytes * 8, what)
  return (plgpu.TilingTransform((8, swizzle // 2)),
          plgpu.SwizzleTransform(swizzle))


def pipeline(body: Callable, compute_context: Callable, *, grid, in_specs,
             steps: int):
  """The warp-specialized pipeline of `body` over `grid`: one memory
  warpgroup (40 registers) loading the `in_specs` tiles by TMA, the two
  compute warpgroups (axis "wg") running `body` in `compute_context`,
  `steps` steps in flight."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  return plgpu.emit_pipeline_warp_specialized(
      body, grid=grid, memory_registers=40,
      in_specs=in_specs,
      wg_axis="wg", num_compute_wgs=2,
      max_concurrent_steps=steps,
      compute_context=compute_context)


def with_allocations(make_pipeline: Callable, *refs):
  """Decorator: runs the function with `pipeline_allocs`, the shared
  memory of the pipeline `make_pipeline(body, compute_context)` makes on
  the GMEM `refs`, allocated once for all warpgroups, so that every
  pipeline the persistent loop runs reuses it."""
  ignore = lambda *_, **__: None
  return functools.partial(
      pl.run_scoped,
      pipeline_allocs=make_pipeline(ignore, ignore).get_allocations(*refs),
      collective_axes="wg")


def accumulate(shape: tuple[int, int], epilogue: Callable) -> Callable:
  """A pipeline's `compute_context`: a compute warpgroup's FP32 wgmma
  accumulator of `shape`, the pipeline run into it, then `epilogue` of its
  value (the warpgroup's output tile, FP32)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top

  def compute_context(eval_pipeline):
    @functools.partial(pl.run_scoped,
                       acc_ref=plgpu.ACC(shape, jnp.float32))
    def _acc(acc_ref):
      eval_pipeline(acc_ref)
      epilogue(acc_ref[...])
  return compute_context


def mma(acc_ref, a, b):
  """One pipeline step of a compute warpgroup: `acc_ref += a @ b` by
  wgmma, waited for; returns `acc_ref` (the pipeline's carry)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  plgpu.wgmma(acc_ref, a, b)
  plgpu.wgmma_wait(0)
  return acc_ref


def epilogue_slots(config: GemmConfig) -> int:
  """`output_smem`'s slots per compute warpgroup: two square epilogue
  tiles, or as many as the warpgroup's output tile holds if fewer."""
  e = config.epi_tile
  return min(2, (config.tile_m * config.tile_n) // (e * e))


def output_smem(slots: int, epi_tile: int, out_dtype):
  """The epilogue's SMEM: `slots` swizzled `[epi_tile, epi_tile]` tiles per
  compute warpgroup (`store_output` writes through them)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  bits = jnp.dtype(out_dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(epi_tile * bits, "out")
  return plgpu.SMEM((2, slots, epi_tile, epi_tile), out_dtype,
                    transforms=(plgpu.TilingTransform((8, swizzle * 8 // bits)),
                                plgpu.SwizzleTransform(swizzle)))


def store_output(acc, out_smem, wg_idx, out_tile):
  """Writes a warpgroup's output tile `acc` (registers, the output dtype)
  to `out_tile` (its view of the output in GMEM) by TMA, in square pieces
  through its `out_smem` slots (`output_smem`), one store in flight while
  the next piece is staged."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  _, slots, e, _ = out_smem.shape
  tile_m, tile_n = acc.shape
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  for mi in range(tile_m // e):
    for ni in range(tile_n // e):
      ms, ns = slice(mi * e, (mi + 1) * e), slice(ni * e, (ni + 1) * e)
      slot = (mi * (tile_n // e) + ni) % slots
      plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
      out_smem[wg_idx, slot] = acc[ms, ns]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem.at[wg_idx, slot], out_tile.at[ms, ns])


def kernel(body: Callable, *, out_type, num_sms: int, out_smem):
  """`body` as a Mosaic GPU kernel: a persistent grid of `num_sms` CTAs
  (axis "cluster_grid"), each of 3 warpgroups (axis "wg": two compute, one
  memory) in Warpgroup semantics, `out_smem` (`output_smem`, or a union
  holding it) its epilogue's shared memory."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  return plgpu.kernel(
      body, out_type=out_type,
      grid=(num_sms,), grid_names=("cluster_grid",),
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      scratch_types=dict(out_smem=out_smem))
