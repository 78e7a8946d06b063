"""Did NVFP4 really run? A report of every linear GEMM in a traced program.

    print(nvfp4_jax.report(train_step, state, batch))
    print(nvfp4_jax.report(train_step, state, batch).compiled(
        jax.jit(train_step).lower(state, batch).compile().as_text()))

`Report.compiled(hlo)` corrects the report by what XLA compiled: a GEMM
traced as cuDNN's block-scaled dot that the optimized HLO does not hand to
cuDNN (`__cudnn$blockScaledDot`; e.g. cuDNN below 9.10, where XLA decomposes
it into dequantize and an FP32 GEMM without a word) is reported as that
decomposition (`compiled_report` does both steps on this process's device).

`report` traces the function (`jax.make_jaxpr`: no FLOPs) and reads the
program, not the configuration: each NVFP4 layer's GEMMs carry a name scope
with the layer's path and the recipe they were traced with (see
`training.names.layer_scope`), each GEMM and quantizer region its name, and the kernels
inside them their own names. Every other `dot_general` of the program is a
high-precision GEMM that no NVFP4 layer owns (embeddings, a plain head,
attention's batched GEMMs) and is counted with its reason.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterator

import jax

from nvfp4_jax.training.names import LAYER_SCOPE

_ROUTER = "moe_router"  # `nvfp4_jax.training.moe_routing.ROUTER_SCOPE`.
_GEMM_REGION = re.compile(r"^(nvfp4|bf16)_(fprop|dgrad|wgrad)$")
_QUANT_REGION = re.compile(r"^nvfp4_quantize_(x|dy|w)$")
_SCOPE = re.compile(re.escape(LAYER_SCOPE) + r"\[(.*?)\|(.*?)\]")
_OPERANDS = {"fprop": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("dy", "x")}


@dataclasses.dataclass(frozen=True)
class Gemm:
  """One linear GEMM of the traced program.

  Attributes:
    layer: the layer's path ("" for GEMMs no NVFP4 layer owns).
    gemm: "fprop", "dgrad", "wgrad", or "backward" (a high-precision layer's
      autodiff GEMMs), or "other".
    precision: the operand formats it ran with, e.g. "nvfp4,nvfp4-16x16";
      "bf16" for a high-precision GEMM.
    implementation: what computes it (a kernel name, the exact emulation, a
      native FP4 path, or XLA's dot).
    quantizers: the quantizer implementations feeding it ("" if none).
    branch: "" outside a `lax.cond`; "cond k/n" inside branch k of n (the
      late switch traces both recipes).
    reason: for high-precision GEMMs, why.
  """

  layer: str
  gemm: str
  precision: str
  implementation: str
  quantizers: str = ""
  branch: str = ""
  reason: str = ""

  @property
  def quantized(self) -> bool:
    """Whether this GEMM ran with quantized operands."""
    return self.precision != "bf16"


@dataclasses.dataclass(frozen=True)
class Report:
  """The GEMMs of a traced program, as `report` found them.

  `str(report)` prints one row per GEMM (layer, GEMM, formats,
  implementation, quantizers, reason); `summary()` is the one-line version,
  `count()` counts GEMMs by kind, and `compiled(hlo)` corrects the native
  GEMMs' implementations by what XLA compiled.

  Attributes:
    gemms: every linear GEMM of the program, in trace order.
    quantized: the GEMMs that ran with quantized operands.
    high_precision: the others, each with its `Gemm.reason`.
  """

  gemms: tuple[Gemm, ...]

  @property
  def quantized(self) -> tuple[Gemm, ...]:
    """The GEMMs that ran with quantized operands, in trace order."""
    return tuple(g for g in self.gemms if g.quantized)

  @property
  def high_precision(self) -> tuple[Gemm, ...]:
    """The GEMMs that ran in high precision, each with its `Gemm.reason`."""
    return tuple(g for g in self.gemms if not g.quantized)

  def count(self, gemm: str | None = None, *, quantized: bool = True) -> int:
    """How many GEMMs ran quantized (or not).

    Args:
      gemm: count only this kind ("fprop", "dgrad", "wgrad", ...); None
        counts every kind.
      quantized: count the quantized GEMMs (True) or the high-precision ones.

    Returns:
      The number of matching GEMMs.
    """
    return sum(g.quantized == quantized and (gemm is None or g.gemm == gemm)
               for g in self.gemms)

  def compiled(self, hlo: str) -> "Report":
    """This report, with each native GEMM's implementation read from `hlo`.

    A block-scaled dot that XLA decomposed (cuDNN below 9.10) is reported as
    the emulation it runs, not as cuDNN.

    Args:
      hlo: the optimized HLO text of the same program
        (`jax.jit(fn).lower(...).compile().as_text()`).

    Returns:
      A new `Report`; GEMMs other than native FP4 ones are unchanged.
    """
    found = _compiled_targets(hlo)
    gemms = []
    for g in self.gemms:
      if g.quantized and g.implementation.startswith("native FP4"):
        targets = found.get((g.layer, g.gemm), set())
        if "__cudnn$blockScaledDot" in targets:
          impl = "native FP4: cuDNN block-scaled dot"
        elif "triton_kernel_call" in targets:
          impl = "native FP4: triton tl.dot_scaled"
        else:
          impl = ("emulation: XLA decomposed the block-scaled dot "
                  "(dequantize + " + ("cuBLAS" if any(
                      t.startswith("__cublas") for t in targets)
                                      else "XLA") + " FP32 GEMM)")
        g = dataclasses.replace(g, implementation=impl)
      gemms.append(g)
    return Report(tuple(gemms))

  def summary(self) -> str:
    """One line: quantized GEMMs and their implementations, high-precision
    GEMMs by reason."""
    impls = sorted({g.implementation for g in self.quantized})
    quants = sorted({q for g in self.quantized for q in
                     g.quantizers.split("; ") if q})
    reasons: dict[str, int] = {}
    for g in self.high_precision:
      reasons[g.reason] = reasons.get(g.reason, 0) + 1
    hp = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()))
    return (f"NVFP4: {len(self.quantized)} GEMMs quantized"
            + (f" (GEMM: {', '.join(impls)}; quantizers: "
               f"{', '.join(quants) or 'none'})" if impls else "")
            + f"; {len(self.high_precision)} in high precision"
            + (f" ({hp})" if hp else ""))

  def __str__(self) -> str:
    cols = ("layer", "gemm", "precision", "implementation", "quantizers",
            "branch", "reason")
    rows = [[getattr(g, c) or ("-" if c == "layer" else "") for c in cols]
            for g in self.gemms]
    widths = [max([len(c)] + [len(r[i]) for r in rows])
              for i, c in enumerate(cols)]
    line = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
    return "\n".join([line(cols), line(["-" * w for w in widths])]
                     + [line(r) for r in rows] + ["", self.summary()])


def _subjaxprs(eqn) -> Iterator[tuple[int | None, int, Any]]:
  """`(branch index or None, branch count, jaxpr)` of an eqn's sub-programs."""
  if eqn.primitive.name == "cond":
    branches = eqn.params["branches"]
    for i, b in enumerate(branches):
      yield i, len(branches), b.jaxpr
    return
  for v in eqn.params.values():
    for s in (v if isinstance(v, (list, tuple)) else (v,)):
      inner = getattr(s, "jaxpr", s)
      if hasattr(inner, "eqns"):
        yield None, 0, inner


def _kernels(jaxpr) -> list[str]:
  """Names of the kernels (Pallas calls, Triton calls, cuDNN scaled matmul)
  anywhere inside `jaxpr`."""
  names = []
  for eqn in jaxpr.eqns:
    prim = eqn.primitive.name
    if prim == "pallas_call":
      info = eqn.params.get("name_and_src_info") or eqn.params.get("name")
      names.append(str(getattr(info, "name", info)).split(" ")[0])
    elif "triton" in prim:
      names.append("triton:" + str(eqn.params.get("name", prim)))
    elif "scaled_matmul" in prim or "scaled_dot" in prim:
      names.append("cudnn:" + prim)
    for _, _, sub in _subjaxprs(eqn):
      names += _kernels(sub)
  return names


def _gemm_implementation(kind: str, jaxpr) -> str:
  kernels = _kernels(jaxpr)
  if kind == "bf16":
    return "xla dot"
  if any(k.startswith("triton:") for k in kernels):
    return "native FP4: triton tl.dot_scaled"
  if any(k.startswith("cudnn:") for k in kernels):
    return "native FP4: cuDNN scaled_matmul"
  if kernels:
    return f"emulation: pallas {'+'.join(sorted(set(kernels)))} + bf16 dot"
  return "emulation: xla block values + bf16 dot"


def _quantizer_implementation(jaxpr) -> str:
  kernels = sorted(set(_kernels(jaxpr)))
  return f"pallas {'+'.join(kernels)}" if kernels else "xla reference"


def _scope(eqn) -> tuple[str, str] | None:
  m = _SCOPE.search(str(eqn.source_info.name_stack))
  return (m.group(1), m.group(2)) if m else None


def _walk(jaxpr, branch: str, out: list, quant: dict,
          outer: tuple[str, str] | None = None) -> None:
  """Collects the GEMMs of `jaxpr`; `outer` is the layer scope of the eqn
  that holds it (name stacks inside a sub-program are relative to it)."""
  for eqn in jaxpr.eqns:
    name = eqn.params.get("name", "") if eqn.primitive.name in (
        "pjit", "jit") else ""
    gm = _GEMM_REGION.match(str(name))
    qm = _QUANT_REGION.match(str(name))
    scope = _scope(eqn) or outer
    if gm:
      kind, gemm = gm.groups()
      layer, tag = scope or ("?", "")
      formats = dict(t.split("=") for t in tag.split(" ") if "=" in t)
      precision = formats.get(gemm, kind) if kind == "nvfp4" else "bf16"
      out.append((Gemm(layer=layer, gemm=gemm, precision=precision,
                       implementation=_gemm_implementation(
                           kind, eqn.params["jaxpr"].jaxpr),
                       branch=branch,
                       reason="" if kind == "nvfp4" else "recipe: bf16"),
                  _OPERANDS[gemm]))
      continue
    if qm:
      layer = scope[0] if scope else "?"
      quant[(layer, branch, qm.group(1))] = _quantizer_implementation(
          eqn.params["jaxpr"].jaxpr)
      continue
    if eqn.primitive.name == "dot_general":
      (_, _), (lb, _) = eqn.params["dimension_numbers"]
      if scope:  # A layer whose recipe is bf16 throughout: plain dots.
        gemm = ("backward" if "transpose(" in str(eqn.source_info.name_stack)
                else "fprop")
        out.append((Gemm(layer=scope[0], gemm=gemm, precision="bf16",
                         implementation="xla dot", branch=branch,
                         reason="recipe: bf16"), ()))
      else:
        out.append((Gemm(layer="", gemm="other", precision="bf16",
                         implementation="xla dot", branch=branch,
                         reason=("batched GEMM (attention)" if lb else
                                 "MoE router (FP32)" if _ROUTER in str(
                                     eqn.source_info.name_stack) else
                                 "not an NVFP4 layer")), ()))
      continue
    for i, n, sub in _subjaxprs(eqn):
      _walk(sub, branch if i is None else
            f"{branch + ' ' if branch else ''}cond {i + 1}/{n}", out, quant,
            scope)


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def _compiled_targets(hlo: str) -> dict[tuple[str, str], set[str]]:
  """`(layer, gemm) -> custom-call targets` of an optimized HLO text, read
  from each instruction's `op_name` (which holds the layer scope and the
  GEMM's region, e.g. `nvfp4_layer[blk/mlp|...]/jit(nvfp4_fprop)`)."""
  out: dict[tuple[str, str], set[str]] = {}
  for line in hlo.splitlines():
    t, n = _TARGET.search(line), _OP_NAME.search(line)
    if not (t and n):
      continue
    scope = _SCOPE.search(n.group(1))
    gemm = re.search(r"\(nvfp4_(fprop|dgrad|wgrad)\)", n.group(1))
    if scope and gemm:
      out.setdefault((scope.group(1), gemm.group(1)), set()).add(t.group(1))
  return out


def compiled_report(fn: Callable[..., Any], *args, **kwargs) -> Report:
  """`report(fn, ...)`, corrected by what XLA compiles `jax.jit(fn)` to.

  Compiles `fn` for this process's default device and reads the optimized
  HLO (`Report.compiled`); runs nothing.

  Args:
    fn: as for `report`.
    *args: its positional arguments (arrays or `jax.ShapeDtypeStruct`s).
    **kwargs: its keyword arguments.

  Returns:
    The `Report` of the traced program, each native FP4 GEMM's
    implementation as compiled.

  Raises:
    Whatever `jax.jit(fn).lower(...).compile()` raises for these arguments.
  """
  hlo = jax.jit(lambda *a, **k: fn(*a, **k)).lower(
      *args, **kwargs).compile().as_text()
  return report(fn, *args, **kwargs).compiled(hlo)


def report(fn: Callable[..., Any], *args, **kwargs) -> Report:
  """Traces `fn(*args, **kwargs)` and reports every linear GEMM in it.

  Args:
    fn: e.g. a train step or `lambda p, x: model.apply(p, x)`; traced with
      `jax.make_jaxpr` (abstractly: pass arrays or `jax.ShapeDtypeStruct`s).
    *args: its positional arguments.
    **kwargs: its keyword arguments.

  Returns:
    A `Report`: one `Gemm` per linear GEMM with its layer path, the operand
    formats it was traced with, the implementation that computes it and the
    quantizers feeding it; high-precision GEMMs with their reason.
  """
  # A fresh wrapper: `make_jaxpr` reuses jit's trace cache, which would hide
  # a `default_implementation` block around this call.
  closed = jax.make_jaxpr(lambda *a, **k: fn(*a, **k))(*args, **kwargs)
  found: list = []
  quant: dict = {}
  _walk(closed.jaxpr, "", found, quant)
  gemms = []
  for g, operands in found:
    q = [quant[(g.layer, g.branch, o)] for o in operands
         if (g.layer, g.branch, o) in quant]
    gemms.append(dataclasses.replace(g, quantizers="; ".join(
        dict.fromkeys(q))) if g.quantized else g)
  return Report(tuple(gemms))
