"""Loading a Hugging Face checkpoint directory as a GPT and its parameters.

    model, params = models.load_hf("path/to/llama")
    with nvfp4_jax.precision_rules(nvfp4_jax.PrecisionRules.high_precision()):
      logits = model.apply({"params": params}, tokens)  # the checkpoint's

A directory holds `config.json` (`models.hf.config_from_hf`) and its weights
as safetensors: `model.safetensors`, or shards listed by
`model.safetensors.index.json`. PyTorch pickles (`pytorch_model.bin`,
`*.pt`, `*.pth`) are refused, never unpickled: unpickling runs arbitrary
code.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.gpt import GPT
from models.gpt import _DTYPES
from models.hf import config_from_hf
from models.hf import from_hf_tensors

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
CONVERT_HINT = (
    "convert it once with transformers (which unpickles it: only for a "
    "checkpoint you trust): `transformers.AutoModelForCausalLM."
    "from_pretrained(DIR).save_pretrained(OUT, safe_serialization=True)`, "
    "then load OUT")


def checkpoint_files(directory: str) -> list[str]:
  """The safetensors files of the HF checkpoint in `directory`.

  Raises:
    FileNotFoundError: no `config.json`, no weights, or a shard the index
      names that is missing.
    ValueError: only PyTorch pickle weights (`.bin`, `.pt`, `.pth`), with
      the conversion to run.
  """
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"load_hf: {directory!r} is not a directory; "
                            f"give a HF checkpoint directory (config.json "
                            f"and model.safetensors).")
  names = sorted(os.listdir(directory))
  if "config.json" not in names:
    raise FileNotFoundError(f"load_hf: {directory!r} has no config.json; "
                            f"a HF checkpoint directory has config.json and "
                            f"safetensors weights.")
  index = os.path.join(directory, SAFETENSORS_INDEX)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise ValueError(f"load_hf: {index} has no 'weight_map'; rewrite it "
                       f"with save_pretrained.")
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not os.path.exists(
        os.path.join(directory, f))]
    if missing:
      raise FileNotFoundError(f"load_hf: {index} names shards that are not "
                              f"in {directory!r}: {missing}.")
    return [os.path.join(directory, f) for f in files]
  if SAFETENSORS in names:
    return [os.path.join(directory, SAFETENSORS)]
  pickles = [n for n in names if n.endswith(_PICKLE_SUFFIXES)
             or n == "pytorch_model.bin.index.json"]
  if pickles:
    raise ValueError(
        f"load_hf: {directory!r} holds PyTorch pickle weights {pickles}, "
        f"which this loader never unpickles (unpickling runs arbitrary "
        f"code); {CONVERT_HINT}.")
  raise FileNotFoundError(
      f"load_hf: {directory!r} has no {SAFETENSORS} or {SAFETENSORS_INDEX} "
      f"(found {names}); save the model with save_pretrained.")


def read_safetensors(files: list[str]) -> dict[str, np.ndarray]:
  """Every tensor of the safetensors `files`, as host numpy arrays (bf16 as
  `ml_dtypes.bfloat16`).

  Raises:
    ValueError: a tensor name stored in two files.
  """
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  out: dict[str, np.ndarray] = {}
  # The "flax" reader handles bf16 (numpy's has no such dtype); read onto
  # the host so a checkpoint never passes through accelerator memory.
  with jax.default_device(jax.devices("cpu")[0]):
    for path in files:
      with safe_open(path, framework="flax") as f:
        for name in f.keys():
          if name in out:
            raise ValueError(f"load_hf: tensor {name!r} is stored twice "
                             f"(again in {path}).")
          out[name] = np.asarray(f.get_tensor(name))
  return out


def load_hf(directory: str, *, dtype: str | None = None
            ) -> tuple[GPT, dict[str, Any]]:
  """A HF `LlamaForCausalLM`, `MistralForCausalLM` or `MixtralForCausalLM`
  checkpoint as a GPT and its parameters.

  Args:
    directory: holds `config.json` and `model.safetensors` (or shards with
      `model.safetensors.index.json`), as `save_pretrained` writes them.
    dtype: the GPT's compute and parameter dtype, "float32" (default: the
      checkpoint's values exactly, bf16 ones included) or "bfloat16".

  Returns:
    `(model, params)`: `model.apply({"params": params}, tokens)` gives the
    logits, FP32 `[batch, seq, vocab]`. Apply it inside
    `nvfp4_jax.precision_rules(...)`: `PrecisionRules.high_precision()` for
    the checkpoint's own function, `paper_rules(...)` to train in NVFP4.

  Raises:
    FileNotFoundError: no checkpoint in `directory`.
    ValueError: pickle-only weights (with the conversion to run), a config
      field the GPT cannot honour (all of them named), or tensors that do
      not match the config (all of them named).
  """
  if dtype is not None and dtype not in _DTYPES:
    raise ValueError(f"load_hf: dtype={dtype!r}; use one of "
                     f"{tuple(_DTYPES)} or None (float32).")
  files = checkpoint_files(directory)
  with open(os.path.join(directory, "config.json")) as f:
    hf = json.load(f)
  cfg = config_from_hf(hf)
  if dtype is not None:
    cfg = cfg.replace(dtype=dtype)
  params = from_hf_tensors(cfg, read_safetensors(files))
  return GPT(cfg), jax.tree.map(jnp.asarray, params)
