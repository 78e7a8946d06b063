"""Which layers of a GPT should stay in BF16? Measure, rank, suggest rules.

    python -m train.sensitivity --preset small --checkpoint runs/small-nvfp4
    python -m train.sensitivity --preset tiny --batches 2 --budget 0.15
    python -m train.sensitivity --preset tiny --sr-draws 64

Runs `nvfp4_jax.tools.sensitivity.analyze` on a few training batches (the
model's own activations and output gradients, in high precision) and prints,
per projection, the relative error of its NVFP4 Fprop, Dgrad and Wgrad and the
flushed/saturated fractions; then the layers the suggested rules keep in BF16
(the `--budget` share of the projections), next to the paper's preset, and
writes a plot of the three errors per layer. With `--sr-draws N` it then
checks, per projection, that the stochastically rounded Dgrad and Wgrad are
unbiased (`sensitivity.analyze_sr_bias` over N draws on the first batch).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Sequence

PROG = "python -m train.sensitivity"


def plot(results, path: pathlib.Path, title: str) -> str:
  """Grouped bars of the three GEMM errors per layer (model order)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from nvfp4_jax.tools.sensitivity import METRICS  # pylint: disable=g-import-not-at-top
  x = np.arange(len(results))
  fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(results)), 3.5))
  for i, m in enumerate(METRICS):
    ax.bar(x + (i - 1) * 0.27, [r.stats[m] for r in results], 0.27,
           label=m.replace("_err", ""))
  ax.set_xticks(x, [r.path for r in results], rotation=90, fontsize=7)
  ax.set_ylabel("relative error vs FP32")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return str(path)


def main(argv: Sequence[str] | None = None) -> int:
  from models import PRESETS  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
  p.add_argument("--preset", choices=list(PRESETS), default="tiny")
  p.add_argument("--checkpoint", metavar="RUN_DIR",
                 help="a run of python -m train (default: a fresh "
                 "initialization of --preset)")
  p.add_argument("--data", metavar="PATH", help="as python -m train --data")
  p.add_argument("--batches", type=int, default=2)
  p.add_argument("--batch-size", type=int, default=8)
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--budget", type=float, default=0.15,
                 help="share of the projections to keep in BF16")
  p.add_argument("--out", default="runs/sensitivity.png",
                 help="the plot to write")
  p.add_argument("--sr-draws", type=int, default=0, metavar="N",
                 help="also measure the stochastic-rounding bias of each "
                 "projection's Dgrad and Wgrad over N >= 2 draws on the first "
                 "batch (default 0: off)")
  args = p.parse_args(argv)
  if not 0 <= args.budget <= 1 or args.batches < 1:
    p.error(f"--budget must be in [0, 1] and --batches >= 1, got "
            f"{args.budget} and {args.batches}")
  if args.sr_draws != 0 and args.sr_draws < 2:
    p.error(f"--sr-draws must be 0 (off) or >= 2, got {args.sr_draws}")

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import nvfp4_jax as nv  # pylint: disable=g-import-not-at-top
  from models import GPT  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.tools import sensitivity  # pylint: disable=g-import-not-at-top
  from train import data as data_lib  # pylint: disable=g-import-not-at-top
  from train.config import TrainConfig  # pylint: disable=g-import-not-at-top
  from train.loop import cross_entropy  # pylint: disable=g-import-not-at-top
  from train.loop import model_config  # pylint: disable=g-import-not-at-top

  try:
    corpus = data_lib.load_corpus(args.data)
    if args.checkpoint:
      from train.export import restore_run  # pylint: disable=g-import-not-at-top
      cfg, mcfg, step, params, _ = restore_run(args.checkpoint)
      origin = f"{args.checkpoint} (step {step})"
    else:
      cfg = TrainConfig(preset=args.preset)
      mcfg = model_config(cfg, corpus.vocab_size)
      with nv.precision_rules(nv.PrecisionRules.high_precision()):
        params = GPT(mcfg).init(jax.random.key(0), jnp.zeros(
            (1, args.seq_len), jnp.int32))["params"]
      origin = f"a fresh {args.preset} initialization"
  except (OSError, ValueError) as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  model = GPT(mcfg)
  batcher = data_lib.Batcher(corpus.train, batch_size=args.batch_size,
                             seq_len=args.seq_len, seed=0)
  batches = [jnp.asarray(batcher.batch(i)) for i in range(args.batches)]

  def loss(p, b):
    return cross_entropy(model.apply({"params": p}, b[:, :-1]), b[:, 1:])
  results = sensitivity.analyze(loss, params, batches)
  print(f"NVFP4 sensitivity of GPT {mcfg.num_layers}-layer ({origin}), "
        f"{args.batches} x {args.batch_size} x {args.seq_len} tokens:\n")
  print(sensitivity.table(results))
  rules = sensitivity.suggest_rules(results, budget=args.budget)
  kept = sorted(r.path for r in results
                if not rules.recipe_for(r.path).quantized)
  paper = nv.paper_rules(mcfg.num_layers)
  paper_kept = sorted(r.path for r in results
                      if not paper.recipe_for(r.path).quantized)
  print(f"\nsuggested BF16 layers ({len(kept)}/{len(results)}): "
        f"{', '.join(kept) or 'none'}")
  print(f"the paper's preset keeps ({len(paper_kept)}/{len(results)}): "
        f"{', '.join(paper_kept)}")
  if kept:
    print(f"as a run: python -m train --preset {cfg.preset} "
          f"--bf16-layers {','.join(kept)}")
  print("as rules: nvfp4_jax.PrecisionRules(rules=("
        + "".join(f"(r'{pat}', nvfp4_jax.Recipe.bf16()), "
                  for pat, _ in rules.rules) + "))")
  if args.sr_draws:
    bias = sensitivity.analyze_sr_bias(loss, params, batches[0],
                                       draws=args.sr_draws)
    print("\n" + sensitivity.sr_bias_table(bias, args.sr_draws))
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  print(f"plot: {plot(results, out, f'NVFP4 error per layer ({origin})')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
