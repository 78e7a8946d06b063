"""The grouped block-scaled GEMMs through jax-triton: `tl.dot_scaled` on FP4/FP8 tensor cores.

The grouped GEMMs of `nvfp4_jax.ragged_dot` on codes, as the block-scaled
MMA of Blackwell multiplies them (compute capability 10.0 / 10.3: NVFP4
`tcgen05.mma ... kind::mxf4nvf4`, MXFP4 and MXFP8 `kind::mxf8f6f4` with
UE8M0 scales per 32, `scale_vec::1X`), with FP32 accumulation and each
group's FP32 `alpha` (NVFP4's tensor scales; None for MX, which has none)
multiplied into the accumulator before the one store, as the dense kernel
(`ops/block_scaled_matmul/triton.py`) does for one GEMM. Operands are
consumed as the grouped quantizers store them (`codes=True`): NVFP4 packed
E2M1 bytes (element `2k` in the low nibble, `tl.dot_scaled`'s packing) and
E4M3 scales per 16 elements along the contraction (a 16x16 weight tile's
scale is replicated over its 16 rows, the per-row layout `tl.dot_scaled`
reads); MXFP4 the same packing, MXFP8 one E4M3 byte per element, both with
E8M0 scale bytes per 32 (`FORMATS`).

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
kernel: a 32-wide step does not compile on sm_100; MX: 128, four scale
columns per step) with zero code bytes (and scale bytes 0, MX 127), which
add exact zeros; Wgrad masks its token steps instead.

`native=False` runs the same kernel (the same map, pointers, masks and
epilogue) with the MMA replaced by an in-kernel decode of the codes to their
exact bf16 block values and a bf16 `tl.dot` (FP32 accumulation): the only
form of this kernel that runs on Hopper, where Triton 3.6 does not compile
`tl.dot_scaled` with E4M3 scales (`TritonGPUAccelerateMatmul` fails on
sm_90), so the kernel's plumbing is checked there against the reference
(MX values decoded as `dequantize_mx` does).
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
from pallas_kernels import launch


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
  def e4m3_f32(c):
    """E4M3 bytes (uint8) to FP32: 2^(e-7) (1 + m/8) for e > 0, m 2^-9 for
    e = 0, NaN for the magnitude 0x7F; built as FP32 bits (bias 127)."""
    mag = (c & 0x7F).to(tl.uint32)
    e = mag >> 3
    bits = tl.where(mag == 0x7F, 0x7FC00000,
                    ((e + 120) << 23) | ((mag & 7) << 20)).to(tl.uint32)
    v = tl.where(e == 0, (mag & 7).to(tl.float32) * 0.001953125,
                 bits.to(tl.float32, bitcast=True))
    return tl.where(c >= 128, -v, v)

  @triton.jit
  def block_values(codes, scales, ROWS: tl.constexpr, COLS: tl.constexpr,
                   FMT: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """An operand's codes to its exact bf16 block values `[ROWS, COLS]`:
    packed E2M1 `[ROWS, COLS // 2]` (FMT "e2m1") or E4M3 bytes `[ROWS,
    COLS]` ("e4m3"), times E4M3 scales per 16 (NVFP4) or E8M0 scale bytes
    per 32 (MX: `2^(s - 127)`, applied as `dequantize_mx` does: 2^-127 as
    0.5 * 2^-126; 255 is NaN)."""
    if FMT == "e2m1":
      v = tl.join(e2m1_bf16(codes & 0xF), e2m1_bf16(codes >> 4))
      v = tl.reshape(v, (ROWS, COLS // SCALE_BLOCK, SCALE_BLOCK))
      v = v.to(tl.float32)
    else:
      v = tl.reshape(e4m3_f32(codes), (ROWS, COLS // SCALE_BLOCK,
                                       SCALE_BLOCK))
    if SCALE_BLOCK == 16:
      v = v * scales.to(tl.float32)[:, :, None]
    else:
      s = scales.to(tl.uint32)
      half = tl.where(s == 0, 0.5, 1.0)
      sc = tl.where(s == 255, 0x7FC00000, tl.maximum(s, 1) << 23)
      sc = sc.to(tl.uint32).to(tl.float32, bitcast=True)
      v = (v * half[:, :, None]) * sc[:, :, None]
    return tl.reshape(v, (ROWS, COLS)).to(tl.bfloat16)

  @triton.jit
  def grouped_kernel(seg_ptr, row0_ptr, lo_ptr, hi_ptr, a_ptr, as_ptr, b_ptr,
                     bs_ptr, alpha_ptr, c_ptr,
                     M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                     E: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NATIVE: tl.constexpr, HAS_ALPHA: tl.constexpr,
                     FMT: tl.constexpr = "e2m1", PACK: tl.constexpr = 2,
                     SCALE_BLOCK: tl.constexpr = 16):
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
    kp = tl.arange(0, BLOCK_K // PACK)
    ks = tl.arange(0, BLOCK_K // SCALE_BLOCK)
    b_base = b_ptr + gc.to(tl.int64) * (N * (K // PACK))
    bs_base = bs_ptr + gc.to(tl.int64) * (N * (K // SCALE_BLOCK))
    a_ptrs = a_ptr + rows_a[:, None] * (K // PACK) + kp[None, :]
    as_ptrs = as_ptr + rows_a[:, None] * (K // SCALE_BLOCK) + ks[None, :]
    bs_ptrs = bs_base + rows_b[:, None] * (K // SCALE_BLOCK) + ks[None, :]
    if NATIVE:  # [BK/P, BN]
      b_ptrs = b_base + rows_b[None, :] * (K // PACK) + kp[:, None]
    else:  # [BN, BK/P]
      b_ptrs = b_base + rows_b[:, None] * (K // PACK) + kp[None, :]
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
        acc = tl.dot_scaled(a, sa, FMT, b, sb, FMT, acc)
      else:
        va = block_values(a, sa, BLOCK_M, BLOCK_K, FMT, SCALE_BLOCK)
        vb = block_values(b, sb, BLOCK_N, BLOCK_K, FMT, SCALE_BLOCK)
        acc = tl.dot(va, tl.trans(vb), acc)
      a_ptrs += BLOCK_K // PACK
      b_ptrs += BLOCK_K // PACK
      as_ptrs += BLOCK_K // SCALE_BLOCK
      bs_ptrs += BLOCK_K // SCALE_BLOCK
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
                       HAS_ALPHA: tl.constexpr, FMT: tl.constexpr = "e2m1",
                       PACK: tl.constexpr = 2,
                       SCALE_BLOCK: tl.constexpr = 16):
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
    kp = tl.arange(0, BLOCK_K // PACK)
    ks = tl.arange(0, BLOCK_K // SCALE_BLOCK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = start // BLOCK_K
    last = tl.where(end > start, (end + BLOCK_K - 1) // BLOCK_K, first)
    for s in range(first, last):
      byte = s * (BLOCK_K // PACK) + kp       # Tokens (E2M1: pairs 2j, 2j+1).
      blk = s * (BLOCK_K // SCALE_BLOCK) + ks  # Token blocks.
      if PACK == 2:
        tok = byte * 2
        keep_lo = (tok >= start) & (tok < end)
        keep_hi = (tok + 1 >= start) & (tok + 1 < end)
        keep_byte = tl.where(keep_lo, 0x0F, 0) | tl.where(keep_hi, 0xF0, 0)
      else:
        keep_byte = tl.where((byte >= start) & (byte < end), 0xFF, 0)
      keep_blk = ((blk * SCALE_BLOCK + SCALE_BLOCK > start)
                  & (blk * SCALE_BLOCK < end))
      in_l = byte < L // PACK
      in_blk = blk < L // SCALE_BLOCK
      a = tl.load(a_ptr + rows_a[:, None] * (L // PACK) + byte[None, :],
                  mask=in_l[None, :], other=0)
      a = a & keep_byte.to(tl.uint8)[None, :]
      sa = tl.load(as_ptr + rows_a[:, None] * (L // SCALE_BLOCK)
                   + blk[None, :], mask=(in_blk & keep_blk)[None, :],
                   other=0.0)
      sb = tl.load(bs_ptr + rows_b[:, None] * (L // SCALE_BLOCK)
                   + blk[None, :], mask=(in_blk & keep_blk)[None, :],
                   other=0.0)
      if NATIVE:
        b = tl.load(b_ptr + rows_b[None, :] * (L // PACK) + byte[:, None],
                    mask=in_l[:, None], other=0)      # [BK/P, BN]
        if PACK == 1:  # An E4M3 NaN byte of another group stays out.
          b = b & keep_byte.to(tl.uint8)[:, None]
        acc = tl.dot_scaled(a, sa, FMT, b, sb, FMT, acc)
      else:
        b = tl.load(b_ptr + rows_b[:, None] * (L // PACK) + byte[None, :],
                    mask=in_l[None, :], other=0)      # [BN, BK/P]
        if PACK == 1:
          b = b & keep_byte.to(tl.uint8)[None, :]
        va = block_values(a, sa, BLOCK_M, BLOCK_K, FMT, SCALE_BLOCK)
        vb = block_values(b, sb, BLOCK_N, BLOCK_K, FMT, SCALE_BLOCK)
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
  if launch.backend() != "gpu":
    raise NotImplementedError(
        f"{what}: the jax-triton grouped NVFP4 GEMM runs on NVIDIA GPUs only; "
        f"use implementation='xla' elsewhere.")
  if native is None or native:
    if not dense.has_fp4_mma():
      raise NotImplementedError(
          f"{what}: implementation='triton' runs tl.dot_scaled on FP4 tensor "
          f"cores, which Triton compiles for compute capability "
          f"{', '.join(f'{a}.{b}' for a, b in dense.BLOCK_SCALED_MMA_CCS)}; "
          f"this GPU is {launch.compute_capability()}. The grouped GEMM on "
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


# Each format's operand: (element format, elements per byte, scale block,
# scale dtype, code dtype, the padding scale byte). MX scales reach Triton as
# bytes (UE8M0, what `tl.dot_scaled` reads from uint8), and so do MXFP8's
# E4M3 elements (`tl.dot_scaled` bitcasts them), so that Wgrad masks a token
# with one AND; a padded MX block takes scale 2^0 (127: finite, unlike 0xFF).
FORMATS = {
    "nvfp4": ("e2m1", 2, 16, jnp.float8_e4m3fn, jnp.uint8, 0),
    "mxfp4": ("e2m1", 2, 32, jnp.float8_e8m0fnu, jnp.uint8, 127),
    "mxfp8": ("e4m3", 1, 32, jnp.float8_e8m0fnu, jnp.float8_e4m3fn, 127),
}


def _format(what: str, fmt: str):
  if fmt not in FORMATS:
    raise NotImplementedError(
        f"{what}: fmt={fmt!r}; the grouped Triton GEMM multiplies "
        f"{', '.join(FORMATS)} codes (use implementation='xla').")
  return FORMATS[fmt]


def _check_operand(what, name, codes, scales, lead, cols, fmt="nvfp4"):
  _, pack, block, scale_dtype, code_dtype, _ = FORMATS[fmt]
  if (codes.dtype != code_dtype or scales.dtype != scale_dtype
      or codes.shape != (*lead, cols // pack)
      or scales.shape != (*lead, cols // block)):
    raise ValueError(
        f"{what}: {name} must be {fmt} codes {jnp.dtype(code_dtype).name} "
        f"{(*lead, cols // pack)} and scales {jnp.dtype(scale_dtype).name} "
        f"{(*lead, cols // block)}, got {codes.dtype} {codes.shape} and "
        f"{scales.dtype} {scales.shape}.")


def _bytes(x: jax.Array) -> jax.Array:
  return (x if x.dtype == jnp.uint8
          else jax.lax.bitcast_convert_type(x, jnp.uint8))


def _operand(codes, scales, fmt: str):
  """The operand as the kernel reads it: NVFP4 as stored, MX as bytes."""
  if fmt == "nvfp4":
    return codes, scales
  return _bytes(codes), _bytes(scales)


def _pad_k(codes, scales, k: int, fmt: str = "nvfp4"):
  """Zero code bytes up to `k` elements along the last axis, and scale
  bytes 0 (NVFP4) or 127 (MX, 2^0) for the new blocks: they add exact
  zeros. MX operands come and go as bytes (`_operand`)."""
  _, pack, block, _, _, pad = FORMATS[fmt]
  extra = k - codes.shape[-1] * pack
  if not extra:
    return codes, scales
  width = [(0, 0)] * (codes.ndim - 1)
  return (jnp.pad(codes, (*width, (0, extra // pack))),
          jnp.pad(scales, (*width, (0, extra // block)),
                  constant_values=jnp.asarray(pad, scales.dtype)))


def _alpha(alpha, num_groups: int) -> jax.Array:
  if alpha is None:
    return jnp.ones((num_groups,), jnp.float32)
  return jnp.broadcast_to(jnp.asarray(alpha, jnp.float32), (num_groups,))


def _cc() -> int:
  cc = launch.compute_capability() or (9, 0)
  return cc[0] * 10 + cc[1]


def ragged_codes_matmul(a_codes: jax.Array, a_scales: jax.Array,
                        b_codes: jax.Array, b_scales: jax.Array,
                        group_sizes: jax.Array,
                        alpha: jax.Array | None = None, *,
                        out_dtype=jnp.float32, fmt: str = "nvfp4",
                        native: bool | None = None,
                        block_m: int = 128, block_n: int = 128,
                        block_k: int = 128, num_warps: int = 8,
                        num_stages: int = 3) -> jax.Array:
  """Row `r` of group `e`: `(a[r] @ b[e].T) * alpha[e]`, FP32 accumulation.

  Args:
    a_codes, a_scales: `a [M, K]`, rows sorted by group, in `fmt`: NVFP4
      uint8 `[M, K // 2]` and float8_e4m3fn `[M, K // 16]`; MXFP4 uint8
      `[M, K // 2]`, MXFP8 float8_e4m3fn `[M, K]`, and float8_e8m0fnu
      `[M, K // 32]`.
    b_codes, b_scales: `b [E, N, K]`, the same per expert.
    group_sizes: int `[E]` (traced); rows past their sum give zeros.
    alpha: FP32 `[E]` (or a scalar), or None for 1 (MX: no tensor scale).
    out_dtype: the result's dtype (one cast of the FP32 product).
    fmt: "nvfp4", "mxfp4" or "mxfp8", both operands'.
    native: True / None: the block-scaled MMA (`has_fp4_mma` GPUs only);
      False: the decode form (any CUDA GPU; see the module docstring).

  Returns:
    `[M, N]`.

  Raises:
    NotImplementedError: not on a GPU where the form asked for compiles,
      jax-triton missing, or another format.
  """
  what = "ragged_codes_matmul"
  native = _check(what, native)
  elem, pack, block, _, _, _ = _format(what, fmt)
  m, k = a_codes.shape[0], a_codes.shape[1] * pack
  e, n = b_codes.shape[0], b_codes.shape[1]
  _check_operand(what, "a", a_codes, a_scales, (m,), k, fmt)
  _check_operand(what, "b", b_codes, b_scales, (e, n), k, fmt)
  if group_sizes.shape != (e,):
    raise ValueError(f"{what}: group_sizes must be [{e}], got "
                     f"{group_sizes.shape}.")
  jt = _jt(what)
  kp = dense.padded_k(k, mx=fmt != "nvfp4")
  a_codes, a_scales = _pad_k(*_operand(a_codes, a_scales, fmt), kp, fmt)
  b_codes, b_scales = _pad_k(*_operand(b_codes, b_scales, fmt), kp, fmt)
  bk = block_k
  while kp % bk:
    bk //= 2
  seg, row0, lo, hi = _tile_map(group_sizes, m, block_m)
  grid = (seg.shape[0] * launch.cdiv(n, block_n),)
  kernel, _ = _kernels()
  return jt.triton_call(
      seg, row0, lo, hi, a_codes, a_scales, b_codes, b_scales,
      _alpha(alpha, e), kernel=kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), jnp.dtype(out_dtype)),
      grid=grid, num_warps=num_warps, num_stages=num_stages,
      M=m, N=n, K=kp, E=e, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
      NATIVE=native, HAS_ALPHA=alpha is not None, FMT=elem, PACK=pack,
      SCALE_BLOCK=block, compute_capability=_cc())


def ragged_codes_matmul_t(a_codes: jax.Array, a_scales: jax.Array,
                          b_codes: jax.Array, b_scales: jax.Array,
                          group_sizes: jax.Array,
                          alpha: jax.Array | None = None, *,
                          out_dtype=jnp.float32, fmt: str = "nvfp4",
                          native: bool | None = None,
                          block_m: int = 128, block_n: int = 128,
                          block_k: int = 128, num_warps: int = 8,
                          num_stages: int = 3) -> jax.Array:
  """Group `e`'s tokens contracted: `out[e] = (a_e @ b_e.T) * alpha[e]`.

  Args:
    a_codes, a_scales: `a [K, L]` quantized along the tokens `L` in `fmt`
      (as `ragged_codes_matmul`'s operands, with `L` for K).
    b_codes, b_scales: `b [N, L]`, the same.
    group_sizes: int `[E]`, tokens per group, in order from token 0; an
      empty group gives zeros.
    alpha, out_dtype, fmt, native: as `ragged_codes_matmul`.

  Returns:
    `[E, K, N]`.
  """
  what = "ragged_codes_matmul_t"
  native = _check(what, native)
  elem, pack, block, _, _, _ = _format(what, fmt)
  k, length = a_codes.shape[0], a_codes.shape[1] * pack
  n = b_codes.shape[0]
  _check_operand(what, "a", a_codes, a_scales, (k,), length, fmt)
  _check_operand(what, "b", b_codes, b_scales, (n,), length, fmt)
  if group_sizes.ndim != 1:
    raise ValueError(f"{what}: group_sizes must be [E], got "
                     f"{group_sizes.shape}.")
  jt = _jt(what)
  a_codes, a_scales = _operand(a_codes, a_scales, fmt)
  b_codes, b_scales = _operand(b_codes, b_scales, fmt)
  e = group_sizes.shape[0]
  gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(gs), length)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  grid = (e * launch.cdiv(k, block_m) * launch.cdiv(n, block_n),)
  _, kernel = _kernels()
  return jt.triton_call(
      starts, ends, a_codes, a_scales, b_codes, b_scales, _alpha(alpha, e),
      kernel=kernel,
      out_shape=jax.ShapeDtypeStruct((e, k, n), jnp.dtype(out_dtype)),
      grid=grid, num_warps=num_warps, num_stages=num_stages,
      K=k, N=n, L=length, BLOCK_M=block_m, BLOCK_N=block_n,
      BLOCK_K=block_k, NATIVE=native, HAS_ALPHA=alpha is not None,
      FMT=elem, PACK=pack, SCALE_BLOCK=block, compute_capability=_cc())
