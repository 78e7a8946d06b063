"""Plots of the benchmark reference's tables, drawn from BENCHMARKS.md itself.

`python -m benchmarks.plot_reference [--out results]` reads two tables of
BENCHMARKS.md (the section "Several GPUs") and writes:

- `scaling.png`: weak scaling of GPT base (tokens/s per GPU over `data=1`)
  for each mesh of the bold rows (one run, 4x H100), BF16 against NVFP4,
  with each mesh's target;
- `step_breakdown.png`: GPU 0's step in those runs, split into compute,
  exposed NCCL (NCCL with no other kernel running) and idle.

The figures are only what the tables say (the tables carry the device, the
date, the commit and the command); redraw them after the tables change.
"""

from __future__ import annotations

import argparse
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCALING = "### The scaling table"
BREAKDOWN = "GPU 0's step in the bold rows, ms:"


def _table(text: str, after: str) -> list[list[str]]:
  """The rows (cells stripped) of the first Markdown table after `after`,
  without its header and separator."""
  start = text.index(after)
  lines = text[start:].splitlines()
  first = next(i for i, l in enumerate(lines) if l.startswith("|"))
  rows = []
  for line in lines[first + 2:]:
    if not line.startswith("|"):
      break
    rows.append([c.strip() for c in line.strip().strip("|").split("|")])
  return rows


def _bold(cell: str) -> float | None:
  m = re.fullmatch(r"\*\*([\d.]+)\*\*", cell.split(";")[0].strip())
  return float(m.group(1)) if m else None


def scaling(text: str) -> list[tuple[str, float, float, float]]:
  """`(mesh, target, BF16, NVFP4)` of the scaling table's bold rows (the
  multi-GPU meshes of one run; `data=1` is their baseline)."""
  out = []
  for mesh, _, target, bf16, nvfp4, *_ in _table(text, SCALING):
    b, n = _bold(bf16), _bold(nvfp4)
    if b is None or n is None or mesh.endswith("ms"):
      continue
    t = re.fullmatch(r"[\d.]+", target)
    out.append((mesh.strip("`"), float(target) if t else float("nan"), b, n))
  return out


def breakdown(text: str) -> list[tuple[str, float, float, float, float, float]]:
  """`(configuration, step, NCCL, exposed NCCL, compute, idle)` in ms."""
  return [(c, *map(float, rest)) for c, *rest in _table(text, BREAKDOWN)]


def plot(text: str, out: pathlib.Path) -> list[pathlib.Path]:
  """Draws both figures into `out`; returns their paths."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  out.mkdir(parents=True, exist_ok=True)
  paths = []

  rows = scaling(text)
  fig, ax = plt.subplots(figsize=(7, 3.6))
  x = np.arange(len(rows))
  ax.bar(x - 0.2, [r[2] for r in rows], 0.4, label="BF16")
  ax.bar(x + 0.2, [r[3] for r in rows], 0.4, label="NVFP4")
  for i, r in enumerate(rows):
    if np.isfinite(r[1]):
      ax.hlines(r[1], i - 0.45, i + 0.45, colors="k", linestyles="dashed",
                label="target" if i == 0 else None)
  ax.set_xticks(x, [r[0] for r in rows])
  ax.set_ylim(0.5, 1.0)
  ax.set_ylabel("tokens/s per GPU over data=1")
  ax.set_title("GPT base, 16 x 1024 per GPU: weak scaling (4x H100, one run)")
  ax.legend(loc="lower left")
  fig.tight_layout()
  paths.append(out / "scaling.png")
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)

  rows = breakdown(text)
  fig, ax = plt.subplots(figsize=(7, 5.0))
  y = np.arange(len(rows))[::-1]
  compute = np.array([r[4] for r in rows])
  exposed = np.array([r[3] for r in rows])
  idle = np.array([r[5] for r in rows])
  ax.barh(y, compute, label="compute")
  ax.barh(y, exposed, left=compute, label="exposed NCCL")
  ax.barh(y, idle, left=compute + exposed, label="idle")
  ax.set_yticks(y, [r[0].replace("`", "") for r in rows], fontsize=8)
  ax.set_xlabel("GPU 0's step, ms")
  ax.set_title("GPT base: where the step goes (4x H100, one run)")
  ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14),
            ncol=3)
  fig.tight_layout()
  paths.append(out / "step_breakdown.png")
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)
  return paths


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.plot_reference",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--reference", type=pathlib.Path,
                 default=ROOT / "BENCHMARKS.md")
  p.add_argument("--out", type=pathlib.Path, default=ROOT / "results")
  args = p.parse_args(argv)
  for path in plot(args.reference.read_text(), args.out):
    print(path)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
