"""What a compiled program communicates: its collectives, from the HLO.

    compiled = jax.jit(step).lower(state, batch).compile()
    for c in nvfp4_jax.sharding.collectives(compiled):
      print(c.op, c.dtypes, c.result_bytes)

Reads the optimized HLO text (`compiled.as_text()`): each all-gather,
all-reduce, reduce-scatter, all-to-all and collective-permute with its
operands' and results' per-device types, and the size of its device groups.
The metadata on the instruction line (`Collective.line`) holds the JAX name
scope it came from, e.g. an NVFP4 layer's `nvfp4_layer[...]`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.-]+)\s*=\s*(?P<type>\(.*?\)|\S+)\s+"
    r"(?P<op>[\w-]+)\((?P<args>[^)]*)\)")
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                "ragged-all-to-all", "collective-permute")
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled program.

  Attributes:
    op: "all-gather", "all-reduce", "reduce-scatter", "all-to-all" or
      "collective-permute".
    operands: `(dtype, shape)` of each operand (per device).
    results: `(dtype, shape)` of each result (per device).
    line: the HLO instruction.
    group_size: devices per replica group (0: not stated, e.g. a
      collective-permute).
  """

  op: str
  operands: tuple[tuple[str, tuple[int, ...]], ...]
  results: tuple[tuple[str, tuple[int, ...]], ...]
  line: str
  group_size: int = 0

  @property
  def trivial(self) -> bool:
    """Over groups of one device (a mesh axis of size 1): moves nothing."""
    return self.group_size == 1

  @property
  def dtypes(self) -> tuple[str, ...]:
    """The operands' element types as HLO names them ("u8", "f32", ...)."""
    return tuple(d for d, _ in self.operands)

  @property
  def result_bytes(self) -> int:
    """Bytes of the result on each device (for an all-gather: the gathered
    tensor, of which `(n-1)/n` arrives from other devices)."""
    return sum(_nbytes(d, s) for d, s in self.results)


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "f8e8m0fnu": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
  return _DTYPE_BYTES.get(dtype, 4) * math.prod(shape)


def _shapes(text: str):
  return tuple((d, tuple(int(v) for v in s.split(",") if v))
               for d, s in _SHAPE.findall(text))


def collectives(compiled: Any) -> tuple[Collective, ...]:
  """The collectives of a compiled program, from its optimized HLO.

  Args:
    compiled: `jax.jit(f).lower(*args).compile()`, or its `as_text()`.

  Returns:
    One `Collective` per collective instruction (an async start/done pair
    counted once), with its operands' and results' per-device types; XLA
    keeps some over size-1 mesh axes (`Collective.trivial`).
  """
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  types, found = {}, []
  for line in text.splitlines():
    m = _INSTRUCTION.match(line)
    if m is None:
      continue
    types[m.group("name")] = m.group("type")
    op = m.group("op").removesuffix("-start")
    if op in _COLLECTIVES:
      found.append((op, m.group("args"), m.group("type"), line.strip()))
  out = []
  for op, args, result, line in found:
    names = re.findall(r"%([\w.-]+)", args)
    operands = tuple(s for n in names for s in _shapes(types.get(n, "")))
    results = _shapes(result)
    if (re.search(r"\s[\w-]+-start\(", line)
        and results[:len(operands)] == operands
        and len(results) > len(operands)):
      # An async start's type (GPU) is `((operands), (results))`.
      results = results[len(operands):]
    out.append(Collective(op=op, operands=operands, results=results,
                          line=line, group_size=_group_size(line)))
  return tuple(out)


def _group_size(line: str) -> int:
  """Devices per replica group: `replica_groups={{0,2},{1,3}}` or the iota
  form `replica_groups=[2,4]<=[8]` (2 groups of 4)."""
  m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[([0-9]+),([0-9]+)\]", line)
  if m:
    return int(m.group(2))
  # Shardy's form: `replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`
  # (groups along the braced axes).
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'",
                                                         m.group(2)))
  return 0
