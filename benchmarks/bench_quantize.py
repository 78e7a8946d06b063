"""Quantize kernels: achieved TB/s vs the copy bandwidth, and vs pure XLA.

Bytes are the fewest a single pass can move: each input element read once
(2 B for bf16) plus the outputs written once (0.5 B of codes + 1/16 B of
scales per element; +2 B with the bf16 block values). Rows "+amax" include
the separate tensor-amax pass (a global max must be complete before encoding),
which reads the input a second time but is not counted in the bytes: their
TB/s is effective throughput, the ratio what a caller gets.
"""

from __future__ import annotations

import argparse
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4_jax as nf
from nvfp4_jax.ops.quantize import api as quantize_api
from nvfp4_jax.ops.quantize_pair import api as pair_api
from nvfp4_jax.ops.quantize_rht_t import api as rht_t_api
from nvfp4_jax.core import numerics as nm
from nvfp4_jax.ops.block_values import reference as values_ref
from nvfp4_jax.ops.quantize import reference as quantize_ref
from nvfp4_jax.core.recipe import Operand
from nvfp4_jax.ops.quantize import pallas_triton as pq
from nvfp4_jax.ops.block_values import pallas_triton as pbd
from pallas_kernels import e2m1_decode
from pallas_kernels import e2m1_encode
from nvfp4_jax.ops.quantize_rht_t import pallas_triton as pr
from nvfp4_jax.tools import timing
from nvfp4_jax.tools.check_device import check_input
from nvfp4_jax.tools.check_device import exact_vs_cpu
from nvfp4_jax.tools.check_device import same_bytes

Q_BYTES = 0.5 + 1 / 16  # Codes + scales written per element.


RTNE = Operand(format="nvfp4")
RTNE_RHT = Operand(format="nvfp4", rht=True)
SR = Operand(format="nvfp4", rounding="stochastic")
SR_RHT = Operand(format="nvfp4", rounding="stochastic", rht=True)


def variants(key):
  """(name, bytes/elem, pallas fn, xla fn, needs_amax_t?) over x [T, F]."""
  q = functools.partial
  k_row, k_t = pair_api.split_key(key)
  return [
      ("quantize 1x16 RTNE", 2 + Q_BYTES,
       lambda x, a: quantize_api.quantize(x, amax=a, implementation="pallas"),
       lambda x, a: quantize_api.quantize(x, amax=a, implementation="xla"), "x"),
      ("quantize 1x16 RTNE +amax", 2 + Q_BYTES,
       q(quantize_api.quantize, implementation="pallas"),
       q(quantize_api.quantize, implementation="xla"), None),
      ("quantize 1x16 SR", 2 + Q_BYTES,
       lambda x, a: quantize_api.quantize(x, amax=a, rounding="stochastic", key=key,
                                   implementation="pallas"),
       lambda x, a: quantize_api.quantize(x, amax=a, rounding="stochastic", key=key,
                                   implementation="xla"), "x"),
      ("quantize 1x16 SR +amax", 2 + Q_BYTES,
       q(quantize_api.quantize, rounding="stochastic", key=key,
         implementation="pallas"),
       q(quantize_api.quantize, rounding="stochastic", key=key,
         implementation="xla"), None),
      ("quantize 16x16 RTNE +amax", 2 + Q_BYTES,
       q(quantize_api.quantize, block_2d=True, implementation="pallas"),
       q(quantize_api.quantize, block_2d=True, implementation="xla"), None),
      ("quantize 1x16 + bf16 values +amax", 4 + Q_BYTES,
       q(quantize_api.quantize_with_values, implementation="pallas"),
       q(quantize_api.quantize_with_values, implementation="xla"), None),
      ("rht_t RTNE", 2 + Q_BYTES,
       lambda x, a: rht_t_api.quantize_rht_t(x, amax=a, implementation="pallas"),
       lambda x, a: rht_t_api.quantize_rht_t(x, amax=a, implementation="xla"),
       "t"),
      ("rht_t RTNE +amax", 2 + Q_BYTES,
       q(rht_t_api.quantize_rht_t, implementation="pallas"),
       q(rht_t_api.quantize_rht_t, implementation="xla"), None),
      ("rht_t SR", 2 + Q_BYTES,
       lambda x, a: rht_t_api.quantize_rht_t(x, amax=a, rounding="stochastic",
                                         key=key, implementation="pallas"),
       lambda x, a: rht_t_api.quantize_rht_t(x, amax=a, rounding="stochastic",
                                         key=key, implementation="xla"), "t"),
      ("rht_t SR +amax", 2 + Q_BYTES,
       q(rht_t_api.quantize_rht_t, rounding="stochastic", key=key,
         implementation="pallas"),
       q(rht_t_api.quantize_rht_t, rounding="stochastic", key=key,
         implementation="xla"), None),
      ("x + rht_t RTNE +amax", 2 + 2 * Q_BYTES,
       q(pair_api.quantize_x_and_rht_t, implementation="pallas"),
       q(pair_api.quantize_x_and_rht_t, implementation="xla"), None),
      ("x + rht_t SR +amax", 2 + 2 * Q_BYTES,
       q(pair_api.quantize_x_and_rht_t, key=key, implementation="pallas"),
       q(pair_api.quantize_x_and_rht_t, key=key, implementation="xla"), None),
      # The pairs as the layer quantizes them on Hopper (`NVFP4Values` for
      # the operands multiplied at once: no dequantize pass follows).
      ("X pair as used: x values + rht_t codes, RTNE +amax", 4 + Q_BYTES,
       q(pair_api.quantize_pair, row=RTNE, wgrad=RTNE_RHT, values=(True, False),
         implementation="pallas"),
       q(pair_api.quantize_pair, row=RTNE, wgrad=RTNE_RHT, values=(True, False),
         implementation="xla"), None),
      ("dY pair as used: both values, SR +amax", 6.0,
       q(pair_api.quantize_pair, row=SR, wgrad=SR_RHT, key_row=k_row, key_t=k_t,
         values=(True, True), implementation="pallas"),
       q(pair_api.quantize_pair, row=SR, wgrad=SR_RHT, key_row=k_row, key_t=k_t,
         values=(True, True), implementation="xla"), None),
  ]


@contextlib.contextmanager
def _kernels(*, asm: bool = True, decode: bool = True, columns: bool = True):
  """Runs the block with the kernels' module switches set
  (`e2m1_encode.ASM_ENCODE`, `e2m1_decode.ASM_DECODE`,
  `quantize_rht_t.COLUMNS`), then back on: the before and after of one run.
  Trace a new function inside (jit caches traces by function, not by these
  switches)."""
  e2m1_encode.ASM_ENCODE, e2m1_decode.ASM_DECODE = asm, decode
  pr.COLUMNS = columns
  try:
    yield
  finally:
    e2m1_encode.ASM_ENCODE, e2m1_decode.ASM_DECODE, pr.COLUMNS = (
        True, True, True)


def run(tokens: int = 8192, features: int = 8192, *, copy_bw: float,
        n_inputs: int = 2, encoders: bool = False,
        tensor_cores: bool = False) -> list[dict]:
  """The table. `encoders`: also time every Pallas row with the kernels'
  jnp encoders instead of the GPU encoder (`e2m1_encode.ASM_ENCODE = False`),
  marked "(jnp encode)": the before and after of one run. `tensor_cores`:
  also time every RHT row with the tensor-core RHT kernels instead of the
  columns ones (`quantize_rht_t.COLUMNS = False`), marked "(tensor
  cores)"."""
  key = jax.random.key(0)
  xs = [jax.random.normal(jax.random.key(i), (tokens, features),
                          jnp.float32).astype(jnp.bfloat16)
        for i in range(n_inputs)]
  n = tokens * features
  amax_x = [jnp.max(jnp.abs(x)).astype(jnp.float32) for x in xs]
  amax_t = [pr.rht_amax(x) for x in xs]
  rows = []
  # The GPU-time columns' ceiling: the copy's GPU time (`a * 1.0001` on n
  # FP32 elements: 8n bytes moved), from a trace like the rows'.
  gpu_copy_s = None
  if jax.default_backend() == "gpu":
    ys = [jax.random.normal(jax.random.key(9 + i), (n,), jnp.float32)
          for i in range(2)]
    gpu_copy_s = timing.gpu_seconds(
        jax.jit(lambda a: a * jnp.float32(1.0001)), [(y,) for y in ys])
    del ys

  # The amax pass alone and the dequantize kernel, for reference.
  f_amax = jax.jit(lambda x: quantize_ref.tensor_amax(nm.ftz(x.astype(jnp.float32))))
  t = timing.bench(f_amax, [(x,) for x in xs])
  rows.append(dict(kernel="amax pass (XLA reduction)", bytes_per_elem=2.0,
                   us=t * 1e6, tbps=2 * n / t / 1e12,
                   of_copy=2 * n / t / copy_bw))
  for suffix, columns in ([("", True), (" (tensor cores)", False)]
                          if tensor_cores else [("", True)]):
    with _kernels(columns=columns):  # A new function: jit traces again.
      f_amax_t = jax.jit(lambda x: pr.rht_amax(x, with_x=True))
      t = timing.bench(f_amax_t, [(x,) for x in xs])
      g = (timing.gpu_seconds(f_amax_t, [(x,) for x in xs]) if gpu_copy_s
           else float("nan"))
    rows.append(dict(kernel="amax pass (x and rht(x.T), Pallas)" + suffix,
                     bytes_per_elem=2.0, us=t * 1e6, tbps=2 * n / t / 1e12,
                     of_copy=2 * n / t / copy_bw, gpu_us=g * 1e6,
                     gpu_of_copy=(2 * n / g) * gpu_copy_s / (8 * n)
                     if gpu_copy_s else float("nan")))

  qs = [quantize_api.quantize(x, implementation="pallas") for x in xs]
  f_x = jax.jit(lambda q: values_ref.block_dequantize_nvfp4(q)[0])
  t_x = timing.bench(f_x, [(q,) for q in qs])
  b = (Q_BYTES + 2) * n
  q_small = quantize_api.quantize(check_input(), implementation="pallas")
  for asm in (True, False):  # The kernels' decode, and the jnp one.
    with _kernels(decode=asm):
      f_p = jax.jit(lambda q: pbd.block_values(q))  # pylint: disable=unnecessary-lambda
      t_p = timing.bench(f_p, [(q,) for q in qs])
      exact = exact_vs_cpu(f_p, f_x, (q_small,))
    rows.append(dict(
        kernel="dequantize to bf16 values" + ("" if asm else
                                              " (jnp decode)"),
        bytes_per_elem=2.5625, us=t_p * 1e6, tbps=b / t_p / 1e12,
        of_copy=b / t_p / copy_bw, xla_us=t_x * 1e6, vs_xla=t_x / t_p,
        exact=exact))

  small = check_input()
  for name, bpe, fp, fx, amax_kind in variants(key):
    if amax_kind is None:
      args = [(x,) for x in xs]
      small_args = (small,)
    else:
      am = amax_x if amax_kind == "x" else amax_t
      args = list(zip(xs, am))
      small_args = (small, jnp.float32(3e4))
    jx = jax.jit(fx)
    t_x = timing.bench(jx, args)
    b = bpe * n
    modes = [("", True, True)]  # (suffix, ASM_ENCODE, COLUMNS)
    if encoders:
      modes.append((" (jnp encode)", False, True))
    if tensor_cores and ("rht" in name or "pair" in name):
      modes.append((" (tensor cores)", True, False))
    for suffix, asm, columns in modes:
      with _kernels(asm=asm, columns=columns):  # A new function: jit traces.
        jp = jax.jit(lambda *a, fp=fp: fp(*a))
        exact = exact_vs_cpu(lambda *a, fp=fp: fp(*a), fx, small_args)
        t_p = timing.bench(jp, args)
        g_p = timing.gpu_seconds(jp, args) if gpu_copy_s else float("nan")
      rows.append(dict(kernel=name + suffix,
                       bytes_per_elem=bpe, us=t_p * 1e6,
                       tbps=b / t_p / 1e12, of_copy=b / t_p / copy_bw,
                       gpu_us=g_p * 1e6,
                       gpu_of_copy=(b / g_p) * gpu_copy_s / (8 * n)
                       if gpu_copy_s else float("nan"),
                       xla_us=t_x * 1e6, vs_xla=t_x / t_p, exact=exact))
  return rows


def sweep(tokens: int = 8192, features: int = 8192, *, copy_bw: float
          ) -> list[dict]:
  """Tile-size sweep of the two main kernels (amax given)."""
  x = jax.random.normal(jax.random.key(0), (tokens, features),
                        jnp.float32).astype(jnp.bfloat16)
  xs = [x, x * 0.5]
  n = tokens * features
  rows = []
  a = jnp.max(jnp.abs(x)).astype(jnp.float32)
  for br, bc, w in [(32, 256, 4), (16, 256, 4), (16, 256, 2), (8, 256, 2),
                    (16, 512, 4), (8, 512, 4), (32, 128, 4), (16, 128, 2),
                    (64, 256, 8)]:
    cfg = pq.QuantizeConfig(block_rows=br, block_cols=bc, num_warps=w)
    f = jax.jit(lambda x, cfg=cfg: pq.quantize(x, amax=a, config=cfg))
    t = timing.bench(f, [(v,) for v in xs])
    rows.append(dict(kernel=f"quantize 1x16 {br}x{bc} w{w}", us=t * 1e6,
                     of_copy=(2 + Q_BYTES) * n / t / copy_bw))
  at = pr.rht_amax(x)
  for nb, bf, w in COLUMNS_CONFIGS:
    cfg = pr.ColumnsConfig(blocks=nb, block_features=bf, num_warps=w)
    f = jax.jit(lambda x, cfg=cfg: pr.quantize_rht_t(x, amax=at, config=cfg))
    t = timing.bench(f, [(v,) for v in xs])
    rows.append(dict(kernel=f"rht_t columns {nb} blocks x{bf} w{w}",
                     us=t * 1e6, of_copy=(2 + Q_BYTES) * n / t / copy_bw))
  for bt, bf, w in [(64, 64, 4), (32, 64, 2), (64, 32, 2), (32, 32, 2),
                    (64, 64, 8), (128, 32, 4), (32, 128, 4)]:
    cfg = pr.RHTConfig(block_tokens=bt, block_features=bf, num_warps=w)
    f = jax.jit(lambda x, cfg=cfg: pr.quantize_rht_t(x, amax=at, config=cfg))
    t = timing.bench(f, [(v,) for v in xs])
    rows.append(dict(kernel=f"rht_t tensor cores {bt}x{bf} w{w}", us=t * 1e6,
                     of_copy=(2 + Q_BYTES) * n / t / copy_bw))
    f = jax.jit(lambda x, cfg=cfg: pr.rht_amax(x, with_x=True, config=cfg))
    t = timing.bench(f, [(v,) for v in xs])
    rows.append(dict(kernel=f"rht_amax {bt}x{bf} w{w}", us=t * 1e6,
                     of_copy=2 * n / t / copy_bw))
  return rows


# Tiles of the columns kernels, (blocks, block_features, num_warps), the
# default first (BENCHMARKS.md, 2026-11-26, fourth).
COLUMNS_CONFIGS = ((4, 128, 4), (4, 64, 4), (8, 64, 4), (2, 256, 4),
                   (8, 128, 8), (4, 256, 8), (2, 128, 4))
AMAX_COLUMNS_CONFIGS = (  # (blocks, block_features, amax_steps, warps)
    (4, 128, 16, 4), (4, 128, 8, 4), (4, 64, 16, 4), (8, 64, 8, 4),
    (2, 256, 16, 4), (8, 128, 8, 8))
AMAX_CONFIGS = (  # (block_tokens, block_features, amax_steps, stages, warps)
    (64, 64, 1, 1, 4), (64, 64, 8, 1, 4), (64, 64, 8, 2, 4), (64, 64, 16, 2, 4),
    (32, 64, 16, 2, 4), (64, 128, 8, 2, 4), (64, 128, 8, 2, 8),
    (32, 128, 8, 2, 4), (128, 64, 4, 2, 8), (64, 32, 16, 2, 2))


def sweep_amax(tokens: int = 8192, features: int = 8192, *, copy_bw: float,
               old=None) -> list[dict]:
  """The amax pass (`rht_amax(with_x=True)`) at several configs, by wall and
  GPU time, against the XLA reduction of `max |x|` alone (no transform) and
  the copy. Every row is checked equal to the CPU reference on heavy-tailed
  input. `old`: another `rht_amax` (e.g. a previous version's) timed the
  same way, in the same run."""
  xs = [jax.random.normal(jax.random.key(i), (tokens, features),
                          jnp.float32).astype(jnp.bfloat16) for i in range(2)]
  n = tokens * features
  ys = [jax.random.normal(jax.random.key(9 + i), (n,), jnp.float32)
        for i in range(2)]
  gpu_copy_s = timing.gpu_seconds(
      jax.jit(lambda a: a * jnp.float32(1.0001)), [(y,) for y in ys])
  del ys
  small = check_input()
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    want = jax.jit(lambda x: (
        quantize_ref.tensor_amax(nm.ftz(x.astype(jnp.float32))),
        quantize_ref.tensor_amax(nf.rht(x.T).astype(jnp.float32))))(
            jax.device_put(small, cpu))

  def row(name, f, exact):
    t = timing.bench(f, [(x,) for x in xs])
    g = timing.gpu_seconds(f, [(x,) for x in xs])
    return dict(kernel=name, us=t * 1e6, of_copy=2 * n / t / copy_bw,
                gpu_us=g * 1e6, gpu_of_copy=2 * n / g * gpu_copy_s / (8 * n),
                exact=exact)

  def same(f):
    got = f(small)
    return all(same_bytes(a, b) for a, b in zip(got, want))

  f = jax.jit(lambda x: quantize_ref.tensor_amax(nm.ftz(x.astype(jnp.float32))))
  rows = [row("amax of x alone (XLA reduction)", f, "")]
  if old is not None:
    f = jax.jit(functools.partial(old, with_x=True))
    rows.append(row("rht_amax, previous kernel", f, same(f)))
  for nb, bf, steps, w in AMAX_COLUMNS_CONFIGS:
    cfg = pr.ColumnsConfig(blocks=nb, block_features=bf, num_warps=w,
                           amax_steps=steps)
    f = jax.jit(functools.partial(pr.rht_amax, with_x=True, config=cfg))
    rows.append(row(f"rht_amax columns {nb} blocks x{bf} x{steps} w{w}", f,
                    same(f)))
  for bt, bf, steps, stages, w in AMAX_CONFIGS:
    cfg = pr.RHTConfig(block_tokens=bt, block_features=bf, num_warps=w,
                       amax_steps=steps, amax_stages=stages)
    f = jax.jit(functools.partial(pr.rht_amax, with_x=True, config=cfg))
    rows.append(row(f"rht_amax tensor cores {bt}x{bf} x{steps} s{stages} "
                    f"w{w}", f, same(f)))
  return rows


def sweep_pair(tokens: int = 8192, features: int = 8192, *, copy_bw: float
               ) -> list[dict]:
  """The recipe's pairs (X: both RTNE; dY: both SR), amaxes given: the fused
  kernel (`quantize_rht_t.quantize_call(fused_x=True)`) at several tiles,
  against its two halves as separate kernels (the rht_t kernel and the 1x16
  kernel, each reading `x`). Every row is checked equal to the default's."""
  x = jax.random.normal(jax.random.key(0), (tokens, features),
                        jnp.float32).astype(jnp.bfloat16)
  xs = [x, x * 0.5]
  n = tokens * features
  bpe = 2 + 2 * Q_BYTES
  a_x, a_t = pr.rht_amax(x, with_x=True)
  kx, kt = jax.random.split(jax.random.key(1))
  rows = []
  for label, sr in (("X (RTNE)", False), ("dY (SR)", True)):
    keys = dict(key_t=kt if sr else None, key_x=kx if sr else None)

    def fused_fn(v, cfg=None, keys=keys):
      return pr.quantize_call(v, amax_t=a_t, amax_x=a_x, size=16,
                              sign_vector=None, fused_x=True, config=cfg,
                              **keys)

    def split_fn(v, keys=keys, sr=sr):
      qt = pr.quantize_call(v, amax_t=a_t, key_t=keys["key_t"], size=16,
                            sign_vector=None, fused_x=False, config=None)
      qx = pq.quantize(v, amax=a_x, key=keys["key_x"],
                       rounding="stochastic" if sr else "nearest")
      return qx, qt

    want = jax.jit(fused_fn)(x)
    t = timing.bench(jax.jit(split_fn), [(v,) for v in xs])
    rows.append(dict(kernel=f"{label} two kernels", us=t * 1e6,
                     of_copy=bpe * n / t / copy_bw,
                     exact=same_bytes(jax.jit(split_fn)(x), want)))
    for bt, bf, w in [(64, 64, 4), (32, 64, 4), (64, 32, 4), (32, 32, 2),
                      (32, 32, 4), (16, 64, 2), (64, 64, 8), (128, 32, 4),
                      (32, 128, 4), (128, 64, 8)]:
      cfg = pr.RHTConfig(block_tokens=bt, block_features=bf, num_warps=w)
      f = jax.jit(functools.partial(fused_fn, cfg=cfg))
      try:
        ok = same_bytes(f(x), want)
        t = timing.bench(f, [(v,) for v in xs])
      except Exception as e:  # pylint: disable=broad-except
        rows.append(dict(kernel=f"{label} fused {bt}x{bf} w{w}",
                         exact=f"failed: {type(e).__name__}"))
        continue
      rows.append(dict(kernel=f"{label} fused {bt}x{bf} w{w}", us=t * 1e6,
                       of_copy=bpe * n / t / copy_bw, exact=ok))
  return rows


USED_CONFIGS = dict(
    rht_t=COLUMNS_CONFIGS,
    pair=((64, 64, 4), (32, 64, 4), (32, 32, 2), (32, 128, 4), (64, 128, 8),
          (16, 64, 2), (32, 64, 2)),
    row=((16, 256, 4), (8, 256, 2), (32, 256, 4), (16, 512, 4), (8, 512, 4),
         (32, 128, 4), (16, 128, 2)),
    dequant=((16, 256, 4), (32, 256, 4), (32, 256, 8), (64, 256, 8),
             (16, 512, 4), (16, 512, 8), (32, 512, 8), (8, 256, 2),
             (64, 128, 4)))


def sweep_used(tokens: int, features: int,
               kernels_swept: str | None = None) -> list[dict]:
  """The quantizers as the layers run them, at several tiles, by GPU time
  (`timing.gpu_seconds`), against an XLA copy of the same tensor timed the
  same way: dY's Wgrad operand (rht_t, SR, values; the columns kernel's
  tiles), the X pair (RTNE, x
  values + rht_t codes), dY's Dgrad operand (1x16, SR, values), amaxes
  given, and the dequantize pass (`block_values` of the tensor's 1x16 codes:
  Wgrad's saved `q(rht(X^T))` is `[features, tokens]`, so sweep that shape
  for it). The first tile of each is the default; every row is checked
  equal to it (the tiles change no numbers)."""
  xs = [jax.random.normal(jax.random.key(i), (tokens, features),
                          jnp.float32).astype(jnp.bfloat16) for i in range(2)]
  copy_s = timing.gpu_seconds(jax.jit(lambda a: a * jnp.bfloat16(1.0001)),
                              [(x,) for x in xs])
  a_x, a_t = pr.rht_amax(xs[0], with_x=True)
  kx, kt = jax.random.split(jax.random.key(1))
  kernels = dict(
      rht_t=(4, lambda v, c: pr.quantize_call(
          v, amax_t=a_t, key_t=kt, size=16, sign_vector=None, fused_x=False,
          config=pr.ColumnsConfig(blocks=c[0], block_features=c[1],
                                  num_warps=c[2]), values_t=True)),
      pair=(4 + Q_BYTES, lambda v, c: pr.quantize_call(
          v, amax_t=a_t, amax_x=a_x, key_t=None, size=16, sign_vector=None,
          fused_x=True, values_x=True,
          config=pr.RHTConfig(block_tokens=c[0], block_features=c[1],
                              num_warps=c[2]))),
      row=(4, lambda v, c: pq.quantize(
          v, amax=a_x, rounding="stochastic", key=kx, with_codes=False,
          config=pq.QuantizeConfig(block_rows=c[0], block_cols=c[1],
                                   num_warps=c[2]))),
      dequant=(4 - 2 + Q_BYTES, lambda q, c: pbd.block_values(
          q, config=pq.QuantizeConfig(block_rows=c[0], block_cols=c[1],
                                      num_warps=c[2]))))
  rows = []
  for name, (bpe, fn) in kernels.items():
    if kernels_swept and name not in kernels_swept.split(","):
      continue
    want = None
    # The dequantize pass reads codes, the quantizers the bf16 tensor.
    ins = ([pq.quantize(x, amax=a_x) for x in xs] if name == "dequant"
           else xs)
    for cfg in USED_CONFIGS[name]:
      f = jax.jit(functools.partial(fn, c=cfg))
      label = (f"{name} {cfg[0]} blocks x{cfg[1]} w{cfg[2]}"
               if name == "rht_t" else f"{name} {cfg[0]}x{cfg[1]} w{cfg[2]}")
      try:
        got = f(ins[0])
        want = got if want is None else want
        g = timing.gpu_seconds(f, [(x,) for x in ins])
      except Exception as e:  # pylint: disable=broad-except
        rows.append(dict(shape=f"{tokens}x{features}", kernel=label,
                         exact=f"failed: {type(e).__name__}"))
        continue
      rows.append(dict(shape=f"{tokens}x{features}", kernel=label,
                       gpu_us=g * 1e6, of_copy=bpe / 4 * copy_s / g,
                       exact=same_bytes(got, want)))
  return rows


def sweep_amax_programs(tokens: int, features: int,
                        programs=(128, 256, 512, 1024, 2048, 8192)
                        ) -> list[dict]:
  """The amax pass at the default tile with other floors on its program
  count (`quantize_rht_t.AMAX_PROGRAMS`: programs loop over fewer tiles
  where the grid would drop below it), by GPU time against XLA's reduction
  of `max |x|` alone. Every row is checked equal to the default's."""
  xs = [jax.random.normal(jax.random.key(i), (tokens, features),
                          jnp.float32).astype(jnp.bfloat16) for i in range(2)]
  f = jax.jit(lambda x: quantize_ref.tensor_amax(nm.ftz(x.astype(jnp.float32))))
  xla = timing.gpu_seconds(f, [(x,) for x in xs])
  rows = [dict(shape=f"{tokens}x{features}", kernel="max |x| (XLA)",
               gpu_us=xla * 1e6, vs_xla=1.0)]
  default = pr.AMAX_PROGRAMS
  want = jax.jit(functools.partial(pr.rht_amax, with_x=True))(xs[0])
  try:
    for n in programs:
      pr.AMAX_PROGRAMS = n
      f = jax.jit(functools.partial(pr.rht_amax, with_x=True))
      g = timing.gpu_seconds(f, [(x,) for x in xs])
      rows.append(dict(shape=f"{tokens}x{features}",
                       kernel=f"rht_amax, >= {n} programs"
                       + (" (default)" if n == default else ""),
                       gpu_us=g * 1e6, vs_xla=xla / g,
                       exact=same_bytes(f(xs[0]), want)))
  finally:
    pr.AMAX_PROGRAMS = default
  return rows


COLS = ("kernel", "bytes_per_elem", "us", "tbps", "of_copy", "gpu_us",
        "gpu_of_copy", "xla_us", "vs_xla", "exact")

if __name__ == "__main__":
  p = argparse.ArgumentParser()
  p.add_argument("--tokens", type=int, default=8192)
  p.add_argument("--features", type=int, default=8192)
  p.add_argument("--sweep", action="store_true")
  p.add_argument("--pair-sweep", action="store_true",
                 help="only the X/dY pair kernels: fused tiles vs two kernels")
  p.add_argument("--amax-sweep", action="store_true",
                 help="only the amax pass, at several configs")
  p.add_argument("--encoders", action="store_true",
                 help="also time each kernel with its jnp encoders "
                      "(before the GPU encoder), in the same run")
  p.add_argument("--tensor-cores", action="store_true",
                 help="also time each RHT kernel as the tensor-core one "
                      "(before the columns kernels), in the same run")
  p.add_argument("--used-sweep", default=None, metavar="TxF,...",
                 help="only the quantizers as the layers run them, at "
                      "several tiles, for these shapes (e.g. 16384x768)")
  p.add_argument("--used-kernels", default=None,
                 metavar="rht_t,pair,row,dequant",
                 help="with --used-sweep: only these kernels")
  p.add_argument("--amax-programs", default=None, metavar="TxF,...",
                 help="only the amax pass at several floors on its program "
                      "count, for these shapes")
  a = p.parse_args()
  for shapes, sweep_fn, col in (
      (a.amax_programs, sweep_amax_programs, "vs_xla"),
      (a.used_sweep, functools.partial(sweep_used,
                                       kernels_swept=a.used_kernels),
       "of_copy")):
    if shapes:  # Per shape "TxF", GPU time only.
      print(timing.table(
          [r for s in shapes.split(",")
           for r in sweep_fn(*(int(v) for v in s.split("x")))],
          ("shape", "kernel", "gpu_us", col, "exact")))
      raise SystemExit(0)
  bw = timing.copy_bandwidth()
  print(f"copy bandwidth: {bw / 1e12:.3f} TB/s")
  if a.amax_sweep:
    print(timing.table(sweep_amax(a.tokens, a.features, copy_bw=bw),
                       ("kernel", "us", "of_copy", "gpu_us", "gpu_of_copy",
                        "exact")))
    raise SystemExit(0)
  if a.pair_sweep:
    print(timing.table(sweep_pair(a.tokens, a.features, copy_bw=bw),
                       ("kernel", "us", "of_copy", "exact")))
    raise SystemExit(0)
  if a.sweep:
    print(timing.table(sweep(a.tokens, a.features, copy_bw=bw),
                       ("kernel", "us", "of_copy")))
  print(timing.table(run(a.tokens, a.features, copy_bw=bw,
                         encoders=a.encoders, tensor_cores=a.tensor_cores),
                     COLS))
