"""Check this GPU: which implementations run, are they bit-exact, how fast.

    python -m benchmarks.check_device            # on the GPU (a few minutes)
    python -m benchmarks.check_device --small    # smoke run (CPU: interpreted)

Made for Blackwell users (compute capability 10.x / 12.x), where the default
GEMM is a native FP4 path that the project's own CI and benchmarks cannot
run. Prints, as Markdown tables:

1. the device, versions, and the implementation each op picks by default
   here (`implementation=None`), with the fallbacks in order;
2. exactness: every kernel's bytes (codes, E4M3 scales, amax, SR bits, bf16
   values) against the pure-jnp reference run on the CPU, and every GEMM
   implementation against the reference: bit for bit where every partial sum
   is exact, within the FP32 summation-order bound otherwise;
3. speed, ratios from this run: the NVFP4 GEMM (default, each native path,
   the emulation) against cuBLAS bf16, `NVFP4Dense` fwd+bwd against
   `nn.Dense`, and the GPT `small` train step NVFP4 against BF16 (each step
   configuration in a fresh process, see `benchmarks.bench_step`).

Send the output with a bug report; nothing else is written.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4_jax as nv
from benchmarks import bench_dense
from benchmarks import bench_gemm
from benchmarks import bench_step
from benchmarks import timing
from benchmarks.bench_quantize import check_input
from benchmarks.bench_quantize import exact_vs_cpu
from nvfp4_jax.core import dispatch
from nvfp4_jax.ops.quantize import api as quantize_api
from nvfp4_jax.ops.quantize_pair import api as pair_api
from nvfp4_jax.ops.quantize_rht_t import api as rht_t_api
from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
from nvfp4_jax.ops.block_scaled_matmul import reference as gemm_ref
from nvfp4_jax.core.recipe import Operand

_OPS = {"quantize": quantize_api.QUANTIZE, "quantize_rht_t": rht_t_api.QUANTIZE_RHT_T,
        "quantize_pair": pair_api.QUANTIZE_PAIR,
        "quantize_with_values": quantize_api.QUANTIZE_WITH_VALUES,
        "block_scaled_matmul": gemm_api.BLOCK_SCALED_MATMUL}


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


def exactness(shape) -> list[dict]:
  """Each quantizer (default implementation) against the CPU reference."""
  x = check_input(shape)
  key = jax.random.key(7)
  sr, sr_t = Operand(rounding="stochastic"), Operand(rounding="stochastic",
                                                     rht=True)
  cases = [
      ("quantize 1x16 RTNE", nv.quantize),
      ("quantize 1x16 SR", functools.partial(nv.quantize,
                                             rounding="stochastic", key=key)),
      ("quantize 16x16", functools.partial(nv.quantize, block_2d=True)),
      ("quantize_with_values", quantize_api.quantize_with_values),
      ("quantize_rht_t SR", functools.partial(
          rht_t_api.quantize_rht_t, rounding="stochastic", key=key)),
      ("quantize_pair (dY: SR + RHT)", lambda x: pair_api.quantize_pair(
          x, sr, sr_t, key_row=key, key_t=jax.random.key(8))),
      ("block_dequantize", lambda x: nv.block_dequantize(nv.quantize(x))),
  ]
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
  with nv.default_implementation("xla"):
    return fn(*args)


def gemm_exactness(k: int) -> list[dict]:
  """Every GEMM implementation against the reference."""
  rng = np.random.default_rng(0)
  grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
  xa = rng.choice(grid, (128, k)) * rng.choice([-1, 1], (128, k))
  xb = rng.choice(grid, (64, k)) * rng.choice([-1, 1], (64, k))
  xa[:, ::16], xb[:, ::16] = 6.0, -6.0  # One common scale: exact sums.
  a, b = nv.quantize(jnp.asarray(xa)), nv.quantize(jnp.asarray(xb))
  ha = nv.quantize(jnp.asarray(check_input((128, k), 1), jnp.float32))
  hb = nv.quantize(jnp.asarray(check_input((64, k), 2), jnp.float32),
                   block_2d=True)
  want_exact = np.asarray(jax.jit(functools.partial(
      gemm_api.block_scaled_matmul, implementation="xla"))(a, b))
  want = np.asarray(jax.jit(functools.partial(
      gemm_api.block_scaled_matmul, implementation="xla"))(ha, hb), np.float64)
  va = np.abs(np.asarray(nv.block_dequantize(ha)[0], np.float64))
  vb = np.abs(np.asarray(nv.block_dequantize(hb)[0], np.float64))
  bound = (va @ vb.T) * float(gemm_ref.gemm_alpha(ha, hb)) * k * 2.0**-23
  rows = []
  for impl in (None, "pallas", "triton", "scaled_matmul"):
    name = impl or "default"
    try:
      f = jax.jit(functools.partial(gemm_api.block_scaled_matmul,
                                    implementation=impl))
      exact = np.array_equal(np.asarray(f(a, b)), want_exact)
      within = bool(np.all(np.abs(np.asarray(f(ha, hb), np.float64) - want)
                           <= bound))
      rows.append(dict(check=f"GEMM {name}", result=(
          f"{'exact' if exact else 'DIFFERS'} on exact sums; "
          f"{'within' if within else 'OUTSIDE'} the FP32 order bound")))
    except NotImplementedError as e:
      rows.append(dict(check=f"GEMM {name}", result=f"not here: {e}"[:140]))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(check=f"GEMM {name}", result=f"failed: "
                       f"{type(e).__name__}: {str(e)[:100]}"))
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--small", action="store_true",
                 help="small shapes and the tiny preset (a smoke run)")
  p.add_argument("--no-step", action="store_true",
                 help="skip the GPT train-step timing")
  a = p.parse_args(argv)
  print(header(), flush=True)
  rows = exactness((64, 128) if a.small else (256, 512))
  rows += gemm_exactness(128 if a.small else 512)
  print("\n## Exactness\n" + timing.table(rows, ("check", "result")),
        flush=True)
  n = 256 if a.small else 8192
  print("\n## GEMM vs cuBLAS bf16\n" + timing.table(
      bench_gemm.run_shape(n, n, n, full=True), bench_gemm.COLS), flush=True)
  dense = bench_dense.run(*((256, 256, 256) if a.small else
                            (8192, 4096, 4096)))
  print("\n## Layer\n" + timing.table(dense, bench_dense.COLS), flush=True)
  if not a.no_step:
    cfg = (dict(preset="tiny", batch=4, seq=64, steps=3) if a.small else
           dict(preset="small", batch=64, seq=512, steps=15))
    configs = [bench_step.StepConfig(precision=prec, **cfg)
               for prec in ("bf16", "nvfp4")]
    print("\n## GPT train step\n" + timing.table(
        bench_step.run(configs, repeats=1 if a.small else 2),
        bench_step.COLS), flush=True)


if __name__ == "__main__":
  main()
