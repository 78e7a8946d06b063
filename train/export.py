"""Export a trained run's quantized layers as packed NVFP4, and sample from it.

    python -m train.export runs/tiny-nvfp4 tiny.safetensors
    python -m train.export runs/tiny-nvfp4 tiny.safetensors --generate 200 \\
        --prompt "def main(" --mode weight_only

Reads the run's `config.json` and its newest checkpoint that restores (the
FP32 master weights; a damaged newer one is named on stderr and skipped),
packs every layer whose forward GEMM the run quantized
(`nvfp4_jax.export.save`: safetensors, 4.5 bits per quantized weight), checks
that the packed model's W4A4 logits equal the trained model's forward, and
optionally samples bytes from the exported model.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Sequence

import numpy as np

PROG = "python -m train.export"


def restore_run(run_dir: str | pathlib.Path):
  """`(TrainConfig, GPTConfig, step, FP32 master params, rules)` of a run."""
  import jax  # pylint: disable=g-import-not-at-top

  import nvfp4_jax  # pylint: disable=g-import-not-at-top
  from models import GPTConfig  # pylint: disable=g-import-not-at-top
  from models import convert_fused_layout  # pylint: disable=g-import-not-at-top
  from models import saved_fused_layout  # pylint: disable=g-import-not-at-top
  from train import data as data_lib  # pylint: disable=g-import-not-at-top
  from train.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  from train.checkpoint import existing_checkpoints  # pylint: disable=g-import-not-at-top
  from train.config import TrainConfig  # pylint: disable=g-import-not-at-top
  from train.loop import Trainer  # pylint: disable=g-import-not-at-top
  from train.step import TrainState  # pylint: disable=g-import-not-at-top

  run = pathlib.Path(run_dir)
  config_path = run / "config.json"
  if not config_path.is_file():
    raise FileNotFoundError(
        f"{run} holds no config.json: pass a run directory written by "
        f"python -m train (e.g. runs/tiny-nvfp4).")
  try:
    saved = json.loads(config_path.read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{config_path} is not valid JSON ({e}); it is damaged: "
                     f"python -m train rewrites it when the run is resumed "
                     f"(--resume).") from None
  try:
    if not isinstance(saved, dict):
      raise TypeError("not a JSON object")
    cfg = TrainConfig(**saved["train"])
    # A run of a version before `fused_layout` kept the fused kernels
    # "concatenated": its configuration says so from here on.
    mcfg = GPTConfig(**dict(saved["model"],
                            fused_layout=saved_fused_layout(saved["model"])))
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{config_path} does not describe a run of this "
                     f"version ({e}); retrain or export with the version "
                     f"that trained it.") from None
  # The trainer only needs a corpus to exist: the export reads no data.
  tokens = np.zeros(cfg.batch_size * (cfg.seq_len + 1) * 2, np.uint16)
  corpus = data_lib.Corpus(train=tokens, val=tokens,
                           vocab_size=mcfg.vocab_size, source="export")
  trainer = Trainer(cfg, corpus, mcfg)
  ckpt = Checkpointer(run / "checkpoints", read_only=True)
  try:
    if not existing_checkpoints(run / "checkpoints"):
      raise FileNotFoundError(f"{run}/checkpoints holds no checkpoint; "
                              f"train the run first.")

    skipped = []  # Named once a checkpoint restores (else the error does).
    step, state, saved_ckpt = ckpt.restore_latest(
        jax.eval_shape(trainer.fns.init_state),
        on_skip=lambda path, reason: skipped.append((path, reason)),
        fix="resume the run (python -m train ... --resume) to write a good "
        "one, or train it again with --overwrite")
    for path, reason in skipped:
      print(f"{PROG}: warning: skipped the damaged checkpoint {path} "
            f"({reason}); exporting step {step}", file=sys.stderr,
            flush=True)
  finally:
    ckpt.close()
  # The checkpoint's fused layout (of the configuration saved with it: a
  # run resumed by a newer version rewrote config.json before its next
  # checkpoint), converted to the one `mcfg` runs.
  state = convert_fused_layout(
      state, mcfg, saved_fused_layout(saved_ckpt.get("model", {})),
      mcfg.fused_layout)
  master = nvfp4_jax.master_params(TrainState(*state).opt_state)
  return cfg, mcfg, step, master, trainer.rules


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
  p.add_argument("run", help="a run directory of python -m train")
  p.add_argument("out", help="the .safetensors file to write")
  p.add_argument("--generate", type=int, default=0, metavar="N",
                 help="then sample N bytes from the exported model")
  p.add_argument("--prompt", default="def ", help="the sampling prompt")
  p.add_argument("--temperature", type=float, default=0.8)
  p.add_argument("--mode", choices=("w4a4", "weight_only"), default="w4a4",
                 help="inference GEMMs: quantized activations as trained, or "
                 "bf16 activations with the packed weights")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  out = pathlib.Path(args.out)
  if out.is_dir() or not out.absolute().parent.is_dir():
    print(f"{PROG}: error: out {args.out}: "
          + ("is a directory" if out.is_dir() else
             f"{out.absolute().parent} is not a directory")
          + "; give the path of the .safetensors file to write",
          file=sys.stderr)
    return 2
  if args.generate < 0:
    print(f"{PROG}: error: --generate {args.generate}: give a number of "
          f"bytes >= 0", file=sys.stderr)
    return 2
  try:
    cfg, mcfg, step, params, rules = restore_run(args.run)
  except (FileNotFoundError, ValueError) as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import nvfp4_jax  # pylint: disable=g-import-not-at-top
  from models import GPT  # pylint: disable=g-import-not-at-top

  model = GPT(mcfg)
  example = jnp.zeros((1, min(cfg.seq_len, 64)), jnp.int32)
  info = nvfp4_jax.export.save(args.out, model, params, rules, example,
                               step=step)
  print(f"{args.out}: {info['bytes'] / 2**20:.2f} MiB, "
        f"{len(info['quantized'])} layers packed at "
        f"{info['bits_per_quantized_weight']:.2f} bits per weight, "
        f"{len(info['high_precision'])} NVFP4 layers kept in high precision "
        f"(run {cfg.precision}, step {step})")
  packed = nvfp4_jax.export.load(args.out)
  probe = jax.random.randint(jax.random.key(1), (2, example.shape[1]), 0,
                             mcfg.vocab_size)
  with nvfp4_jax.precision_rules(rules, step=step):
    want = model.apply({"params": params}, probe)
  same = bool(jnp.array_equal(nvfp4_jax.export.apply(model, packed, probe),
                              want))
  print(f"W4A4 logits of the packed model equal the trained forward: {same}")
  if args.generate:
    prompt = jnp.asarray([list(args.prompt.encode())], jnp.int32)
    out = nvfp4_jax.export.generate(
        lambda t: nvfp4_jax.export.apply(model, packed, t[:, -cfg.seq_len:],
                                         mode=args.mode),
        prompt, args.generate, jax.random.key(args.seed),
        temperature=args.temperature)
    text = bytes(int(t) for t in np.asarray(out[0]) if t < 256)
    print(f"--- sample ({args.mode}) ---")
    print(text.decode("utf-8", errors="replace"))
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
