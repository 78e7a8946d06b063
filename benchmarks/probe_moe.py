"""Stage by stage: where the NVFP4 grouped GEMM's time and compile time go.

    python -m benchmarks.probe_moe --shape 65536,512,1408,8 --stages fb,fb_bf16,dense_fb,profile
    python -m benchmarks.probe_moe --shape 65536,512,1408,8 --stages stack1,stack2 --recipe bf16
    python -m benchmarks.probe_moe --stages step --preset moe-small --batch 64 --seq 512
    python -m benchmarks.probe_moe --shape 131072,512,1408,8 --stages permute

`--shape M,K,N,E` (balanced groups). Each stage prints its lower and compile
seconds, the first call's and the mean of five calls' wall milliseconds:

- `rows`, `rows_sr`, `tokens`, `experts`: the grouped quantizers alone (X's
  rows, dY's rows with SR, dY's Wgrad operand with RHT and SR, the 16x16
  expert weights);
- `fwd`, `fb`: `nvfp4_jax.ragged_dot` forward, forward + backward (`--recipe`);
  `fb_bf16`: the bf16 recipe; `dense_fb`: a dense bf16 GEMM of the same FLOPs;
- `stackN`: N chained ops forward + backward in one program (how compile
  time grows with the number of ops);
- `profile`: the NVFP4 forward + backward's GPU kernels from a trace, the 30
  longest (a GPU only);
- `step`: the trainer's step for `--preset` (build, lower, compile, median
  of ten steps);
- `permute`: the MoE dispatch's row permutation of the `[M, K]` tokens
  (`moe_routing.permute`: `gather_rows`, a Pallas kernel on GPUs) against XLA's
  gather with a fill, the same with clamped indices and a select, and on
  uint32 words (the same bits): GPU time and bandwidth (a GPU only).

A faulthandler dump every `--dump-after` seconds shows where a stage that
does not finish is.
"""

from __future__ import annotations

import argparse
import faulthandler
import time

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4_jax as nv
from nvfp4_jax.core import recipe as rc
from nvfp4_jax.ops.ragged_quantize import api
from nvfp4_jax.training import ragged_dot as trd
from nvfp4_jax.tools import timing

BF16 = jnp.bfloat16


def timed(name: str, f, *args) -> None:
  t0 = time.perf_counter()
  low = jax.jit(f).lower(*args)
  t1 = time.perf_counter()
  c = low.compile()
  t2 = time.perf_counter()
  jax.block_until_ready(c(*args))
  t3 = time.perf_counter()
  out = None
  for _ in range(5):
    out = c(*args)
  jax.block_until_ready(out)
  t4 = time.perf_counter()
  print(f"{name:10s} lower {t1 - t0:6.2f} s  compile {t2 - t1:6.2f} s  "
        f"first {(t3 - t2) * 1e3:8.2f} ms  mean {(t4 - t3) / 5 * 1e3:8.3f} ms",
        flush=True)


def _fwd_bwd(g):
  def f(x, w, dy):
    y, vjp = jax.vjp(g, x, w)
    return y, *vjp(dy)
  return f


def op_stages(stages, m: int, k: int, n: int, e: int, recipe: str) -> None:
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((m, k)), BF16)
  w = jnp.asarray(rng.standard_normal((e, k, n)) * 0.05, jnp.float32)
  dy = jnp.asarray(rng.standard_normal((m, n)), BF16)
  gs = jnp.full((e,), m // e, jnp.int32)
  key = jax.random.key(0)
  r = rc.as_recipe("nvfp4")
  keys = trd.expert_keys(r, trd.per_expert_keys(key, e))

  def op(name):
    cast = name == "bf16"
    return lambda x, w: nv.ragged_dot(
        x, w.astype(BF16) if cast else w, gs, recipe=name, key=key,
        preferred_element_type=BF16)

  for st in stages:
    if st == "rows":
      timed(st, lambda x: api.quantize_rows(x, gs, r.fprop_x,
                                            keys["fprop_x"]).values, x)
    elif st == "rows_sr":
      timed(st, lambda d: api.quantize_rows(d, gs, r.dgrad_dy,
                                            keys["dgrad_dy"]).values, dy)
    elif st == "tokens":
      timed(st, lambda d: api.quantize_tokens(
          d, gs, r.wgrad_dy, keys["wgrad_dy"], rht_size=r.rht_size,
          sign_vector=r.rht_sign_vector).values, dy)
    elif st == "experts":
      timed(st, lambda w: api.quantize_experts(w, r.fprop_w, None).values, w)
    elif st == "fwd":
      timed(st, op(recipe), x, w)
    elif st == "fb":
      timed(st, _fwd_bwd(op(recipe)), x, w, dy)
    elif st == "fb_bf16":
      timed(st, _fwd_bwd(op("bf16")), x, w, dy)
    elif st == "dense_fb":
      timed(st, _fwd_bwd(lambda x, w: x @ w), x, w[0].astype(BF16), dy)
    elif st.startswith("stack"):
      count = int(st[len("stack"):])
      wk = w[:, :, :k]

      def layers(x, w, count=count):
        h = x
        for i in range(count):
          wi = w * (1 + i)
          h = nv.ragged_dot(h, wi.astype(BF16) if recipe == "bf16" else wi,
                            gs, recipe=recipe, key=jax.random.fold_in(key, i),
                            preferred_element_type=BF16)
        return h

      timed(st, lambda x, w: _fwd_bwd(layers)(x, w, x), x, wk)
    elif st.startswith("permute"):
      # A row permutation as the MoE layer's dispatch runs it
      # (`moe_routing.permute`: `gather_rows`, the Pallas kernel on a GPU), and
      # forms of the same gather to compare: XLA's `jnp.take(mode="fill")`
      # (the reference), the kernel named, indices clamped and a select
      # after it, and the bf16 rows moved as uint32 words (the same bits).
      # The kernels' GPU time: `timing.gpu_kernels`.
      from nvfp4_jax.training import moe_routing  # pylint: disable=g-import-not-at-top
      order = jnp.asarray(rng.permutation(m + m // 8)[:m].astype(np.int32))
      from nvfp4_jax.ops.gather_rows.api import gather_rows  # pylint: disable=g-import-not-at-top
      forms = {
          "permute": lambda x, o: moe_routing.permute(x, o, o),
          "fill": lambda x, o: gather_rows(x, o, implementation="xla"),
          "kernel": lambda x, o: gather_rows(x, o, implementation="pallas"),
          "clip": lambda x, o: jnp.where(
              (o < x.shape[0])[:, None],
              jnp.take(x, o, axis=0, mode="clip"), 0),
          "words": lambda x, o: jax.lax.bitcast_convert_type(
              jnp.take(jax.lax.bitcast_convert_type(
                  x.reshape(x.shape[0], -1, 2), jnp.uint32), o, axis=0,
                       mode="fill", fill_value=0), BF16).reshape(
                           o.shape[0], -1),
      }
      for form, f in forms.items():
        kernels = timing.gpu_kernels(jax.jit(f), [(x, order)], calls=5)
        total = sum(t for _, t in kernels.values())
        if not total:
          print(f"permute {form:7s} no GPU kernels traced", flush=True)
          continue
        print(f"permute {form:7s} {total * 1e3:8.3f} ms GPU per call "
              f"({2 * x.size * 2 / total / 1e9:6.0f} GB/s of rows read and "
              "written)", flush=True)
    elif st == "profile":
      kernels = timing.gpu_kernels(jax.jit(_fwd_bwd(op(recipe))),
                                   [(x, w, dy)], calls=5)
      total = sum(t for _, t in kernels.values())
      print(f"profile: {total * 1e3:.3f} ms GPU per call, {len(kernels)} "
            f"kernels", flush=True)
      for name, (calls, t) in sorted(kernels.items(),
                                     key=lambda kv: -kv[1][1])[:30]:
        print(f"  {t * 1e6:9.1f} us  x{calls:4.1f}  {name[:100]}")
    else:
      raise SystemExit(f"unknown stage {st!r}")


def step_stage(preset: str, precision: str, batch: int, seq: int) -> None:
  from benchmarks.bench_step import StepConfig  # pylint: disable=g-import-not-at-top
  from benchmarks.bench_step import build  # pylint: disable=g-import-not-at-top
  t0 = time.time()
  trainer, state, b = build(StepConfig(preset=preset, precision=precision,
                                       batch=batch, seq=seq))
  t1 = time.time()
  low = trainer.train_step.lower(state, b)
  t2 = time.time()
  c = low.compile()
  t3 = time.time()
  state, m = c(state, b)
  jax.block_until_ready(m)
  times = []
  for _ in range(10):
    s0 = time.perf_counter()
    state, m = c(state, b)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - s0)
  print(f"step {preset} {precision} {batch}x{seq}: build {t1 - t0:.1f} s  "
        f"lower {t2 - t1:.1f} s  compile {t3 - t2:.1f} s  median "
        f"{sorted(times)[5] * 1e3:.2f} ms", flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shape", default="65536,512,1408,8", help="M,K,N,E")
  p.add_argument("--stages", default="fb,fb_bf16,dense_fb")
  p.add_argument("--recipe", default="nvfp4")
  p.add_argument("--preset", default="moe-small")
  p.add_argument("--precisions", default="nvfp4,bf16")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--seq", type=int, default=512)
  p.add_argument("--dump-after", type=int, default=0,
                 help="seconds between stack dumps (0: none)")
  a = p.parse_args(argv)
  if a.dump_after:
    faulthandler.dump_traceback_later(a.dump_after, repeat=True)
  stages = [s for s in a.stages.split(",") if s]
  m, k, n, e = (int(v) for v in a.shape.split(","))
  op_stages([s for s in stages if s != "step"], m, k, n, e, a.recipe)
  if "step" in stages:
    for precision in a.precisions.split(","):
      step_stage(a.preset, precision, a.batch, a.seq)


if __name__ == "__main__":
  main()
