"""GPU facts the kernels rely on, checked on the device (prints a table).

1. FP32 division inside Pallas-Triton: `/` vs `fp32.exact_divide` (inline
   `div.rn.f32`) against NumPy's correctly rounded division, on the block
   encode scale's actual operands (`1 / (f32(d_e4m3) * inv_s_enc)`).
2. `tl.dot_scaled` with NVFP4 (E4M3, block-16) scales on this GPU: native
   (Triton's own decomposition on Hopper) vs the written-out decomposition.
3. XLA:GPU "excess precision": does a bf16 rounding feeding an FP32 consumer
   in one fusion survive? And the reference quantizer on GPU vs on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from nvfp4_jax.ops.block_scaled_matmul import api as gemm_api
from nvfp4_jax.ops.quantize import api as quantize_api
from nvfp4_jax.ops.quantize import reference as quantize_ref
from pallas_kernels import fp32
from pallas_kernels import launch


def division() -> list[str]:
  rng = np.random.default_rng(0)
  n = 1 << 20
  d = rng.integers(1, 127, n).astype(np.uint8).view(jnp.float8_e4m3fn)
  d = np.asarray(d, np.float32)
  inv = np.float32(1) / (np.float32(2688) / rng.uniform(1e-3, 1e4, n)
                         ).astype(np.float32)
  denom = (d * inv.astype(np.float32)).astype(np.float32)
  want = (np.float32(1) / denom).astype(np.float32)
  out = []
  for name, div in (("a / b", jnp.divide),
                    ("div.rn.f32", fp32.exact_divide(False))):
    def kernel(x_ref, o_ref, div=div):
      o_ref[...] = div(jnp.float32(1.0), x_ref[...])
    f = pl.pallas_call(kernel, grid=(n // 1024,),
                       in_specs=[pl.BlockSpec((1024,), lambda i: (i,))],
                       out_specs=pl.BlockSpec((1024,), lambda i: (i,)),
                       out_shape=jax.ShapeDtypeStruct((n,), jnp.float32))
    got = np.asarray(jax.jit(f)(jnp.asarray(denom)))
    bad = int(np.sum(got.view(np.uint32) != want.view(np.uint32)))
    out.append(f"| division {name} | {bad} of {n} differ from IEEE |")
  return out


def dot_scaled() -> list[str]:
  a = jax.random.normal(jax.random.key(0), (256, 512), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (384, 512), jnp.float32)
  qa, qb = quantize_api.quantize(a), quantize_api.quantize(b)
  want = np.asarray(gemm_api.block_scaled_matmul(qa, qb, implementation="xla"))
  out = []
  try:
    f = jax.jit(functools.partial(gemm_api.block_scaled_matmul,
                                  implementation="triton"))
    got = np.asarray(f(qa, qb))
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    out.append(f"| tl.dot_scaled | max rel err {err:.2e} |")
  except Exception as e:  # pylint: disable=broad-except
    msg = str(e).replace("\n", " ")[:300]
    out.append(f"| tl.dot_scaled | FAILED {type(e).__name__}: {msg} |")
  return out


def excess_precision() -> list[str]:
  from nvfp4_jax.core.hadamard import rht  # pylint: disable=g-import-not-at-top
  cpu = jax.devices("cpu")[0]
  x = (jax.random.normal(jax.random.key(0), (2048, 1024), jnp.float32) * 3
       ).astype(jnp.bfloat16)

  def both(fn):
    g = jax.jit(fn)(x)
    with jax.default_device(cpu):
      c = jax.jit(fn)(jax.device_put(x, cpu))
    return jax.tree.leaves(g), jax.tree.leaves(c)

  out = []
  g, c = both(lambda x: rht(x.T).astype(jnp.float32) * 3.0)
  bad = int(np.sum(np.asarray(g[0]) != np.asarray(c[0])))
  out.append(f"| rht(x.T) -> f32 * 3 fused, GPU vs CPU | {bad} of {x.size} "
             f"differ |")
  for name, fn in (
      ("quantize_reference(rht(x.T))",
       lambda x: quantize_ref.quantize_reference(rht(x.T))),
      ("quantize_reference(rht(x.T), SR)",
       lambda x: quantize_ref.quantize_reference(rht(x.T), rounding="stochastic",
                                          key=jax.random.key(3))),
      ("quantize_reference(x)", quantize_ref.quantize_reference)):
    g, c = both(fn)
    bad = [int(np.sum(np.atleast_1d(np.asarray(a)).view(np.uint8)
                      != np.atleast_1d(np.asarray(b)).view(np.uint8)))
           for a, b in zip(g, c)]
    out.append(f"| {name} GPU vs CPU | differing bytes (codes, scales, "
               f"amax): {bad} |")
  return out


if __name__ == "__main__":
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"cc {launch.compute_capability()}")
  print("| probe | result |\n| --- | --- |")
  for line in division() + dot_scaled() + excess_precision():
    print(line, flush=True)
