"""`NVFP4Dense` forward+backward vs `nn.Dense` bf16, time and peak memory.

x: [tokens, in] bf16, params FP32 (mixed precision, as the recipe trains),
kernel [in, out]. One step is `jax.vjp` of the layer in (params, x) with a bf16
cotangent: Fprop, Dgrad and Wgrad. Rows: nn.Dense bf16; NVFP4Dense with the
default dispatch (Pallas kernels on GPU); NVFP4Dense with every op forced to
the pure-XLA reference (`nvfp4_jax.default_implementation("xla")`).
Peak memory is XLA's compiled buffer assignment of that step (arguments +
outputs + temporaries), which is what the step needs on the device.
"""

from __future__ import annotations

import argparse
import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp

from benchmarks import timing


def _step(module):
  def f(params, x, dy, key):
    def apply(p, x):
      return module.apply(p, x, rngs={"nvfp4": key})
    y, vjp = jax.vjp(apply, params, x)
    return y, vjp(dy)
  return f


def _peak_bytes(compiled) -> float:
  m = compiled.memory_analysis()
  if m is None:
    return float("nan")
  return float(m.argument_size_in_bytes + m.output_size_in_bytes
               + m.temp_size_in_bytes - m.alias_size_in_bytes)


def run(tokens: int = 8192, d_in: int = 4096, d_out: int = 4096,
        kernels: list | None = None) -> list[dict]:
  """The table's rows; with a `kernels` list, also appends the per-kernel
  GPU time of each case (`timing.gpu_kernels`) to it."""
  try:
    import nvfp4_jax as nf  # pylint: disable=g-import-not-at-top
    dense4 = nf.NVFP4Dense
  except (ImportError, AttributeError) as e:
    return [dict(layer="NVFP4Dense", note=f"unavailable: {e}")]
  x = jax.random.normal(jax.random.key(0), (tokens, d_in),
                        jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(1), (tokens, d_out),
                         jnp.float32).astype(jnp.bfloat16)
  key = jax.random.key(2)
  flops = 3 * 2.0 * tokens * d_in * d_out
  rows = []
  cases = [
      ("nn.Dense bf16", nn.Dense(d_out, dtype=jnp.bfloat16),
       contextlib.nullcontext()),
      ("NVFP4Dense (default: kernels)", dense4(d_out, dtype=jnp.bfloat16),
       contextlib.nullcontext()),
      ("NVFP4Dense (pure XLA reference)", dense4(d_out, dtype=jnp.bfloat16),
       nf.default_implementation("xla")),
  ]
  base = None
  for name, module, ctx in cases:
    params = module.init(jax.random.key(3), x)
    with ctx:
      f = jax.jit(_step(module))
      compiled = f.lower(params, x, dy, key).compile()
      peak = _peak_bytes(compiled)
      t = timing.bench(compiled, [(params, x, dy, key)], calls=5, reps=7)
      if kernels is not None:
        for kname, (n, g) in sorted(timing.gpu_kernels(
            compiled, [(params, x, dy, key)]).items(), key=lambda kv: -kv[1][1]):
          kernels.append(dict(layer=name, kernel=kname[:70], calls=n,
                              us=g * 1e6))
    base = base or (t, peak)
    rows.append(dict(layer=name, ms=t * 1e3, tflops=flops / t / 1e12,
                     vs_bf16=t / base[0], peak_mib=peak / 2**20,
                     peak_vs_bf16=peak / base[1]))
  return rows


COLS = ("layer", "ms", "tflops", "vs_bf16", "peak_mib", "peak_vs_bf16",
        "note")

if __name__ == "__main__":
  p = argparse.ArgumentParser()
  p.add_argument("--tokens", type=int, default=8192)
  p.add_argument("--dim", type=int, default=4096)
  p.add_argument("--kernels", action="store_true",
                 help="also print each case's kernels by GPU time")
  a = p.parse_args()
  ks = [] if a.kernels else None
  print(timing.table(run(a.tokens, a.dim, a.dim, ks), COLS))
  if ks:
    print(timing.table(ks, ("layer", "kernel", "calls", "us")))
