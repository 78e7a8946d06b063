"""The grouped NVFP4 GEMMs through jax-triton: `tl.dot_scaled` on FP4 tensor cores.

The grouped GEMMs of `nvfp4_jax.ragged_dot` on codes, as the block-scaled
FP4 MMA of Blackwell multiplies them (`tcgen05.mma ... kind::mxf4nvf4` on
compute capability 10.0 / 10.3), with FP32 accumulation and each group's
FP32 `alpha` multiplied into the accumulator before the one store, as the
dense kernel (`ops/block_scaled_matmul/triton.py`) does for one GEMM.
Operands are consumed as the grouped quantizers store them (`codes=True`):
packed E2M1 bytes (element `2k` in the low nibble, `tl.dot_scaled`'s
packing) and E4M3 scales per 16 elements along the contraction (a 16x16
weight tile's scale is replicated over its 16 rows, the per-row layout
`tl.dot_scaled` reads).

- `ragged_codes_matmul` (Fprop, Dgrad): `a [M, K]` ragged along M times
  `b [E, N, K]` (each group's `[N, K]`, quantized along K). The tile-to-group
  map of the Hopper kernel (`pallas_mosaic_gpu._tile_map`): one program per
  (map entry, N tile); an M tile holding rows of two groups is computed once
  per group and each stores its own rows; rows past the groups' sum are
  stored as zeros.
- `ragged_codes_matmul_t` (Wgrad): `a [K, L]`, `b [N, L]` quantized along
  the tokens `L`; group `e` contracts its tokens `[start_e, end_e)` into
  `out[e]` `[K, N]`. One program per (group, output tile); its K-loop runs
  over the group's token steps only, and in a step holding other tokens
  their codes (per token) and their blocks' scales (per block) are zeroed
  before the MMA: no other group's value, finite or not, enters.

The contraction is padded to a multiple of 64 (`K_MULTIPLE` of the dense
kernel: a 32-wide step does not compile on sm_100) with zero code and scale
bytes, which add exact zeros; Wgrad masks its token steps instead.

`native=False` runs the same kernel (the same map, pointers, masks and
epilogue) with the MMA replaced by an in-kernel decode of the codes to their
exact bf16 block values and a bf16 `tl.dot` (FP32 accumulation): the only
form of this kernel that runs on Hopper, where Triton 3.6 does not compile
`tl.dot_scaled` with E4M3 scales (`TritonGPUAccelerateMatmul` fails on
sm_90), so the kernel's plumbing is checked there against the reference.
Both forms multiply exact products: results differ from the reference only
in the FP32 summation order.

The default (`native=None`) runs only where `tl.dot_scaled` compiles to the
block-scaled MMA (`has_fp4_mma`: 10.0, 10.3; 12.0's `mma.sync` form too)
and raises `NotImplementedError` elsewhere (dispatch then falls back).
jax-triton and triton are imported lazily: they are GPU-only extras.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nvfp4_jax.ops.block_scaled_matmul import triton as dense
from nvfp4_jax.ops.ragged_dot.pallas_mosaic_gpu import _tile_map
from pallas_kernels import common


@functools.lru_cache(maxsize=None)
def _kernels():
  import triton  # pylint: disable=g-import-not-at-top
  import triton.language as tl  # pylint: disable=g-import-not-at-top

  @triton.jit
  def e2m1_bf16(c):
    """E2M1 codes (uint8 nibbles) to bf16: magnitude 2^(e-1) (1 + m/2) for
    e > 0, m/2 for e = 0, built as bf16 bits (exponent bias 127)."""
    mag = (c & 7).to(tl.uint16)
    bits = tl.where(mag >= 2, (mag << 6) + (126 << 7),
                    tl.where(mag == 1, 126 << 7, 0)).to(tl.uint16)
    bits = bits | ((c & 8).to(tl.uint16) << 12)
    return bits.to(tl.bfloat16, bitcast=True)

  @triton.jit
  def block_values(codes, scales, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Packed codes `[ROWS, COLS // 2]` and E4M3 scales `[ROWS, COLS //
    16]` to the exact bf16 block values `[ROWS, COLS]`."""
    v = tl.join(e2m1_bf16(codes & 0xF), e2m1_bf16(codes >> 4))
    v = tl.reshape(v, (ROWS, COLS // 16, 16)).to(tl.float32)
    v = v * scales.to(tl.float32)[:, :, None]
    return tl.reshape(v, (ROWS, COLS)).to(tl.bfloat16)

  @triton.jit
  def grouped_kernel(seg_ptr, row0_ptr, lo_ptr, hi_ptr, a_ptr, as_ptr, b_ptr,
                     bs_ptr, alpha_ptr, c_ptr,
                     M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                     E: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NATIVE: tl.constexpr, HAS_ALPHA: tl.constexpr):
    pid = tl.program_id(0)
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    t = pid // num_n
    pid_n = pid % num_n
    g = tl.load(seg_ptr + t)
    row0 = tl.load(row0_ptr + t)
    lo = tl.load(lo_ptr + t)
    hi = tl.load(hi_ptr + t)
    gc = tl.minimum(g, E - 1)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = offs_m % M  # Clamp reads; the store is masked.
    rows_b = offs_n % N
    kp = tl.arange(0, BLOCK_K // 2)
    ks = tl.arange(0, BLOCK_K // 16)
    b_base = b_ptr + gc.to(tl.int64) * (N * (K // 2))
    bs_base = bs_ptr + gc.to(tl.int64) * (N * (K // 16))
    a_ptrs = a_ptr + rows_a[:, None] * (K // 2) + kp[None, :]
    as_ptrs = as_ptr + rows_a[:, None] * (K // 16) + ks[None, :]
    bs_ptrs = bs_base + rows_b[:, None] * (K // 16) + ks[None, :]
    if NATIVE:
      b_ptrs = b_base + rows_b[None, :] * (K // 2) + kp[:, None]  # [BK/2, BN]
    else:
      b_ptrs = b_base + rows_b[:, None] * (K // 2) + kp[None, :]  # [BN, BK/2]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Map entries without rows, and the rows past the groups (segment E),
    # run no step.
    steps = tl.where((hi > lo) & (g < E), K // BLOCK_K, 0)
    for _ in range(0, steps):
      a = tl.load(a_ptrs)
      b = tl.load(b_ptrs)
      sa = tl.load(as_ptrs)
      sb = tl.load(bs_ptrs)
      if NATIVE:
        acc = tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1", acc)
      else:
        va = block_values(a, sa, BLOCK_M, BLOCK_K)
        vb = block_values(b, sb, BLOCK_N, BLOCK_K)
        acc = tl.dot(va, tl.trans(vb), acc)
      a_ptrs += BLOCK_K // 2
      b_ptrs += BLOCK_K // 2
      as_ptrs += BLOCK_K // 16
      bs_ptrs += BLOCK_K // 16
    if HAS_ALPHA:
      acc = acc * tl.load(alpha_ptr + gc)
    out = tl.where(g < E, acc, 0.0)
    c_ptrs = c_ptr + offs_m[:, None] * N + offs_n[None, :]
    mask = (((offs_m >= lo) & (offs_m < hi))[:, None]
            & (offs_n < N)[None, :])
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)

  @triton.jit
  def grouped_t_kernel(start_ptr, end_ptr, a_ptr, as_ptr, b_ptr, bs_ptr,
                       alpha_ptr, c_ptr,
                       K: tl.constexpr, N: tl.constexpr, L: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, NATIVE: tl.constexpr,
                       HAS_ALPHA: tl.constexpr):
    pid = tl.program_id(0)
    num_m = (K + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    g = pid // (num_m * num_n)
    rest = pid % (num_m * num_n)
    pid_m = rest // num_n
    pid_n = rest % num_n
    start = tl.load(start_ptr + g)
    end = tl.load(end_ptr + g)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = offs_m % K
    rows_b = offs_n % N
    kp = tl.arange(0, BLOCK_K // 2)
    ks = tl.arange(0, BLOCK_K // 16)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = start // BLOCK_K
    last = tl.where(end > start, (end + BLOCK_K - 1) // BLOCK_K, first)
    for s in range(first, last):
      byte = s * (BLOCK_K // 2) + kp          # Token pairs 2j, 2j + 1.
      blk = s * (BLOCK_K // 16) + ks          # Token blocks.
      tok = byte * 2
      keep_lo = (tok >= start) & (tok < end)
      keep_hi = (tok + 1 >= start) & (tok + 1 < end)
      keep_byte = tl.where(keep_lo, 0x0F, 0) | tl.where(keep_hi, 0xF0, 0)
      keep_blk = (blk * 16 + 16 > start) & (blk * 16 < end)
      in_l = byte < L // 2
      in_blk = blk < L // 16
      a = tl.load(a_ptr + rows_a[:, None] * (L // 2) + byte[None, :],
                  mask=in_l[None, :], other=0)
      a = a & keep_byte.to(tl.uint8)[None, :]
      sa = tl.load(as_ptr + rows_a[:, None] * (L // 16) + blk[None, :],
                   mask=(in_blk & keep_blk)[None, :], other=0.0)
      sb = tl.load(bs_ptr + rows_b[:, None] * (L // 16) + blk[None, :],
                   mask=(in_blk & keep_blk)[None, :], other=0.0)
      if NATIVE:
        b = tl.load(b_ptr + rows_b[None, :] * (L // 2) + byte[:, None],
                    mask=in_l[:, None], other=0)      # [BK/2, BN]
        acc = tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1", acc)
      else:
        b = tl.load(b_ptr + rows_b[:, None] * (L // 2) + byte[None, :],
                    mask=in_l[None, :], other=0)      # [BN, BK/2]
        va = block_values(a, sa, BLOCK_M, BLOCK_K)
        vb = block_values(b, sb, BLOCK_N, BLOCK_K)
        acc = tl.dot(va, tl.trans(vb), acc)
    if HAS_ALPHA:
      acc = acc * tl.load(alpha_ptr + g)
    out = tl.where(end > start, acc, 0.0)
    c_ptrs = (c_ptr + g.to(tl.int64) * (K * N) + offs_m[:, None] * N
              + offs_n[None, :])
    mask = (offs_m < K)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)

  return grouped_kernel, grouped_t_kernel


def _check(what: str, native: bool | None) -> bool:
  """Whether to run the block-scaled MMA (else the decode form)."""
  if common.backend() != "gpu":
    raise NotImplementedError(
        f"{what}: the jax-triton grouped NVFP4 GEMM runs on NVIDIA GPUs only; "
        f"use implementation='xla' elsewhere.")
  if native is None or native:
    if not dense.has_fp4_mma():
      raise NotImplementedError(
          f"{what}: implementation='triton' runs tl.dot_scaled on FP4 tensor "
          f"cores, which Triton compiles for compute capability "
          f"{', '.join(f'{a}.{b}' for a, b in dense.BLOCK_SCALED_MMA_CCS)}; "
          f"this GPU is {common.compute_capability()}. The grouped GEMM on "
          f"block values ('pallas', 'lax') runs elsewhere.")
    return True
  return False


def _jt(what: str):
  try:
    import jax_triton as jt  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise NotImplementedError(
        f"{what}: implementation='triton' needs jax-triton (pip install "
        f"'nvfp4-jax[gpu]').") from e
  return jt


def _check_operand(what, name, codes, scales, lead, cols):
  if (codes.dtype != jnp.uint8 or scales.dtype != jnp.float8_e4m3fn
      or codes.shape != (*lead, cols // 2)
      or scales.shape != (*lead, cols // 16)):
    raise ValueError(
        f"{what}: {name} must be packed E2M1 uint8 {(*lead, cols // 2)} and "
        f"E4M3 scales {(*lead, cols // 16)}, got {codes.dtype} {codes.shape} "
        f"and {scales.dtype} {scales.shape}.")


def _pad_k(codes, scales, k: int):
  """Zero code and scale bytes up to `k` along the last axis (exact)."""
  extra = k - codes.shape[-1] * 2
  if not extra:
    return codes, scales
  width = [(0, 0)] * (codes.ndim - 1)
  return (jnp.pad(codes, (*width, (0, extra // 2))),
          jnp.pad(scales, (*width, (0, extra // 16))))


def _alpha(alpha, num_groups: int) -> jax.Array:
  if alpha is None:
    return jnp.ones((num_groups,), jnp.float32)
  return jnp.broadcast_to(jnp.asarray(alpha, jnp.float32), (num_groups,))


def _cc() -> int:
  cc = common.compute_capability() or (9, 0)
  return cc[0] * 10 + cc[1]


def ragged_codes_matmul(a_codes: jax.Array, a_scales: jax.Array,
                        b_codes: jax.Array, b_scales: jax.Array,
                        group_sizes: jax.Array,
                        alpha: jax.Array | None = None, *,
                        out_dtype=jnp.float32, native: bool | None = None,
                        block_m: int = 128, block_n: int = 128,
                        block_k: int = 128, num_warps: int = 8,
                        num_stages: int = 3) -> jax.Array:
  """Row `r` of group `e`: `(a[r] @ b[e].T) * alpha[e]`, FP32 accumulation.

  Args:
    a_codes, a_scales: `a [M, K]`, rows sorted by group: uint8 `[M, K // 2]`
      and float8_e4m3fn `[M, K // 16]`.
    b_codes, b_scales: `b [E, N, K]`: `[E, N, K // 2]`, `[E, N, K // 16]`.
    group_sizes: int `[E]` (traced); rows past their sum give zeros.
    alpha: FP32 `[E]` (or a scalar), or None for 1.
    out_dtype: the result's dtype (one cast of the FP32 product).
    native: True / None: the block-scaled MMA (`has_fp4_mma` GPUs only);
      False: the decode form (any CUDA GPU; see the module docstring).

  Returns:
    `[M, N]`.

  Raises:
    NotImplementedError: not on a GPU where the form asked for compiles, or
      jax-triton missing.
  """
  what = "ragged_codes_matmul"
  native = _check(what, native)
  m, k = a_codes.shape[0], a_codes.shape[1] * 2
  e, n = b_codes.shape[0], b_codes.shape[1]
  _check_operand(what, "a", a_codes, a_scales, (m,), k)
  _check_operand(what, "b", b_codes, b_scales, (e, n), k)
  if group_sizes.shape != (e,):
    raise ValueError(f"{what}: group_sizes must be [{e}], got "
                     f"{group_sizes.shape}.")
  jt = _jt(what)
  kp = dense.padded_k(k)
  a_codes, a_scales = _pad_k(a_codes, a_scales, kp)
  b_codes, b_scales = _pad_k(b_codes, b_scales, kp)
  bk = block_k
  while kp % bk:
    bk //= 2
  seg, row0, lo, hi = _tile_map(group_sizes, m, block_m)
  grid = (seg.shape[0] * common.cdiv(n, block_n),)
  kernel, _ = _kernels()
  return jt.triton_call(
      seg, row0, lo, hi, a_codes, a_scales, b_codes, b_scales,
      _alpha(alpha, e), kernel=kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), jnp.dtype(out_dtype)),
      grid=grid, num_warps=num_warps, num_stages=num_stages,
      M=m, N=n, K=kp, E=e, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
      NATIVE=native, HAS_ALPHA=alpha is not None,
      compute_capability=_cc())


def ragged_codes_matmul_t(a_codes: jax.Array, a_scales: jax.Array,
                          b_codes: jax.Array, b_scales: jax.Array,
                          group_sizes: jax.Array,
                          alpha: jax.Array | None = None, *,
                          out_dtype=jnp.float32, native: bool | None = None,
                          block_m: int = 128, block_n: int = 128,
                          block_k: int = 128, num_warps: int = 8,
                          num_stages: int = 3) -> jax.Array:
  """Group `e`'s tokens contracted: `out[e] = (a_e @ b_e.T) * alpha[e]`.

  Args:
    a_codes, a_scales: `a [K, L]` quantized along the tokens `L`: uint8
      `[K, L // 2]`, float8_e4m3fn `[K, L // 16]`.
    b_codes, b_scales: `b [N, L]`, the same.
    group_sizes: int `[E]`, tokens per group, in order from token 0; an
      empty group gives zeros.
    alpha, out_dtype, native: as `ragged_codes_matmul`.

  Returns:
    `[E, K, N]`.
  """
  what = "ragged_codes_matmul_t"
  native = _check(what, native)
  k, length = a_codes.shape[0], a_codes.shape[1] * 2
  n = b_codes.shape[0]
  _check_operand(what, "a", a_codes, a_scales, (k,), length)
  _check_operand(what, "b", b_codes, b_scales, (n,), length)
  if group_sizes.ndim != 1:
    raise ValueError(f"{what}: group_sizes must be [E], got "
                     f"{group_sizes.shape}.")
  jt = _jt(what)
  e = group_sizes.shape[0]
  gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(gs), length)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  grid = (e * common.cdiv(k, block_m) * common.cdiv(n, block_n),)
  _, kernel = _kernels()
  return jt.triton_call(
      starts, ends, a_codes, a_scales, b_codes, b_scales, _alpha(alpha, e),
      kernel=kernel,
      out_shape=jax.ShapeDtypeStruct((e, k, n), jnp.dtype(out_dtype)),
      grid=grid, num_warps=num_warps, num_stages=num_stages,
      K=k, N=n, L=length, BLOCK_M=block_m, BLOCK_N=block_n,
      BLOCK_K=block_k, NATIVE=native, HAS_ALPHA=alpha is not None,
      compute_capability=_cc())
