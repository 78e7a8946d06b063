"""A trained GPT written as a Hugging Face directory that serving stacks and
`transformers` load.

    models.save_hf("out", model, params)                 # BF16
    models.save_hf("out", model, params, format="modelopt",
                   rules=rules, calibration=batches)     # vLLM, SGLang
    models.save_hf("out", model, params, rules=rules,
                   format="compressed-tensors",
                   activations="bf16")                   # transformers, W4A16

The directory holds `config.json` (`models.hf.hf_config`),
`generation_config.json`, the weights as safetensors (one file, or shards
with `model.safetensors.index.json` above `max_shard_size`) and the
tokenizer (`tokenizer.json`, `tokenizer_config.json`).

Formats:

| format | NVFP4 layers | what loads it |
| --- | --- | --- |
| "hf" | none: BF16 of the FP32 masters | transformers, every server |
| "modelopt" | `weight` uint8 `[out, in/2]`, `weight_scale` E4M3 `[out, in/16]`, `weight_scale_2` = amax / 2688, `input_scale` = activation amax / 2688 (FP32 scalars); `hf_quant_config.json` | vLLM, SGLang, TensorRT-LLM |
| "compressed-tensors" | `weight_packed`, `weight_scale` E4M3, `weight_global_scale` = 2688 / amax, `input_global_scale` = 2688 / activation amax (FP32 `[1]`): "nvfp4-pack-quantized" | transformers (with compressed-tensors), vLLM |

Every layer whose forward (Fprop) weight the run's rules quantize to NVFP4
is written with exactly the codes and scale bytes the trained forward
multiplies (`nvfp4_jax.export.quantized_weights`): a 16x16 weight tile's
scale, replicated over its 16 rows, is the 1x16 serving layout's scale of
each of those rows, so nothing is requantized. The fused kernels are split
into the HF modules (`models.hf.linear_rows`: q/k/v of `attn/qkv`, gate/up
of `mlp/up` and of each expert, the interleaved layouts unpermuted), each
keeping the fused tensor's global scale (so fused shards have equal
`weight_scale_2`, as vLLM expects); a split that would cut a 16-row tile is
refused. (Four-over-Six weights: the tensor factor is amax / 1536, and the
global scales say so.) Every other linear layer (the rules' BF16 blocks,
the head, the MoE router) is BF16 and listed in `ignore`/`exclude_modules`.

Activations: "nvfp4" (W4A4, what ModelOpt's NVFP4 serves) needs static input
scales: the FP32 amax of each quantized layer's input over `calibration`
batches (`calibrate`); "bf16" is weight-only (W4A16: compressed-tensors'
NVFP4A16, no input scales; ModelOpt has no such variant).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4_jax
from nvfp4_jax.core import numerics as nm
from nvfp4_jax.flax.linen import observe_inputs
from nvfp4_jax.tools import safetensors

FORMATS = ("hf", "modelopt", "compressed-tensors")
ACTIVATIONS = ("nvfp4", "bf16")
PRODUCER = "nvfp4-jax"
MAX_SHARD_SIZE = 5 * 2**30  # Bytes per safetensors shard (transformers' 5GB).
GROUP_SIZE = nm.NVFP4_BLOCK
SHARDED_INDEX = "model.safetensors.index.json"
_EXAMPLE_SHAPE = (1, 32)


def _unwrap(params: Any) -> Any:
  if isinstance(params, dict) and set(params) == {"params"}:
    params = params["params"]
  return jax.tree.map(np.asarray, jax.device_get(params))


def forward_params(model, params: Any) -> Any:
  """`params` (e.g. the FP32 master) cast leaf by leaf to the dtypes
  `model.init` creates: the parameters the model's forward reads (a
  bfloat16 model's NVFP4 layers quantize the bf16 weights)."""
  example = jnp.zeros(_EXAMPLE_SHAPE, jnp.int32)
  with nvfp4_jax.precision_rules(nvfp4_jax.PrecisionRules.high_precision()):
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.key(0), example))["params"]
  params = _unwrap(params)
  try:
    return jax.tree.map(lambda p, s: np.asarray(p).astype(s.dtype), params,
                        jax.tree.map(lambda s: s, shapes))
  except ValueError as e:
    raise ValueError(
        f"save_hf: params do not have the tree of this model's parameters "
        f"({e}); pass the parameters of the model (configuration) given."
    ) from None


def _layer_amax(path: str, x: jax.Array, group_sizes) -> jax.Array:
  """The FP32 amax of a layer's input (`[E]` per expert for a grouped
  GEMM: each expert's rows, groups in order from row 0)."""
  a = jnp.abs(x.astype(jnp.float32))
  if group_sizes is None:
    return jnp.max(a)
  rows = jnp.max(a.reshape(-1, a.shape[-1]), axis=-1)
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  ids = jnp.searchsorted(ends, jnp.arange(rows.shape[0]), side="right")
  num = group_sizes.shape[0]
  per = jax.ops.segment_max(rows, ids, num_segments=num + 1)[:num]
  del path
  return jnp.maximum(per, 0.0)  # An expert without rows: -inf -> 0.


def calibrate(model, params: Any, rules, batches: Iterable[Any], *,
              step: int | None = None) -> dict[str, np.ndarray]:
  """The FP32 amax of every NVFP4 layer's GEMM input over `batches`.

  Runs the model's forward as trained (`rules` at `step`) on each batch of
  token ids (`int [batch, seq]`) and takes, per layer, the max of `|x|`
  over all batches: a scalar per linear layer (q, k and v share the input
  of `attn/qkv`, gate and up that of `mlp/up`), `[E]` per mixture-of-experts
  projection (each expert's own routed tokens).

  Returns:
    `{layer path: np.float32 amax or [E]}`.

  Raises:
    ValueError: no batch, or a batch that is not a 2-D array of token ids.
  """
  cfg = getattr(model, "cfg", None)
  if cfg is not None and getattr(cfg, "remat", "none") != "none":
    # Same values; the observer needs the blocks in the outer trace.
    model = model.clone(cfg=cfg.replace(remat="none"))
  params = forward_params(model, params)

  @jax.jit
  def one(p, tokens):
    found = {}

    def seen(path, x, group_sizes):
      v = _layer_amax(path, x, group_sizes)
      found[path] = jnp.maximum(found[path], v) if path in found else v
    with observe_inputs(seen), nvfp4_jax.precision_rules(rules, step=step):
      model.apply({"params": p}, tokens,
                  rngs={nvfp4_jax.RNG_STREAM: jax.random.key(0)})
    return found

  total: dict[str, np.ndarray] = {}
  n = 0
  for batch in batches:
    tokens = np.asarray(batch)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(
          f"calibrate: batch {n} has shape {tokens.shape} and dtype "
          f"{tokens.dtype}; give int token ids [batch, seq].")
    for k, v in one(params, jnp.asarray(tokens, jnp.int32)).items():
      v = np.asarray(v, np.float32)
      total[k] = np.maximum(total[k], v) if k in total else v
    n += 1
  if not n:
    raise ValueError("calibrate: no calibration batch; give at least one "
                     "batch of token ids (e.g. a few of the run's training "
                     "batches).")
  return total


def _tile_exact(name: str, layer: str, rows: np.ndarray, block_2d: bool
                ) -> None:
  """Raises unless `rows` is a sequence of whole, aligned 16-row tiles."""
  if not block_2d:
    return
  b = nm.NVFP4_BLOCK
  tiles = rows.reshape(-1, b) if rows.size % b == 0 else None
  if tiles is None or np.any(tiles[:, 0] % b) or np.any(
      tiles - tiles[:, :1] != np.arange(b)):
    raise ValueError(
        f"save_hf: the HF module {name!r} takes {rows.size} rows of layer "
        f"{layer!r} that do not form whole 16-row tiles of its 16x16-scaled "
        f"weight; its exported scales would not be the tiles' own. Make the "
        f"head dimension (and every split width) a multiple of 16, or keep "
        f"{layer!r} in BF16 with a precision rule.")


def _global_scales(amax: np.ndarray, denominator: float
                   ) -> tuple[np.float32, np.float32]:
  """`(decode, encode)`: the FP32 tensor factor `amax / denominator` that
  dequantization multiplies by and its encode scale `denominator / amax`
  (the quantizer's `S_enc`); both 1 for a zero amax (`S_enc = 1`)."""
  amax = np.float32(amax)
  enc = np.float32(nm.global_encode_scale(jnp.float32(amax),
                                          numerator=denominator))
  if amax == 0:
    return np.float32(1.0), enc
  dec = np.float32(nm.global_decode_scale(jnp.float32(amax),
                                          denominator=denominator))
  return dec, enc


def _byte_level_tokenizer():
  """A `tokenizers.Tokenizer` mapping byte b to id b (GPT-2's byte-to-
  unicode alphabet, no merges): the byte presets' vocabulary."""
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders  # pylint: disable=g-import-not-at-top
  from tokenizers import models as tok_models  # pylint: disable=g-import-not-at-top,line-too-long
  from tokenizers import pre_tokenizers  # pylint: disable=g-import-not-at-top
  printable = (list(range(ord("!"), ord("~") + 1))
               + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  vocab = {chars[b]: b for b in range(256)}
  tok = Tokenizer(tok_models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                               use_regex=False)
  tok.decoder = decoders.ByteLevel()
  return tok


def _write_tokenizer(out: pathlib.Path, tokenizer, vocab_size: int) -> list:
  """Writes the tokenizer files into `out`; returns their names."""
  if tokenizer is False:
    return []
  tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                      "clean_up_tokenization_spaces": False}
  if tokenizer is None:
    if vocab_size != 256:
      raise ValueError(
          f"save_hf: a vocabulary of {vocab_size} ids needs its tokenizer: "
          f"pass tokenizer= the run's tokenizer.json (or a directory holding "
          f"one), or tokenizer=False to write none (only the byte-level "
          f"vocabulary of 256 is written without one).")
    _byte_level_tokenizer().save(str(out / "tokenizer.json"))
  else:
    src = pathlib.Path(tokenizer)
    folder = src if src.is_dir() else src.parent
    file = src / "tokenizer.json" if src.is_dir() else src
    if not file.is_file():
      what = ("tokenizer.json in that directory" if src.is_dir() else
              "such file")
      raise FileNotFoundError(
          f"save_hf: tokenizer {tokenizer}: no {what}; give a HF "
          f"tokenizer.json or a directory holding one.")
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    try:
      n = Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"save_hf: tokenizer {file} does not load with the "
                       f"tokenizers library ({e}); give a HF tokenizer.json."
                       ) from None
    if n > vocab_size:
      raise ValueError(
          f"save_hf: tokenizer {file} has {n} ids but the model's vocabulary "
          f"is {vocab_size}; give the tokenizer the run was trained with.")
    shutil.copyfile(file, out / "tokenizer.json")
    for extra in ("tokenizer_config.json", "special_tokens_map.json"):
      if src.is_dir() and (folder / extra).is_file():
        shutil.copyfile(folder / extra, out / extra)
    if (out / "tokenizer_config.json").is_file():
      return sorted(p.name for p in out.iterdir()
                    if p.name.startswith(("tokenizer", "special_tokens")))
  (out / "tokenizer_config.json").write_text(
      json.dumps(tokenizer_config, indent=2) + "\n")
  return ["tokenizer.json", "tokenizer_config.json"]


def _write_safetensors(out: pathlib.Path, tensors: dict[str, np.ndarray],
                       max_shard_size: int) -> list[str]:
  """Writes `tensors` as one file or as shards with their index."""
  shards, size, current = [], 0, {}
  for name, arr in tensors.items():
    if current and size + arr.nbytes > max_shard_size:
      shards.append(current)
      current, size = {}, 0
    current[name] = arr
    size += arr.nbytes
  shards.append(current)
  meta = {"format": "pt"}
  if len(shards) == 1:
    safetensors.save(out / "model.safetensors", shards[0], meta)
    return ["model.safetensors"]
  names, weight_map = [], {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    safetensors.save(out / fname, shard, meta)
    names.append(fname)
    weight_map.update({k: fname for k in shard})
  index = {"metadata": {"total_size": int(sum(a.nbytes for a in
                                              tensors.values()))},
           "weight_map": weight_map}
  (out / SHARDED_INDEX).write_text(json.dumps(index, indent=2) + "\n")
  return names + [SHARDED_INDEX]


def _quant_config(fmt: str, activations: str, ignore: list[str]) -> dict:
  """The config.json `quantization_config` of `fmt`."""
  w4 = {"num_bits": 4, "type": "float", "symmetric": True,
        "group_size": GROUP_SIZE, "strategy": "tensor_group",
        "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
  a4 = None
  if activations == "nvfp4":
    # Static global scale (the calibrated amax), 1x16 block scales computed
    # on the fly ("local").
    a4 = dict(w4, dynamic="local", observer="static_minmax")
  if fmt == "compressed-tensors":
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": w4, "input_activations": a4,
            "output_activations": None, "format": "nvfp4-pack-quantized"}},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }
  group = {"targets": ["Linear"],
           "weights": {"num_bits": 4, "type": "float",
                       "group_size": GROUP_SIZE, "dynamic": False},
           "input_activations": {"num_bits": 4, "type": "float",
                                 "group_size": GROUP_SIZE, "dynamic": False}}
  return {"quant_method": "modelopt", "quant_algo": "NVFP4",
          "producer": {"name": PRODUCER, "version": nvfp4_jax.__version__},
          "group_size": GROUP_SIZE, "kv_cache_quant_algo": None,
          "config_groups": {"group_0": group}, "ignore": ignore,
          "exclude_modules": ignore}


def _check_args(fmt, rules, calibration, activations, max_shard_size):
  if fmt not in FORMATS:
    raise ValueError(f"save_hf: unknown format {fmt!r}; use one of "
                     f"{FORMATS}.")
  if activations not in ACTIVATIONS:
    raise ValueError(f"save_hf: unknown activations {activations!r}; use "
                     f"one of {ACTIVATIONS}.")
  if not (isinstance(max_shard_size, int) and max_shard_size > 0):
    raise ValueError(f"save_hf: max_shard_size must be a positive number "
                     f"of bytes, got {max_shard_size!r}.")
  if fmt == "hf":
    if calibration is not None or activations != "nvfp4":
      raise ValueError(
          "save_hf: format 'hf' writes BF16 weights: calibration and "
          "activations apply to the NVFP4 formats ('modelopt', "
          "'compressed-tensors') only.")
    return
  if not isinstance(rules, nvfp4_jax.PrecisionRules):
    raise TypeError(
        f"save_hf: format {fmt!r} needs rules=, the PrecisionRules the "
        f"model was trained with (they decide which layers are NVFP4), got "
        f"{rules!r}.")
  if fmt == "modelopt" and activations == "bf16":
    raise ValueError(
        "save_hf: ModelOpt's NVFP4 layout has no weight-only variant (its "
        "servers quantize the activations with input_scale); write W4A16 "
        "with format='compressed-tensors', activations='bf16'.")
  if activations == "nvfp4" and calibration is None:
    raise ValueError(
        f"save_hf: format {fmt!r} with NVFP4 activations needs their static "
        f"input scales: pass calibration= a few batches of token ids (or "
        f"their amaxes from calibrate()), or activations='bf16' for "
        f"weight-only NVFP4 (compressed-tensors).")
  if activations == "bf16" and calibration is not None:
    raise ValueError("save_hf: activations='bf16' is weight-only: it takes "
                     "no calibration.")


def save_hf(directory: str | os.PathLike, model, params: Any, *,
            format: str = "hf",  # pylint: disable=redefined-builtin
            rules: nvfp4_jax.PrecisionRules | None = None,
            step: int | None = None, calibration: Any = None,
            activations: str = "nvfp4", tokenizer: Any = None,
            max_shard_size: int = MAX_SHARD_SIZE) -> dict[str, Any]:
  """Writes `model` (a `models.GPT`) with `params` as a HF directory.

  Args:
    directory: the directory to create (it must not exist, or be empty);
      written in a temporary sibling and renamed into place.
    model: the `GPT`.
    params: its parameters (a "params" collection is unwrapped), the FP32
      master weights.
    format: "hf", "modelopt" or "compressed-tensors" (see the module).
    rules: the `PrecisionRules` it was trained with (NVFP4 formats).
    step: the training step for the rules' late switch (None: before it).
    calibration: NVFP4 activations: an iterable of token-id batches
      (`int [batch, seq]`) whose per-layer input amax gives the static input
      scales, or the dict `calibrate` returns.
    activations: "nvfp4" (W4A4) or "bf16" (weight-only, compressed-tensors).
    tokenizer: a HF `tokenizer.json` or a directory holding one (copied
      with its `tokenizer_config.json`); None: a byte-level tokenizer for a
      vocabulary of 256 (byte b is id b); False: none.
    max_shard_size: bytes per safetensors file before sharding.

  Returns:
    `{"format", "quantized": [HF modules], "ignore": [HF modules],
    "files": [names], "bytes": size of the weights}`.

  Raises:
    ValueError, TypeError, FileExistsError, FileNotFoundError: bad
      arguments, each named with its fix.
  """
  from models import hf  # pylint: disable=g-import-not-at-top
  _check_args(format, rules, calibration, activations, max_shard_size)
  out = pathlib.Path(directory)
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise FileExistsError(
        f"save_hf: {out} exists and is not an empty directory; give a new "
        f"directory (a leftover model file there could be loaded instead).")
  cfg = model.cfg
  master = _unwrap(params)
  # Every stored float in BF16 (the masters rounded once), as HF
  # checkpoints hold them; the NVFP4 layers replace theirs below.
  tensors = {k: (np.asarray(v).astype(jnp.bfloat16)
                 if jnp.issubdtype(np.asarray(v).dtype, jnp.floating) else
                 np.asarray(v))
             for k, v in hf.to_hf_tensors(cfg, master).items()}
  quantized, ignore = [], []
  if format != "hf":
    fwd = forward_params(model, master)
    example = jnp.zeros(_EXAMPLE_SHAPE, jnp.int32)
    # Every layer reports its path whatever its recipe: traced without the
    # quantizers (faster).
    with nvfp4_jax.precision_rules(nvfp4_jax.PrecisionRules.high_precision()):
      layers = nvfp4_jax.nvfp4_layer_paths(model, example)
    for layer in layers:
      op = rules.recipe_at(layer, step).fprop_w
      if op.quantized and op.format != "nvfp4":
        raise ValueError(
            f"save_hf: layer {layer!r} was trained with {op.format} weights; "
            f"the serving formats hold NVFP4 only: export with format='hf'.")
    weights = nvfp4_jax.export.quantized_weights(model, fwd, rules, example,
                                                 step=step, layers=layers)
    if not weights:
      raise ValueError(
          f"save_hf: the rules quantize no layer's forward weight to NVFP4 "
          f"(at step {step}); export this model with format='hf'.")
    amax = None
    if activations == "nvfp4":
      amax = (calibration if isinstance(calibration, dict) else
              calibrate(model, master, rules, calibration, step=step))
    flat_fwd = safetensors.flatten(fwd)
    for layer, q in weights.items():
      if amax is not None and layer not in amax:
        raise ValueError(
            f"save_hf: the calibration holds no input amax of layer "
            f"{layer!r}; calibrate this model (calibrate()) with its rules.")
      quantized += _write_layer(tensors, cfg, layer, q, flat_fwd, format,
                                None if amax is None else amax[layer])
    for name, arr in tensors.items():
      module, _, leaf = name.rpartition(".")
      if (leaf == "weight" and arr.ndim == 2 and module not in quantized
          and not module.endswith("embed_tokens")):
        ignore.append(module)
    if "lm_head" not in ignore:
      ignore.append("lm_head")  # Tied: the module exists, its tensor not.
  config = dict(hf.hf_config(cfg, dtype="bfloat16"))
  if format != "hf":
    config["quantization_config"] = _quant_config(format, activations,
                                                  ignore)
  parent = out.absolute().parent
  if not parent.is_dir():
    raise FileNotFoundError(f"save_hf: {parent} is not a directory; create "
                            f"it first.")
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
  try:
    files = _write_safetensors(tmp, tensors, max_shard_size)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"_from_model_config": True}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
      if config.get(k) is not None:
        gen[k] = config[k]
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2)
                                                + "\n")
    files += ["config.json", "generation_config.json"]
    if format == "modelopt":
      (tmp / "hf_quant_config.json").write_text(json.dumps({
          "producer": {"name": PRODUCER, "version": nvfp4_jax.__version__},
          "quantization": {"quant_algo": "NVFP4", "group_size": GROUP_SIZE,
                           "kv_cache_quant_algo": None,
                           "exclude_modules": ignore}}, indent=2) + "\n")
      files.append("hf_quant_config.json")
    files += _write_tokenizer(tmp, tokenizer, cfg.vocab_size)
    if out.exists():
      out.rmdir()  # Empty (checked above).
    os.replace(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return {"format": format, "quantized": quantized, "ignore": ignore,
          "files": sorted(files),
          "bytes": int(sum(a.nbytes for a in tensors.values()))}


def _write_layer(tensors: dict[str, np.ndarray], cfg, layer: str, q,
                 flat_fwd: dict[str, Any], fmt: str, amax) -> list[str]:
  """Replaces the BF16 weights of `layer`'s HF modules in `tensors` by its
  NVFP4 codes and scales (`q`: the layer's `NVFP4Array`, or one per
  expert); returns the modules."""
  from models import hf  # pylint: disable=g-import-not-at-top
  kernel = np.asarray(flat_fwd[f"{layer}/kernel"])
  parts = ([(None, q, kernel.T)] if not isinstance(q, list) else
           [(e, qe, kernel[e].T) for e, qe in enumerate(q)])
  modules = []
  for expert, qe, w in parts:
    codes, scales = np.asarray(qe.codes), np.asarray(qe.scales)
    dec, enc = _global_scales(np.asarray(qe.amax), qe.tensor_denominator)
    in_scales = None
    if amax is not None:
      a = np.asarray(amax, np.float32)
      if a.ndim:  # Per expert; one that saw no token takes the layer's.
        a = a[expert] if a[expert] > 0 else np.max(a)
      in_scales = _global_scales(a, nm.E4M3_MAX_X_E2M1_MAX)
    for name, idx in hf.linear_rows(cfg, layer, expert):
      idx = np.asarray(idx, np.int64).reshape(-1)
      _tile_exact(name, layer, idx, qe.block_2d)
      dense = tensors.get(f"{name}.weight")
      if dense is None or dense.shape != (idx.size, w.shape[1]) or not (
          np.array_equal(np.asarray(dense, np.float32),
                         np.asarray(w[idx].astype(dense.dtype), np.float32))):
        # Names and rows come from one mapping (models.hf): the BF16 tensor
        # there must be these rows of the weight.
        raise RuntimeError(
            f"save_hf: models.hf.linear_rows({layer!r}, {expert}) gives "
            f"{name!r} rows that to_hf_tensors does not hold as its weight; "
            f"the HF name mapping is inconsistent (a bug: please report it).")
      del tensors[f"{name}.weight"]
      if fmt == "modelopt":
        tensors[f"{name}.weight"] = codes[idx]
        tensors[f"{name}.weight_scale"] = scales[idx]
        tensors[f"{name}.weight_scale_2"] = np.asarray(dec, np.float32)
        if in_scales is not None:
          tensors[f"{name}.input_scale"] = np.asarray(in_scales[0],
                                                      np.float32)
      else:
        tensors[f"{name}.weight_packed"] = codes[idx]
        tensors[f"{name}.weight_scale"] = scales[idx]
        tensors[f"{name}.weight_global_scale"] = np.asarray([enc],
                                                            np.float32)
        if in_scales is not None:
          tensors[f"{name}.input_global_scale"] = np.asarray(
              [in_scales[1]], np.float32)
      modules.append(name)
  return modules
