"""Export a trained run as a HF directory (vLLM, transformers) or packed file.

A Hugging Face directory for serving stacks and transformers, or the
library's own packed NVFP4 file:

    python -m train.export runs/tiny-nvfp4 out --format modelopt --calibrate 8
    python -m train.export runs/tiny-nvfp4 out --format compressed-tensors \\
        --activations bf16
    python -m train.export runs/tiny-nvfp4 out --format hf
    python -m train.export runs/tiny-nvfp4 tiny.safetensors    # packed
    python -m train.export runs/tiny-nvfp4 tiny.safetensors --generate 200 \\
        --prompt "def main(" --mode weight_only

Reads the run's `config.json` and its newest checkpoint that restores (the
FP32 master weights; a damaged newer one is named on stderr and skipped).

`--format hf|modelopt|compressed-tensors` writes the directory OUT with
`models.save_hf`: config.json, generation_config.json, safetensors and the
tokenizer (the run's, `--tokenizer`, or a byte-level one for a vocabulary of
256). "hf" holds BF16 weights; "modelopt" (vLLM, SGLang, TensorRT-LLM) and
"compressed-tensors" (transformers, vLLM) hold every layer the run
quantized in its forward as NVFP4, with exactly the trained forward's codes
and scales. Their activations are NVFP4 with static input scales from the
activation amax over the first `--calibrate N` training batches (of `--data`,
the corpus the run trained on: the standard-library corpus by default), or
BF16 with `--activations bf16` (weight-only, compressed-tensors).

`--format packed` (the default) is the library's own format
(`nvfp4_jax.export.save`: one safetensors file on flax paths, 4.5 bits per
quantized weight, read back by `nvfp4_jax.export.load`): it checks that the
packed model's W4A4 logits equal the trained model's forward, and optionally
samples bytes from it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Sequence

import numpy as np

PROG = "python -m train.export"
FORMATS = ("packed", "hf", "modelopt", "compressed-tensors")


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


def _usage_error(args) -> str | None:
  """Why the combination of options cannot run, or None."""
  hf_format = args.format != "packed"
  if hf_format:
    if args.generate or args.mode is not None:
      return (f"--generate and --mode sample from the packed format; with "
              f"--format {args.format} load OUT in transformers or serve it "
              f"(vllm serve OUT)")
    if args.format == "hf" and (args.calibrate or args.activations):
      return ("--format hf writes BF16 weights: --calibrate and "
              "--activations apply to modelopt and compressed-tensors")
    activations = args.activations or "nvfp4"
    if args.format == "modelopt" and activations == "bf16":
      return ("ModelOpt's NVFP4 layout has no weight-only variant (its "
              "servers quantize activations with input_scale); use --format "
              "compressed-tensors --activations bf16")
    if args.format != "hf" and activations == "nvfp4" and not args.calibrate:
      return (f"--format {args.format} with NVFP4 activations needs their "
              f"static input scales: give --calibrate N (N training batches, "
              f"e.g. 8), or --activations bf16 for weight-only NVFP4")
    if activations == "bf16" and args.calibrate:
      return "--activations bf16 is weight-only: drop --calibrate"
    if args.data and not args.calibrate:
      return "--data is the corpus --calibrate reads: give --calibrate N"
    out = pathlib.Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
      return (f"out {args.out} exists and is not an empty directory; give a "
              f"new directory for the HF files")
    if not out.absolute().parent.is_dir():
      return f"out {args.out}: {out.absolute().parent} is not a directory"
    return None
  for flag, value in (("--calibrate", args.calibrate),
                      ("--activations", args.activations),
                      ("--tokenizer", args.tokenizer),
                      ("--data", args.data)):
    if value:
      return (f"{flag} applies to the HF formats (--format hf, modelopt, "
              f"compressed-tensors), not to the packed file")
  out = pathlib.Path(args.out)
  if out.is_dir() or not out.absolute().parent.is_dir():
    return (f"out {args.out}: "
            + ("is a directory" if out.is_dir() else
               f"{out.absolute().parent} is not a directory")
            + "; give the path of the .safetensors file to write")
  if args.generate < 0:
    return f"--generate {args.generate}: give a number of bytes >= 0"
  return None


def _export_hf(args, cfg, mcfg, step, params, rules) -> int:
  """`--format hf|modelopt|compressed-tensors`: `models.save_hf`."""
  from models import GPT  # pylint: disable=g-import-not-at-top
  from models import save_hf  # pylint: disable=g-import-not-at-top
  from train import data as data_lib  # pylint: disable=g-import-not-at-top

  calibration = None
  if args.calibrate:
    corpus = data_lib.load_corpus(args.data)
    batcher = data_lib.Batcher(corpus.train, batch_size=cfg.batch_size,
                               seq_len=cfg.seq_len, seed=cfg.seed)
    # The run's first training batches, inputs only.
    calibration = [batcher.batch(i)[:, :-1] for i in range(args.calibrate)]
  tokenizer = args.tokenizer or getattr(cfg, "tokenizer", None)
  info = save_hf(args.out, GPT(mcfg), params, format=args.format,
                 rules=None if args.format == "hf" else rules, step=step,
                 calibration=calibration,
                 activations=args.activations or "nvfp4",
                 tokenizer=tokenizer)
  what = ("BF16 weights" if args.format == "hf" else
          f"{len(info['quantized'])} NVFP4 linear modules ("
          + ("W4A16" if args.activations == "bf16" else
             f"W4A4, input scales from {args.calibrate} batches")
          + f"), {len(info['ignore'])} kept in BF16")
  print(f"{args.out}: {args.format}, {info['bytes'] / 2**20:.2f} MiB of "
        f"weights, {what} (run {cfg.precision}, step {step}); files: "
        + ", ".join(info["files"]))
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
  p.add_argument("run", help="a run directory of python -m train")
  p.add_argument("out", help="the directory to write (HF formats), or the "
                 ".safetensors file (--format packed)")
  p.add_argument("--format", choices=FORMATS, default="packed",
                 help="hf: BF16 HF directory; modelopt: NVFP4 for vLLM, "
                 "SGLang, TensorRT-LLM; compressed-tensors: NVFP4 for "
                 "transformers (and vLLM); packed (default): the library's "
                 "own file (nvfp4_jax.export)")
  p.add_argument("--calibrate", type=int, default=0, metavar="N",
                 help="NVFP4 activations' static input scales from the "
                 "activation amax over the run's first N training batches")
  p.add_argument("--activations", choices=("nvfp4", "bf16"), default=None,
                 help="nvfp4 (W4A4, default) or bf16 (weight-only W4A16, "
                 "compressed-tensors)")
  p.add_argument("--data", default=None, help="the corpus the run trained "
                 "on, for --calibrate (default: the standard-library corpus, "
                 "python -m train's default)")
  p.add_argument("--tokenizer", default=None, help="the HF tokenizer.json (or "
                 "a directory holding one) to ship; default: the run's, else "
                 "byte-level for a vocabulary of 256")
  p.add_argument("--generate", type=int, default=0, metavar="N",
                 help="then sample N bytes from the exported model (packed)")
  p.add_argument("--prompt", default="def ", help="the sampling prompt")
  p.add_argument("--temperature", type=float, default=0.8)
  p.add_argument("--mode", choices=("w4a4", "weight_only"), default=None,
                 help="inference GEMMs of --generate: quantized activations "
                 "as trained (w4a4, default), or bf16 activations with the "
                 "packed weights")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.calibrate < 0:
    print(f"{PROG}: error: --calibrate {args.calibrate}: give a number of "
          f"batches >= 1", file=sys.stderr)
    return 2
  why = _usage_error(args)
  if why is not None:
    print(f"{PROG}: error: {why}", file=sys.stderr)
    return 2
  try:
    cfg, mcfg, step, params, rules = restore_run(args.run)
    if args.format != "packed":
      return _export_hf(args, cfg, mcfg, step, params, rules)
  except (FileNotFoundError, FileExistsError, ValueError) as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  mode = args.mode or "w4a4"

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
                                         mode=mode),
        prompt, args.generate, jax.random.key(args.seed),
        temperature=args.temperature)
    text = bytes(int(t) for t in np.asarray(out[0]) if t < 256)
    print(f"--- sample ({mode}) ---")
    print(text.decode("utf-8", errors="replace"))
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
