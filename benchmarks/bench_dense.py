"""`NVFP4Dense` forward+backward vs `nn.Dense` bf16, time and peak memory.

x: [tokens, in] bf16, params FP32 (mixed precision, as the recipe trains),
kernel [in, out]. One step is `jax.vjp` of the layer in (params, x) with a bf16
cotangent: Fprop, Dgrad and Wgrad. Rows: nn.Dense bf16; NVFP4Dense with the
default dispatch (Pallas kernels on GPU); NVFP4Dense with every op forced to
the pure-XLA reference (`nvfp4_jax.default_implementation("xla")`).
Peak memory is XLA's compiled buffer assignment of that step (arguments +
outputs + temporaries), which is what the step needs on the device.

    python -m benchmarks.bench_dense                      # 8192 x 4096 x 4096
    python -m benchmarks.bench_dense --shapes transformer,gpt-base --repeats 3

`--shapes` times the layer over many shapes (`SHAPES`: the transformer GEMM
table, tokens 8192 and in, out in {2048, 4096, 8192, 14336}; GPT base's four
layers at 16 x 1024 tokens; or `TOKENSxINxOUT` items) the way
`bench_step` times steps: each (shape, layer) in a fresh process, the
processes interleaved and the whole round repeated. Per shape it reports the
median time per step over all rounds with the spread of the per-round
medians, NVFP4's ratio to bf16 (of the medians, and the spread of the
per-round ratios) and the peak memory ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

from nvfp4_jax.tools import speed
from nvfp4_jax.tools import timing


COLS = speed.LAYER_COLS

# (tokens, in, out) of each `--shapes` preset.
_DIMS = (2048, 4096, 8192, 14336)
SHAPES = {
    "transformer": [(8192, k, n) for n in _DIMS for k in _DIMS],
    # GPT base (d_model 768, d_ff 2048) at 16 x 1024 tokens: qkv, the
    # attention output, the fused gate and up projection, down.
    "gpt-base": [(16384, 768, 2304), (16384, 768, 768), (16384, 768, 4096),
                 (16384, 2048, 768)],
}


def parse_shapes(spec: str) -> list[tuple[int, int, int]]:
  """`--shapes`: comma-separated presets (`SHAPES`) and `TOKENSxINxOUT`."""
  out = []
  for item in spec.split(","):
    if item in SHAPES:
      out += SHAPES[item]
      continue
    try:
      t, i, o = (int(v) for v in item.lower().split("x"))
    except ValueError:
      raise SystemExit(
          f"--shapes: {item!r} is neither a preset ({', '.join(SHAPES)}) nor "
          f"TOKENSxINxOUT, e.g. 8192x4096x4096.") from None
    out.append((t, i, o))
  return out


def _child(tokens: int, d_in: int, d_out: int, layer: str) -> dict:
  """Times one layer's step at one shape in this process."""
  import nvfp4_jax as nf  # pylint: disable=g-import-not-at-top
  if layer == "bf16":
    module = nn.Dense(d_out, dtype=jnp.bfloat16)
  else:  # "nvfp4" (the default recipe) or "nvfp4-RESIDUALS".
    recipe = None
    if layer != "nvfp4":
      recipe = nf.Recipe.nvfp4(residuals=layer.split("-", 1)[1])
    module = nf.NVFP4Dense(d_out, dtype=jnp.bfloat16, recipe=recipe)
  x, dy, key = speed.layer_inputs(tokens, d_in, d_out)
  params = module.init(jax.random.key(3), x)
  compiled = jax.jit(speed.layer_step(module)).lower(params, x, dy,
                                                     key).compile()
  times = timing.bench_samples(compiled, [(params, x, dy, key)], calls=5,
                               reps=7)
  return {"times": times, "peak": speed.peak_bytes(compiled),
          "device": jax.devices()[0].device_kind, "jax": jax.__version__}


def run_shapes(shapes: list[tuple[int, int, int]], repeats: int = 3,
               log=sys.stderr, residuals: tuple[str, ...] = ("codes",)
               ) -> list[dict]:
  """Each (shape, layer) in a fresh process, interleaved, `repeats` rounds;
  one row per shape and NVFP4 `residuals` choice (`Recipe.residuals`)."""
  layers = ["bf16"] + ["nvfp4" if r == "codes" else f"nvfp4-{r}"
                       for r in residuals]
  res = {(s, l): [] for s in shapes for l in layers}
  for _ in range(repeats):
    for s in shapes:
      for l in layers:
        res[s, l].append(timing.run_child("benchmarks.bench_dense", [*s, l],
                                          f"{s} {l}"))
        print(f"{'x'.join(map(str, s))} {l}: "
              f"{statistics.median(res[s, l][-1]['times']) * 1e3:.3f} ms",
              file=log, flush=True)
  rows = []
  for s, l in ((s, l) for s in shapes for l in layers[1:]):
    b, q = res[s, "bf16"], res[s, l]
    med = lambda runs: statistics.median(t for r in runs for t in r["times"])
    per_round = [statistics.median(rq["times"]) / statistics.median(rb["times"])
                 for rb, rq in zip(b, q)]
    tb, tq = med(b), med(q)
    rows.append(dict(
        shape="x".join(map(str, s)) + ("" if l == "nvfp4" else
                                        f" residuals={l.split('-', 1)[1]}"),
        bf16_ms=tb * 1e3, bf16_spread=_span(b),
        nvfp4_ms=tq * 1e3, nvfp4_spread=_span(q),
        ratio=tq / tb, ratio_spread=f"{min(per_round):.3f}-{max(per_round):.3f}",
        peak_ratio=q[0]["peak"] / b[0]["peak"],
        device=b[0]["device"], jax=b[0]["jax"]))
  return rows


def _span(runs: list[dict]) -> str:
  """`min-max` ms of the runs' (rounds') median step times."""
  ms = [statistics.median(r["times"]) * 1e3 for r in runs]
  return f"{min(ms):.4g}-{max(ms):.4g}"


SHAPE_COLS = ("shape", "bf16_ms", "bf16_spread", "nvfp4_ms", "nvfp4_spread",
              "ratio", "ratio_spread", "peak_ratio")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, default=8192)
  p.add_argument("--dim", type=int, default=4096)
  p.add_argument("--kernels", action="store_true",
                 help="also print each case's kernels by GPU time")
  p.add_argument("--shapes", default=None,
                 help="comma list of presets (" + ", ".join(SHAPES) +
                 ") and TOKENSxINxOUT: each in fresh processes (see above)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--residuals", default="codes",
                 help="with --shapes: comma list of the NVFP4 layer's "
                 "Recipe.residuals to time (codes, values), a row each")
  p.add_argument("--child", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.repeats < 1:
    p.error(f"--repeats must be at least 1, got {a.repeats}.")
  if a.child:
    print(json.dumps(_child(*json.loads(a.child))))
    return
  if a.shapes:
    rows = run_shapes(parse_shapes(a.shapes), a.repeats,
                      residuals=tuple(a.residuals.split(",")))
    print(f"device: {rows[0]['device']}; jax {rows[0]['jax']}; {a.repeats} "
          f"rounds, a fresh process per (shape, layer); fwd+bwd per step")
    print(timing.table(rows, SHAPE_COLS))
    return
  ks = [] if a.kernels else None
  print(timing.table(speed.layer_speed(a.tokens, a.dim, a.dim, ks),
                     COLS))
  if ks:
    print(timing.table(ks, ("layer", "kernel", "calls", "us")))


if __name__ == "__main__":
  main()
