"""The device mesh's flags: `--mesh AXIS=N,...` and the mesh knobs.

One definition for `python -m train` and the benchmarks that build the
trainer's sharded step (`bench_scaling`, `bench_memory`, `aot_collectives`):
`parse_mesh` reads a `--mesh` spec, `add_mesh_flags` adds `--mesh` and the
knobs (`--tp-partial-sums`, `--sequence-parallel`, `--collective-matmul`,
`--amax`, `--wgrad-schedule`, `--wgrad-sums`) to a parser, and `knob_config`
turns the parsed flags into `TrainConfig`'s fields. With `sweep=True` each
knob takes a comma list of values to time or search the step with (what the
benchmarks sweep) instead of one (`sweep_values` reads it).

The values are validated where they are used (`TrainConfig`, `MeshRules`),
so a bad one is refused naming the field and its choices.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from nvfp4_jax.sharding.mesh import AMAX_SCOPES
from nvfp4_jax.sharding.mesh import AXES
from nvfp4_jax.sharding.mesh import EXPERT_AXIS
from nvfp4_jax.sharding.mesh import PARTIAL_SUMS
from nvfp4_jax.sharding.mesh import WGRAD_SCHEDULES
from nvfp4_jax.sharding.mesh import WGRAD_SUMS

MESH_AXES = AXES + (EXPERT_AXIS,)
MESH_HELP = ("device mesh, e.g. data=2,fsdp=2,model=2 (axes data: batch; "
             "fsdp: batch + parameters and optimizer state; model: tensor "
             "parallelism; expert: batch + the experts of MoE presets, tokens "
             "exchanged all-to-all). Sizes multiply to the device count")
# `--sequence-parallel` in a sweep: off, on, or on with the collective
# matmul as well (ring), so `--collective-matmul` has no sweep of its own.
SEQUENCE_SWEEP = ("off", "on", "ring")


class MeshSpecError(argparse.ArgumentTypeError, ValueError):
  """A malformed `--mesh` spec.

  Attributes:
    text: the spec as given.
    part: the comma-separated part that is not `AXIS=N` (None where an axis
      is given twice).
    axis: the axis given twice (None otherwise).
  """

  def __init__(self, message: str, text: str, part: str | None = None,
               axis: str | None = None):
    super().__init__(message)
    self.text, self.part, self.axis = text, part, axis


def parse_mesh(text: str) -> dict[str, int]:
  """`data=2,fsdp=2,model=2` -> `{"data": 2, "fsdp": 2, "model": 2}`.

  Also an argparse `type`: its error is argparse's message for the flag.

  Raises:
    MeshSpecError: a part is not `AXIS=N` with AXIS in `MESH_AXES` and
      N >= 1, or an axis is given twice.
  """
  sizes = {}
  for part in text.split(","):
    name, _, value = part.strip().partition("=")
    if name not in MESH_AXES or not value.isdigit() or int(value) < 1:
      raise MeshSpecError(
          f"expected AXIS=N pairs with AXIS in {','.join(MESH_AXES)} and N "
          f">= 1, e.g. data=2,fsdp=2,model=2; got {text!r}", text, part=part)
    if name in sizes:
      raise MeshSpecError(f"axis {name!r} given twice in {text!r}", text,
                          axis=name)
    sizes[name] = int(value)
  return sizes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Knob:
  """One mesh knob's flag.

  Attributes:
    field: the `TrainConfig` field, also the flag's name (`--field-name`)
      and its argparse `dest`.
    choices: its values, None for a switch (`store_true`).
    default: the value without the flag.
    help: what it does.
    aliases: older spellings of the flag, accepted and not listed in help.
  """
  field: str
  choices: tuple[str, ...] | None
  default: Any
  help: str
  aliases: tuple[str, ...] = ()

  @property
  def flag(self) -> str:
    return "--" + self.field.replace("_", "-")


KNOBS = (
    Knob(field="tp_partial_sums", choices=PARTIAL_SUMS,
         default="float32", aliases=("--partial-sums",),
         help="with a model mesh axis: sum tensor parallelism's partial "
         "results in float32 (rounded once, the default) or in the output "
         "dtype (half the bytes for bf16, as Megatron-style tensor "
         "parallelism)"),
    Knob(field="sequence_parallel", choices=None,
         default=False,
         help="with a model mesh axis of more than one device: sequence "
         "parallelism, the activations between the tensor-parallel layers "
         "split over model too (their norms and residual adds on a token "
         "shard; the same result)"),
    Knob(field="collective_matmul", choices=None,
         default=False,
         help="with --sequence-parallel: the quantized layers' gathers and "
         "reduce-scatters over model as rings beside their GEMMs, so the "
         "transfers can hide behind them"),
    Knob(field="amax", choices=AMAX_SCOPES, default="global",
         help="on a mesh: the activations' and gradients' tensor amax over "
         "the whole batch (global, the default: the one-device run's "
         "quantization) or each token shard's (local: no collective over "
         "the batch axes, a data-parallel micro-batch's numerics)"),
    Knob(field="wgrad_schedule",
         choices=WGRAD_SCHEDULES, default="layer",
         help="with an fsdp mesh axis: compute each layer's weight gradient "
         "with its input gradient (layer, the default: activations freed "
         "layer by layer) or where XLA's scheduler puts it (xla)"),
    Knob(field="wgrad_sums", choices=WGRAD_SUMS,
         default="float32",
         help="on a mesh that splits the batch: sum the NVFP4 layers' weight "
         "gradients across devices in FP32 (float32, the default: the "
         "one-device run's gradients) or in bf16 (bfloat16: half the bytes, "
         "one more rounding)"),
)
KNOB_FIELDS = tuple(k.field for k in KNOBS)


def _one_of(choices) -> str:
  return "{" + ",".join(choices) + "}"


def add_mesh_flags(p: argparse.ArgumentParser, *, mesh: bool = True,
                   mesh_default: str | None = None,
                   mesh_help: str = MESH_HELP + "; default: all devices on "
                   "data", knobs=KNOB_FIELDS, sweep: bool = False) -> None:
  """Adds `--mesh` (parsed by `parse_mesh`) and the mesh knobs to `p`.

  Args:
    p: the parser.
    mesh: whether to add `--mesh`.
    mesh_default: its default (a spec, parsed as given ones are).
    mesh_help: its help.
    knobs: the `Knob.field`s whose flags to add, of `KNOB_FIELDS`.
    sweep: each knob takes a comma list of values (a string, read with
      `sweep_values`), `--sequence-parallel` of `SEQUENCE_SWEEP` (and
      `--collective-matmul` is not added).
  """
  if mesh:
    p.add_argument("--mesh", metavar="AXIS=N,...", type=parse_mesh,
                   default=mesh_default, help=mesh_help)
  unknown = set(knobs) - set(KNOB_FIELDS)
  if unknown:
    raise ValueError(f"no mesh knob {sorted(unknown)}; the knobs are "
                     f"{KNOB_FIELDS}")
  for k in KNOBS:
    if k.field not in knobs or (sweep and k.field == "collective_matmul"):
      continue
    if sweep:
      choices = SEQUENCE_SWEEP if k.choices is None else k.choices
      default = "off" if k.choices is None else k.default
      ring = (" (ring: with the collective matmul as well)"
              if k.choices is None else "")
      kwargs = dict(metavar="V1,V2,...", default=default,
                    help=f"comma list of {','.join(choices)}: also run with "
                    f"each value listed{ring}; {k.help}")
    elif k.choices is None:
      kwargs = dict(action="store_true", help=k.help)
    else:
      kwargs = dict(metavar=_one_of(k.choices), default=k.default,
                    help=k.help)
    p.add_argument(k.flag, dest=k.field, **kwargs)
    for alias in k.aliases:
      p.add_argument(alias, dest=k.field, default=argparse.SUPPRESS,
                     help=argparse.SUPPRESS,
                     **{key: v for key, v in kwargs.items()
                        if key in ("action", "metavar")})


def knob_config(args: argparse.Namespace) -> dict[str, Any]:
  """The mesh knobs `add_mesh_flags` added to `args`, as `TrainConfig`
  fields (`{"tp_partial_sums": "float32", ...}`)."""
  return {k.field: getattr(args, k.field) for k in KNOBS
          if hasattr(args, k.field)}


def sweep_values(args: argparse.Namespace, field: str) -> list[str]:
  """The values a sweep flag (`add_mesh_flags(sweep=True)`) lists, checked
  against the knob's choices where the sweep has its own words
  (`SEQUENCE_SWEEP`); the library checks the others where they are used.

  Raises:
    SystemExit: a value of `--sequence-parallel` is not one of them.
  """
  text = getattr(args, field)
  items = [t for t in text.split(",") if t]
  choices = SEQUENCE_SWEEP if field == "sequence_parallel" else None
  bad = [t for t in items if choices and t not in choices]
  if bad:
    raise SystemExit(
        f"--{field.replace('_', '-')} {text!r}: {bad[0]!r} is not one of "
        f"{','.join(choices)}; give a comma list of them (e.g. 'off,on').")
  return items
