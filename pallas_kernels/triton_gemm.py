"""NVFP4 x NVFP4 GEMM through jax-triton: `tl.dot_scaled` on FP4 tensor cores.

`a @ b.T` for two `NVFP4Array`s quantized along K, FP32 accumulation, the
tensor scales applied as one FP32 `alpha` at the end (as cuBLASLt/TE do).
Operands are consumed as stored: packed E2M1 bytes (element `2k` in the low
nibble, which is also `tl.dot_scaled`'s packing) and E4M3 block scales
`[rows, K/16]`.

- `native=True`: `tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1")`. On Blackwell
  this is the block-scaled FP4 MMA. On Hopper Triton decomposes it (upcast to
  bf16, scale, bf16 MMA), if this Triton version can (NVFP4 scales in the
  decomposition are recent).
- `native=False`: the same kernel with the decomposition written out (decode
  the nibbles, multiply by the scale, bf16 `tl.dot`): exact, slow, for GPUs
  whose Triton cannot decompose `dot_scaled` with E4M3 scales.

jax-triton and triton are imported lazily: they are GPU-only extras.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nvfp4_jax.nvfp4 import NVFP4Array
from pallas_kernels import common


@functools.lru_cache(maxsize=None)
def _kernel():
  import triton  # pylint: disable=g-import-not-at-top
  import triton.language as tl  # pylint: disable=g-import-not-at-top

  @triton.jit
  def _decode(packed, scale, ROWS: tl.constexpr, BK: tl.constexpr):
    # packed uint8 [ROWS, BK/2], scale fp8 [ROWS, BK/16] -> bf16 [ROWS, BK]
    c = tl.join(packed & 0xF, packed >> 4).reshape(ROWS, BK).to(tl.int32)
    m = c & 7
    mf = m.to(tl.float32)
    mag = tl.where(m < 4, 0.5 * mf, tl.where(m < 6, mf - 2.0, 2.0 * mf - 8.0))
    val = tl.where((c & 8) != 0, -mag, mag)
    s = scale.to(tl.float32)
    val = val.reshape(ROWS, BK // 16, 16) * s[:, :, None]
    return val.reshape(ROWS, BK).to(tl.bfloat16)

  @triton.jit
  def nvfp4_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, alpha_ptr, c_ptr,
                        M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        NATIVE: tl.constexpr):
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
    kp = tl.arange(0, BLOCK_K // 2)
    ks = tl.arange(0, BLOCK_K // 16)
    a_ptrs = a_ptr + rows_a[:, None] * (K // 2) + kp[None, :]
    as_ptrs = as_ptr + rows_a[:, None] * (K // 16) + ks[None, :]
    bs_ptrs = bs_ptr + rows_b[:, None] * (K // 16) + ks[None, :]
    if NATIVE:
      b_ptrs = b_ptr + rows_b[None, :] * (K // 2) + kp[:, None]  # [BK/2, BN]
    else:
      b_ptrs = b_ptr + rows_b[:, None] * (K // 2) + kp[None, :]  # [BN, BK/2]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K // BLOCK_K):
      a = tl.load(a_ptrs)
      b = tl.load(b_ptrs)
      sa = tl.load(as_ptrs)
      sb = tl.load(bs_ptrs)
      if NATIVE:
        acc = tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1", acc)
      else:
        va = _decode(a, sa, BLOCK_M, BLOCK_K)
        vb = _decode(b, sb, BLOCK_N, BLOCK_K)
        acc = tl.dot(va, tl.trans(vb), acc)
      a_ptrs += BLOCK_K // 2
      b_ptrs += BLOCK_K // 2
      as_ptrs += BLOCK_K // 16
      bs_ptrs += BLOCK_K // 16
    alpha = tl.load(alpha_ptr)
    out = acc * alpha
    c_ptrs = c_ptr + offs_m[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)

  return nvfp4_gemm_kernel


def default_native() -> bool:
  """`tl.dot_scaled` where the hardware has FP4 MMA (sm_100+)."""
  cc = common.compute_capability()
  return cc is not None and cc >= (10, 0)


def block_scaled_matmul(a: NVFP4Array, b: NVFP4Array, alpha: jax.Array, *,
                        out_dtype=jnp.float32, native: bool | None = None,
                        block_m: int = 128, block_n: int = 128,
                        block_k: int = 128, num_warps: int = 8,
                        num_stages: int = 3) -> jax.Array:
  """`(a @ b.T) * alpha` on NVFP4 operands `a: [M, K]`, `b: [N, K]`.

  Raises:
    NotImplementedError: not on a GPU, jax-triton missing, MX operands, or K
      not a multiple of 32.
  """
  if common.backend() != "gpu":
    raise NotImplementedError(
        "the jax-triton NVFP4 GEMM runs on NVIDIA GPUs only; use "
        "implementation='xla' (or 'pallas') elsewhere.")
  if not (isinstance(a, NVFP4Array) and isinstance(b, NVFP4Array)):
    raise NotImplementedError("the triton GEMM takes NVFP4Arrays only.")
  try:
    import jax_triton as jt  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise NotImplementedError(
        "implementation='triton' needs jax-triton (pip install "
        "'nvfp4-jax[gpu]').") from e
  (m, k), (n, _) = a.shape, b.shape
  if k % 32:
    raise NotImplementedError(
        f"the FP4 GEMM needs K to be a multiple of 32, got K={k}.")
  bk = block_k
  while k % bk:
    bk //= 2
  native = default_native() if native is None else native
  grid = (common.cdiv(m, block_m) * common.cdiv(n, block_n),)
  return jt.triton_call(
      a.codes, a.scales, b.codes, b.scales,
      jnp.reshape(alpha.astype(jnp.float32), (1,)),
      kernel=_kernel(),
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=grid, num_warps=num_warps, num_stages=num_stages,
      M=m, N=n, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
      GROUP_M=8, NATIVE=bool(native))
