"""Can a GEMM of our own decode NVFP4 in its prologue on Hopper, at cuBLAS speed?

XLA writes every decoded operand to memory before its GEMM reads it back
(`probe_prologue`). The lever left is a GEMM that decodes the codes and block
scales itself, between its shared-memory loads and wgmma: then no quantizer
writes bf16 values and no dequantize pass runs. JAX ships the pattern for
int8 x bf16 (`jax.experimental.pallas.ops.gpu.hopper_mixed_type_matmul_mgpu`:
TMA loads, a warp-specialized pipeline, the int8 tile converted in registers
before wgmma). This probe times, against XLA's GEMM on the values (cuBLAS or
its Triton GEMM fusion, same run):

1. JAX's int8 x bf16 kernel as shipped, and JAX's Mosaic GPU f16 matmul
   (both operands from shared memory), at a few tilings;
2. `decode_matmul`, the int8 kernel's pipeline with an E2M1 decode in place
   of its convert. `a` is one code per byte, pre-shifted to the high byte of
   an f16 (`code_bytes`), laid out `[K/16, M, 16]` with its E4M3 scales
   `[K/16, M]`, so each 16-wide K chunk of a tile is one plane. Per chunk:
   `f16(byte << 8) * 2^14` is the E2M1 value (`byte_values`), times the
   row's scale. Block values are exact in f16 (at most 6 significant bits,
   2^-10 <= |v| <= 2688), so the GEMM runs on f16 operands with FP32
   accumulation, as the emulation does on bf16. Variants (`Config`): four
   chunks assembled into one [tile_m, 64] register operand per wgmma (b on
   a 128-byte swizzle) or one wgmma per chunk (b on a 32-byte swizzle); the
   decoded group fed from registers or stored to shared memory first; and
   f16 values loaded in place of the codes (no decode: the structure's own
   cost).

  python -m benchmarks.archive.probe_decode_gemm [--shapes MxNxK,...]
      [--configs 0,2] [--no-stock]

Mosaic GPU kernels have no CPU interpret mode: on the CPU the kernel is only
lowered (tests/benchmarks/test_bench_tools.py), its decode checked in jnp.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.ops.block_scaled_matmul import pallas_mosaic_gpu as values_matmul
from nvfp4_jax.tools import timing
from pallas_kernels import mosaic_gemm

SHAPES = ((8192, 4096, 4096), (16384, 2048, 768), (16384, 768, 2048))


@dataclasses.dataclass(frozen=True)
class Config:
  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 128
  max_concurrent_steps: int = 4
  epi_tile: int = 64
  grid_minor_n: bool = True
  grid_tile_width: int = 8
  wg_split_n: bool = True  # The two compute warpgroups split N (else M).
  wait_each: bool = False  # wgmma_wait(0) after every chunk (else once).
  # `a` is already f16 values in the same [K/16, M, 16] planes (no decode):
  # the pipeline's own cost, to separate it from the decode's.
  a_values: bool = False
  # Assemble four decoded 16-wide chunks into one [tile_m, 64] register
  # array (register concatenation, no instructions) and issue one wgmma per
  # 64 of K, so b keeps its 128-byte swizzle. Else one wgmma per chunk with
  # b on a 32-byte swizzle.
  assemble: bool = True
  # Store the decoded [tile_m, 64] group into a swizzled SMEM buffer of the
  # warpgroup and let wgmma read both operands from SMEM (else a is fed to
  # wgmma from registers).
  a_smem: bool = False


def code_bytes(codes):
  """E2M1 codes (uint8, 0..15) -> the byte the kernel reads: the high byte
  of an f16 whose bit pattern, times 2^14, is the code's value."""
  codes = jnp.asarray(codes, jnp.uint8)
  return ((codes >> 3) << 7) | ((codes & 7) << 1)


def byte_values(byte):
  """The kernel's decode of `code_bytes` to f16 E2M1 values (a jnp function
  traced inside the kernel as well): `f16(byte << 8)` is the value times
  2^-14 (magnitudes 0 and 1 land in the f16 subnormals, exactly), so one
  multiply by 2^14 gives it."""
  bits = byte.astype(jnp.uint16) << 8
  return lax.bitcast_convert_type(bits, jnp.float16) * jnp.float16(2**14)


def decode_matmul(a_codes, a_scales, b, *, config: Config,
                  out_dtype=jnp.bfloat16, num_sms: int | None = None):
  """`(decode(a_codes, a_scales) @ b)` on Hopper: Pallas Mosaic GPU.

  a_codes: [K/16, M, 16] uint8, `sign << 7 | mag << 1` per E2M1 code;
  a_scales: [K/16, M] float8_e4m3fn; b: [K, N] float16 (block values).
  """
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mm  # pylint: disable=g-import-not-at-top
  kc, m, _ = a_codes.shape
  k, n = b.shape
  if kc * 16 != k or a_scales.shape != (kc, m):
    raise ValueError(
        f"a_codes {a_codes.shape}, a_scales {a_scales.shape} and b {b.shape}"
        " do not fit: want [K/16, M, 16], [K/16, M] and [K, N]")
  c = config
  tile_m, tile_n, tile_k = c.tile_m, c.tile_n, c.tile_k
  chunks = tile_k // 16
  cta_tile_m, cta_tile_n = values_matmul.cta_tile(c)
  if m % cta_tile_m or n % cta_tile_n or k % tile_k:
    raise ValueError(f"{(m, n, k)} not divisible by {(cta_tile_m, cta_tile_n, tile_k)}")
  m_iters, n_iters, k_iters = m // cta_tile_m, n // cta_tile_n, k // tile_k
  # wgmma issues K in groups of swizzle / 2 elements: a 32-byte swizzle on
  # b lets each 16-wide chunk (one block scale per row of a) be one wgmma.
  b_swizzle = plgpu.find_swizzle(tile_n * 16, "rhs") if c.assemble else 32
  group = b_swizzle // 2 // 16 if c.assemble else 1  # chunks per wgmma
  b_transforms = (plgpu.TilingTransform((8, b_swizzle // 2)),
                  plgpu.SwizzleTransform(b_swizzle))
  a_transforms = ((plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
                  if c.a_values else (plgpu.TilingTransform((8, 16)),))
  minor = mm.MatmulDimension.N if c.grid_minor_n else mm.MatmulDimension.M

  def kernel(a_gmem, s_gmem, b_gmem, out_gmem, out_smem, dec_smem=None):
    def get_pipeline(body, compute_context):
      return plgpu.emit_pipeline_warp_specialized(
          body, grid=(k_iters,), memory_registers=40,
          in_specs=[
              plgpu.BlockSpec((chunks, cta_tile_m, 16), lambda i: (i, 0, 0),
                              transforms=a_transforms,
                              memory_space=plgpu.SMEM),
              plgpu.BlockSpec((chunks, cta_tile_m), lambda i: (i, 0),
                              memory_space=plgpu.SMEM),
              plgpu.BlockSpec((tile_k, cta_tile_n), lambda i: (i, 0),
                              transforms=b_transforms,
                              memory_space=plgpu.SMEM),
          ],
          wg_axis="wg", num_compute_wgs=2,
          max_concurrent_steps=c.max_concurrent_steps,
          compute_context=compute_context)

    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(
            a_gmem, s_gmem, b_gmem),
        collective_axes="wg")
    def _scope(pipeline_allocs):
      wg_idx = lax.axis_index("wg")

      @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
      def _mn_loop(info):
        (lin,) = info.index
        cta_m, cta_n, wg_m, wg_n = values_matmul.output_tile(
            lin, (m_iters, n_iters), minor, c, wg_idx)

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped,
                             acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
          def _acc(acc_ref):
            eval_pipeline(acc_ref)
            mosaic_gemm.store_output(
                acc_ref[...].astype(out_dtype), out_smem, wg_idx,
                out_gmem.at[cta_m, cta_n].at[wg_m, wg_n])

        if group > 1:
          from jax.experimental.mosaic import gpu as mgpu  # pylint: disable=g-import-not-at-top
          wg_layout = plgpu.Layout.WGMMA

          @plgpu.inline_mgpu(
              arg_types=(wg_layout,) * group,
              return_type=plgpu.ShapeDtypeStruct((tile_m, 16 * group),
                                                 jnp.float16, wg_layout))
          def concat(_, *parts):
            regs = np.concatenate([q.registers for q in parts], axis=1)
            return mgpu.FragmentedArray(_registers=regs, _layout=parts[0].layout,
                                        _is_signed=None)

        def decode_chunk(a_smem, s_smem, j):
          if c.a_values:
            return a_smem[j, wg_m]
          v = byte_values(a_smem[j, wg_m])              # [tile_m, 16]
          s = s_smem[j, wg_m].astype(jnp.float16)     # [tile_m]
          return v * lax.broadcast_in_dim(s, (v.shape[0], 16), (0,))

        def mma_body(_, a_smem, s_smem, b_smem, acc_ref):
          if group > 1:
            for g in range(chunks // group):
              v = concat(*(decode_chunk(a_smem, s_smem, g * group + i)
                           for i in range(group)))
              if c.a_smem:
                dst = dec_smem.at[wg_idx, g % 2]
                dst[...] = v
                plgpu.commit_smem()
                v = dst
              plgpu.wgmma(acc_ref, v,
                          b_smem.at[pl.ds(16 * group * g, 16 * group), wg_n])
              if c.wait_each:
                plgpu.wgmma_wait(0)
            if not c.wait_each:
              plgpu.wgmma_wait(0)
            return acc_ref
          for j in range(chunks):
            v = decode_chunk(a_smem, s_smem, j)
            plgpu.wgmma(acc_ref, v, b_smem.at[pl.ds(16 * j, 16), wg_n])
            if c.wait_each:
              plgpu.wgmma_wait(0)
          if not c.wait_each:
            plgpu.wgmma_wait(0)
          return acc_ref

        get_pipeline(mma_body, compute_context)(
            a_gmem.at[:, cta_m], s_gmem.at[:, cta_m], b_gmem.at[:, cta_n],
            allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  if num_sms is None:
    num_sms = jax.devices()[0].core_count
  slots = min(2, (tile_m * tile_n) // (c.epi_tile * c.epi_tile))
  scratch = dict(out_smem=mosaic_gemm.output_smem(slots, c.epi_tile,
                                                 out_dtype))
  if c.a_smem:  # Two [tile_m, 64] f16 buffers per compute warpgroup.
    scratch["dec_smem"] = plgpu.SMEM(
        (2, 2, tile_m, 64), jnp.float16,
        transforms=(plgpu.TilingTransform((8, 64)),
                    plgpu.SwizzleTransform(128)))
  f = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(num_sms,), grid_names=("cluster_grid",),
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      scratch_types=scratch)
  return f(a_codes, a_scales, b)


def operands(m: int, n: int, k: int, seed: int):
  """Random NVFP4 `a` (codes, scales, their f16 values) and f16 `b`."""
  rng = np.random.default_rng(seed)
  codes = rng.integers(0, 16, size=(m, k), dtype=np.uint8)
  scale_bits = rng.integers(8, 120, size=(m, k // 16), dtype=np.uint8)
  scales = lax.bitcast_convert_type(jnp.asarray(scale_bits), jnp.float8_e4m3fn)
  values = (nm.e2m1_decode(jnp.asarray(codes)).reshape(m, k // 16, 16)
            * scales.astype(jnp.float32)[..., None]).reshape(m, k)
  byte = code_bytes(codes)
  a_codes = byte.reshape(m, k // 16, 16).transpose(1, 0, 2)
  b = jnp.asarray(rng.standard_normal((k, n), np.float32), jnp.float16)
  values = values.astype(jnp.float16)
  a_planes = values.reshape(m, k // 16, 16).transpose(1, 0, 2)
  return dict(values=values, a_codes=a_codes, a_planes=a_planes,
              a_scales=scales.T, b=b,
              a_i8=jnp.asarray(rng.integers(-128, 128, (m, k), np.int8)),
              b_bf16=b.astype(jnp.bfloat16))


def _xla_dot(a, b, out=jnp.float32):
  return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(out)


CONFIGS = (
    Config(tile_m=64, tile_n=256, tile_k=64, wg_split_n=False),  # Best.
    Config(tile_k=64),
    Config(tile_k=64, wg_split_n=False),
    Config(tile_m=64, tile_n=256, tile_k=128, wg_split_n=False,
           max_concurrent_steps=2),
    Config(tile_m=64, tile_n=256, tile_k=64, wg_split_n=False, a_smem=True,
           max_concurrent_steps=3),
    Config(tile_m=64, tile_n=256, tile_k=64, wg_split_n=False, a_values=True,
           max_concurrent_steps=3),
    Config(tile_k=64, a_values=True),
    Config(tile_k=64, assemble=False),
)


def run(shapes, configs, *, stock: bool = True):
  from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mm  # pylint: disable=g-import-not-at-top
  rows = []
  for m, n, k in shapes:
    sets = [operands(m, n, k, s) for s in range(2)]
    base_f = jax.jit(lambda a, b: _xla_dot(a, b, jnp.bfloat16))
    base = timing.bench(base_f, [(d["values"], d["b"]) for d in sets],
                        calls=5, reps=7)
    ref = np.asarray(jax.jit(_xla_dot)(sets[0]["values"], sets[0]["b"]))
    bf = jax.jit(lambda a, b: _xla_dot(a, b, jnp.bfloat16))
    t_bf = timing.bench(bf, [(d["values"].astype(jnp.bfloat16), d["b_bf16"])
                             for d in sets], calls=5, reps=7)
    shape = f"{m}x{n}x{k}"
    rows.append(dict(shape=shape, kernel="XLA f16 values, bf16 out",
                     us=round(base * 1e6, 1), vs_xla=1.0))
    rows.append(dict(shape=shape, kernel="XLA bf16 values, bf16 out",
                     us=round(t_bf * 1e6, 1), vs_xla=round(base / t_bf, 3)))
    print(rows[-2], rows[-1], flush=True)
    if stock:
      for tn, tk, wgd in itertools.product((64, 128), (64,), ("N", "M")):
        cfg = mm.TuningConfig(tile_m=128, tile_n=tn, tile_k=tk,
                              max_concurrent_steps=4, grid_tile_width=8,
                              wg_dimension=mm.MatmulDimension[wgd])
        try:
          f = jax.jit(functools.partial(mm.mixed_matmul_kernel,
                                        out_dtype=jnp.bfloat16, config=cfg))
          t = timing.bench(f, [(d["a_i8"], d["b_bf16"]) for d in sets],
                           calls=5, reps=7)
          rows.append(dict(shape=shape, kernel=f"JAX int8 x bf16 {tn}x{tk} wg{wgd}",
                           us=round(t * 1e6, 1), vs_xla=round(base / t, 3)))
        except Exception as e:  # pylint: disable=broad-except
          rows.append(dict(shape=shape, kernel=f"JAX int8 x bf16 {tn}x{tk} wg{wgd}",
                           error=str(e).splitlines()[0][:120]))
        print(rows[-1], flush=True)
    if stock:
      from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # pylint: disable=g-import-not-at-top
      for tn, wgd in itertools.product((128,), ("N", "M")):
        cfg = hm.TuningConfig(tile_m=128, tile_n=tn, tile_k=64,
                              max_concurrent_steps=4, grid_tile_width=8,
                              wg_dimension=hm.MatmulDimension[wgd])
        name = f"JAX Mosaic f16 matmul 128x{tn}x64 wg{wgd}"
        try:
          f = jax.jit(lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg))
          t = timing.bench(f, [(d["values"], d["b"]) for d in sets],
                           calls=5, reps=7)
          rows.append(dict(shape=shape, kernel=name, us=round(t * 1e6, 1),
                           vs_xla=round(base / t, 3)))
        except Exception as e:  # pylint: disable=broad-except
          rows.append(dict(shape=shape, kernel=name,
                           error=str(e).splitlines()[0][:120]))
        print(rows[-1], flush=True)
    for cfg in configs:
      name = (f"decode {cfg.tile_m}x{cfg.tile_n}x{cfg.tile_k} s{cfg.max_concurrent_steps}"
              f" wg{'N' if cfg.wg_split_n else 'M'}"
              f"{' wait-each' if cfg.wait_each else ''}"
              f"{'' if cfg.grid_minor_n else ' minorM'}"
              f"{' (f16 values, no decode)' if cfg.a_values else ''}"
              f"{'' if cfg.assemble else ' wgmma per chunk, b swizzle 32'}"
              f" w{cfg.grid_tile_width}"
              f"{' a decoded to SMEM' if cfg.a_smem else ''}")
      try:
        f = jax.jit(functools.partial(decode_matmul, config=cfg))
        a_key = "a_planes" if cfg.a_values else "a_codes"
        out = np.asarray(f(sets[0][a_key], sets[0]["a_scales"], sets[0]["b"])
                         .astype(jnp.float32))
        err = timing.max_rel_diff(out, ref)
        t = timing.bench(f, [(d[a_key], d["a_scales"], d["b"]) for d in sets],
                         calls=5, reps=7)
        rows.append(dict(shape=shape, kernel=name, us=round(t * 1e6, 1),
                         vs_xla=round(base / t, 3), rel_err=err))
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc()
        rows.append(dict(shape=shape, kernel=name,
                         error=str(e).splitlines()[0][:160]))
      print(rows[-1], flush=True)
  return rows


STEP_SHAPES = (
    # GPT base, 16 x 1024 tokens: Fprop, Dgrad, Wgrad of qkv, out, up, down.
    (16384, 2304, 768), (16384, 768, 768), (16384, 4096, 768),
    (16384, 768, 2048), (16384, 768, 2304), (16384, 768, 4096),
    (16384, 2048, 768), (768, 2304, 16384), (768, 768, 16384),
    (768, 4096, 16384), (2048, 768, 16384), (8192, 4096, 4096))


def mosaic_sweep(shapes):
  """XLA's GEMM against JAX's Mosaic GPU matmul on the same bf16 block
  values (`[M, K] @ [K, N]`, bf16 out), a few tilings each, one run."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # pylint: disable=g-import-not-at-top
  rows = []
  for m, n, k in shapes:
    sets = [operands(m, n, k, s) for s in range(2)]
    args = [(d["values"].astype(jnp.bfloat16), d["b_bf16"]) for d in sets]
    xla = jax.jit(lambda a, b: _xla_dot(a, b, jnp.bfloat16))
    ref = np.asarray(xla(*args[0]).astype(jnp.float32))
    t_xla = timing.bench(xla, args, calls=5, reps=7)
    row = dict(shape=f"{m}x{n}x{k}", xla_us=round(t_xla * 1e6, 1))
    best = None
    for tm, tn, wgd, width in ((128, 128, "N", 8), (128, 128, "M", 8),
                               (128, 64, "M", 8), (128, 128, "M", 4),
                               (64, 128, "M", 8)):
      cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64,
                            max_concurrent_steps=4, grid_tile_width=width,
                            wg_dimension=hm.MatmulDimension[wgd],
                            epi_tile_n=min(64, tn), epi_tile_m=min(64, tm))
      try:
        f = jax.jit(lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg))
        out = np.asarray(f(*args[0]).astype(jnp.float32))
        err = timing.max_rel_diff(out, ref)
        t = timing.bench(f, args, calls=5, reps=7)
      except Exception as e:  # pylint: disable=broad-except
        print(m, n, k, cfg, str(e).splitlines()[0][:120], flush=True)
        continue
      if best is None or t < best[0]:
        best = (t, f"{tm}x{tn} wg{wgd} w{width}", err)
    if best:
      row.update(mosaic_us=round(best[0] * 1e6, 1), config=best[1],
                 rel_err=best[2], xla_over_mosaic=round(t_xla / best[0], 3))
    rows.append(row)
    print(row, flush=True)
  return rows


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", default=None)
  p.add_argument("--configs", default=None,
                 help="comma-separated indices into CONFIGS")
  p.add_argument("--no-stock", action="store_true")
  p.add_argument("--mosaic-sweep", action="store_true",
                 help="only XLA's GEMM against JAX's Mosaic GPU matmul on "
                      "bf16 values, at GPT base's GEMM shapes (or --shapes)")
  a = p.parse_args()
  if a.mosaic_sweep:
    shapes = STEP_SHAPES if a.shapes is None else tuple(
        tuple(int(v) for v in s.split("x")) for s in a.shapes.split(","))
    print(jax.devices()[0].device_kind, jax.__version__)
    print(timing.table(mosaic_sweep(shapes), [
        "shape", "xla_us", "mosaic_us", "xla_over_mosaic", "config",
        "rel_err"]))
    return
  shapes = SHAPES if a.shapes is None else tuple(
      tuple(int(v) for v in s.split("x")) for s in a.shapes.split(","))
  configs = CONFIGS if a.configs is None else tuple(
      CONFIGS[int(i)] for i in a.configs.split(","))
  print(jax.devices()[0].device_kind, jax.__version__)
  rows = run(shapes, configs, stock=not a.no_stock)
  print(timing.table(rows, ["shape", "kernel", "us", "vs_xla", "rel_err",
                            "error"]))


if __name__ == "__main__":
  main()
