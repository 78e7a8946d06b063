"""Block-scaled GEMM on quantized operands: the exact emulation.

`block_scaled_matmul(a, b)` computes `a @ b.T` for two arrays quantized along
their shared last axis K (the TN layout of Blackwell's block-scaled GEMM). On
hardware without FP4 tensor cores the exact emulation is: block-dequantize each
operand to bf16 (exact: see `block_dequantize`), a bf16 GEMM with FP32
accumulation, then the tensor scales as one FP32 factor
`alpha = amax_a * amax_b / 2688^2`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_jax import dispatch
from nvfp4_jax import numerics as nm
from nvfp4_jax.mx import MXArray
from nvfp4_jax.qarray import NVFP4Array
from nvfp4_jax.qarray import NVFP4Values
from nvfp4_jax.quant import QArray, block_dequantize

# The implementations that multiply bf16 block values (the exact emulation).
EMULATIONS = ("xla", "pallas")


def gemm_alpha(a: QArray, b: QArray) -> jax.Array:
  """The FP32 output factor of `a @ b.T`.

  NVFP4 x NVFP4: `amax_a * amax_b / 2688^2` (1536 for a Four-over-Six
  operand), computed as TE's
  `compute_nvfp4_per_tensor_scale_kernel` does: `(amax_a * amax_b) *
  f32(1 / 2688^2)`. (Written as a division, XLA would silently make the same
  rewrite; writing it out keeps it when that rewrite changes.) MX operands have
  no tensor scale (factor 1).
  """
  def amax_over(q):
    if isinstance(q, (NVFP4Array, NVFP4Values)):
      return q.amax, q.tensor_denominator
    return jnp.float32(1.0), 1.0
  amax_a, den_a = amax_over(a)
  amax_b, den_b = amax_over(b)
  return nm.ftz((amax_a * amax_b) * jnp.float32(1.0 / (den_a * den_b)))


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
      - "triton": a jax-triton kernel with `tl.dot_scaled` (FP4 tensor cores;
        compute capability >= 10 only). NVFP4 only.
      - "scaled_matmul": `jax.nn.scaled_matmul` on float4_e2m1fn operands
        (cuDNN on Blackwell; XLA decomposes it elsewhere). NVFP4 on GPU only.
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


def consumes_values() -> bool:
  """Whether `block_scaled_matmul(implementation=None)` runs the exact
  emulation here (bf16 block values, then a bf16 GEMM).

  Then a quantizer may hand the GEMM `NVFP4Values` instead of codes and
  scales, and no dequantize pass runs; where a native FP4 GEMM comes first
  (Blackwell, or a `default_implementation` naming one) it takes the codes.
  """
  return BLOCK_SCALED_MATMUL.order()[0] in EMULATIONS


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
  values (e.g. from `nvfp4_jax.fused.quantize_with_values`). `vb_kn`: `vb`
  is `[K, N]` instead (`va @ vb`; e.g. a 16x16-scaled weight's values in
  flax's `[in, out]` layout, the transpose of its `[out, in]` quantization):
  the same products, and the GEMM reads the layout as it is.

  implementation: "xla" (`lax.dot_general`, FP32 accumulation, then
  `* alpha` and the cast), "pallas" (a Pallas Mosaic GPU GEMM with `alpha`
  in its epilogue, Hopper only: `pallas_kernels.values_matmul`), or None:
  "pallas" on a GPU where it runs the call and is measured to win (large
  outputs), "xla" otherwise. Both multiply exact products; results differ
  only by the FP32 summation order.
  """
  return VALUES_MATMUL(implementation, va, vb, alpha, out_dtype=out_dtype,
                       vb_kn=vb_kn)


def _values_matmul_xla(va, vb, alpha, *, out_dtype, vb_kn):
  acc = jax.lax.dot_general(
      va, vb, (((1,), (0 if vb_kn else 1,)), ((), ())),
      preferred_element_type=jnp.float32)
  return (acc * alpha).astype(out_dtype)


VALUES_MATMUL = dispatch.Op("block_values_matmul", {
    "xla": _values_matmul_xla,
    "pallas": "pallas_kernels.values_matmul:values_matmul",
})


def _matmul_xla(a, b, *, out_dtype):
  va, _ = block_dequantize(a)
  vb, _ = block_dequantize(b)
  return block_values_matmul(va, vb, gemm_alpha(a, b), out_dtype=out_dtype)


def _require_nvfp4(a, b, what):
  if not (isinstance(a, NVFP4Array) and isinstance(b, NVFP4Array)):
    raise NotImplementedError(
        f"implementation={what!r} takes NVFP4Arrays only; use 'xla' for MX.")


def _matmul_pallas(a, b, *, out_dtype):
  _require_nvfp4(a, b, "pallas")
  return block_values_matmul(BLOCK_VALUES("pallas", a),
                             BLOCK_VALUES("pallas", b),
                             gemm_alpha(a, b), out_dtype=out_dtype)


# The bf16 block values of an NVFP4Array: the emulated GEMM's operand.
BLOCK_VALUES = dispatch.Op("block_values", {
    "xla": lambda q: block_dequantize(q)[0],
    "pallas": "pallas_kernels.block_dequantize:block_values",
})


def _matmul_triton(a, b, *, out_dtype):
  _require_nvfp4(a, b, "triton")
  from pallas_kernels import block_scaled_matmul as kernel  # pylint: disable=g-import-not-at-top
  return kernel.block_scaled_matmul(a, b, gemm_alpha(a, b),
                                    out_dtype=out_dtype)


def _matmul_scaled_matmul(a, b, *, out_dtype):
  _require_nvfp4(a, b, "scaled_matmul")
  if dispatch.platform() != "gpu":
    raise NotImplementedError(
        "jax.nn.scaled_matmul has no lowering on this platform "
        f"({dispatch.platform()}); use implementation='xla'.")

  def f4(q):  # Packed bytes -> float4_e2m1fn [rows, K] (low nibble first).
    v = jax.lax.bitcast_convert_type(q.codes, jnp.float4_e2m1fn)
    return v.reshape(q.shape)[None]
  acc = jax.nn.scaled_matmul(f4(a), f4(b), a.scales[None], b.scales[None],
                             preferred_element_type=jnp.float32)[0]
  return (acc * gemm_alpha(a, b)).astype(out_dtype)


def weight_only_matmul(x: jax.Array, w: NVFP4Array, *, out_dtype=None,
                       implementation: str | None = None) -> jax.Array:
  """`x @ dequantize(w).T` with a packed NVFP4 weight: inference decoding.

  Activations stay in high precision (cast to bf16 for the tensor cores);
  the weight is read packed (0.5625 bytes per weight), decoded to its exact
  bf16 block values, multiplied with FP32 accumulation, and the tensor factor
  is applied to the FP32 result.

  Args:
    x: `[..., K]` activations.
    w: `NVFP4Array [N, K]` (e.g. a layer's `W = kernel^T`, see
      `nvfp4_jax.export`).
    out_dtype: the result's dtype (default `x.dtype`).
    implementation: "xla" (block-dequantize, dot) or "pallas" (a kernel that
      decodes the packed weight in registers: memory-bound decode shapes
      read ~3.5x fewer bytes than a bf16 weight); None: "pallas" on GPU.

  Returns:
    `[..., N]` in `out_dtype`.
  """
  if not isinstance(w, NVFP4Array) or w.ndim != 2:
    raise TypeError(f"weight_only_matmul: w must be a 2-D NVFP4Array [N, K], "
                    f"got {type(w).__name__}"
                    f"{getattr(w, 'shape', '')}.")
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating) or x.shape[-1] != w.shape[1]:
    raise ValueError(
        f"weight_only_matmul: x must be floating [..., K={w.shape[1]}], got "
        f"{x.dtype}{x.shape}; pass activations whose last axis is the "
        f"weight's K.")
  out_dtype = out_dtype or x.dtype
  lead = x.shape[:-1]
  y = WEIGHT_ONLY_MATMUL(implementation, x.reshape(-1, x.shape[-1]), w,
                         out_dtype=out_dtype)
  return y.reshape(*lead, w.shape[0])


def _weight_only_xla(x, w, *, out_dtype):
  vals, _ = block_dequantize(w)
  acc = jax.lax.dot_general(x.astype(jnp.bfloat16), vals,
                            (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
  return (acc * w.tensor_scale).astype(out_dtype)


WEIGHT_ONLY_MATMUL = dispatch.Op("weight_only_matmul", {
    "xla": _weight_only_xla,
    "pallas": "pallas_kernels.weight_only_matmul:weight_only_matmul",
})


def gemm_preference(platform: str, cc: tuple[int, int] | None
                    ) -> tuple[str, ...]:
  """The implementations `block_scaled_matmul` tries first on a device.

  Blackwell (compute capability 10.x data-center, 12.x consumer) has
  block-scaled FP4 tensor cores: a native path first, the exact emulation
  ("pallas") as the fallback. Data-center parts take cuDNN through
  `jax.nn.scaled_matmul` first (JAX's own route to them), consumer parts
  Triton's `tl.dot_scaled` first. Other GPUs (Hopper has no FP4 tensor cores)
  take `dispatch.PREFERRED` (the emulation).
  """
  if platform == "gpu" and cc is not None and cc >= (10, 0):
    native = (("triton", "scaled_matmul") if cc[0] >= 12
              else ("scaled_matmul", "triton"))
    return native + ("pallas",)
  return tuple(dispatch.PREFERRED.get(platform, ()))


BLOCK_SCALED_MATMUL = dispatch.Op("block_scaled_matmul", {
    "xla": _matmul_xla,
    "pallas": _matmul_pallas,
    "triton": _matmul_triton,
    "scaled_matmul": _matmul_scaled_matmul,
}, preferred=lambda platform: gemm_preference(
    platform, dispatch.compute_capability()))
