"""Offline SASS report of the Pallas-Triton kernels (no GPU needed).

Lowers each kernel of `pallas_kernels` for CUDA on a CPU-only machine, takes
the Triton IR (TTIR) of its `pallas_call`, compiles it with the `triton`
Python package to PTX and an sm_90 cubin, disassembles the cubin and reports
per kernel: SASS instructions of the kernel body by opcode class, registers
per thread, spill bytes, and SASS instructions per element of the tile a
program processes (and of a loop's body where the kernel has one, e.g. the
K loop of the weight-only matmul).

Needs (none of it is a project dependency; nothing is installed by the tool):

- the `triton` wheel (3.6.0, the GPU machine's version), kept out of the
  project's environment:

      pip install --no-deps --target /tmp/trisite triton-3.6.0-*.whl

- its bundled `ptxas`, `nvdisasm` and `cuobjdump` (triton/backends/nvidia/bin;
  `--ptxas` picks another `ptxas`, e.g. a CUDA 13 one).

Run:

    python -m nvfp4_jax.tools.sass_report --triton-path /tmp/trisite
    python -m nvfp4_jax.tools.sass_report --triton-path /tmp/trisite \\
        --kernels quantize_rtne,weight_only --out-dir /tmp/sass

`--out-dir` keeps each kernel's .ttir, .ptx, .cubin, .sass and ptxas log.

How: `launch.backend`/`compute_capability` are patched at runtime to claim an
sm_90 GPU (as tests/kernels/test_kernels.py does), `jax.jit(...).lower(...)` runs on
`jax.ShapeDtypeStruct`s (nothing is computed), and the TTIR is captured by
wrapping `jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module`,
which `pallas_call_registration` calls on jax 0.10 and 0.11; warps and stages
come from a wrapper of `launch.pallas_call`. `pallas_kernels/` is not edited.

Caveats: on the GPU, XLA compiles the same TTIR with its own pinned Triton
pipeline and ptxas, so the SASS there can differ in details; counts are
static (each instruction once; cold paths such as the slow path of
`div.rn.f32`, which are separate subroutines, are reported apart from the
body).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import types
from typing import Callable

ELEMS = 8192  # Default square bf16 input, 8192 x 8192.

# Opcode classes (by the opcode before its first '.'). Uniform-datapath ops
# (U*) are one class except their loads/branches.
_CLASSES = {
    "int": ("IADD3 IADD IADD32I IMAD IMAD32I IMUL LOP3 LOP LOP32I SHF SHL "
            "SHR PRMT LEA ISETP IMNMX VIMNMX IABS BFE BFI BMSK FLO POPC BREV "
            "SGXT IDP ISCADD VIADD VIADDMNMX VIMNMX3").split(),
    "fp32": ("FADD FMUL FFMA FMNMX FSETP FSET FCHK MUFU FRND FSWZADD FADD32I "
             "FMUL32I FFMA32I FMNMX3 FMUL2 FFMA2 FADD2 "  # x2: sm_100.
             "FHFMA").split(),  # FHFMA: sm_100's fma.rn.f32.f16.
    "fp16x2": "HADD2 HMUL2 HFMA2 HMNMX2 HSETP2 HSET2 HADD2.F32".split(),
    "cvt": "F2F F2I I2F F2FP I2FP F2IP I2I I2IP FRND.F16".split(),
    "mov/sel": "MOV SEL FSEL CS2R S2R S2UR R2UR P2R R2P PLOP3 VOTE".split(),
    "ld.global": "LDG".split(),
    "st.global": "STG".split(),
    "ld.shared": "LDS LDSM".split(),
    "st.shared": "STS STSM".split(),
    "ld.const": "LDC ULDC LDCU".split(),
    "local": "LDL STL".split(),
    "async/tma": ("LDGSTS LDGDEPBAR DEPBAR UTMALDG UTMASTG UBLKCP ARRIVES "
                  "SYNCS").split(),
    "atomic": "ATOM ATOMG ATOMS RED REDG".split(),
    "shuffle": "SHFL".split(),
    "barrier": "BAR WARPSYNC MEMBAR FENCE ERRBAR CCTL".split(),
    "branch": ("BRA BRX JMP JMX CALL RET EXIT BSSY BSYNC BMOV BREAK YIELD "
               "WARPSYNC.ALL").split(),
    "mma": "HMMA HGMMA IMMA QGMMA WARPGROUP BGMMA".split(),
}
_CLASS_OF = {op: cls for cls, ops in _CLASSES.items() for op in ops}

_INSN = re.compile(
    r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)(.*);")
_LABEL = re.compile(r"^\s*(\S+):\s*$")
_TARGET = re.compile(r"`\(([^)]+)\)")


def opcode_class(opcode: str) -> str:
  """The report's class of a SASS opcode ("NOP" for no-ops)."""
  base = opcode.split(".")[0]
  if base == "NOP":
    return "NOP"
  if base in _CLASS_OF:
    return _CLASS_OF[base]
  return "uniform" if base.startswith("U") else "other"


@dataclasses.dataclass
class Sass:
  """The parsed SASS of one kernel.

  Attributes:
    body: `(address, opcode, operands)` of the entry function, up to its first
      subroutine, without NOPs and the trailing `BRA` to itself.
    subroutines: instruction count of each subroutine (`$__internal...`).
    loops: `(start, end, count)` of each backward branch's range in `body`.
  """

  body: list[tuple[int, str, str]]
  subroutines: dict[str, int]
  loops: list[tuple[int, int, int]]


def parse_sass(text: str, kernel: str) -> Sass:
  """Splits `nvdisasm -c` output of the `kernel` function."""
  section, current = False, None
  body, subs = [], collections.Counter()
  labels = {}
  pending = []
  for line in text.splitlines():
    words = line.split()
    if words and words[0] == ".section":
      section = words[1].split(",")[0] == f".text.{kernel}"
      current = None
      continue
    if not section:
      continue
    m = _LABEL.match(line)
    if m:
      name = m.group(1)
      if name.startswith("$__internal"):
        current = name
      pending.append(name)
      continue
    m = _INSN.match(line)
    if not m:
      continue
    addr, op, rest = int(m.group(1), 16), m.group(2), m.group(3)
    for name in pending:
      labels[name] = addr
    pending = []
    if current is not None:
      if op != "NOP":
        subs[current] += 1
      continue
    body.append((addr, op, rest))
  # Drop NOPs and self-branches (the `EXIT; BRA .` idiom), find loops.
  kept, loops = [], []
  for addr, op, rest in body:
    if op == "NOP":
      continue
    t = _TARGET.search(rest)
    target = labels.get(t.group(1)) if t else None
    if op.startswith("BRA") and target == addr:
      continue
    kept.append((addr, op, rest))
    if op.startswith("BRA") and target is not None and target < addr:
      loops.append((target, addr))
  loops = [(s, e, sum(1 for a, _, _ in kept if s <= a <= e))
           for s, e in loops]
  return Sass(kept, dict(subs), loops)


def class_counts(insns) -> collections.Counter:
  return collections.Counter(opcode_class(op) for _, op, _ in insns)


# --- Kernel cases -------------------------------------------------------------


@dataclasses.dataclass
class Case:
  """One kernel configuration to lower.

  Attributes:
    name: the report's name (`--kernels`).
    kernel: the `pallas_call` name to pick among those the function lowers.
    build: returns `(fn, args)` for `jax.jit(fn).lower(*args)`.
    tile: the tile a program processes, in words.
    elems_per_program: elements of the tile (the per-element denominator).
    loop_elems: elements one iteration of the kernel's loop processes (None:
      no loop expected).
    loop_iters: iterations of that loop per program.
  """

  name: str
  kernel: str
  build: Callable[[], tuple[Callable, tuple]]
  tile: str
  elems_per_program: int
  loop_elems: int | None = None
  loop_iters: int = 1


def _cases() -> list[Case]:
  """The kernels at their default tile configs (bf16 8192^2 input)."""
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  from nvfp4_jax.ops.quantize import api as quantize_api
  from nvfp4_jax.core.arrays import NVFP4Array
  from nvfp4_jax.ops.block_values import pallas_triton as pbd
  from nvfp4_jax.ops.quantize import pallas_triton as pq
  from nvfp4_jax.ops.quantize_pair import pallas_triton as pp
  from nvfp4_jax.ops.quantize_rht_t import pallas_triton as pr
  from nvfp4_jax.ops.weight_only_matmul import pallas_triton as pwo
  # pylint: enable=g-import-not-at-top
  sds = jax.ShapeDtypeStruct
  n = ELEMS
  x = sds((n, n), jnp.bfloat16)
  amax = sds((), jnp.float32)
  key = lambda i: jax.random.key(i)

  def q(**kw):
    return lambda: (lambda x, a: pq.quantize(x, amax=a, **kw), (x, amax))

  # The round-to-nearest codes kernels take 8K tiles where the E2M1
  # conversion exists (`pq.wide_tiles`; `capture_ttir` claims the GPU).
  wide = pq.wide_tiles(False, False, False)
  qc = pq.default_config(n, n)
  wc1 = pq.default_config(n, n, wide=wide)
  wc2 = pq.default_config(n, n, True, wide=wide)
  wcv = pq.default_config(n, n, wide=pq.wide_tiles(False, True, False))
  # Four-over-Six's round-to-nearest codes (the word path where the E2M1
  # conversion exists).
  wf1 = pq.default_config(n, n, wide=pq.wide_tiles(False, False, True))
  wf2 = pq.default_config(n, n, True, wide=pq.wide_tiles(False, False, True))
  rc = pr.default_config(n, n)
  q_tile = f"{qc.block_rows}x{qc.block_cols}"
  r_tile = f"{rc.block_tokens}x{rc.block_features} (tok x feat)"
  r_elems = rc.block_tokens * rc.block_features
  # The columns kernels (the default for 16-point RHT): 16-token blocks x
  # features per program (per step of the amax pass's loop).
  cc = pr.ColumnsConfig()
  c_tile = f"{cc.blocks} blocks x {cc.block_features} feat (x16 tok)"
  c_elems = cc.blocks * 16 * cc.block_features
  c_steps = pr._amax_grid(n // 16, cc.blocks, n, cc.block_features,  # pylint: disable=protected-access
                          cc.amax_steps)[0]

  def rht_t(config=None, **kw):
    return lambda: (lambda x, a: pr.quantize_rht_t(
        x, amax=a, config=config, **kw), (x, amax))

  def block_values():
    def fn(codes, scales, a):
      return pbd.block_values(NVFP4Array(codes=codes, scales=scales, amax=a))
    return fn, (sds((n, n // 2), jnp.uint8), sds((n, n // 16),
                                                 jnp.float8_e4m3fn), amax)

  pc = pp.pair_config(n, n)
  p_tile = f"{pc.block_tokens}x{pc.block_features} (tok x feat)"
  p_elems = pc.block_tokens * pc.block_features

  pv = pp.pair_config(n, n, values_x=True)
  pv_tile = f"{pv.block_tokens}x{pv.block_features} (tok x feat)"

  def pair(rounding, config=pc, values_x=False, fos=False):
    # The fused X/dY kernel itself (`quantize_pair` runs both-SR pairs as
    # two kernels, the rows above), on the pair tiles.
    def fn(x, a):
      k = (lambda i: key(i)) if rounding == "stochastic" else (lambda i: None)
      return pr.quantize_call(x, amax_t=a, key_t=k(1), amax_x=a, key_x=k(0),
                              size=16, sign_vector=None, fused_x=True,
                              config=config, values_x=values_x,
                              four_over_six_t=fos, four_over_six_x=fos)
    return lambda: (fn, (x, amax))

  # Four-over-Six's Wgrad operand: the columns kernel where its word path
  # runs (Blackwell), else the tensor-core kernel.
  fos_columns = pr._columns_words_apply(False, False)  # pylint: disable=protected-access
  fc = pr.columns_config(four_over_six=True)
  fc_tile = f"{fc.blocks} blocks x {fc.block_features} feat (x16 tok)"
  # Round-to-nearest codes: the word path's tile where it runs.
  rw = pr.columns_config(words=fos_columns)
  rw_tile = f"{rw.blocks} blocks x {rw.block_features} feat (x16 tok)"

  wm, wn, wk = 16, 4096, 4096
  wc = pwo.default_config(wm, wn, wk)

  def weight_only():
    def fn(x, w):
      return pwo.weight_only_matmul(x, quantize_api.quantize(w, block_2d=True))
    return fn, (sds((wm, wk), jnp.bfloat16), sds((wn, wk), jnp.bfloat16))

  return [
      Case("quantize_rtne", "nvfp4_quantize", q(),
           f"{wc1.block_rows}x{wc1.block_cols}",
           wc1.block_rows * wc1.block_cols),
      Case("quantize_sr", "nvfp4_quantize",
           q(rounding="stochastic", key=key(0)), q_tile,
           qc.block_rows * qc.block_cols),
      Case("quantize_2d", "nvfp4_quantize_2d", q(block_2d=True),
           f"{wc2.block_rows}x{wc2.block_cols}",
           wc2.block_rows * wc2.block_cols),
      Case("quantize_fos", "nvfp4_quantize", q(four_over_six=True),
           f"{wf1.block_rows}x{wf1.block_cols}",
           wf1.block_rows * wf1.block_cols),
      Case("quantize_2d_fos", "nvfp4_quantize_2d",
           q(block_2d=True, four_over_six=True),
           f"{wf2.block_rows}x{wf2.block_cols}",
           wf2.block_rows * wf2.block_cols),
      Case("quantize_values", "nvfp4_quantize", q(with_values=True),
           f"{wcv.block_rows}x{wcv.block_cols}",
           wcv.block_rows * wcv.block_cols),
      Case("quantize_values_only", "nvfp4_quantize_values",  # X's values
           q(with_values=True, with_codes=False),  # in Blackwell's split pair.
           f"{wcv.block_rows}x{wcv.block_cols}",
           wcv.block_rows * wcv.block_cols),
      Case("block_values", "nvfp4_block_values", block_values, q_tile,
           qc.block_rows * qc.block_cols),
      Case("quantize_sr_values", "nvfp4_quantize_values",  # dY's Dgrad op.
           q(rounding="stochastic", key=key(0), with_values=True,
             with_codes=False), q_tile, qc.block_rows * qc.block_cols),
      Case("rht_t_rtne", "nvfp4_quantize_rht_t_columns", rht_t(), rw_tile,
           rw.blocks * 16 * rw.block_features),
      Case("rht_t_fos", "nvfp4_quantize_rht_t"
           + ("_columns" if fos_columns else ""),
           rht_t(four_over_six=True), fc_tile if fos_columns else r_tile,
           fc.blocks * 16 * fc.block_features if fos_columns else r_elems),
      Case("rht_t_sr", "nvfp4_quantize_rht_t_columns",
           rht_t(rounding="stochastic", key=key(0)), c_tile, c_elems),
      Case("rht_t_sr_values", "nvfp4_quantize_rht_t_columns_values",
           rht_t(rounding="stochastic", key=key(0), values=True), c_tile,
           c_elems),  # dY's Wgrad operand, as the layers run it on Hopper.
      Case("rht_t_sr_tc", "nvfp4_quantize_rht_t",
           rht_t(rc, rounding="stochastic", key=key(0)), r_tile, r_elems),
      Case("pair_rtne", "nvfp4_quantize_x_and_rht_t", pair("nearest"),
           p_tile, p_elems),
      Case("pair_fos", "nvfp4_quantize_x_and_rht_t",
           pair("nearest", fos=True), p_tile, p_elems),
      Case("pair_sr", "nvfp4_quantize_x_and_rht_t", pair("stochastic"),
           p_tile, p_elems),
      Case("pair_rtne_values", "nvfp4_quantize_x_and_rht_t_values",
           pair("nearest", pv, values_x=True), pv_tile,
           pv.block_tokens * pv.block_features),  # X's pair on Hopper.
      Case("rht_amax_x", "nvfp4_rht_amax_columns",
           lambda: (lambda x: pr.rht_amax(x, with_x=True), (x,)),
           f"{c_tile}, {c_steps} steps", c_elems * c_steps, c_elems, c_steps),
      Case("rht_amax_x_tc", "nvfp4_rht_amax",
           lambda: (lambda x: pr.rht_amax(x, with_x=True, config=rc), (x,)),
           r_tile, r_elems),
      Case("weight_only", "nvfp4_weight_only_matmul", weight_only,
           f"bn{wc.block_n} bk{wc.block_k} split{wc.split_k} (x {wm}x{wk})",
           wc.block_n * wk // wc.split_k, wc.block_n * wc.block_k,
           wk // (wc.block_k * wc.split_k)),
  ]


def cases_for(cc: tuple[int, int], accelerated: bool = False) -> list[Case]:
  """`_cases()` with the tiles dispatch picks on compute capability `cc`
  (e.g. Blackwell's round-to-nearest quantizers take 8K tiles;
  `accelerated`: see `capture_ttir`)."""
  with capture_ttir(cc, accelerated):
    return _cases()


# --- Lowering off-GPU ---------------------------------------------------------


@dataclasses.dataclass
class Lowered:
  name: str
  ttir: str
  grid: tuple[int, ...]
  num_warps: int
  num_stages: int


@contextlib.contextmanager
def capture_ttir(cc: tuple[int, int], accelerated: bool = False):
  """Claims a GPU of compute capability `cc`; yields the captured kernels.

  `accelerated`: the kernels are lowered for the arch-specific target
  (sm_XYa, as XLA compiles for a GPU that reports its accelerated features,
  and as Triton's own compile here does from 9.0), where the E2M1
  conversion compiles from 10.0: `e2m1_encode.e2m1_conversion_compiles`
  (the probe `e2m1_encode.hardware_e2m1` asks outside
  `e2m1_encode.HW_E2M1_CCS`) answers True; else False, as for plain sm_XY
  (XLA's ahead-of-time compile for a bare capability). Nothing is compiled
  to ask: the report's own compile targets sm_XYa either way."""
  # pylint: disable=g-import-not-at-top
  from jax._src.pallas.triton import lowering
  from jax._src.pallas.triton import pallas_call_registration as reg
  from pallas_kernels import e2m1_encode
  from pallas_kernels import launch
  # pylint: enable=g-import-not-at-top
  captured: list[Lowered] = []
  params: dict[str, tuple[int, int]] = {}
  saved = [(launch, "backend", launch.backend),
           (launch, "compute_capability", launch.compute_capability),
           (launch, "pallas_call", launch.pallas_call),
           (lowering, "lower_jaxpr_to_triton_module",
            lowering.lower_jaxpr_to_triton_module)]
  if hasattr(reg, "gpu_info_lib"):  # jax >= 0.11 asks the (absent) GPU.
    saved.append((reg, "gpu_info_lib", reg.gpu_info_lib))
    reg.gpu_info_lib = types.SimpleNamespace(
        get_gpu_info=lambda: types.SimpleNamespace(
            compute_capability=cc[0] * 10 + cc[1]))
  pallas_call = launch.pallas_call
  lower = lowering.lower_jaxpr_to_triton_module

  def record_params(kernel, *, num_warps, num_stages, name, **kwargs):
    params[name] = (num_warps, num_stages)
    return pallas_call(kernel, num_warps=num_warps, num_stages=num_stages,
                       name=name, **kwargs)

  def capture(*args, **kwargs):
    result = lower(*args, **kwargs)
    caller = sys._getframe(1).f_locals  # pylint: disable=protected-access
    text = result.module.operation.get_asm()
    name = re.search(r"tt\.func\s+(?:public\s+)?@([\w$.]+)", text).group(1)
    warps, stages = params.get(name, (None, None))
    captured.append(Lowered(
        name=name, ttir=text, grid=tuple(result.grid),
        num_warps=caller.get("num_warps", warps) if warps is None else warps,
        num_stages=(caller.get("num_stages", stages) if stages is None
                    else stages)))
    return result

  if hasattr(e2m1_encode, "e2m1_conversion_compiles"):
    saved.append((e2m1_encode, "e2m1_conversion_compiles",
                  e2m1_encode.e2m1_conversion_compiles))
    e2m1_encode.e2m1_conversion_compiles = lambda: accelerated
  launch.backend = lambda: "gpu"
  launch.compute_capability = lambda: cc
  launch.pallas_call = record_params
  lowering.lower_jaxpr_to_triton_module = capture
  try:
    yield captured
  finally:
    for obj, attr, value in saved:
      setattr(obj, attr, value)


def lower_case(case: Case, cc: tuple[int, int], accelerated: bool = False
               ) -> Lowered:
  """The TTIR of `case.kernel`, lowered for CUDA without a GPU
  (`accelerated`: see `capture_ttir`)."""
  import jax  # pylint: disable=g-import-not-at-top
  with capture_ttir(cc, accelerated) as captured:
    fn, args = case.build()
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  picked = [k for k in captured if k.name == case.kernel]
  if not picked:
    raise RuntimeError(f"{case.name}: no pallas_call named {case.kernel!r} "
                       f"among {[k.name for k in captured]}")
  return picked[-1]


# --- Triton compile, ptxas, disassembly --------------------------------------

# Textual TTIR rewrites for the Triton version (pattern, replacement). jax
# 0.10.2's TTIR parses as is in triton 3.6.0; add entries here if a version
# renames ops or attributes.
TTIR_REWRITES: list[tuple[str, str]] = []


def import_triton(path: str | None):
  if path:
    sys.path.insert(0, path)
  try:
    import triton  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise SystemExit(
        f"cannot import triton ({e}); install it outside the project's "
        f"environment (pip install --no-deps --target DIR triton-*.whl) and "
        f"pass --triton-path DIR.") from e
  return triton


def tool(triton, name: str) -> str:
  """A CUDA tool: triton's bundled one, else the system CUDA's."""
  bundled = os.path.join(os.path.dirname(triton.__file__), "backends",
                         "nvidia", "bin", name)
  for p in (bundled, f"/usr/local/cuda/bin/{name}",
            f"/usr/local/cuda-13.0/bin/{name}"):
    if os.path.exists(p):
      return p
  raise FileNotFoundError(f"no {name} (looked in {bundled} and CUDA)")


@dataclasses.dataclass
class Compiled:
  ptx: str
  cubin: bytes
  sass: str
  ptxas_log: str
  regs: int
  spill_stores: int
  spill_loads: int
  shared: int


def compile_ttir(triton, lowered: Lowered, capability: int, ptxas: str,
                 workdir: str) -> Compiled:
  """TTIR -> PTX -> cubin (triton.compile), ptxas -v log, SASS."""
  # pylint: disable-next=g-import-not-at-top
  from triton.backends.compiler import GPUTarget
  text = lowered.ttir
  for pattern, repl in TTIR_REWRITES:
    text = re.sub(pattern, repl, text)
  path = os.path.join(workdir, f"{lowered.name}.ttir")
  with open(path, "w") as f:
    f.write(text)
  kernel = triton.compile(
      path, target=GPUTarget("cuda", capability, 32),
      options=dict(num_warps=lowered.num_warps,
                   num_stages=lowered.num_stages))
  ptx, cubin = kernel.asm["ptx"], kernel.asm["cubin"]
  arch = re.search(r"^\.target\s+(\w+)", ptx, re.M).group(1)
  ptx_path = os.path.join(workdir, f"{lowered.name}.ptx")
  with open(ptx_path, "w") as f:
    f.write(ptx)
  log = subprocess.run(
      [ptxas, "-lineinfo", "-v", f"--gpu-name={arch}", ptx_path, "-o",
       os.path.join(workdir, f"{lowered.name}.ptxas.cubin")],
      check=True, capture_output=True, text=True).stderr
  cubin_path = os.path.join(workdir, f"{lowered.name}.cubin")
  with open(cubin_path, "wb") as f:
    f.write(cubin)
  sass = subprocess.run([tool(triton, "nvdisasm"), "-c", cubin_path],
                        check=True, capture_output=True, text=True).stdout
  usage = subprocess.run(
      [tool(triton, "cuobjdump"), "--dump-resource-usage", cubin_path],
      check=True, capture_output=True, text=True).stdout
  regs = re.search(r"REG:(\d+)", usage)
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                     log)
  return Compiled(
      ptx=ptx, cubin=cubin, sass=sass, ptxas_log=log,
      regs=int(regs.group(1)) if regs else -1,
      spill_stores=int(spills.group(1)) if spills else -1,
      spill_loads=int(spills.group(2)) if spills else -1,
      shared=int(getattr(kernel.metadata, "shared", 0)))


# --- Report -------------------------------------------------------------------


@dataclasses.dataclass
class Row:
  case: Case
  lowered: Lowered
  compiled: Compiled
  sass: Sass


def _fmt_classes(counts: collections.Counter, top: int | None = None) -> str:
  items = counts.most_common(top)
  return ", ".join(f"{c} {n}" for c, n in items)


def detail(row: Row) -> str:
  """A per-kernel section: classes, top opcodes, loops, subroutines."""
  s, c, lw = row.sass, row.compiled, row.lowered
  lines = [f"### {row.case.name} ({lw.name})",
           f"grid {lw.grid}, {lw.num_warps} warps, {lw.num_stages} stages, "
           f"{c.regs} regs, spill stores/loads {c.spill_stores}/"
           f"{c.spill_loads} B, shared {c.shared} B",
           f"body: {len(s.body)} instructions; classes: "
           f"{_fmt_classes(class_counts(s.body))}",
           "top opcodes: " + ", ".join(
               f"{op} {n}" for op, n in collections.Counter(
                   op for _, op, _ in s.body).most_common(12))]
  for start, end, count in s.loops:
    insns = [i for i in s.body if start <= i[0] <= end]
    lines.append(f"loop {start:#06x}-{end:#06x}: {count} instructions; "
                 f"{_fmt_classes(class_counts(insns))}")
  if s.subroutines:
    lines.append("subroutines (cold paths, not in the body): " + ", ".join(
        f"{k} {v}" for k, v in s.subroutines.items()))
  return "\n".join(lines)


def e2m1_conversions(sass: Sass) -> int:
  """The body's E2M1 conversions (`F2FP...E2M1...PACK`: the hardware
  encoder's `cvt...e2m1x2.f32`; not the `UNPACK` decodes)."""
  return sum(op.startswith("F2FP") and ".E2M1." in op and "UNPACK" not in op
             for _, op, _ in sass.body)


def table(rows: list[Row]) -> str:
  """The summary table; per element = per element a thread owns."""
  head = ("| kernel | tile | warps | regs | spills (B) | SASS body | "
          "body / tile elems | instrs / elem (thread) | loop body "
          "(instrs / elem) | E2M1 cvt (F2FP) | top opcode classes |")
  out = [head, "|" + "---|" * 11]
  for r in rows:
    n = dynamic = len(r.sass.body)
    threads = 32 * r.lowered.num_warps
    loop = "-"
    if r.sass.loops:
      _, _, count = max(r.sass.loops, key=lambda l: l[2])
      per = (f" ({count * threads / r.case.loop_elems:.2f})"
             if r.case.loop_elems else "")
      loop = f"{count}{per}"
      dynamic += count * (r.case.loop_iters - 1)
    c = r.compiled
    spills = c.spill_stores + c.spill_loads
    out.append(
        f"| {r.case.name} | {r.case.tile} | {r.lowered.num_warps} | "
        f"{c.regs} | {spills} | {n} | {n / r.case.elems_per_program:.3f} | "
        f"{dynamic * threads / r.case.elems_per_program:.1f} | {loop} | "
        f"{e2m1_conversions(r.sass)} | "
        f"{_fmt_classes(class_counts(r.sass.body), 4)} |")
  return "\n".join(out)


NOTES = """\
SASS body: static instructions of the kernel function (NOPs and the cold-path
subroutines excluded; each counted once). The body runs once per thread
(32 x warps per program), each thread owning tile elems / threads elements:
`instrs / elem (thread)` = body x threads / tile elems is what a thread
executes per element it owns (straight-line code); divide by 32 for warp
instructions (issue slots) per element. `body / tile elems` is the plain
ratio. weight_only: the tile is its weights (bn x K / split_k); the loop
body is the largest backward-branch range (the K loop), per weight element
of one iteration (bn x bk), and its `instrs / elem` counts the loop body
once per iteration (body + loop x (iterations - 1))."""


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--arch", default="sm_90",
                      help="CUDA target, sm_XY or sm_XYa (default sm_90); "
                      "from 10.0, sm_XYa lowers the kernels with the E2M1 "
                      "conversion where `e2m1_encode.HW_E2M1_CCS` does not "
                      "list the capability (as XLA compiles for the GPU "
                      "itself), sm_XY without (as for a bare capability)")
  parser.add_argument("--kernels", default="",
                      help="comma-separated case names (default: all)")
  parser.add_argument("--triton-path", default=None,
                      help="directory to import triton from (pip --target)")
  parser.add_argument("--ptxas", default=None,
                      help="ptxas for the cubin and -v (default: triton's)")
  parser.add_argument("--out-dir", default=None,
                      help="keep TTIR/PTX/cubin/SASS here")
  parser.add_argument("--list", action="store_true", help="list the cases")
  parser.add_argument("--software-e2m1", action="store_true",
                      help="compile with `e2m1_encode.HW_E2M1 = False` (the "
                      "software E2M1 encoder where the conversion exists)")
  args = parser.parse_args(argv)

  m = re.fullmatch(r"sm_(\d+)(\d)(a?)", args.arch)
  if not m:
    parser.error(f"--arch {args.arch!r}: expected sm_XY or sm_XYa")
  cc = (int(m.group(1)), int(m.group(2)))
  accelerated = m.group(3) == "a"
  capability = cc[0] * 10 + cc[1]
  if args.ptxas:
    os.environ["TRITON_PTXAS_PATH"] = args.ptxas
    os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = args.ptxas
  workdir = args.out_dir or tempfile.mkdtemp(prefix="sass_report_")
  os.makedirs(workdir, exist_ok=True)
  os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(workdir, "cache"))
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  if args.software_e2m1:
    from pallas_kernels import e2m1_encode  # pylint: disable=g-import-not-at-top
    e2m1_encode.HW_E2M1 = False
  cases = cases_for(cc, accelerated)
  if args.list:
    print("\n".join(f"{c.name}: {c.kernel}, {c.tile}" for c in cases))
    return
  if args.kernels:
    wanted = args.kernels.split(",")
    unknown = set(wanted) - {c.name for c in cases}
    if unknown:
      parser.error(f"unknown kernels {sorted(unknown)}; see --list")
    cases = [c for c in cases if c.name in wanted]

  triton = import_triton(args.triton_path)
  ptxas = args.ptxas or tool(
      triton, "ptxas-blackwell" if capability >= 100 else "ptxas")
  print(f"triton {triton.__version__} ({triton.__file__}), ptxas {ptxas}, "
        f"{args.arch}, work dir {workdir}")
  rows, failures = [], []
  for case in cases:
    try:
      lowered = lower_case(case, cc, accelerated)
      sub = os.path.join(workdir, case.name)
      os.makedirs(sub, exist_ok=True)
      compiled = compile_ttir(triton, lowered, capability, ptxas, sub)
      with open(os.path.join(sub, f"{lowered.name}.sass"), "w") as f:
        f.write(compiled.sass)
      with open(os.path.join(sub, "ptxas.log"), "w") as f:
        f.write(compiled.ptxas_log)
      row = Row(case, lowered, compiled, parse_sass(compiled.sass,
                                                    lowered.name))
    except Exception as e:  # pylint: disable=broad-except
      msg = f"{type(e).__name__}: {e}"
      failures.append((case.name, msg))
      print(f"\n### {case.name}: FAILED\n{msg[:2000]}", flush=True)
      continue
    rows.append(row)
    print("\n" + detail(row), flush=True)
  print("\n" + table(rows))
  print("\n" + NOTES)
  for name, msg in failures:
    print(f"FAILED {name}: {msg.splitlines()[0] if msg else ''}")
  if failures:
    sys.exit(1)


if __name__ == "__main__":
  main()
