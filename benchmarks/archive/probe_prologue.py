"""Does XLA fuse an NVFP4 decode into its GEMM (a dequantizing prologue)?

On hardware without FP4 tensor cores the block-scaled GEMM multiplies bf16
block values. Today a quantizer (or a dequantize pass) writes those values to
memory and the GEMM reads them back. If XLA fused the decode of codes and
scales into its own Triton GEMM fusion, the values would never be written.

For `a @ b` with `a: [M, K]` quantized 1x16 along K and `b: [K, N]` bf16
block values, this compiles and times several ways of writing the decode of
`a` in jnp, counts the kernels XLA made (a decode fused into the GEMM leaves
one GEMM fusion and no other fusion), and times each against the GEMM on
the values (same run):

  python -m benchmarks.archive.probe_prologue [--shapes 8192x4096x4096,...]
"""

from __future__ import annotations

import argparse
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax.core import numerics as nm
from nvfp4_jax.core import tile
from nvfp4_jax.tools import timing

SHAPES = ((8192, 4096, 4096), (16384, 2304, 768), (16384, 768, 2048),
          (16384, 4096, 768))


def _operands(m: int, n: int, k: int, seed: int):
  rng = np.random.default_rng(seed)
  codes = rng.integers(0, 16, size=(m, k), dtype=np.uint8)
  scales = rng.integers(8, 120, size=(m, k // 16), dtype=np.uint8)
  scales = jax.lax.bitcast_convert_type(jnp.asarray(scales),
                                        jnp.float8_e4m3fn)
  codes = jnp.asarray(codes)
  values = (nm.e2m1_decode(codes).reshape(m, k // 16, 16)
            * scales.astype(jnp.float32)[..., None]).reshape(m, k)
  b = jnp.asarray(rng.standard_normal((k, n), np.float32), jnp.bfloat16)
  packed = nm.pack_e2m1(codes.reshape(m, k // 16, 16)).reshape(m, k // 2)
  f4 = nm.e2m1_decode(codes).astype(jnp.float4_e2m1fn)
  return dict(values=values.astype(jnp.bfloat16), codes=codes, packed=packed,
              f4=f4, scales=scales, b=b)


def _scaled(v, scales):
  m, k = v.shape
  s = scales.astype(jnp.bfloat16)[..., None]
  return (v.reshape(m, k // 16, 16) * s).reshape(m, k)


def _decode_u8(c):
  """E2M1 code per byte -> bf16 by building the bits with integer ops.

  The same values as `numerics.e2m1_decode` (tested), written another way on
  purpose: the probe asks whether XLA fuses any form of the decode, and
  integer bit ops fuse differently from `e2m1_decode`'s float selects.
  """
  c = c.astype(jnp.uint16)
  mag = c & 7
  bits = jnp.where(mag >= 2, (((mag >> 1) + 126) << 7) | ((mag & 1) << 6),
                   jnp.where(mag == 1, jnp.uint16(126 << 7), jnp.uint16(0)))
  bits = bits | ((c >> 3) << 15)
  return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def _dot(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(
      jnp.bfloat16)


VARIANTS = {
    # name: (inputs, fn)
    "GEMM on the values": (("values", "b"), _dot),
    "packed u8 -> tile.block_values": (
        ("packed", "scales", "b"),
        lambda p, s, b: _dot(tile.block_values(
            p.reshape(p.shape[0], -1, 8), s).reshape(p.shape[0], -1), b)),
    "f4e2m1fn -> convert * scale": (
        ("f4", "scales", "b"),
        lambda f, s, b: _dot(_scaled(f.astype(jnp.bfloat16), s), b)),
    "f4e2m1fn -> convert, no scale (other values)": (
        ("f4", "b"), lambda f, b: _dot(f.astype(jnp.bfloat16), b)),
    "u8 code -> int bits * scale": (
        ("codes", "scales", "b"),
        lambda c, s, b: _dot(_scaled(_decode_u8(c), s), b)),
}


def entry_kernels(hlo: str) -> dict[str, int]:
  """The kernels of a compiled module's entry computation, by kind: GEMM
  fusions (XLA's Triton GEMMs, `gemm_fusion*`), other fusions (a decode
  that did not land in a GEMM runs as one of these), library calls."""
  entry = hlo[hlo.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  counts = {"gemm fusions": 0, "other fusions": 0, "library calls": 0}
  for line in entry.splitlines():
    if re.search(r" fusion\(", line):
      gemm = re.search(r"calls=%?gemm_fusion", line)
      counts["gemm fusions" if gemm else "other fusions"] += 1
    elif re.search(r" custom-call\(", line):
      counts["library calls"] += 1
  return counts


def run(shapes=SHAPES, dump: str | None = None) -> list[dict]:
  rows = []
  for m, n, k in shapes:
    sets = [_operands(m, n, k, s) for s in range(2)]
    base = None
    ref = None
    for name, (inputs, fn) in VARIANTS.items():
      f = jax.jit(fn)
      args = [tuple(d[i] for i in inputs) for d in sets]
      compiled = f.lower(*args[0]).compile()
      hlo = compiled.as_text()
      if dump:
        os.makedirs(dump, exist_ok=True)
        tag = re.sub(r"\W+", "_", f"{m}x{n}x{k}_{name}")
        with open(os.path.join(dump, tag + ".hlo"), "w") as fh:
          fh.write(hlo)
      out = np.asarray(f(*args[0]).astype(jnp.float32))
      if ref is None:
        ref = out
      t = timing.bench(f, args, calls=5, reps=7)
      base = base or t
      rows.append(dict(
          shape=f"{m}x{n}x{k}", variant=name, us=round(t * 1e6, 1),
          vs_values=round(base / t, 3),
          max_diff=timing.max_rel_diff(out, ref),
          **entry_kernels(hlo)))
      print(rows[-1], flush=True)
  return rows


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", default=None,
                 help="comma-separated MxNxK (default: the layer and three "
                      "GPT base shapes)")
  p.add_argument("--dump", default=None, help="write each HLO here")
  a = p.parse_args()
  shapes = SHAPES if a.shapes is None else tuple(
      tuple(int(v) for v in s.split("x")) for s in a.shapes.split(","))
  print(jax.devices()[0].device_kind, jax.__version__)
  rows = run(shapes, a.dump)
  print(timing.table(rows, ["shape", "variant", "us", "vs_values",
                            "max_diff", "gemm fusions", "other fusions",
                            "library calls"]))


if __name__ == "__main__":
  main()
