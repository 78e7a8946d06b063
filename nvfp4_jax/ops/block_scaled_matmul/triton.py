"""`nvfp4_jax.block_scaled_matmul` through jax-triton: `tl.dot_scaled` on FP4 tensor cores.

`a @ b.T` for two `NVFP4Array`s quantized along K, FP32 accumulation, the
tensor scales applied as one FP32 `alpha` at the end (as cuBLASLt/TE do).
Operands are consumed as stored: packed E2M1 bytes (element `2k` in the low
nibble, which is also `tl.dot_scaled`'s packing) and E4M3 block scales
`[rows, K/16]`.

The K-loop multiplies with `tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1")`:
the block-scaled FP4 MMA of Blackwell (compute capability >= 10). Elsewhere
the kernel raises `NotImplementedError` and dispatch takes the exact
emulation ("pallas": block values + a bf16 GEMM), which is also the faster
path on Hopper (Triton 3.6 cannot decompose `dot_scaled` with E4M3 scales
there, and a K-loop that decodes the nibbles itself reached 22% of cuBLAS).
No E2M1 decode is written here: the hardware decodes.

jax-triton and triton are imported lazily: they are GPU-only extras.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nvfp4_jax.core.arrays import MXArray
from nvfp4_jax.core.arrays import NVFP4Array
from pallas_kernels import launch


@functools.lru_cache(maxsize=None)
def _kernel():
  import triton  # pylint: disable=g-import-not-at-top
  import triton.language as tl  # pylint: disable=g-import-not-at-top

  @triton.jit
  def nvfp4_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, alpha_ptr, c_ptr,
                        M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        FMT: tl.constexpr = "e2m1", PACK: tl.constexpr = 2,
                        SCALE_BLOCK: tl.constexpr = 16):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = offs_m % M  # Clamp reads; the store is masked.
    rows_b = offs_n % N
    kp = tl.arange(0, BLOCK_K // PACK)
    ks = tl.arange(0, BLOCK_K // SCALE_BLOCK)
    a_ptrs = a_ptr + rows_a[:, None] * (K // PACK) + kp[None, :]
    as_ptrs = as_ptr + rows_a[:, None] * (K // SCALE_BLOCK) + ks[None, :]
    bs_ptrs = bs_ptr + rows_b[:, None] * (K // SCALE_BLOCK) + ks[None, :]
    b_ptrs = b_ptr + rows_b[None, :] * (K // PACK) + kp[:, None]  # [BK/P, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K // BLOCK_K):
      a = tl.load(a_ptrs)
      b = tl.load(b_ptrs)
      sa = tl.load(as_ptrs)
      sb = tl.load(bs_ptrs)
      acc = tl.dot_scaled(a, sa, FMT, b, sb, FMT, acc)
      a_ptrs += BLOCK_K // PACK
      b_ptrs += BLOCK_K // PACK
      as_ptrs += BLOCK_K // SCALE_BLOCK
      bs_ptrs += BLOCK_K // SCALE_BLOCK
    alpha = tl.load(alpha_ptr)
    out = acc * alpha
    c_ptrs = c_ptr + offs_m[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)

  return nvfp4_gemm_kernel


# Compute capabilities where Triton 3.6 lowers `tl.dot_scaled` on E2M1
# operands with E4M3 scales to a block-scaled MMA, compiled ahead of time
# (`python -m benchmarks.check_device --target`): sm_100 and sm_103
# `tcgen05.mma ... kind::mxf4nvf4.block_scale.scale_vec::4X`, sm_120
# `mma.sync ... kind::mxf4nvf4.block_scale.scale_vec::4X` (SASS OMMA). On
# sm_121 (GB10), sm_110 and sm_90 TritonGPUAccelerateMatmul fails ("TTIR->TTGIR
# pass failed!"): a compile error at lowering, so dispatch must not pick it.
BLOCK_SCALED_MMA_CCS = ((10, 0), (10, 3), (12, 0))

# K is padded up to a multiple of this: with K = 32 (mod 64) the K loop's
# BLOCK_K would be 32, which fails to compile on sm_100/103/120 ("Instruction
# shape is too large" / "Invalid index"). Zero code bytes and zero scale
# bytes add exact zeros to every dot product.
K_MULTIPLE = 64


def _bytes(scales: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(scales, jnp.uint8)


def has_fp4_mma(cc: tuple[int, int] | None = None) -> bool:
  """Whether this kernel compiles to a block-scaled FP4 MMA on compute
  capability `cc` (default: the GPU dispatch targets)."""
  cc = launch.compute_capability() if cc is None else cc
  return cc is not None and tuple(cc) in BLOCK_SCALED_MMA_CCS


# MX operands (32-blocks): K padded to 128, four scale columns per step.
K_MULTIPLE_MX = 128


def padded_k(k: int, mx: bool = False) -> int:
  """The K the kernel runs: `k` rounded up to `K_MULTIPLE` (MX:
  `K_MULTIPLE_MX`)."""
  multiple = K_MULTIPLE_MX if mx else K_MULTIPLE
  return -(-k // multiple) * multiple


def pad_k(q, k: int):
  """`q` with K padded to `k` by zero elements (exact: they add zeros);
  NVFP4 scale bytes 0, MX scale bytes 127 (2^0: finite, unlike 0xFF)."""
  extra = k - q.shape[1]
  if not extra:
    return q
  if isinstance(q, NVFP4Array):
    return NVFP4Array(
        codes=jnp.pad(q.codes, ((0, 0), (0, extra // 2))),
        scales=jnp.pad(q.scales, ((0, 0), (0, extra // 16))), amax=q.amax)
  pack = 2 if q.fmt == "mxfp4" else 1
  scales = jax.lax.bitcast_convert_type(q.scales, jnp.uint8)
  scales = jnp.pad(scales, ((0, 0), (0, extra // 32)), constant_values=127)
  return MXArray(data=jnp.pad(q.data, ((0, 0), (0, extra // pack))),
                 scales=jax.lax.bitcast_convert_type(scales,
                                                     jnp.float8_e8m0fnu),
                 fmt=q.fmt)


def block_scaled_matmul(a, b, alpha: jax.Array, *,
                        out_dtype=jnp.float32, block_m: int = 128, block_n: int = 128,
                        block_k: int = 128, num_warps: int = 8,
                        num_stages: int = 3) -> jax.Array:
  """`(a @ b.T) * alpha` on block-scaled operands `a: [M, K]`, `b: [N, K]`:
  two `NVFP4Array`s (E2M1, E4M3 scales per 16) or two `MXArray`s of one
  format (MXFP4: E2M1, MXFP8: E4M3; UE8M0 scales per 32).

  Raises:
    NotImplementedError: not on a GPU where Triton compiles the block-scaled
      MMA (`BLOCK_SCALED_MMA_CCS`), jax-triton missing, or operands of two
      formats.
  """
  if launch.backend() != "gpu":
    raise NotImplementedError(
        "the jax-triton NVFP4 GEMM runs on NVIDIA GPUs only; use "
        "implementation='xla' (or 'pallas') elsewhere.")
  if not has_fp4_mma():
    raise NotImplementedError(
        f"implementation='triton' runs tl.dot_scaled on FP4 tensor cores, "
        f"which Triton compiles for compute capability "
        f"{', '.join(f'{a}.{b}' for a, b in BLOCK_SCALED_MMA_CCS)}; this GPU "
        f"is {launch.compute_capability()}. Use 'scaled_matmul' (cuDNN) or "
        f"'pallas' (the exact emulation).")
  mx = isinstance(a, MXArray)
  if not ((isinstance(a, NVFP4Array) and isinstance(b, NVFP4Array)) or (
      mx and isinstance(b, MXArray) and a.fmt == b.fmt)):
    raise NotImplementedError(
        "the triton GEMM takes two NVFP4Arrays or two MXArrays of one "
        "format.")
  try:
    import jax_triton as jt  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise NotImplementedError(
        "implementation='triton' needs jax-triton (pip install "
        "'nvfp4-jax[gpu]').") from e
  k = padded_k(a.shape[1], mx)
  a, b = pad_k(a, k), pad_k(b, k)
  (m, _), (n, _) = a.shape, b.shape
  bk = block_k
  while k % bk:
    bk //= 2
  grid = (launch.cdiv(m, block_m) * launch.cdiv(n, block_n),)
  cc = launch.compute_capability()
  if mx:  # UE8M0 scales reach Triton as bytes; no tensor scale.
    operands = [a.data, _bytes(a.scales), b.data, _bytes(b.scales)]
    fmt = dict(FMT="e2m1" if a.fmt == "mxfp4" else "e4m3",
               PACK=2 if a.fmt == "mxfp4" else 1, SCALE_BLOCK=32)
  else:
    operands = [a.codes, a.scales, b.codes, b.scales]
    fmt = dict(FMT="e2m1", PACK=2, SCALE_BLOCK=16)
  return jt.triton_call(
      *operands, jnp.reshape(alpha.astype(jnp.float32), (1,)),
      kernel=_kernel(),
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=grid, num_warps=num_warps, num_stages=num_stages,
      M=m, N=n, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
      GROUP_M=8, **fmt,
      # The GPU compiled for (dispatch.target_device when ahead of time).
      compute_capability=cc[0] * 10 + cc[1])
