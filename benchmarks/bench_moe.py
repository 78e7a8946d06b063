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
checked in the same run: three groups of each against dense GEMMs of their
rows (max relative difference; bf16 outputs: up to 2^-8 is one rounding).
tokamax's `ragged_dot` (its default implementation on the GPU, forward
and `jax.vjp`), timed where `import tokamax` works (carried as wheels to a
machine without a network); the table says "not installed" otherwise.
`--profile` prints each kernel's GPU time. `--quick`: 16k tokens only,
`lax.ragged_dot` timed for the last model's balanced routing only (it runs
at 1-2% of dense; at 64k tokens it is not timed). `--smoke` (CPU): tiny
shapes, the per-group reference in place of the kernels, nothing timed that matters.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax.tools import timing

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


def _tokamax():
  """tokamax's `ragged_dot`, or the reason it does not import."""
  try:
    import tokamax  # pylint: disable=g-import-not-at-top
  except Exception as ex:  # pylint: disable=broad-except
    return f"not installed ({type(ex).__name__}: {ex})"[:200]
  return tokamax.ragged_dot


def measure(model, tokens, routing, *, with_lax: bool, smoke: bool,
            calls: int, reps: int, profile: bool = False,
            ours_first: bool = False) -> dict:
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
  of = jax.jit(lambda a, b, g: fprop(a, b, g, out_dtype=BF16))
  od = jax.jit(lambda a, b, g: fprop(a, b, g, out_dtype=BF16,
                                     vb_layout="nk"))
  ow = jax.jit(lambda a, b, g: wgrad(a, b, g, out_dtype=BF16,
                                     tokens_last=False))
  # Interleaved per GEMM (dense, ours; or ours, dense), so both see the same
  # clocks.
  d, o = [], []
  for (df, da), (kf, ka) in (((dense_f, (x, w0)), (of, (x, w, gs))),
                             ((dense_f, (dy, w0.T)), (od, (dy, w, gs))),
                             ((dense_t, (x, dy)), (ow, (x, dy, gs)))):
    if ours_first:
      o.append(t(kf, [ka]))
    d.append(t(df, [da]))
    if not ours_first:
      o.append(t(kf, [ka]))

  # The first, the largest and the last non-empty group against dense GEMMs
  # of their rows (XLA's grouped GEMM runs out of memory at these shapes).
  sizes = np.asarray(gs)
  ends = np.cumsum(sizes)
  nz = np.flatnonzero(sizes)
  got_f, got_d, got_w = of(x, w, gs), od(dy, w, gs), ow(x, dy, gs)
  errs = {"fwd err": [], "dgrad err": [], "wgrad err": []}
  for g in sorted({int(nz[0]), int(np.argmax(sizes)), int(nz[-1])}):
    s0, s1 = int(ends[g] - sizes[g]), int(ends[g])
    errs["fwd err"].append(timing.max_rel_diff(got_f[s0:s1],
                                               dense_f(x[s0:s1], w[g])))
    errs["dgrad err"].append(timing.max_rel_diff(got_d[s0:s1],
                                                 dense_f(dy[s0:s1], w[g].T)))
    errs["wgrad err"].append(timing.max_rel_diff(got_w[g],
                                                 dense_t(x[s0:s1], dy[s0:s1])))
  row.update({k: max(v) for k, v in errs.items()})
  del got_f, got_d, got_w

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
    lax_f = jax.jit(lambda a, b, g: jax.lax.ragged_dot(
        a, b, g, preferred_element_type=F32).astype(BF16))
    slow = functools.partial(timing.bench, calls=1, reps=3 if not smoke
                             else 1)
    for key, fn, a in (("lax fwd", lax_f, (x, w, gs)),
                       ("lax f+b", jax.jit(lax_fb), (x, w, gs, dy))):
      try:
        sec = slow(fn, [a]) / (1 if key == "lax fwd" else 3)
        row[key] = flop / sec / 1e12
        if key == "lax fwd":
          row["lax fwd ratio"] = d[0] / sec
      except jax.errors.JaxRuntimeError as ex:  # Its autotuner: OOM.
        row[key] = ("OOM" if "RESOURCE_EXHAUSTED" in str(ex)
                    or "Out of memory" in str(ex) else "error")
  tk = _tokamax() if not smoke else "not timed (--smoke)"
  if isinstance(tk, str):
    row["tokamax fwd"] = row["tokamax f+b"] = tk.split(" (")[0]
    if "(" in tk:
      print(f"  tokamax: {tk}", flush=True)
  else:
    def tk_fb(a, b, g, cot):
      y, vjp = jax.vjp(lambda a, b: tk(
          a, b, g, preferred_element_type=F32).astype(BF16), a, b)
      return y, vjp(cot)
    tk_f = jax.jit(lambda a, b, g: tk(a, b, g, preferred_element_type=F32
                                      ).astype(BF16))
    for key, fn, a in (("tokamax fwd", tk_f, (x, w, gs)),
                       ("tokamax f+b", jax.jit(tk_fb), (x, w, gs, dy))):
      try:
        sec = t(fn, [a]) / (1 if key == "tokamax fwd" else 3)
        row[key] = flop / sec / 1e12
        row[key + " ratio"] = (
            d[0] / sec if key == "tokamax fwd" else sum(d) / (3 * sec))
      except Exception as ex:  # pylint: disable=broad-except
        row[key] = f"error: {type(ex).__name__}"
        print(f"  tokamax {key}: {str(ex)[:300]}", flush=True)
  if profile:
    for label, fn, a in (("fwd", of, (x, w, gs)), ("dgrad", od, (dy, w, gs)),
                         ("wgrad", ow, (x, dy, gs))):
      ks = timing.gpu_kernels(fn, [a], calls=5)
      print(f"  {name} {routing} ours {label} GPU us per call:",
            {kn[:40]: round(v[1] * 1e6, 1) for kn, v in ks.items()},
            flush=True)
  return row


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--quick", action="store_true")
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--models", default="")
  p.add_argument("--tokens", default="",
                 help="comma-separated token counts (default 16384,65536)")
  p.add_argument("--ours-first", action="store_true",
                 help="time the kernels before the dense GEMM of each pair")
  p.add_argument("--profile", action="store_true",
                 help="print each kernel's GPU time of the three GEMMs")
  args = p.parse_args(argv)
  if args.smoke:
    models = [("tiny", 4, 128, 256, 2)]
    token_counts = [64]
    calls, reps = 1, 1
  else:
    models = [mm for mm in MODELS
              if not args.models or mm[0] in args.models.split(",")]
    if not models:
      p.error(f"--models {args.models!r} names none of "
              f"{[mm[0] for mm in MODELS]} (comma-separated).")
    token_counts = [16384] if args.quick else [16384, 65536]
    if args.tokens:
      token_counts = [int(v) for v in args.tokens.split(",")]
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
                    smoke=args.smoke, calls=calls, reps=reps,
                    profile=args.profile and not args.smoke,
                    ours_first=args.ours_first)
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
      "lax fwd", "tokamax fwd", "ours fwd", "fwd ratio", "tokamax fwd ratio",
      "dense f+b", "lax f+b", "tokamax f+b", "ours f+b", "f+b ratio",
      "tokamax f+b ratio", "dgrad ratio", "wgrad ratio", "lax fwd ratio",
      "fwd err",
      "dgrad err", "wgrad err")))
  return rows


if __name__ == "__main__":
  main()
