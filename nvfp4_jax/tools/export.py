"""Packed NVFP4 export of a trained model, its loader, and inference with it.

    nv.export.save("model.safetensors", model, params, rules, example_input)
    packed = nv.export.load("model.safetensors")
    logits = nv.export.apply(model, packed, tokens)            # W4A4, as trained
    logits = nv.export.apply(model, packed, tokens, mode="weight_only")

This is the library's own format: one safetensors file on the model's flax
parameter paths, read back by `load` and run by `apply`. Serving stacks and
transformers load Hugging Face directories instead: `models.save_hf` writes
those (ModelOpt's and compressed-tensors' NVFP4 layouts, from the same
`quantized_weights`). For every NVFP4 layer whose Fprop GEMM the rules
quantize (the weight is `W = kernel^T`, `[out, in]`):

| tensor | dtype, shape | what |
| --- | --- | --- |
| `<path>.weight` | uint8 `[out, in/2]` | two E2M1 codes per byte, element `2k` in the low nibble |
| `<path>.weight_scale` | float8_e4m3fn `[out, in/16]` | block decode scales (16x16 tiles replicated over their rows) |
| `<path>.weight_scale_2` | float32 `[]` | the per-tensor factor `amax / 2688` (`amax / 1536` for Four-over-Six) |
| `<path>.weight_amax` | float32 `[]` | the tensor amax (so the W4A4 GEMM's `alpha` is exactly training's) |
| `<path>.bias` | as trained | if the layer has one |

Every other parameter is stored unchanged under its path (`embed.embedding`,
`head.kernel`, ...), in its training dtype. The metadata records the format
and each quantized layer's scaling, so `load` rebuilds the `NVFP4Array`s
exactly: a quantized weight costs 4.5 bits (4 for the code, 8 per 16 for its
scale).
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax.tools import safetensors
from nvfp4_jax.ops.block_scaled_matmul.api import block_scaled_matmul
from nvfp4_jax.ops.weight_only_matmul.api import weight_only_matmul
from nvfp4_jax.flax.linen import NVFP4Dense
from nvfp4_jax.flax.linen import nvfp4_layer_paths
from nvfp4_jax.ops.quantize.api import quantize
from nvfp4_jax.ops.ragged_quantize.api import quantize_experts
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.arrays import check_nvfp4_array
from nvfp4_jax.core import numerics as nm
from nvfp4_jax.flax.rules import PrecisionRules
from nvfp4_jax.flax.rules import precision_rules

FORMAT = "nvfp4-jax/packed-v1"
MODES = ("w4a4", "weight_only")


def _check_rules(rules: Any) -> None:
  if not isinstance(rules, PrecisionRules):
    raise TypeError(
        f"export: rules must be the PrecisionRules the model was "
        f"trained with (they decide which layers are packed), got "
        f"{rules!r}; pass e.g. nvfp4_jax.paper_rules(num_blocks), or "
        f"PrecisionRules() if every layer ran the default NVFP4 recipe.")


def _params(params: Any) -> Any:
  if isinstance(params, dict) and set(params) == {"params"}:
    params = params["params"]
  return jax.tree.map(np.asarray, jax.device_get(params))


# Compiled, as the training step runs them (one program per shape, not op
# by op).
@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_weight(kernel, block_2d: bool, four_over_six: bool):
  return quantize(kernel.T, block_2d=block_2d, four_over_six=four_over_six)


@functools.partial(jax.jit, static_argnums=(1,))
def _quantize_experts(kernel, op):
  return quantize_experts(jnp.swapaxes(kernel, 1, 2), op, None, values=False)


def quantized_weights(model: nn.Module, params: Any, rules: PrecisionRules,
                      *example_args, step: int | None = None,
                      layers: list[str] | None = None
                      ) -> dict[str, NVFP4Array | list[NVFP4Array]]:
  """The NVFP4 weights the forward (Fprop) GEMMs multiply, by layer path.

  Every NVFP4 layer of `model` whose Fprop weight the rules quantize to
  NVFP4 at `step`, quantized as its forward quantizes it (RTNE, the
  recipe's 16x16 tiles and Four-over-Six): a linear layer's weight
  `W = kernel^T` (`[out, in]`) as one `NVFP4Array`; a mixture of experts'
  stacked kernel `[E, in, out]` as a list of E, each expert's `W` with its
  own amax (the grouped GEMM's `quantize_experts`, exactly
  `quantize(kernel[e].T)`).

  Args:
    model, params, rules, example_args, step: as `save`. The kernels are
      quantized in their dtype here, as the layer does (pass the parameters
      the forward reads: for a bfloat16 model, the master cast to bf16).
    layers: the model's `nvfp4_layer_paths` if already known (else traced
      from `example_args`).

  Returns:
    `{layer path: NVFP4Array | [NVFP4Array] * E}`.

  Raises:
    TypeError: `rules` is not a `PrecisionRules`.
    ValueError: a quantized weight rounds stochastically (its codes depend
      on the step's keys: no single export is the forward's).
  """
  _check_rules(rules)
  flat = safetensors.flatten(_params(params))
  out = {}
  if layers is None:
    layers = nvfp4_layer_paths(model, *example_args)
  for layer in layers:
    op = rules.recipe_at(layer, step).fprop_w
    if not op.quantized or op.format != "nvfp4":
      continue
    kernel = flat.get(f"{layer}/kernel")
    if kernel is None or kernel.ndim not in (2, 3):
      continue
    if op.rounding != "nearest":
      raise ValueError(
          f"export: layer {layer!r} quantizes its forward weight with "
          f"{op.rounding} rounding, whose codes change with every step's "
          f"keys; export a model trained with round-to-nearest weights (the "
          f"recipe's default) or keep this layer in high precision.")
    if kernel.ndim == 2:
      out[layer] = _quantize_weight(jnp.asarray(kernel), op.block_2d,
                                    op.four_over_six)
      continue
    g = _quantize_experts(jnp.asarray(kernel), op)
    out[layer] = [NVFP4Array(g.data[e], g.scales[e], g.amax[e],
                             block_2d=op.block_2d,
                             four_over_six=op.four_over_six)
                  for e in range(kernel.shape[0])]
  return out


def save(path: str | pathlib.Path, model: nn.Module, params: Any,
         rules: PrecisionRules, *example_args, step: int | None = None
         ) -> dict[str, Any]:
  """Exports `params` of `model` with the quantized layers packed.

  Args:
    path: the `.safetensors` file to write (atomically).
    model: the linen model (to find its NVFP4 layers).
    params: its parameters (a "params" collection is unwrapped); FP32 master
      weights give the training forward's exact quantized weights.
    rules: the precision rules it was trained with: layers whose Fprop GEMM
      they quantize at `step` are packed, the others stored unchanged.
    *example_args: an input `model.init` accepts (traced abstractly).
    step: the training step for the rules' late switch (None: before it).

  Returns:
    A summary: `{"quantized": [paths], "high_precision": [paths],
    "bytes": file size, "bits_per_quantized_weight": ...}`.

  Raises:
    TypeError: `rules` is not a `PrecisionRules`.
  """
  _check_rules(rules)
  params = _params(params)
  flat = safetensors.flatten(params)
  layers = nvfp4_layer_paths(model, *example_args)
  tensors, packed, quantized_elems, layer_meta = {}, set(), 0, {}
  weights = quantized_weights(model, params, rules, *example_args, step=step)
  for layer, q in weights.items():
    if isinstance(q, list):  # Expert kernels stay unpacked here.
      continue
    kernel = flat[f"{layer}/kernel"]
    op = rules.recipe_at(layer, step).fprop_w
    name = layer.replace("/", ".")
    tensors[f"{name}.weight"] = np.asarray(q.codes)
    tensors[f"{name}.weight_scale"] = np.asarray(q.scales)
    tensors[f"{name}.weight_scale_2"] = np.asarray(q.tensor_scale,
                                                   np.float32)
    tensors[f"{name}.weight_amax"] = np.asarray(q.amax, np.float32)
    layer_meta[layer] = {"block_2d": op.block_2d,
                         "four_over_six": op.four_over_six,
                         "recipe": rules.recipe_at(layer, step).tag,
                         "shape": list(q.shape)}
    packed.add(f"{layer}/kernel")
    quantized_elems += kernel.size
  for p, v in flat.items():
    if p not in packed:
      tensors[p.replace("/", ".")] = np.asarray(v)
  metadata = {"format": FORMAT, "layers": json.dumps(layer_meta),
              "paths": json.dumps(sorted(flat))}
  safetensors.save(path, tensors, metadata)
  size = pathlib.Path(path).stat().st_size
  q_bytes = sum(tensors[f"{l.replace('/', '.')}.{t}"].nbytes
                for l in layer_meta for t in ("weight", "weight_scale"))
  return {"quantized": sorted(layer_meta),
          "high_precision": sorted(set(layers) - set(layer_meta)),
          "bytes": size,
          "bits_per_quantized_weight": (8 * q_bytes / quantized_elems
                                        if quantized_elems else float("nan"))}


def load(path: str | pathlib.Path) -> dict[str, Any]:
  """Reads an exported file: the parameter tree, each packed layer's
  `kernel` replaced by its weight `W = kernel^T` as an `NVFP4Array` under
  the key "packed" (and no "kernel").

  Each packed layer's tensors are checked against each other and the
  metadata: uint8 codes `[out, in/2]`, float8_e4m3fn scales `[out, in/16]`,
  float32 scalar amax and tensor factor (the factor that amax gives), the
  weight shape recorded at export.

  Args:
    path: the file `save` wrote.

  Returns:
    The nested parameter tree (`{"Dense_0": {"packed": ..., "bias": ...}}`):
    each packed weight an `NVFP4Array`, every other parameter a `jax.Array`.

  Raises:
    SafetensorsError: a truncated, damaged, edited or foreign file.
  """
  tensors, meta = safetensors.load(path)
  if meta.get("format") != FORMAT:
    raise safetensors.SafetensorsError(
        f"{path} is not an nvfp4-jax packed export (format "
        f"{meta.get('format')!r}, expected {FORMAT!r}); export it with "
        f"nvfp4_jax.export.save.")
  try:
    layers = json.loads(meta["layers"])
    paths = json.loads(meta["paths"])
  except (KeyError, json.JSONDecodeError) as e:
    raise safetensors.SafetensorsError(
        f"{path}: damaged export metadata ({e}); re-export it.") from None
  flat = {}
  for p in paths:
    layer = p.rsplit("/", 1)[0]
    if layer in layers and p.endswith("/kernel"):
      name = layer.replace("/", ".")
      try:
        codes, scales, amax = (tensors[f"{name}.{t}"] for t in
                               ("weight", "weight_scale", "weight_amax"))
      except KeyError as e:
        raise safetensors.SafetensorsError(
            f"{path}: the packed layer {layer!r} lacks {e}; re-export "
            f"it.") from None
      flat[f"{layer}/packed"] = _packed(path, layer, layers[layer], codes,
                                        scales, amax,
                                        tensors.get(f"{name}.weight_scale_2"))
      continue
    key = p.replace("/", ".")
    if key not in tensors:
      raise safetensors.SafetensorsError(
          f"{path}: parameter {p!r} is missing; re-export it.")
    flat[p] = jnp.asarray(tensors[key])
  return safetensors.unflatten(flat)


def _packed(path, layer: str, meta: Any, codes: np.ndarray,
            scales: np.ndarray, amax: np.ndarray,
            scale_2: np.ndarray | None) -> NVFP4Array:
  """A packed layer's `NVFP4Array`, after checking its tensors against
  each other and the metadata (a SafetensorsError names what differs)."""
  def bad(why: str):
    return safetensors.SafetensorsError(
        f"{path}: the packed layer {layer!r} {why}; the file was edited or "
        f"damaged: re-export it with nvfp4_jax.export.save.")
  if not isinstance(meta, dict) or not all(
      isinstance(meta.get(k), bool) for k in ("block_2d", "four_over_six")):
    raise bad(f"has damaged metadata {meta!r}")
  q = NVFP4Array(jnp.asarray(codes), jnp.asarray(scales), jnp.asarray(amax),
                 block_2d=meta["block_2d"],
                 four_over_six=meta["four_over_six"])
  try:
    check_nvfp4_array(q, "export.load", f"layer {layer!r}")
  except ValueError as e:
    raise bad(f"does not hold a valid NVFP4 weight ({e})") from None
  shape = meta.get("shape")
  if shape is not None and list(q.shape) != list(shape):
    raise bad(f"holds a weight of shape {list(q.shape)} ([out, in]) but was "
              f"exported with {list(shape)}")
  if meta["block_2d"] and (q.shape[0] % nm.NVFP4_BLOCK):
    raise bad(f"is 16x16-scaled but has {q.shape[0]} rows")
  if scale_2 is not None:
    want = np.asarray(q.tensor_scale, np.float32)
    if (scale_2.dtype != np.float32 or scale_2.shape != ()
        or scale_2.tobytes() != want.tobytes()):
      raise bad(f"has weight_scale_2 {scale_2!r} but its amax "
                f"{float(amax)} gives {want!r}")
  return q


def _get(tree, path):
  for part in path.split("/"):
    tree = tree[part]
  return tree


def apply(model: nn.Module, packed: dict[str, Any], *args,
          mode: str = "w4a4", implementation: str | None = None,
          **kwargs) -> Any:
  """Runs `model` on exported parameters (`load`'s tree), forward only.

  Each packed layer computes from its stored bytes, never a bf16 copy:

  - "w4a4": `quantize(x)` (RTNE, 1x16) and the block-scaled GEMM with the
    stored weight: the training forward's Fprop, bit for bit.
  - "weight_only": `weight_only_matmul(x, W)` (activations in bf16).

  The NVFP4 layers that were not packed run in high precision, as their
  Fprop did in training; other modules run as trained.

  Args:
    model: the linen model the file was exported from.
    packed: `load`'s tree.
    *args: `model.apply`'s inputs.
    mode: "w4a4" or "weight_only" (above).
    implementation: of the GEMMs (and the activation quantizer), as the ops'
      `implementation=`.
    **kwargs: `model.apply`'s keyword arguments.

  Returns:
    What `model.apply` returns.

  Raises:
    ValueError: an unknown `mode`, or a packed layer whose shape is not the
      model's.
  """
  if mode not in MODES:
    raise ValueError(f"unknown mode {mode!r}; use one of {MODES}.")

  def interceptor(next_fun, fargs, fkwargs, context):
    m = context.module
    if not (isinstance(m, NVFP4Dense) and context.method_name == "__call__"):
      return next_fun(*fargs, **fkwargs)
    path = "/".join(str(p) for p in m.scope.path)
    try:
      node = _get(packed, path)
    except (KeyError, TypeError):
      node = None
    if not isinstance(node, dict) or "packed" not in node:
      return next_fun(*fargs, **fkwargs)
    x = fargs[0]
    dtype = m.dtype or x.dtype
    w = node["packed"]
    want = (m.features, x.shape[-1])
    if tuple(w.shape) != want:
      raise ValueError(
          f"export.apply: layer {path!r} of the model computes {want[1]} -> "
          f"{want[0]} features, but the file's packed weight is "
          f"{tuple(w.shape)} ([out, in]); apply the model (configuration) "
          f"the file was exported from.")
    if "bias" in node and jnp.shape(node["bias"]) != (m.features,):
      raise ValueError(
          f"export.apply: layer {path!r} has {m.features} features but the "
          f"file's bias has shape {jnp.shape(node['bias'])}; apply the "
          f"model the file was exported from.")
    xf = x.reshape(-1, x.shape[-1])
    if mode == "w4a4":
      y = block_scaled_matmul(quantize(xf.astype(dtype)), w, out_dtype=dtype,
                              implementation=implementation)
    else:
      y = weight_only_matmul(xf.astype(dtype), w, out_dtype=dtype,
                             implementation=implementation)
    y = y.reshape(*x.shape[:-1], w.shape[0])
    if "bias" in node:
      y = y + jnp.asarray(node["bias"], dtype)
    return y

  # The layers that were not packed ran their Fprop in high precision.
  with precision_rules(PrecisionRules.high_precision()), \
      nn.intercept_methods(interceptor):
    return model.apply({"params": packed}, *args, **kwargs)


def generate(logits_fn: Callable[[jax.Array], jax.Array], prompt: jax.Array,
             steps: int, key: jax.Array, *, temperature: float = 1.0
             ) -> jax.Array:
  """Samples `steps` tokens after `prompt` (`int [batch, seq]`).

  `logits_fn(tokens) -> [batch, seq, vocab]`, e.g. `lambda t: apply(model,
  packed, t, mode="weight_only")`; the context is the whole sequence so far
  (no cache: for small models and examples).

  Args:
    logits_fn: tokens `[batch, seq]` to logits `[batch, seq, vocab]`.
    prompt: int tokens `[batch, seq]`.
    steps: the number of tokens to sample.
    key: PRNG key; step `i` samples with `fold_in(key, i)`.
    temperature: the softmax temperature; 0 or less samples greedily
      (argmax).

  Returns:
    The tokens `[batch, seq + steps]`, prompt first.
  """
  tokens = prompt
  for i in range(steps):
    logits = logits_fn(tokens)[:, -1].astype(jnp.float32)
    k = jax.random.fold_in(key, i)
    if temperature <= 0:
      nxt = jnp.argmax(logits, axis=-1)
    else:
      nxt = jax.random.categorical(k, logits / temperature, axis=-1)
    tokens = jnp.concatenate([tokens, nxt[:, None].astype(tokens.dtype)], 1)
  return tokens
