"""Check this GPU: which implementations run, are they bit-exact, how fast.

    nvfp4-check-device                 # on the GPU (a few minutes)
    nvfp4-check-device --small         # smoke run (CPU: interpreted)
    nvfp4-check-device --target b200   # ahead of time, no GPU

(or `python -m nvfp4_jax.tools.check_device`; `python -m
benchmarks.check_device` in a source checkout also times the GPT step).

`--target {b200,gb200,b300,rtx-pro-6000,rtx-5090,gb10}` compiles for that
GPU on any machine (no GPU needed: JAX's CUDA plugin, the `gpu` extra, and
nothing else) and prints what each program lowered to: the NVFP4 layer's
forward and backward, every quantizer, the weight-only matmul, the GEMMs
(NVFP4 and MX) and the MoE op (`ragged_dot`), and which E2M1 encoder
each program's quantizers use (the hardware conversion where it compiles
for the target: `--features`, default `accelerated`, compiles for sm_XYa
as on the GPU itself, `none` for plain sm_XY); with the `triton` package,
each Pallas-Triton kernel's SASS instructions per element
(`nvfp4_jax.tools.sass_report`). It exits non-zero on a
compile error, on a block-scaled dot XLA decomposed, or on a Blackwell GEMM
that runs no native FP4. Nothing runs: exactness and speed need the GPU.

Made for Blackwell users (compute capability 10.x / 12.x), where the default
GEMM is a native FP4 path that the project's own CI and benchmarks cannot
run. Prints, as Markdown tables:

1. the device, versions, and the implementation each op picks by default
   here (`implementation=None`), with the fallbacks in order;
2. exactness: every kernel's bytes (codes, E4M3 scales, amax, SR bits, bf16
   values) against the pure-jnp reference run on the CPU, and every GEMM
   implementation against the reference: bit for bit where every partial sum
   is exact, within the FP32 summation-order bound otherwise (also on every
   E4M3 scale byte, subnormal and zero ones included, and zero blocks; MXFP4
   and MXFP8 too), and the MoE op's grouped GEMMs on codes (NVFP4, MXFP4,
   MXFP8; the Triton kernel on Blackwell) on uneven, empty and skewed
   groups;
3. speed, ratios from this run: the NVFP4 GEMM (default, each native path,
   the emulation) against cuBLAS bf16, `NVFP4Dense` fwd+bwd against
   `nn.Dense` (`nvfp4_jax.tools.speed`), and, from a source checkout
   (`python -m benchmarks.check_device`), the example GPT's `small` train
   step NVFP4 against BF16 (each step configuration in a fresh process, see
   `benchmarks.bench_step`).

Send the output with a bug report; nothing else is written.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib.metadata
import os
import sys
import tempfile
from typing import Callable

# `--target` compiles for a GPU that is not here: JAX's CUDA plugin must
# register without loading CUDA's libraries, which it does when JAX runs on
# the CPU (set before JAX starts a backend).
if __name__ == "__main__" and "--target" in " ".join(sys.argv):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax.core import dispatch
from nvfp4_jax.core.arrays import MXArray
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.dispatch import default_implementation
from nvfp4_jax.core.recipe import Operand
from nvfp4_jax.flax.linen import NVFP4Dense
from nvfp4_jax.flax.linen import RNG_STREAM
from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
from nvfp4_jax.ops.block_scaled_matmul import cudnn as cudnn_api
from nvfp4_jax.ops.block_scaled_matmul import reference as gemm_ref
from nvfp4_jax.ops.block_values.api import block_dequantize
from nvfp4_jax.ops.quantize import api as quantize_api
from nvfp4_jax.ops.quantize.api import quantize
from nvfp4_jax.ops.quantize.mx import quantize_mx
from nvfp4_jax.ops.quantize_pair import api as pair_api
from nvfp4_jax.ops.quantize_rht_t import api as rht_t_api
from nvfp4_jax.ops.ragged_dot import api as ragged_api
from nvfp4_jax.ops.ragged_quantize import api as rq_api
from nvfp4_jax.ops.weight_only_matmul import api as wo_api
from nvfp4_jax.ops.weight_only_matmul.api import weight_only_matmul
from nvfp4_jax.tools import aot
from nvfp4_jax.tools import sass_report
from nvfp4_jax.tools import speed
from nvfp4_jax.tools import timing
from nvfp4_jax.training.ragged_dot import ragged_dot

def same_bytes(a, b) -> bool:
  """Whether pytrees `a` and `b` hold the same leaves, byte for byte."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
      np.array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8),
                     np.atleast_1d(np.asarray(y)).view(np.uint8))
      for x, y in zip(la, lb))


def check_input(shape=(256, 512), seed=0) -> jax.Array:
  """Heavy-tailed bf16 data whose 16-token RHT sums are exact in FP32 (so the
  RHT'd operand does not depend on summation order; see tests/test_kernels)."""
  rng = np.random.default_rng(seed)
  k = rng.integers(-127, 128, shape).astype(np.float32)
  x = k * np.exp2(rng.integers(0, 7, (shape[0], 1))) * np.exp2(
      rng.integers(-12, 13, (1, shape[1])))
  return jnp.asarray(x, jnp.float32).astype(jnp.bfloat16)


def exact_vs_cpu(fn_kernel, fn_ref, args) -> bool:
  """The kernel on the default device vs the reference on the CPU (bytes)."""
  got = jax.jit(fn_kernel)(*args)
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    want = jax.jit(fn_ref)(*jax.device_put(args, cpu))
  return same_bytes(got, want)


_OPS = {"quantize": quantize_api.QUANTIZE, "quantize_rht_t": rht_t_api.QUANTIZE_RHT_T,
        "quantize_pair": pair_api.QUANTIZE_PAIR,
        "quantize_with_values": quantize_api.QUANTIZE_WITH_VALUES,
        "block_scaled_matmul": gemm_api.BLOCK_SCALED_MATMUL,
        "ragged_codes_matmul": ragged_api.RAGGED_CODES_MATMUL}


def _version(pkg: str) -> str:
  try:
    return importlib.metadata.version(pkg)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def header() -> str:
  dev = jax.devices()[0]
  lines = [f"device: {dev.device_kind} ({dev.platform}), compute capability "
           f"{dispatch.compute_capability()}",
           "versions: " + ", ".join(
               f"{p} {_version(p)}" for p in ("jax", "jaxlib", "flax",
                                              "triton", "jax-triton"))]
  rows = [dict(op=name, tries=" -> ".join(op.order()))
          for name, op in _OPS.items()]
  return "\n".join(lines) + "\n\n" + timing.table(rows, ("op", "tries"))


def quantizer_cases(key) -> list[tuple[str, object]]:
  """`(name, fn)` of every quantizer as the layers call it (`key` for the
  stochastic ones): checked on a device and compiled ahead of time."""
  sr, sr_t = Operand(rounding="stochastic"), Operand(rounding="stochastic",
                                                     rht=True)
  return [
      ("quantize 1x16 RTNE", quantize),
      ("quantize 1x16 SR", functools.partial(quantize,
                                             rounding="stochastic", key=key)),
      ("quantize 16x16", functools.partial(quantize, block_2d=True)),
      ("quantize_with_values", quantize_api.quantize_with_values),
      ("quantize_rht_t SR", functools.partial(
          rht_t_api.quantize_rht_t, rounding="stochastic", key=key)),
      ("quantize_pair (dY: SR + RHT)", lambda x: pair_api.quantize_pair(
          x, sr, sr_t, key_row=key, key_t=jax.random.key(8))),
      # Four-over-Six (Blackwell: the word paths of both kernels).
      ("quantize 1x16 Four-over-Six", functools.partial(
          quantize, four_over_six=True)),
      ("quantize 16x16 Four-over-Six", functools.partial(
          quantize, block_2d=True, four_over_six=True)),
      ("quantize_pair (X: RTNE + RHT, Four-over-Six)",
       lambda x: pair_api.quantize_pair(
           x, Operand(four_over_six=True),
           Operand(rht=True, four_over_six=True))),
      ("block_dequantize", lambda x: block_dequantize(quantize(x))),
  ]


def exactness(shape) -> list[dict]:
  """Each quantizer (default implementation) against the CPU reference."""
  x = check_input(shape)
  cases = quantizer_cases(jax.random.key(7))
  rows = []
  for name, fn in cases:
    try:
      ok = exact_vs_cpu(fn, functools.partial(_xla, fn), (x,))
      rows.append(dict(check=name, result="exact" if ok else "DIFFERS"))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(check=name, result=f"failed: {type(e).__name__}: "
                       f"{str(e)[:100]}"))
  return rows


def _xla(fn, *args):
  with default_implementation("xla"):
    return fn(*args)


def gemm_exactness(k: int) -> list[dict]:
  """Every GEMM implementation against the reference."""
  rng = np.random.default_rng(0)
  grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
  xa = rng.choice(grid, (128, k)) * rng.choice([-1, 1], (128, k))
  xb = rng.choice(grid, (64, k)) * rng.choice([-1, 1], (64, k))
  xa[:, ::16], xb[:, ::16] = 6.0, -6.0  # One common scale: exact sums.
  a, b = quantize(jnp.asarray(xa)), quantize(jnp.asarray(xb))
  ha = quantize(jnp.asarray(check_input((128, k), 1), jnp.float32))
  hb = quantize(jnp.asarray(check_input((64, k), 2), jnp.float32),
                   block_2d=True)
  want_exact = np.asarray(jax.jit(functools.partial(
      gemm_api.block_scaled_matmul, implementation="xla"))(a, b))
  want = np.asarray(jax.jit(functools.partial(
      gemm_api.block_scaled_matmul, implementation="xla"))(ha, hb), np.float64)
  va = np.abs(np.asarray(block_dequantize(ha)[0], np.float64))
  vb = np.abs(np.asarray(block_dequantize(hb)[0], np.float64))
  bound = (va @ vb.T) * float(gemm_ref.gemm_alpha(ha, hb)) * k * 2.0**-23
  # Every scale byte a quantizer can write (0x00-0x7E: zero, the E4M3
  # subnormals 0x01-0x07, up to 448) on random codes, and zero blocks: the
  # native GEMMs decode the scales themselves.
  ra, rb = _random_scales(rng, 128, k), _random_scales(rng, 64, k)
  want_r = np.asarray(jax.jit(functools.partial(
      gemm_api.block_scaled_matmul, implementation="xla"))(ra, rb),
                      np.float64)
  vra = np.abs(np.asarray(block_dequantize(ra)[0], np.float64))
  vrb = np.abs(np.asarray(block_dequantize(rb)[0], np.float64))
  bound_r = (vra @ vrb.T) * float(gemm_ref.gemm_alpha(ra, rb)) * k * 2.0**-23
  rows = []
  for fmt in ("mxfp4", "mxfp8"):  # Native on Blackwell: within the bound.
    ma = quantize_mx(jnp.asarray(check_input((128, k), 1), jnp.float32), fmt)
    mb = quantize_mx(jnp.asarray(check_input((64, k), 2), jnp.float32), fmt)
    vma = np.abs(np.asarray(block_dequantize(ma)[0], np.float64))
    vmb = np.abs(np.asarray(block_dequantize(mb)[0], np.float64))
    mx_want = np.asarray(jax.jit(functools.partial(
        gemm_api.block_scaled_matmul, implementation="xla"))(ma, mb),
                         np.float64)
    mx_bound = (vma @ vmb.T) * k * 2.0**-23
    try:
      got = np.asarray(jax.jit(gemm_api.block_scaled_matmul)(ma, mb),
                       np.float64)
      within = bool(np.all(np.abs(got - mx_want) <= mx_bound))
      rows.append(dict(check=f"GEMM {fmt} default", result=(
          f"{'within' if within else 'OUTSIDE'} the FP32 order bound")))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(check=f"GEMM {fmt} default", result=f"failed: "
                       f"{type(e).__name__}: {str(e)[:100]}"))
  for impl in (None, "pallas", "triton", "scaled_matmul"):
    name = impl or "default"
    try:
      f = jax.jit(functools.partial(gemm_api.block_scaled_matmul,
                                    implementation=impl))
      exact = np.array_equal(np.asarray(f(a, b)), want_exact)
      within = bool(np.all(np.abs(np.asarray(f(ha, hb), np.float64) - want)
                           <= bound))
      within_r = bool(np.all(np.abs(np.asarray(f(ra, rb), np.float64)
                                    - want_r) <= bound_r))
      rows.append(dict(check=f"GEMM {name}", result=(
          f"{'exact' if exact else 'DIFFERS'} on exact sums; "
          f"{'within' if within else 'OUTSIDE'} the FP32 order bound; "
          f"every scale byte: {'within' if within_r else 'OUTSIDE'}")))
    except NotImplementedError as e:
      rows.append(dict(check=f"GEMM {name}", result=f"not here: {e}"[:140]))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(check=f"GEMM {name}", result=f"failed: "
                       f"{type(e).__name__}: {str(e)[:100]}"))
  return rows


def ragged_exactness(k: int, fmt: str = "nvfp4") -> list[dict]:
  """The grouped GEMMs on codes (the MoE op's, default implementation: the
  Triton kernel on Blackwell) against their reference, on uneven, empty
  and skewed groups, in `fmt` ("nvfp4", "mxfp4", "mxfp8"): within the FP32
  summation-order bound, 2 n 2^-24 sum |a b| |alpha| per output (n
  products; MX: alpha 1)."""
  from nvfp4_jax.ops.ragged_dot import reference as ragged_ref  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(3)
  m, n, e = 4 * k, 256, 6
  block = 16 if fmt == "nvfp4" else 32
  sizes = np.array([0, k // 2 + 5, 2 * k, 0, 3, k - 16], np.int32)
  gs = jnp.asarray(sizes)
  x = jnp.asarray(rng.standard_t(3, (m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_t(3, (e, n, k)) * .1, jnp.float32)
  op = Operand(format=fmt)
  qa = rq_api.quantize_rows(x, gs, op, None, values=False, codes=True)
  qb = rq_api.quantize_experts(
      w, Operand(block_2d=True) if fmt == "nvfp4" else op, None,
      values=False)

  def alphas(a, b, num):
    alpha = ragged_api.group_alpha(a, b)
    return (np.ones(num) if alpha is None else np.asarray(alpha, np.float64))

  def absvals(q):
    return np.abs(np.asarray(ragged_ref.codes_values(q.data, q.scales, fmt),
                             np.float64))
  alpha = alphas(qa, qb, e)
  va, vb = absvals(qa), absvals(qb)
  ends = np.cumsum(sizes)
  rows = int(ends[-1])
  bound = np.concatenate([
      2 * k * 2.0**-24 * (va[s - z:s] @ vb[g].T) * alpha[g]
      for g, (s, z) in enumerate(zip(ends, sizes))])
  # Wgrad: the same rows as tokens (x^T, quantized along the tokens).
  pad = -(-sizes // block) * block
  xt = jnp.asarray(rng.standard_t(3, (int(pad.sum()), 128)), jnp.float32)
  dt = jnp.asarray(rng.standard_t(3, (int(pad.sum()), n)), jnp.float32)
  ta = rq_api.quantize_tokens(xt, jnp.asarray(pad), op, None,
                              values=False, codes=True)
  tb = rq_api.quantize_tokens(dt, jnp.asarray(pad), op, None,
                              values=False, codes=True)
  talpha = alphas(ta, tb, e)
  vta, vtb = absvals(ta), absvals(tb)
  ends = np.cumsum(pad)
  tbound = np.stack([
      2 * max(p, 1) * 2.0**-24 * (vta[:, s - p:s] @ vtb[:, s - p:s].T) * a
      for s, p, a in zip(ends, pad, talpha)])
  mx = fmt != "nvfp4"
  cases = (
      ("Fprop/Dgrad", ragged_api.ragged_codes_matmul, (qa, qb, gs), alpha,
       bound, lambda y: y[:rows]),
      ("Wgrad", ragged_api.ragged_codes_matmul_t, (ta, tb, jnp.asarray(pad)),
       talpha, tbound, lambda y: y))
  out = []
  for name, fn, args, alpha_, bnd, part in cases:
    check = (f"grouped GEMM on codes ({name}"
             f"{', ' + fmt.upper() if mx else ''}), default")
    a = None if mx else jnp.asarray(alpha_, jnp.float32)
    try:
      impl = ragged_api.RAGGED_CODES_MATMUL.order()[0]
      want = np.asarray(jax.jit(functools.partial(
          fn, implementation="xla"))(*args, a), np.float64)
      got = np.asarray(jax.jit(fn)(*args, a), np.float64)
      within = bool(np.all(np.abs(part(got) - part(want)) <= bnd))
      out.append(dict(check=check, result=(
          f"{impl}: {'within' if within else 'OUTSIDE'} the FP32 order "
          f"bound")))
    except Exception as e:  # pylint: disable=broad-except
      out.append(dict(check=check, result=f"failed: {type(e).__name__}: "
                      f"{str(e)[:100]}"))
  return out


def _random_scales(rng, rows: int, k: int) -> NVFP4Array:
  """An NVFP4 operand of random code bytes and random finite E4M3 scale
  bytes (0x00-0x7E, positive as a quantizer writes them), every eighth
  block zero (codes and scale)."""
  codes = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
  scales = rng.integers(0, 0x7F, (rows, k // 16), dtype=np.uint8)
  scales[:, ::8] = 0
  codes.reshape(rows, k // 16, 8)[:, ::8] = 0
  return NVFP4Array(
      codes=jnp.asarray(codes),
      scales=jax.lax.bitcast_convert_type(jnp.asarray(scales),
                                          jnp.float8_e4m3fn),
      amax=jnp.float32(1000.0))


# --- Ahead of time (--target) ------------------------------------------------

AOT_COLS = ("program", "dispatch", "lowered to", "E2M1 encoder", "status")
# `--features` -> `aot.Target.features`.
FEATURES = {"accelerated": "ACCELERATED_FEATURES",
            "family": "FAMILY_COMPATIBLE_FEATURES", "none": None}
_E2M1_CVT = "cvt.rn.satfinite.e2m1x2.f32"
# `--target` choices: the Blackwell GPUs (`aot.TARGETS` also has Thor, cc
# 11.0, for the dispatch's tests: XLA's Triton cannot compile the Pallas
# kernels for it, jax 0.11.2).
AOT_TARGETS = ("b200", "gb200", "b300", "rtx-pro-6000", "rtx-5090", "gb10")


@dataclasses.dataclass
class AotCase:
  """One program to compile for the target.

  Attributes:
    name: the row's name.
    build: returns `(fn, args)`, args abstract (`jax.ShapeDtypeStruct`).
    native: on Blackwell every GEMM of it must run native FP4 (cuDNN's
      block-scaled dot or Triton's block-scaled MMA); None: where dispatch
      picks a native implementation.
    dispatch: what the project's dispatch picks, in words (computed inside
      the target's block).
  """

  name: str
  build: Callable[[], tuple[Callable, tuple]]
  native: bool | None = False
  dispatch: Callable[[], str] = lambda: ""


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def _nvfp4(rows, k):
  return NVFP4Array(codes=_sds((rows, k // 2), jnp.uint8),
                    scales=_sds((rows, k // 16), jnp.float8_e4m3fn),
                    amax=_sds((), jnp.float32))


def _mx(rows, k, fmt):
  data = (_sds((rows, k // 2), jnp.uint8) if fmt == "mxfp4"
          else _sds((rows, k), jnp.float8_e4m3fn))
  return MXArray(data=data, scales=_sds((rows, k // 32), jnp.float8_e8m0fnu),
                 fmt=fmt)


def _gemm_order(m, n, k, fmt="nvfp4"):
  """Which implementation `block_scaled_matmul(implementation=None)` runs
  for `[m, k] x [n, k]` here: the first in its order that accepts."""
  q = _nvfp4 if fmt == "nvfp4" else functools.partial(_mx, fmt=fmt)

  def first():
    for name in gemm_api.BLOCK_SCALED_MATMUL.order():
      try:
        jax.eval_shape(functools.partial(gemm_api.block_scaled_matmul,
                                         implementation=name),
                       q(m, k), q(n, k))
        return name
      except NotImplementedError:
        continue
    return "xla"
  return first


def _layer_case(tokens, features=512, out=384, native=True):
  def build():
    model = NVFP4Dense(out, recipe="nvfp4")
    x = jnp.zeros((tokens, features), jnp.bfloat16)
    params = jax.eval_shape(model.init, jax.random.key(0), x)

    def loss(params, x, key):
      y = model.apply(params, x, rngs={RNG_STREAM: key})
      return jnp.sum(y.astype(jnp.float32) ** 2)

    def step(params, x):
      return jax.value_and_grad(loss, argnums=(0, 1))(params, x,
                                                      jax.random.key(1))
    return step, (params, _sds(x.shape, x.dtype))
  return AotCase(
      f"NVFP4Dense fwd+bwd, {tokens} tokens x {features} -> {out}", build,
      native=native, dispatch=lambda: "GEMMs: " + " -> ".join(
          gemm_api.BLOCK_SCALED_MATMUL.order()))


def _moe_case(experts=8, tokens=1000, features=544, out=384,
              recipe="nvfp4"):
  """`nvfp4_jax.ragged_dot` forward and backward (a mixture of experts'
  layer, uneven K) with `recipe` ("nvfp4", "mxfp4", "mxfp8"): on 10.x /
  12.0 its three grouped GEMMs multiply codes in the Triton kernel
  (`ops/ragged_dot/triton.py`)."""
  def build():
    def step(x, w, gs, dy):
      y, vjp = jax.vjp(lambda x, w: ragged_dot(
          x, w, gs, recipe=recipe, key=jax.random.key(0)), x, w)
      return y, vjp(dy)
    return step, (_sds((tokens, features), jnp.bfloat16),
                  _sds((experts, features, out), jnp.float32),
                  _sds((experts,), jnp.int32), _sds((tokens, out), jnp.float32))

  def dispatch_():
    if ragged_api.multiplies_codes():
      return ragged_api.RAGGED_CODES_MATMUL.order()[0]
    return "values: " + " -> ".join(ragged_api.RAGGED_VALUES_MATMUL.order())
  what = "MoE" if recipe == "nvfp4" else f"MoE, {recipe.upper()}"
  return AotCase(
      f"ragged_dot ({what}) fwd+bwd, {experts} experts, {tokens} tokens x "
      f"{features} -> {out}", build, native=None, dispatch=dispatch_)


def aot_cases() -> list[AotCase]:
  """The programs `--target` compiles."""
  x = _sds((256, 512), jnp.bfloat16)
  quantizers = quantizer_cases(jax.random.key(0))
  # 4000 tokens: Wgrad's K = 32 (mod 64) and rows no multiple of 128; on
  # GB10 (no Triton MMA) cuDNN declines those shapes: the emulation runs.
  cases = [_layer_case(256), _layer_case(4000, native=False)]
  for name, fn in quantizers:
    op = _OPS["quantize_pair" if "pair" in name else "quantize_rht_t"
              if "rht_t" in name else "quantize"]
    cases.append(AotCase(name, lambda fn=fn: (fn, (x,)),
                         dispatch=lambda op=op: op.order()[0]))
  cases.append(AotCase(
      "weight_only_matmul 16 x 4096 -> 4096",
      lambda: (functools.partial(weight_only_matmul),
               (_sds((16, 4096), jnp.bfloat16), _nvfp4(4096, 4096))),
      dispatch=lambda: wo_api.WEIGHT_ONLY_MATMUL.order()[0]))
  for m, n, k, what in ((256, 384, 512, ""), (256, 384, 544, ", K = 32 mod 64"),
                        (256, 384, 48, ", K = 48"), (40, 384, 512, ", M = 40")):
    cases.append(AotCase(
        f"NVFP4 GEMM {m}x{n}x{k}{what}",
        lambda m=m, n=n, k=k: (gemm_api.block_scaled_matmul,
                               (_nvfp4(m, k), _nvfp4(n, k))),
        native=None, dispatch=_gemm_order(m, n, k)))
  for impl in gemm_api.BLOCK_SCALED_MATMUL.order()[:-1]:  # Each path named.
    cases.append(AotCase(
        f"NVFP4 GEMM 256x384x512, implementation={impl!r}",
        lambda impl=impl: (functools.partial(
            gemm_api.block_scaled_matmul, implementation=impl),
                           (_nvfp4(256, 512), _nvfp4(384, 512))),
        native=impl in ("triton", "scaled_matmul"), dispatch=lambda: "named"))
  cases += [_moe_case(recipe=r) for r in ("nvfp4", "mxfp4", "mxfp8")]
  for fmt in ("mxfp4", "mxfp8"):
    cases.append(AotCase(
        f"{fmt.upper()} GEMM 256x384x512",
        lambda fmt=fmt: (gemm_api.block_scaled_matmul,
                         (_mx(256, 512, fmt), _mx(384, 512, fmt))),
        native=None, dispatch=_gemm_order(256, 384, 512, fmt)))
  return cases


def _describe(pre: str, post: str, kernels, cudnn_visible: bool = True
              ) -> tuple[str, list[str]]:
  """What a compiled program runs, and what is wrong with it.
  `cudnn_visible=False`: this compile cannot hand block-scaled dots to cuDNN
  (`aot.Compiler.cudnn_visible`), so a decomposition says nothing about the
  GPU: reported, not a failure."""
  low = aot.lowering(post)
  requested = pre.count("__op$block_scaled_dot")
  parts, problems = [], []
  if low.cudnn_block_scaled:
    parts.append(f"cuDNN __cudnn$blockScaledDot x{low.cudnn_block_scaled}"
                 + (f" (alpha in its graph x{low.cudnn_global_scaled})"
                    if low.cudnn_global_scaled else ""))
  if low.triton_calls:
    mma = aot.describe_mma(tuple(sorted({m for k in kernels
                                         for m in aot.ptx_mma(k.ptx)})))
    parts.append(f"Triton {mma} x{low.triton_calls}")
    if "block_scale" not in "".join(m for k in kernels
                                    for m in aot.ptx_mma(k.ptx)):
      problems.append("a Triton GEMM without block-scaled MMA")
  if low.pallas_triton:
    parts.append(f"Pallas-Triton kernels x{low.pallas_triton}")
  decomposed = requested - low.cudnn_block_scaled
  if decomposed > 0 and cudnn_visible:
    problems.append(f"{decomposed} block-scaled dot(s) decomposed by XLA")
    parts.append(f"XLA decomposition (dequantize + dot) x{decomposed}")
  elif decomposed > 0:
    parts.append(f"cuDNN block-scaled dot x{decomposed} (dispatch; not "
                 f"verifiable by this compile: decomposed here)")
  dots = collections.Counter(low.dots)
  if dots and decomposed <= 0:
    parts.append("XLA dot " + ", ".join(f"{t} x{n}" for t, n in dots.items())
                 + (" (emulation)" if not (low.cudnn_block_scaled
                                           or low.triton_calls) else ""))
  if low.cublas:
    parts.append(f"cuBLAS x{len(low.cublas)}")
  return "; ".join(parts) or "elementwise XLA only", problems


def _encoder(post: str) -> str:
  """Which E2M1 encoder the Pallas-Triton kernels of a compiled program
  use: "hardware cvt" where their Triton IR (carried in the optimized HLO)
  has `cvt.rn.satfinite.e2m1x2.f32` (the round-to-nearest quantizers on
  the GPUs where it compiles), "software" where they have none, "-"
  without Pallas-Triton kernels."""
  if "__gpu$xla.gpu.triton" not in post:
    return "-"
  return "hardware cvt" if _E2M1_CVT in post else "software"


def e2m1_probe_line(t: aot.Target, hw: bool) -> str:
  """What `e2m1_encode.hardware_e2m1` answered for the target, in words."""
  from pallas_kernels import e2m1_encode  # pylint: disable=g-import-not-at-top
  arch = f"sm_{t.cc[0]}{t.cc[1]}" + {"ACCELERATED_FEATURES": "a",
                                      "FAMILY_COMPATIBLE_FEATURES": "f"}.get(
                                          t.features, "")
  how = ("known to compile" if t.cc in e2m1_encode.HW_E2M1_CCS else
         "not asked below 10.0" if t.cc < (10, 0) else
         "probed: compiles" if hw else "probed: does not compile")
  return (f"E2M1 conversion ({_E2M1_CVT}) for {arch} ({how}): the "
          f"round-to-nearest quantizers use the "
          f"{'hardware conversion' if hw else 'software encoder'}")


def ahead_of_time(target: str, *, cudnn=aot.DEFAULT_CUDNN, sass: bool = True,
                  cases: list[AotCase] | None = None,
                  features: str | None = "ACCELERATED_FEATURES") -> int:
  """Compiles every case for `target`, prints the tables; the number of
  failed rows (0: all compiled as expected). `features`: the compute
  capability's feature extension (`aot.Target.features`; None: the bare
  capability, e.g. plain sm_120)."""
  from pallas_kernels import e2m1_encode  # pylint: disable=g-import-not-at-top
  t = aot.target(target, features)
  print(f"target: {t.name} ({t.device_kind}), compute capability "
        f"{t.cc[0]}.{t.cc[1]} ({t.features or 'no feature extension'}), "
        f"cuDNN {cudnn[0]}.{cudnn[1]}, compiled ahead of "
        f"time on {jax.devices()[0].platform}\nversions: " + ", ".join(
            f"{p} {_version(p)}" for p in (
                "jax", "jaxlib", "jax-cuda13-plugin", "triton",
                "jax-triton")), flush=True)
  rows, failed = [], 0
  with aot.compiling_for(t, cudnn=cudnn) as c:
    hw = e2m1_encode.hardware_e2m1()
    print(e2m1_probe_line(t, hw), flush=True)
    visible = cudnn < cudnn_api.MIN_CUDNN or c.cudnn_visible()
    decomposes = cudnn < cudnn_api.MIN_CUDNN or not visible
    if not visible:
      print(f"\nNOTE: jax {jax.__version__} compiling without a GPU "
            f"decomposes every block-scaled dot (its deviceless compile sees "
            f"no cuDNN version), so the rows that run cuDNN's block-scaled "
            f"dot cannot be verified here; jax 0.10.2 with jax-cuda13-plugin "
            f"0.10.2 can.", flush=True)
    print("\n" + timing.table([dict(op=name, tries=" -> ".join(op.order()))
                               for name, op in _OPS.items()],
                              ("op", "tries")), flush=True)
    for case in cases if cases is not None else aot_cases():
      row = dict(program=case.name)
      try:
        row["dispatch"] = case.dispatch()
        fn, args = case.build()
        lowered = c.lower(fn, *args)
        pre = lowered.as_text()
        if (decomposes and t.cc >= (11, 0)
            and "__op$block_scaled_dot" in pre):
          # The decomposition converts E2M1 in XLA's own kernels, which
          # jax 0.11.2's XLA aborts the process on for sm_110/sm_120/sm_121
          # (LLVM: "Cannot select: intrinsic llvm.nvvm.e2m1x2.to.f16x2.rn").
          row["lowered to"] = ("not compiled: XLA would decompose it here, "
                               "and jax 0.11.2's XLA aborts compiling that "
                               "decomposition for cc >= 11")
          row["status"] = "skipped"
          rows.append(row)
          continue
        post = lowered.compile().as_text()
        row["lowered to"], problems = _describe(pre, post, c.triton_kernels,
                                                visible)
        row["E2M1 encoder"] = _encoder(post)
        low = aot.lowering(post)
        cudnn_by_dispatch = not visible and "__op$block_scaled_dot" in pre
        native = (case.native if case.native is not None else
                  row["dispatch"] in ("triton", "scaled_matmul"))
        if (native and t.cc >= (10, 0) and not low.cudnn_block_scaled
            and not low.triton_calls and not cudnn_by_dispatch):
          problems.append("no native FP4 GEMM")
      except Exception as e:  # pylint: disable=broad-except
        row["lowered to"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        problems = ["compile error"]
      row["status"] = "FAIL: " + "; ".join(problems) if problems else "ok"
      failed += bool(problems)
      rows.append(row)
  print("\n## Compiled for " + t.name + "\n" + timing.table(rows, AOT_COLS),
        flush=True)
  if sass:
    failed += _sass(t, hw)
  return failed


def _sass(t, hw: bool = False) -> int:
  """The Pallas-Triton kernels' SASS instructions per element on the
  target (`sass_report`), lowered as for the XLA compile (`hw`:
  with the E2M1 conversion where the probe said it compiles); 0, or 1 if
  it could not run."""
  try:
    import triton  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    print(f"\n(SASS report skipped: {e}; it needs the triton package)")
    return 0
  cap = t.cc[0] * 10 + t.cc[1]
  ptxas = sass_report.tool(triton, "ptxas-blackwell" if cap >= 100
                           else "ptxas")
  rows, failures = [], []
  saved = os.environ.get("TRITON_CACHE_DIR")
  with tempfile.TemporaryDirectory(prefix="check_device_sass_") as work:
    # Triton's compile cache: a scratch one, whatever $HOME allows.
    os.environ["TRITON_CACHE_DIR"] = os.path.join(work, "cache")
    for case in sass_report.cases_for(t.cc, hw):
      try:
        lowered = sass_report.lower_case(case, t.cc, hw)
        sub = os.path.join(work, case.name)
        os.makedirs(sub)
        compiled = sass_report.compile_ttir(triton, lowered, cap, ptxas, sub)
        rows.append(sass_report.Row(case, lowered, compiled,
                                    sass_report.parse_sass(compiled.sass,
                                                           lowered.name)))
      except Exception as e:  # pylint: disable=broad-except
        failures.append(f"{case.name}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0][:160] if str(e) else ''}")
  if saved is None:
    os.environ.pop("TRITON_CACHE_DIR", None)
  else:
    os.environ["TRITON_CACHE_DIR"] = saved
  print(f"\n## Quantizer kernels' SASS on sm_{cap} (triton "
        f"{triton.__version__}, static counts; lowered "
        f"{'with' if hw else 'without'} the E2M1 conversion, as for "
        f"{t.features or 'the bare capability'})\n"
        + sass_report.table(rows), flush=True)
  for f in failures:
    print("FAILED", f)
  return len(failures)


def main(argv=None, step: Callable[[bool], str] | None = None):
  """The check's command line.

  Args:
    argv: the flags (default: `sys.argv[1:]`).
    step: `step(small)`, the "GPT train step" section's table, or None: the
      section names the command that times it (the example GPT is not part
      of the library).
  """
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--small", action="store_true",
                 help="small shapes and the tiny preset (a smoke run)")
  p.add_argument("--no-step", action="store_true",
                 help="skip the GPT train-step timing")
  p.add_argument("--target", choices=AOT_TARGETS,
                 help="compile ahead of time for this GPU (no GPU needed) "
                      "and report what each program lowered to")
  p.add_argument("--cudnn", default=None,
                 help="with --target: cuDNN version MAJOR.MINOR to compile "
                      f"against (default {aot.DEFAULT_CUDNN[0]}."
                      f"{aot.DEFAULT_CUDNN[1]})")
  p.add_argument("--features", choices=tuple(FEATURES),
                 default="accelerated",
                 help="with --target: the compute capability's feature "
                      "extension, as XLA compiles for it: 'accelerated' "
                      "(default: sm_XYa, as on the GPU itself), 'family' "
                      "(sm_XYf), 'none' (plain sm_XY, where arch-specific "
                      "instructions such as the E2M1 conversion do not "
                      "exist)")
  p.add_argument("--no-sass", action="store_true",
                 help="with --target: skip the SASS instruction counts")
  a = p.parse_args(argv)
  if a.target and "JAX_PLATFORMS" not in os.environ:
    # As the module's `__main__` sets it, for the console script (before
    # JAX starts a backend).
    jax.config.update("jax_platforms", "cpu")
  if a.target:
    cudnn = (tuple(int(v) for v in a.cudnn.split(".")) if a.cudnn
             else aot.DEFAULT_CUDNN)
    try:
      failed = ahead_of_time(a.target, cudnn=cudnn, sass=not a.no_sass,
                             features=FEATURES[a.features])
    except aot.Unavailable as e:
      raise SystemExit(f"check_device --target: {e}") from e
    if failed:
      raise SystemExit(f"check_device --target {a.target}: {failed} "
                       f"program(s) failed (see the status column).")
    return
  print(header(), flush=True)
  rows = exactness((64, 128) if a.small else (256, 512))
  rows += gemm_exactness(128 if a.small else 512)
  for fmt in ragged_api.CODES_FORMATS:
    rows += ragged_exactness(128 if a.small else 512, fmt)
  print("\n## Exactness\n" + timing.table(rows, ("check", "result")),
        flush=True)
  n = 256 if a.small else 8192
  print("\n## GEMM vs cuBLAS bf16\n" + timing.table(
      speed.gemm_speed(n, n, n, full=True), speed.GEMM_COLS), flush=True)
  dense = speed.layer_speed(*((256, 256, 256) if a.small else
                              (8192, 4096, 4096)))
  print("\n## Layer\n" + timing.table(dense, speed.LAYER_COLS), flush=True)
  if not a.no_step:
    print("\n## GPT train step\n" + (
        step(a.small) if step else "(the example GPT's step: "
        "`python -m benchmarks.check_device` in a source checkout, or "
        "`python -m benchmarks.bench_step`)"), flush=True)


if __name__ == "__main__":
  main()
