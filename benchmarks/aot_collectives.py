"""What the trainer's sharded step communicates on N GPUs, compiled ahead of
time on a machine without them (JAX's CUDA plugin; see `nvfp4_jax.tools.aot`).

    JAX_PLATFORMS=cpu python -m benchmarks.aot_collectives --preset base \\
        --batch 16 --seq 1024 --precision bf16 --mesh fsdp=2 [--hlo out.txt]

Compiles `train.step.StepFunctions.train_step` with the trainer's
`MeshRules` shardings for `--target` x N devices of one host (topology
"1x1xN") and prints every collective of XLA's scheduled program: kind,
dtypes, bytes each device sends (ring estimates: an all-gather's or
reduce-scatter's (n-1)/n of the whole, an all-reduce's twice that), where
it came from (the JAX op name) and how many compute instructions
(fusions, custom calls) XLA scheduled between its start and its done (0:
nothing hides it). `--xla-option name=value` passes XLA debug options to
the compile (e.g. `xla_gpu_all_gather_combine_threshold_bytes=8388608`).
Nothing runs; the GEMM and attention choices are XLA's deviceless ones,
the collectives are the partitioner's and the schedule the latency-hiding
scheduler's cost model, as on the GPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

_INS = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.-]+)\s*=\s*(?P<type>\(.*?\)|\S+)"
                  r"\s+(?P<op>[\w-]+)\((?P<args>[^)]*)\)")
_COMPUTE = ("fusion", "custom-call", "dot", "convolution", "while",
            "conditional", "call")


def sent_bytes(c) -> float:
  """Bytes one device sends for collective `c` (ring estimate; for a
  ragged all-to-all the bound: every row of its operand to another
  device; what it sends is data-dependent)."""
  from nvfp4_jax.sharding import hlo  # pylint: disable=g-import-not-at-top
  n = c.group_size or 2
  operand = sum(hlo._nbytes(d, s) for d, s in c.operands)  # pylint: disable=protected-access
  return {"all-gather": c.result_bytes * (n - 1) / n,
          "reduce-scatter": operand * (n - 1) / n,
          "all-reduce": 2 * operand * (n - 1) / n,
          "all-to-all": operand * (n - 1) / n,
          "ragged-all-to-all": hlo._nbytes(*c.operands[0]) if c.operands  # pylint: disable=protected-access
          else 0}.get(c.op, operand)


def overlap(text: str) -> dict[str, int]:
  """{async start's HLO line: compute instructions scheduled before its
  done}, over every computation of a scheduled HLO module."""
  out, lines, starts = {}, [], {}
  for line in text.splitlines() + ["}"]:
    if line.startswith("}"):
      for i, l in enumerate(lines):
        m = _INS.match(l)
        if not m:
          continue
        op = m.group("op")
        if op.endswith("-start"):
          starts[m.group("name")] = i
        elif op.endswith("-done"):
          src = re.findall(r"%([\w.-]+)", m.group("args"))
          if src and src[0] in starts:
            j = starts.pop(src[0])
            out[lines[j].strip()] = sum(
                1 for x in lines[j + 1:i]
                if (mm := _INS.match(x)) and mm.group("op") in _COMPUTE)
      lines, starts = [], {}
    else:
      lines.append(line)
  return out


def compile_step(preset, precision, batch, seq, mesh_sizes, target="h100",
                 options=None, partial_sums="float32",
                 amax="global", wgrad_sums="float32",
                 sequence_parallel=False, collective_matmul=False) -> str:
  """The scheduled HLO of the trainer's step on `mesh_sizes` of `target`."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import nvfp4_jax  # pylint: disable=g-import-not-at-top
  from models import GPT  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.tools import aot  # pylint: disable=g-import-not-at-top
  from train.build import make_rules  # pylint: disable=g-import-not-at-top
  from train.build import model_config  # pylint: disable=g-import-not-at-top
  from train.config import TrainConfig  # pylint: disable=g-import-not-at-top
  from train.optim import make_optimizer  # pylint: disable=g-import-not-at-top
  from train.step import StepFunctions  # pylint: disable=g-import-not-at-top
  n = 1
  for v in mesh_sizes.values():
    n *= v
  tc = TrainConfig(preset=preset, precision=precision, steps=1000,
                   batch_size=batch * n, seq_len=seq, diagnostics=False,
                   dtype="bfloat16")
  mc = model_config(tc, 256)
  opt, schedule = make_optimizer(tc)
  with aot.compiling_for(target):
    devices = aot.topology_devices(target, n)
    mesh = nvfp4_jax.sharding.make_mesh(devices, **mesh_sizes)
    mr = nvfp4_jax.MeshRules(mesh=mesh, partial_sums=partial_sums,
                             amax=amax, wgrad_sums=wgrad_sums,
                             sequence_parallel=sequence_parallel,
                             collective_matmul=collective_matmul)
    fns = StepFunctions(tc, GPT(mc), make_rules(tc, mc.num_layers), opt,
                        schedule, mesh_rules=mr)
    abstract = jax.eval_shape(fns.init_state)
    ss = mr.shardings(mr.state_specs(abstract, abstract.params))
    bs = NamedSharding(mesh, mr.batch_spec(3, axis=1))
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(
        s.shape, s.dtype, sharding=sh), abstract, ss)
    tokens = jax.ShapeDtypeStruct((1, batch * n, seq + 1), jnp.int32,
                                  sharding=bs)
    step = jax.jit(fns.train_step, donate_argnums=0, in_shardings=(ss, bs),
                   out_shardings=(ss, NamedSharding(mesh, P())))
    lowered = step.trace(state, tokens).lower()
    compiled = (lowered.compile(compiler_options=options) if options
                else lowered.compile())
    return compiled.as_text()


def report(text: str, verbose: bool = True) -> str:
  """The collectives of `text` (scheduled HLO) as Markdown."""
  from nvfp4_jax.tools import timing  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.sharding import hlo  # pylint: disable=g-import-not-at-top
  over = overlap(text)
  rows, totals = [], collections.defaultdict(lambda: [0, 0.0, 0])
  for c in hlo.collectives(text):
    if c.trivial:
      continue
    name = re.search(r'op_name="([^"]*)"', c.line)
    name = re.sub(r"nvfp4_layer\[[^\]]*\]/?|jit\(train_step\)/|"
                  r"while/body/closed_call/", "",
                  name.group(1) if name else "")[:80]
    between = over.get(c.line, -1)  # -1: synchronous.
    kind = f"{c.op} {'/'.join(sorted(set(c.dtypes)))}"
    totals[kind][0] += 1
    totals[kind][1] += sent_bytes(c)
    totals[kind][2] += between <= 0
    rows.append({"collective": kind, "MiB sent": sent_bytes(c) / 2**20,
                 "compute between": between, "from": name})
  out = []
  if verbose:
    out.append(timing.table(rows, ("collective", "MiB sent",
                                   "compute between", "from")))
  summary = [{"collective": k, "count": v[0], "MiB sent": v[1] / 2**20,
              "nothing between": v[2]} for k, v in sorted(totals.items())]
  summary.append({"collective": "total", "count": sum(
      v[0] for v in totals.values()), "MiB sent": sum(
          v[1] for v in totals.values()) / 2**20})
  out.append(timing.table(summary, ("collective", "count", "MiB sent",
                                    "nothing between")))
  return "\n\n".join(out)


def main(argv=None):
  # After `JAX_PLATFORMS` is set: the flags' choices come from the library.
  from train import mesh_flags  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="base")
  p.add_argument("--precision", default="bf16")
  p.add_argument("--batch", type=int, default=16, help="per device")
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--target", default="h100")
  p.add_argument("--xla-option", action="append", default=[],
                 help="name=value, repeatable")
  p.add_argument("--hlo", default="", help="also write the HLO here")
  mesh_flags.add_mesh_flags(
      p, mesh_default="fsdp=2", mesh_help="--target's devices as a mesh "
      "(default fsdp=2): " + mesh_flags.MESH_HELP,
      knobs=("tp_partial_sums", "amax", "wgrad_sums", "sequence_parallel",
             "collective_matmul"))
  p.add_argument("--summary", action="store_true",
                 help="only the totals by kind")
  a = p.parse_args(argv)
  sizes = a.mesh
  options = {}
  for kv in a.xla_option:
    k, v = kv.split("=", 1)
    options[k] = {"true": True, "false": False}.get(v.lower(), v)
    if isinstance(options[k], str) and options[k].isdigit():
      options[k] = int(options[k])
  t0 = time.perf_counter()
  text = compile_step(a.preset, a.precision, a.batch, a.seq, sizes, a.target,
                      options, a.tp_partial_sums, a.amax, a.wgrad_sums,
                      a.sequence_parallel, a.collective_matmul)
  if a.hlo:
    with open(a.hlo, "w") as f:
      f.write(text)
  print(f"{a.preset} {a.precision} {a.batch}x{a.seq} per device on {sizes} "
        f"x {a.target}, compiled ahead of time in "
        f"{time.perf_counter() - t0:.0f} s\n", file=sys.stderr)
  print(report(text, verbose=not a.summary))


if __name__ == "__main__":
  main()
