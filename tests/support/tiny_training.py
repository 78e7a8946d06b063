"""Shared by the training tests: a small GPT, a small corpus and a short run's
`TrainConfig` (tests import it as a top-level module; so does
`tests/support/mesh_checks`)."""

import numpy as np

from models import preset
from train import data
from train.config import TrainConfig

# A small GPT whose paper preset still quantizes one block (block_2 of 4).
MODEL = preset("tiny", d_model=64, num_layers=4, num_heads=2, d_ff=128)


def small_corpus() -> data.Corpus:
  root = data.stdlib_root()
  text = b"".join((root / f).read_bytes() for f in (
      "os.py", "json/decoder.py", "textwrap.py", "functools.py"))
  tokens = np.frombuffer(text, np.uint8)
  n = len(tokens) * 9 // 10
  return data.Corpus(train=tokens[:n], val=tokens[n:], vocab_size=256,
                     source="test")


def config(**kw) -> TrainConfig:
  fields = dict(preset="tiny", precision="nvfp4", steps=24, batch_size=4,
                seq_len=32, lr=3e-3, warmup_steps=3, eval_every=8,
                ckpt_every=8, eval_batches=2)
  fields.update(kw)
  return TrainConfig(**fields)
