"""Block-scaled GEMM on quantized operands, and its backends.

`block_scaled_matmul(a, b)` computes `a @ b.T` for two arrays quantized along
their shared last axis K (the TN layout of Blackwell's block-scaled GEMM). On
hardware without FP4 tensor cores the exact emulation is: block-dequantize each
operand to bf16 (exact: see `block_dequantize`), a bf16 GEMM with FP32
accumulation, then the tensor scales as one FP32 factor
`alpha = amax_a * amax_b / 2688^2`.

Backends, one file each: `reference.py` ("xla"), the emulation with the
Pallas block-values kernel ("pallas"; its GEMM `block_values_matmul` is XLA's
or `pallas_mosaic_gpu.py`'s), `triton.py` (Triton `dot_scaled`, native FP4 on
Blackwell) and `cudnn.py` (`jax.nn.scaled_matmul`, native FP4 on Blackwell).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from nvfp4_jax.core import dispatch
from nvfp4_jax.core.arrays import MXArray
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.arrays import NVFP4Values
from nvfp4_jax.core.arrays import QArray
from nvfp4_jax.core.arrays import check_nvfp4_array

from nvfp4_jax.ops.block_scaled_matmul.cudnn import _matmul_scaled_matmul
from nvfp4_jax.ops.block_scaled_matmul.cudnn import _require_nvfp4
from nvfp4_jax.ops.block_scaled_matmul.cudnn import _require_same_format
from nvfp4_jax.ops.block_scaled_matmul.cudnn import native as cudnn_native
from nvfp4_jax.ops.block_scaled_matmul.reference import _matmul_xla
from nvfp4_jax.ops.block_scaled_matmul.reference import _values_matmul_xla
from nvfp4_jax.ops.block_scaled_matmul.reference import gemm_alpha
from nvfp4_jax.ops.block_scaled_matmul.sharded import matmul_per_shard
from nvfp4_jax.ops.block_values.api import BLOCK_VALUES


# The implementations that multiply bf16 block values (the exact emulation).
EMULATIONS = ("xla", "pallas")


def block_scaled_matmul(a: QArray, b: QArray, *, out_dtype=jnp.float32,
                        implementation: str | None = None) -> jax.Array:
  """`a @ b.T` over the quantized last axis, FP32 accumulation.

  Args:
    a: quantized `[M, K]` (an `NVFP4Array` or `MXArray`; or `NVFP4Values`,
      the block values a quantizer wrote for the exact emulation).
    b: quantized `[N, K]`.
    out_dtype: dtype of the result; the FP32 product is scaled by `alpha` in
      FP32 and then cast.
    implementation: how to run it (all exact: bf16 products of block values,
      FP32 accumulation; results differ only by FP32 summation order):

      - "xla": the reference: block-dequantize in jnp, `lax.dot_general`.
      - "pallas": the Pallas block-dequantize kernel, then a bf16 GEMM with
        FP32 accumulation (`block_values_matmul`'s default: XLA's GEMM, or
        on Hopper our Mosaic GPU kernel where it is measured to win). NVFP4
        only.
      - "triton": a jax-triton kernel with `tl.dot_scaled` (block-scaled
        tensor cores; compute capability 10.0, 10.3, 12.0). NVFP4, MXFP4,
        MXFP8 (both operands of one format).
      - "scaled_matmul": `jax.nn.scaled_matmul` (cuDNN's block-scaled dot on
        Blackwell from cuDNN 9.10; XLA decomposes it elsewhere). NVFP4 and
        MXFP8 on GPU only (XLA decomposes MXFP4 even on Blackwell).
      - None: a native FP4 path on Blackwell (compute capability >= 10;
        see `gemm_preference`), "pallas" on other GPUs, "xla" elsewhere;
        a path that cannot run the call falls back to the next.

      With an `NVFP4Values` operand only the emulations ("xla", "pallas",
      None) apply: the other operand's codes are block-dequantized by that
      implementation and the values multiplied as they are.

  Returns:
    `[M, N]` in `out_dtype`.
  """
  for name, q in (("a", a), ("b", b)):
    if not isinstance(q, (NVFP4Array, NVFP4Values, MXArray)):
      raise TypeError(
          f"block_scaled_matmul: {name} must be an NVFP4Array, NVFP4Values or "
          f"MXArray, got {type(q).__name__}.")
    check_nvfp4_array(q, "block_scaled_matmul", name)
    if q.ndim != 2:
      raise ValueError(
          f"block_scaled_matmul: {name} must be 2-D [rows, K], got shape "
          f"{q.shape}.")
  if a.shape[1] != b.shape[1]:
    raise ValueError(
        f"block_scaled_matmul: contraction sizes differ, a {a.shape} vs b "
        f"{b.shape} (both are quantized along their last axis: a @ b.T).")
  if isinstance(a, NVFP4Values) or isinstance(b, NVFP4Values):
    return _matmul_values(a, b, out_dtype=out_dtype,
                          implementation=implementation)
  return BLOCK_SCALED_MATMUL(implementation, a, b, out_dtype=out_dtype)


@dataclasses.dataclass(frozen=True)
class GemmPlan:
  """How a layer's block-scaled GEMMs run on one device, decided once.

  Attributes:
    impl: the `default_implementation` in force when the layer was traced
      (None: the platform's preference); the backward pass, traced later,
      runs under it too.
    backend: what `block_scaled_matmul(implementation=None)` runs first.
    values: the backend is the exact emulation, which multiplies bf16 block
      values: a quantizer may hand it `NVFP4Values` (no dequantize pass).
      A native FP4 GEMM (Blackwell) multiplies codes.
  """

  impl: str | None
  backend: str
  values: bool


def gemm_plan(*, platform: str, cc: tuple[int, int] | None,
              impl: str | None = None,
              cudnn: tuple[int, int] | None = None) -> GemmPlan:
  """The GEMM backend on `platform` (compute capability `cc`), and what it
  means for the operands: block values or codes.

  Args:
    platform: "cpu", "gpu" or "tpu".
    cc: the GPU's compute capability, None elsewhere.
    impl: a `default_implementation` name in force, or None.
    cudnn: cuDNN's version, None if unknown.
  """
  names = (impl,) if impl is not None else gemm_preference(platform, cc,
                                                           cudnn)
  names = tuple(n for n in names if n in BLOCK_SCALED_MATMUL.implementations
                and n != "xla") + ("xla",)
  backend = names[0]
  return GemmPlan(impl=impl, backend=backend, values=backend in EMULATIONS)


def consumes_values() -> bool:
  """Whether `block_scaled_matmul(implementation=None)` runs the exact
  emulation here (bf16 block values, then a bf16 GEMM): `gemm_plan` on this
  process's default device, under the `default_implementation` in force.
  """
  return gemm_plan(platform=dispatch.platform(),
                   cc=dispatch.compute_capability(),
                   impl=dispatch.current_default(),
                   cudnn=dispatch.cudnn_version()).values


def _matmul_values(a, b, *, out_dtype, implementation):
  if implementation not in (None, *EMULATIONS):
    raise ValueError(
        f"block_scaled_matmul: implementation={implementation!r} multiplies "
        f"FP4 codes; an NVFP4Values operand holds block values, which only "
        f"the emulation {EMULATIONS} (or None) multiplies. Quantize to an "
        f"NVFP4Array (nvfp4_jax.quantize) for a native FP4 GEMM.")
  for q in (a, b):
    if not isinstance(q, (NVFP4Array, NVFP4Values)):
      raise TypeError(
          f"block_scaled_matmul: an NVFP4Values operand multiplies an NVFP4 "
          f"operand, got {type(q).__name__}.")
  def vals(q):
    if isinstance(q, NVFP4Values):
      return q.values
    return BLOCK_VALUES(implementation, q)
  return block_values_matmul(vals(a), vals(b), gemm_alpha(a, b),
                             out_dtype=out_dtype)


def block_values_matmul(va: jax.Array, vb: jax.Array, alpha: jax.Array, *,
                        out_dtype=jnp.float32, vb_kn: bool = False,
                        implementation: str | None = None) -> jax.Array:
  """`(va @ vb.T) * alpha`: bf16 block values `[M, K]`, `[N, K]`, FP32 acc.

  The GEMM of the exact emulation, for callers that already hold the block
  values (e.g. from `nvfp4_jax.quantize_with_values`, or
  `block_dequantize`'s values and `gemm_alpha`).

  Args:
    va: bf16 block values `[M, K]`.
    vb: bf16 block values `[N, K]`, or `[K, N]` with `vb_kn`.
    alpha: the FP32 output factor (`gemm_alpha` of the two operands).
    out_dtype: dtype of the result; the FP32 product is scaled by `alpha` in
      FP32 and then cast.
    vb_kn: `vb` is `[K, N]` (`va @ vb`; e.g. a 16x16-scaled weight's values
      in flax's `[in, out]` layout, the transpose of its `[out, in]`
      quantization): the same products, and the GEMM reads the layout as it
      is.
    implementation: "xla" (`lax.dot_general`, FP32 accumulation, then
      `* alpha` and the cast), "pallas" (a Pallas Mosaic GPU GEMM with
      `alpha` in its epilogue, Hopper only), or None: "pallas" on a GPU where
      it runs the call and is measured to win (large outputs), "xla"
      otherwise. Both multiply exact products; results differ only by the
      FP32 summation order.

  Returns:
    `[M, N]` in `out_dtype`.

  Raises:
    ValueError: an unknown `implementation`.
    NotImplementedError: "pallas" where it cannot run the call (no Hopper
      GPU, unsupported shapes); None then falls back to "xla".
  """
  return VALUES_MATMUL(implementation, va, vb, alpha, out_dtype=out_dtype,
                       vb_kn=vb_kn)


def _values_per_shard(kernel, va, vb, alpha, *, out_dtype, vb_kn):
  """The GEMM kernel per shard under `jax.jit` shardings
  (`sharded.matmul_per_shard`): output rows split as `va`'s rows, columns as
  `vb`'s N; a split K is gathered (no partial sums across devices). A shard
  too small for the kernel's tiles runs XLA's GEMM (exact products too;
  only the FP32 summation order differs)."""
  return matmul_per_shard(kernel, va, vb, alpha, b_kn=vb_kn,
                          fallback=_values_matmul_xla,
                          out_dtype=out_dtype, vb_kn=vb_kn)


VALUES_MATMUL = dispatch.Op("block_values_matmul", {
    "xla": _values_matmul_xla,
    "pallas": "nvfp4_jax.ops.block_scaled_matmul.pallas_mosaic_gpu:values_matmul",
}, per_shard=_values_per_shard)


def _matmul_pallas(a, b, *, out_dtype):
  _require_nvfp4(a, b, "pallas")
  return block_values_matmul(BLOCK_VALUES("pallas", a),
                             BLOCK_VALUES("pallas", b),
                             gemm_alpha(a, b), out_dtype=out_dtype)


def _matmul_triton(a, b, *, out_dtype):
  _require_same_format(a, b, "triton")
  from nvfp4_jax.ops.block_scaled_matmul import triton as kernel  # pylint: disable=g-import-not-at-top
  return kernel.block_scaled_matmul(a, b, gemm_alpha(a, b),
                                    out_dtype=out_dtype)


def gemm_preference(platform: str, cc: tuple[int, int] | None,
                    cudnn: tuple[int, int] | None = None) -> tuple[str, ...]:
  """The implementations `block_scaled_matmul` tries first on a device.

  Blackwell (compute capability 10.x data-center, 12.x consumer) has
  block-scaled FP4 tensor cores: a native path first, the exact emulation
  ("pallas") as the fallback. Data-center parts take cuDNN through
  `jax.nn.scaled_matmul` first (JAX's own route to them), consumer parts
  Triton's `tl.dot_scaled` first. Triton only where it compiles the
  block-scaled MMA (`triton.BLOCK_SCALED_MMA_CCS`: not GB10's 12.1 nor
  11.x); cuDNN only from cuDNN 9.10 (`cudnn`, None: unknown; below, XLA
  decomposes its block-scaled dot). Each native path also declines shapes
  it cannot run (cuDNN: `cudnn.unsupported`; Triton pads K), so a call
  falls through to the next.
  Other GPUs (Hopper has no FP4 tensor cores) take `dispatch.PREFERRED`
  (the emulation).
  """
  from nvfp4_jax.ops.block_scaled_matmul import triton as kernel  # pylint: disable=g-import-not-at-top
  if platform == "gpu" and cc is not None and cc >= (10, 0):
    native = (("triton", "scaled_matmul") if cc[0] >= 12
              else ("scaled_matmul", "triton"))
    drop = (() if kernel.has_fp4_mma(cc) else ("triton",)) + (
        () if cudnn_native(cc, cudnn) else ("scaled_matmul",))
    native = tuple(n for n in native if n not in drop)
    return native + ("pallas",)
  return tuple(dispatch.PREFERRED.get(platform, ()))


def _native_per_shard(kernel, a, b, *, out_dtype):
  """A native FP4 GEMM (Triton, cuDNN) per shard under `jax.jit`
  shardings (`sharded.matmul_per_shard`): output rows split as `a`'s rows,
  columns as `b`'s; a split K is gathered. A shard the kernel turns down
  runs the reference (exact products; only the FP32 summation order
  differs). The emulation ("pallas") is its kernels' composition, each
  per shard already."""
  if kernel is _matmul_pallas:
    return kernel(a, b, out_dtype=out_dtype)
  return matmul_per_shard(kernel, a, b, fallback=_matmul_xla,
                          out_dtype=out_dtype)


BLOCK_SCALED_MATMUL = dispatch.Op("block_scaled_matmul", {
    "xla": _matmul_xla,
    "pallas": _matmul_pallas,
    "triton": _matmul_triton,
    "scaled_matmul": _matmul_scaled_matmul,
}, per_shard=_native_per_shard, preferred=lambda platform: gemm_preference(
    platform, dispatch.compute_capability(), dispatch.cudnn_version()))
