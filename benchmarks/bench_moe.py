"""The MoE grouped GEMMs against a dense GEMM of the same FLOPs (GPU).

`python -m benchmarks.bench_moe [--quick] [--smoke]`

For each MoE layer shape (E experts, K model width, N expert width, top-k,
tokens; M = tokens x top-k routed rows) and routing (balanced: M / E rows
per expert; skewed: a Dirichlet(0.3) draw with a fixed seed, three experts
empty), the bf16 GEMMs of one expert projection, bf16 output, FP32
accumulation:

  Fprop  y[r]  = x[r] @ w[g(r)]          [M, K] x [E, K, N] -> [M, N]
  Dgrad  dx[r] = dy[r] @ w[g(r)].T       [M, N] x [E, K, N] -> [M, K]
  Wgrad  dw[e] = x[rows_e].T @ dy[rows_e]                   -> [E, K, N]

timed for: the dense bf16 GEMM of the same FLOPs (XLA, the ceiling; its
Wgrad is `[K, M] x [M, N]`), `jax.lax.ragged_dot` (XLA's grouped GEMM; its
backward by `jax.vjp`) and the Mosaic GPU kernels
(`nvfp4_jax.ops.ragged_dot.pallas_mosaic_gpu`, each call including the
small XLA ops that build its group map). TFLOP/s count 2 M K N per GEMM;
"fwd+bwd" is the sum of the three GEMMs' times. The kernels' results are
checked against `jax.lax.ragged_dot` in the same run (max relative
difference). `--quick`: 16k tokens only, `lax.ragged_dot` timed on the
smallest shape only. `--smoke` (CPU): tiny shapes, the per-group reference
in place of the kernels, nothing timed that matters.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing

MODELS = (  # name, E, K, N, top-k
    ("mixtral", 8, 4096, 14336, 2),
    ("deepseek-64", 64, 2048, 1408, 6),
    ("qwen-128", 128, 2048, 768, 8),
)
F32 = jnp.float32
BF16 = jnp.bfloat16


def group_sizes(m: int, e: int, routing: str, seed: int = 0) -> np.ndarray:
  """Rows per expert summing to m: balanced, or a Dirichlet(0.3) draw with
  three experts empty (fixed seed)."""
  if routing == "balanced":
    sizes = np.full(e, m // e)
    sizes[: m - sizes.sum()] += 1
    return sizes.astype(np.int32)
  rng = np.random.default_rng(seed)
  p = rng.dirichlet(np.full(e, 0.3))
  p[rng.choice(e, size=min(3, e - 1), replace=False)] = 0
  p /= p.sum()
  sizes = np.floor(p * m).astype(np.int64)
  sizes[np.argmax(sizes)] += m - sizes.sum()
  return sizes.astype(np.int32)


def _ref_fprop(va, vb, gs, *, vb_layout="kn", out_dtype=BF16):
  """Per-group reference (the smoke run's stand-in for the kernels)."""
  e = vb.shape[0]
  ends = jnp.cumsum(gs)
  rows = jnp.arange(va.shape[0])
  g = jnp.sum(rows[:, None] >= ends[None, :], axis=1)
  w = vb if vb_layout == "kn" else jnp.swapaxes(vb, 1, 2)
  y = jnp.einsum("mk,mkn->mn", va.astype(F32),
                 w[jnp.minimum(g, e - 1)].astype(F32))
  return jnp.where((g < e)[:, None], y, 0).astype(out_dtype)


def _ref_wgrad(va, vb, gs, *, tokens_last=False, out_dtype=BF16):
  e = gs.shape[0]
  if tokens_last:
    va, vb = va.T, vb.T
  ends = jnp.cumsum(gs)
  rows = jnp.arange(va.shape[0])
  g = jnp.sum(rows[:, None] >= ends[None, :], axis=1)
  onehot = (g[:, None] == jnp.arange(e)[None, :]).astype(F32)
  return jnp.einsum("me,mk,mn->ekn", onehot, va.astype(F32),
                    vb.astype(F32)).astype(out_dtype)


def _ours(smoke: bool):
  if smoke:
    return _ref_fprop, _ref_wgrad
  from nvfp4_jax.ops.ragged_dot import pallas_mosaic_gpu as rk  # pylint: disable=g-import-not-at-top
  return rk.ragged_values_matmul, rk.ragged_values_matmul_t


def measure(model, tokens, routing, *, with_lax: bool, smoke: bool,
            calls: int, reps: int) -> dict:
  name, e, k, n, topk = model
  m = tokens * topk
  gs = jnp.asarray(group_sizes(m, e, routing))
  keys = jax.random.split(jax.random.key(tokens + e), 3)
  x = jax.random.normal(keys[0], (m, k), F32).astype(BF16)
  w = (jax.random.normal(keys[1], (e, k, n), F32) / np.sqrt(k)).astype(BF16)
  dy = jax.random.normal(keys[2], (m, n), F32).astype(BF16)
  fprop, wgrad = _ours(smoke)
  t = functools.partial(timing.bench, calls=calls, reps=reps)
  flop = 2.0 * m * k * n
  row = dict(model=name, E=e, K=k, N=n, tokens=tokens, M=m, routing=routing,
             empty=int(np.sum(np.asarray(gs) == 0)))

  dense_f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=F32
                                         ).astype(BF16))
  dense_t = jax.jit(lambda a, b: jax.lax.dot_general(
      a, b, (((0,), (0,)), ((), ())), preferred_element_type=F32
  ).astype(BF16))
  w0 = w[0]
  d = [t(dense_f, [(x, w0)]), t(dense_f, [(dy, w0.T)]), t(dense_t, [(x, dy)])]

  of = jax.jit(lambda a, b, g: fprop(a, b, g, out_dtype=BF16))
  od = jax.jit(lambda a, b, g: fprop(a, b, g, out_dtype=BF16,
                                     vb_layout="nk"))
  ow = jax.jit(lambda a, b, g: wgrad(a, b, g, out_dtype=BF16,
                                     tokens_last=False))
  o = [t(of, [(x, w, gs)]), t(od, [(dy, w, gs)]), t(ow, [(x, dy, gs)])]

  lax_f = jax.jit(lambda a, b, g: jax.lax.ragged_dot(
      a, b, g, preferred_element_type=F32).astype(BF16))
  want = lax_f(x, w, gs)
  row["fwd err"] = timing.max_rel_diff(of(x, w, gs), want)
  want_w = jax.jit(lambda a, b, g: jax.lax.ragged_dot_general(
      a, b, g, jax.lax.RaggedDotDimensionNumbers(
          (((0,), (0,)), ((), ())), [0], []),
      preferred_element_type=F32).astype(BF16))(x, dy, gs)
  row["wgrad err"] = timing.max_rel_diff(ow(x, dy, gs), want_w)
  del want, want_w

  row["dense fwd"] = flop / d[0] / 1e12
  row["ours fwd"] = flop / o[0] / 1e12
  row["fwd ratio"] = d[0] / o[0]
  row["dense f+b"] = 3 * flop / sum(d) / 1e12
  row["ours f+b"] = 3 * flop / sum(o) / 1e12
  row["f+b ratio"] = sum(d) / sum(o)
  row["dgrad ratio"] = d[1] / o[1]
  row["wgrad ratio"] = d[2] / o[2]
  if with_lax:
    def lax_fb(a, b, g, cot):
      y, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(
          a, b, g, preferred_element_type=F32).astype(BF16), a, b)
      return y, vjp(cot)
    lf = t(lax_f, [(x, w, gs)])
    lfb = t(jax.jit(lax_fb), [(x, w, gs, dy)])
    row["lax fwd"] = flop / lf / 1e12
    row["lax f+b"] = 3 * flop / lfb / 1e12
    row["lax fwd ratio"] = d[0] / lf
  return row


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--quick", action="store_true")
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--models", default="")
  args = p.parse_args(argv)
  if args.smoke:
    models = [("tiny", 4, 128, 256, 2)]
    token_counts = [64]
    calls, reps = 1, 1
  else:
    models = [mm for mm in MODELS
              if not args.models or mm[0] in args.models.split(",")]
    token_counts = [16384] if args.quick else [16384, 65536]
    calls, reps = (5, 5) if args.quick else (10, 7)
  rows = []
  t0 = time.time()
  for tokens in token_counts:
    for model in models:
      for routing in ("balanced", "skewed"):
        with_lax = args.smoke or not args.quick or (
            model[0] == models[-1][0] and routing == "balanced")
        if not args.smoke and tokens > 16384:
          with_lax = False  # Seconds per call: known to be 1-2% of dense.
        r = measure(model, tokens, routing, with_lax=with_lax,
                    smoke=args.smoke, calls=calls, reps=reps)
        rows.append(r)
        print({k: (round(v, 4) if isinstance(v, float) else v)
               for k, v in r.items()}, f"[{time.time() - t0:.0f}s]",
              flush=True)
  dev = jax.devices()[0]
  print(f"\n{getattr(dev, 'device_kind', dev.platform)}, jax "
        f"{jax.__version__}, bf16 operands and output; TFLOP/s; ratios = "
        "dense time / time.\n")
  print(timing.table(rows, (
      "model", "E", "tokens", "M", "routing", "empty", "dense fwd",
      "lax fwd", "ours fwd", "fwd ratio", "dense f+b", "lax f+b", "ours f+b",
      "f+b ratio", "dgrad ratio", "wgrad ratio", "lax fwd ratio", "fwd err",
      "wgrad err")))
  return rows


if __name__ == "__main__":
  main()
