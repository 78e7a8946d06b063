"""Hugging Face (transformers) names, configurations and layouts of the GPT.

The one place where HF names live: import (`from_hf_tensors`; a whole
directory: `models.hf_import.load_hf`) and export (`to_hf_tensors`, the
NVFP4 exporters slicing packed codes and scale rows with `linear_rows`)
both read them from here.

    cfg = config_from_hf(json.load(open("llama/config.json")))
    model, params = load_hf("llama")       # a GPT and its parameters
    logits = model.apply({"params": params}, tokens)

Architectures: `LlamaForCausalLM`, `MistralForCausalLM` (without a sliding
window shorter than its context) and `MixtralForCausalLM`; a dense GPT
exports as Llama, a mixture of experts as Mixtral. Qwen2 (biases on q, k
and v) and Qwen3 (per-head q/k RMSNorm) compute what the GPT cannot and are
refused by name.

The mapping, per block `i` (`W = kernel.T`, `[out, in]` as HF stores it):

| GPT                               | HF                                        |
| --------------------------------- | ----------------------------------------- |
| `embed/embedding` `[V, D]`        | `model.embed_tokens.weight`               |
| `block_i/attn_norm/scale`         | `model.layers.i.input_layernorm.weight`   |
| `block_i/attn/qkv` rows           | `self_attn.{q,k,v}_proj` (`linear_rows`)  |
| `block_i/attn/out`                | `self_attn.o_proj`                        |
| `block_i/mlp_norm/scale`          | `post_attention_layernorm.weight`         |
| `block_i/mlp/up` rows             | `mlp.{gate,up}_proj` (`linear_rows`)      |
| `block_i/mlp/down`                | `mlp.down_proj`                           |
| `block_i/moe/router` `[D, E]`     | `block_sparse_moe.gate.weight` `[E, D]`   |
| `block_i/moe/experts/up[j]` rows  | `block_sparse_moe.experts.j.{w1,w3}`      |
| `block_i/moe/experts/down[j]`     | `block_sparse_moe.experts.j.w2`           |
| `final_norm/scale`                | `model.norm.weight`                       |
| `head/kernel.T` (untied)          | `lm_head.weight`                          |
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from models.gpt import GPTConfig
from models.gpt import RopeScaling
from models.gpt import _fused_order

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM",
                 "MixtralForCausalLM")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "MixtralForCausalLM": "mixtral"}
# Architectures that compute what the GPT cannot, with the reason.
REFUSED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "Qwen2 adds biases to q, k and v (the GPT has no "
                        "biases)",
    "Qwen3ForCausalLM": "Qwen3 normalizes q and k per head (q_norm, k_norm)",
    "Qwen3MoeForCausalLM": "Qwen3 normalizes q and k per head (q_norm, "
                           "k_norm)",
    "Qwen2MoeForCausalLM": "Qwen2 adds biases to q, k and v and a shared "
                           "expert",
}
# config.json fields that do not change the forward computation (token ids,
# generation and bookkeeping).
_INERT = frozenset((
    "_name_or_path", "architectures", "model_type", "bos_token_id",
    "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
    "transformers_version", "dtype", "torch_dtype", "chunk_size_feed_forward",
    "id2label", "label2id", "is_encoder_decoder", "output_attentions",
    "output_hidden_states", "problem_type", "return_dict", "pretraining_tp",
    "max_position_embeddings", "output_router_logits", "tokenizer_class",
    "router_aux_loss_coef",
))
_HANDLED = frozenset((
    "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "num_hidden_layers", "vocab_size", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
    "head_dim", "hidden_act", "attention_bias", "mlp_bias", "sliding_window",
    "num_local_experts", "num_experts_per_tok", "router_jitter_noise",
    "attention_dropout",
))
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16"}


def _rope(hf: Mapping[str, Any], problems: list[str]):
  """(rope_theta, RopeScaling | None) of a HF config (transformers 5's
  `rope_parameters` or 4's `rope_theta` + `rope_scaling`)."""
  params = hf.get("rope_parameters")
  if params is None:
    params = dict(hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
  else:
    params = dict(params)
    if "rope_theta" not in params and "rope_theta" in hf:
      params["rope_theta"] = hf["rope_theta"]
  if any(isinstance(v, Mapping) for v in params.values()):
    problems.append(f"rope_parameters per layer type {params!r} (the GPT "
                    f"has one rotary embedding for every layer)")
    return 10000.0, None
  theta = float(params.get("rope_theta", 10000.0))
  kind = params.get("rope_type", params.get("type", "default"))
  partial = params.get("partial_rotary_factor", hf.get(
      "partial_rotary_factor", 1.0))
  if partial != 1.0:
    problems.append(f"partial_rotary_factor={partial!r} (the GPT rotates "
                    f"every feature of a head; needs 1.0)")
  if kind in (None, "default"):
    return theta, None
  if kind != "llama3":
    problems.append(f"rope type {kind!r} (supported: 'default' and Llama "
                    f"3's 'llama3')")
    return theta, None
  missing = [k for k in _LLAMA3_KEYS if k not in params]
  if missing:
    problems.append(f"rope 'llama3' without {missing}")
    return theta, None
  return theta, RopeScaling(**{k: params[k] for k in _LLAMA3_KEYS})


def config_from_hf(hf_config: Mapping[str, Any]) -> GPTConfig:
  """The `GPTConfig` of a HF `config.json` (as a dict).

  Args:
    hf_config: the parsed `config.json` of a `LlamaForCausalLM`,
      `MistralForCausalLM` or `MixtralForCausalLM`.

  Returns:
    The configuration, with `dtype="float32"` (replace it to compute in
    bf16) and the default `fused_layout`.

  Raises:
    ValueError: naming, in one message, every field the GPT cannot honour:
      another or an unknown architecture, attention or MLP biases, a
      sliding window shorter than the context, a rope type other than
      "default" or "llama3", `head_dim != hidden_size / num_attention_heads`,
      an activation other than silu, an unknown field; or the GPT's own
      alignment errors for the resulting shapes.
  """
  hf = dict(hf_config)
  problems: list[str] = []
  archs = hf.get("architectures") or []
  arch = archs[0] if len(archs) == 1 else None
  if arch is None:
    problems.append(f"architectures={archs!r} (need exactly one of "
                    f"{list(ARCHITECTURES)})")
  elif arch in REFUSED_ARCHITECTURES:
    problems.append(f"architecture {arch!r}: {REFUSED_ARCHITECTURES[arch]}")
  elif arch not in ARCHITECTURES:
    problems.append(f"unknown architecture {arch!r} (supported: "
                    f"{list(ARCHITECTURES)})")
  required = ["hidden_size", "intermediate_size", "num_attention_heads",
              "num_hidden_layers", "vocab_size"]
  if arch == "MixtralForCausalLM":
    required += ["num_local_experts", "num_experts_per_tok"]
  absent = [k for k in required if hf.get(k) is None]
  if absent:
    problems.append(f"missing fields {absent}")
  unknown = sorted(k for k in hf if k not in _INERT and k not in _HANDLED)
  if unknown:
    problems.append(
        f"fields {unknown} (unknown to this importer: it cannot tell "
        f"whether they change the computation; a quantization_config means "
        f"an already quantized checkpoint: import its unquantized original)")
  for name in ("attention_bias", "mlp_bias"):
    if hf.get(name):
      problems.append(f"{name}=true (the GPT's projections have no biases)")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    problems.append(f"hidden_act={act!r} (the GPT's SwiGLU uses silu)")
  window = hf.get("sliding_window")
  context = hf.get("max_position_embeddings")
  if window is not None and (context is None or window < context):
    problems.append(
        f"sliding_window={window!r} is shorter than the context "
        f"(max_position_embeddings={context!r}); the GPT attends to every "
        f"earlier position")
  dropout = hf.get("attention_dropout") or 0.0
  if dropout:
    problems.append(f"attention_dropout={dropout!r} (the GPT has no "
                    f"dropout; needs 0)")
  jitter = hf.get("router_jitter_noise") or 0.0
  if jitter:
    problems.append(f"router_jitter_noise={jitter!r} (the GPT's router has "
                    f"no noise; needs 0)")
  theta, scaling = _rope(hf, problems)
  d, heads = hf.get("hidden_size"), hf.get("num_attention_heads")
  head_dim = hf.get("head_dim")
  if (head_dim is not None and d and heads
      and head_dim * heads != d):
    problems.append(f"head_dim={head_dim!r} != hidden_size / "
                    f"num_attention_heads = {d} / {heads} (the GPT's heads "
                    f"split hidden_size)")
  if problems:
    raise ValueError(
        f"config.json of {arch or archs!r}: the GPT cannot honour "
        + "; ".join(problems) + ".")
  kv = hf.get("num_key_value_heads")
  fields = dict(
      vocab_size=hf["vocab_size"], d_model=d, num_layers=hf["num_hidden_layers"],
      num_heads=heads, d_ff=hf["intermediate_size"],
      num_kv_heads=None if kv in (None, heads) else kv,
      rope_base=theta, rope_scaling=scaling,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      mlp="swiglu", dtype="float32")
  if arch == "MixtralForCausalLM":
    fields.update(num_experts=hf["num_local_experts"],
                  top_k=hf["num_experts_per_tok"], capacity_factor=None)
    if hf.get("router_aux_loss_coef") is not None:
      fields["aux_loss_weight"] = float(hf["router_aux_loss_coef"])
  try:
    return GPTConfig(**fields)
  except (ValueError, TypeError) as e:
    raise ValueError(f"config.json of {arch!r} maps to a GPTConfig that "
                     f"cannot be built: {e}") from e


def _architecture(cfg: GPTConfig) -> str:
  problems = []
  if cfg.mlp != "swiglu":
    problems.append(f"mlp={cfg.mlp!r} (Llama and Mixtral are SwiGLU)")
  if cfg.num_experts and cfg.capacity_factor is not None:
    problems.append(f"capacity_factor={cfg.capacity_factor!r} (Mixtral is "
                    f"dropless: None)")
  if problems:
    raise ValueError("GPTConfig has no HF (Llama/Mixtral) equivalent: "
                     + "; ".join(problems) + ".")
  return "MixtralForCausalLM" if cfg.num_experts else "LlamaForCausalLM"


def hf_config(cfg: GPTConfig, *, max_position_embeddings: int = 2048,
              dtype: str | None = None) -> dict[str, Any]:
  """The `config.json` dict transformers loads for `GPT(cfg)`.

  Args:
    cfg: the model.
    max_position_embeddings: the context length to declare.
    dtype: the stored weights' dtype ("float32", "bfloat16"); default
      `cfg.dtype`.

  Returns:
    A `LlamaForCausalLM` config (dense) or `MixtralForCausalLM` (experts),
    with transformers 5's `rope_parameters` (and the older `rope_theta` /
    `rope_scaling` for transformers 4).

  Raises:
    ValueError: a GPT with no HF equivalent (squared-ReLU MLP, capacity-
      limited experts).
  """
  arch = _architecture(cfg)
  dtype = _DTYPE_NAMES[dtype or cfg.dtype]
  rope = {"rope_type": "default", "rope_theta": float(cfg.rope_base)}
  legacy_scaling = None
  if cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    legacy_scaling = {"rope_type": "llama3", "factor": float(s.factor),
                      "low_freq_factor": float(s.low_freq_factor),
                      "high_freq_factor": float(s.high_freq_factor),
                      "original_max_position_embeddings":
                          int(s.original_max_position_embeddings)}
    rope.update(legacy_scaling)
  out = {
      "architectures": [arch],
      "model_type": _MODEL_TYPES[arch],
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.kv_heads,
      "num_hidden_layers": cfg.num_layers,
      "head_dim": cfg.head_dim,
      "vocab_size": cfg.vocab_size,
      "hidden_act": "silu",
      "rms_norm_eps": float(cfg.norm_eps),
      "rope_parameters": rope,
      "rope_theta": float(cfg.rope_base),
      "rope_scaling": legacy_scaling,
      "tie_word_embeddings": bool(cfg.tie_embeddings),
      "max_position_embeddings": int(max_position_embeddings),
      "attention_dropout": 0.0,
      "initializer_range": 0.02,
      "use_cache": True,
      "dtype": dtype,
      "torch_dtype": dtype,
  }
  if arch == "MixtralForCausalLM":
    out.update(num_local_experts=cfg.num_experts,
               num_experts_per_tok=cfg.top_k, sliding_window=None,
               router_jitter_noise=0.0, output_router_logits=False,
               router_aux_loss_coef=float(cfg.aux_loss_weight))
  else:
    out.update(attention_bias=False, mlp_bias=False)
  return out


_LAYER = re.compile(r"^block_(\d+)/(attn/qkv|attn/out|mlp/up|mlp/down|"
                    r"moe/experts/up|moe/experts/down)(?:/(\d+))?$")


def linear_rows(cfg: GPTConfig, layer: str, expert: int | None = None
                ) -> list[tuple[str, np.ndarray]]:
  """The HF modules of one of the GPT's linear layers, with their rows.

  Args:
    cfg: the model.
    layer: "block_{i}/attn/qkv", ".../attn/out", ".../mlp/up",
      ".../mlp/down", or for experts "block_{i}/moe/experts/up" and
      ".../down" with the expert given as `expert` or as a path suffix
      ("block_3/moe/experts/up/5").
    expert: the expert index (MoE layers only).

  Returns:
    `[(module name, rows)]`: for each HF module (e.g.
    "model.layers.3.self_attn.q_proj"; its weight is "<name>.weight"), the
    row indices into the layer's `W = kernel.T` (`[out, in]`, in
    `cfg.fused_layout`; for experts `kernel[expert].T`) whose rows, in that
    order, are the HF weight `[out_hf, in]`. The rows of a layer's modules
    partition its rows.

  Raises:
    ValueError: an unknown layer path, a block or expert out of range, an
      expert index on a dense layer (or none on an expert layer), a layer
      the configuration does not have.
  """
  m = _LAYER.match(layer)
  if m is None:
    raise ValueError(
        f"linear_rows: unknown layer {layer!r}; use 'block_<i>/attn/qkv', "
        f"'.../attn/out', '.../mlp/up', '.../mlp/down', "
        f"'.../moe/experts/up' or '.../moe/experts/down'.")
  i, kind, suffix = int(m.group(1)), m.group(2), m.group(3)
  if suffix is not None:
    if expert is not None and int(suffix) != expert:
      raise ValueError(f"linear_rows: {layer!r} names expert {suffix} but "
                       f"expert={expert}; give one.")
    expert = int(suffix)
  if not 0 <= i < cfg.num_layers:
    raise ValueError(f"linear_rows: {layer!r}: blocks are 0 to "
                     f"{cfg.num_layers - 1}.")
  moe = kind.startswith("moe/")
  if moe != bool(cfg.num_experts) and kind not in ("attn/qkv", "attn/out"):
    raise ValueError(
        f"linear_rows: {layer!r} is not a layer of this "
        f"{'mixture-of-experts' if cfg.num_experts else 'dense'} GPT.")
  if moe:
    if expert is None or not 0 <= expert < cfg.num_experts:
      raise ValueError(f"linear_rows: {layer!r} needs an expert in [0, "
                       f"{cfg.num_experts}), got {expert!r}.")
  elif expert is not None:
    raise ValueError(f"linear_rows: {layer!r} has no experts; drop "
                     f"expert={expert!r}.")
  _architecture(cfg)
  pre = f"model.layers.{i}."
  if kind == "attn/qkv":
    inv = _inverse(_fused_order(cfg, "qkv", cfg.fused_layout))
    q, kv = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return [(pre + "self_attn.q_proj", inv[:q]),
            (pre + "self_attn.k_proj", inv[q:q + kv]),
            (pre + "self_attn.v_proj", inv[q + kv:])]
  if kind == "attn/out":
    return [(pre + "self_attn.o_proj", np.arange(cfg.d_model))]
  if kind == "mlp/up":
    inv = _inverse(_fused_order(cfg, "up", cfg.fused_layout))
    return [(pre + "mlp.gate_proj", inv[:cfg.d_ff]),
            (pre + "mlp.up_proj", inv[cfg.d_ff:])]
  if kind == "mlp/down":
    return [(pre + "mlp.down_proj", np.arange(cfg.d_model))]
  ex = f"{pre}block_sparse_moe.experts.{expert}."
  if kind == "moe/experts/up":
    # The experts' fused kernel is [gate, up] (halves; no interleaving).
    return [(ex + "w1", np.arange(cfg.d_ff)),
            (ex + "w3", np.arange(cfg.d_ff, 2 * cfg.d_ff))]
  return [(ex + "w2", np.arange(cfg.d_model))]


def _inverse(order: np.ndarray) -> np.ndarray:
  """`inv[c]`: the position of concatenated column `c` in `order`."""
  inv = np.empty_like(order)
  inv[order] = np.arange(order.size)
  return inv


def linear_layers(cfg: GPTConfig) -> list[tuple[str, int | None]]:
  """Every linear layer of `GPT(cfg)` as `(layer path, expert)` for
  `linear_rows` (expert None for dense layers)."""
  out = []
  for i in range(cfg.num_layers):
    out += [(f"block_{i}/attn/qkv", None), (f"block_{i}/attn/out", None)]
    if cfg.num_experts:
      for j in range(cfg.num_experts):
        out += [(f"block_{i}/moe/experts/up", j),
                (f"block_{i}/moe/experts/down", j)]
    else:
      out += [(f"block_{i}/mlp/up", None), (f"block_{i}/mlp/down", None)]
  return out


def _kernel_path(layer: str) -> tuple[str, ...]:
  return tuple(layer.split("/")) + ("kernel",)


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _put(tree, path, value):
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _others(cfg: GPTConfig) -> list[tuple[tuple[str, ...], str, bool]]:
  """The non-linear parameters: (GPT path, HF name, transposed)."""
  out = [(("embed", "embedding"), "model.embed_tokens.weight", False),
         (("final_norm", "scale"), "model.norm.weight", False)]
  if not cfg.tie_embeddings:
    out.append((("head", "kernel"), "lm_head.weight", True))
  for i in range(cfg.num_layers):
    b, pre = f"block_{i}", f"model.layers.{i}."
    out += [((b, "attn_norm", "scale"), pre + "input_layernorm.weight", False),
            ((b, "mlp_norm", "scale"), pre + "post_attention_layernorm.weight",
             False)]
    if cfg.num_experts:
      out.append(((b, "moe", "router"), pre + "block_sparse_moe.gate.weight",
                  True))
  return out


def to_hf_tensors(cfg: GPTConfig, params: Mapping[str, Any]
                  ) -> dict[str, np.ndarray]:
  """Every parameter of `GPT(cfg)` under its HF name, in HF's layout.

  Args:
    cfg: the model.
    params: its parameters (`{"params": ...}` or the inner tree), arrays of
      any kind; their dtype is kept.

  Returns:
    `{name: array}` (numpy): linear weights `[out, in]` split with
    `linear_rows`, the router `[E, D]`, `lm_head.weight` `[V, D]` (absent
    when the embeddings are tied), norms and the embedding as they are.
  """
  params = params.get("params", params)
  out = {}
  for path, name, transposed in _others(cfg):
    x = np.asarray(_get(params, path))
    out[name] = np.ascontiguousarray(x.T) if transposed else x
  for layer, expert in linear_layers(cfg):
    k = np.asarray(_get(params, _kernel_path(layer)))
    w = (k[expert] if expert is not None else k).T
    for name, rows in linear_rows(cfg, layer, expert):
      out[name + ".weight"] = np.ascontiguousarray(w[rows])
  return out


def _fused_mixtral(tensors: Mapping[str, Any], cfg: GPTConfig) -> dict:
  """`tensors` with transformers 5's in-memory Mixtral names
  (`mlp.gate.weight`, `mlp.experts.gate_up_proj` `[E, 2H, D]`,
  `mlp.experts.down_proj` `[E, D, H]`) rewritten to the checkpoint names
  (`block_sparse_moe.gate.weight`, `experts.{j}.w1/w3/w2.weight`)."""
  out = dict(tensors)
  h = cfg.d_ff
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}."
    new = pre + "block_sparse_moe."
    if pre + "mlp.gate.weight" in out:
      out[new + "gate.weight"] = out.pop(pre + "mlp.gate.weight")
    gu = out.pop(pre + "mlp.experts.gate_up_proj", None)
    if gu is not None:
      gu = np.asarray(gu)
      for j in range(gu.shape[0]):
        out[f"{new}experts.{j}.w1.weight"] = gu[j, :h]
        out[f"{new}experts.{j}.w3.weight"] = gu[j, h:]
    down = out.pop(pre + "mlp.experts.down_proj", None)
    if down is not None:
      down = np.asarray(down)
      for j in range(down.shape[0]):
        out[f"{new}experts.{j}.w2.weight"] = down[j]
  return out


def param_shapes(cfg: GPTConfig) -> dict:
  """The parameter tree of `GPT(cfg)` as shapes and dtypes (nothing
  allocated; every layer traced in high precision)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import nvfp4_jax  # pylint: disable=g-import-not-at-top
  from models.gpt import GPT  # pylint: disable=g-import-not-at-top
  hp = nvfp4_jax.PrecisionRules.high_precision()

  def init():
    with nvfp4_jax.precision_rules(hp):
      return GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 32), jnp.int32))
  return jax.eval_shape(init)["params"]


def from_hf_tensors(cfg: GPTConfig, tensors: Mapping[str, Any]) -> dict:
  """The parameters of `GPT(cfg)` from HF-named tensors (`to_hf_tensors`'
  inverse).

  Args:
    cfg: the model (`config_from_hf` of the checkpoint's config).
    tensors: `{HF name: array}` (numpy, jax or anything `np.asarray`
      takes), e.g. a checkpoint's safetensors. A tied `lm_head.weight` equal
      to the embedding is accepted; Mixtral's experts also under
      transformers 5's fused names.

  Returns:
    The inner parameter tree (`model.apply({"params": tree}, tokens)`), as
    numpy arrays of the dtypes `GPT(cfg)` creates (`cfg.dtype` for weights,
    FP32 for norm scales).

  Raises:
    ValueError: naming every missing, unexpected and mis-shaped tensor.
  """
  tensors = dict(tensors)
  if cfg.num_experts:
    tensors = _fused_mixtral(tensors, cfg)
  shapes = param_shapes(cfg)
  problems, used, params = [], set(), {}

  def take(name, shape):
    if name not in tensors:
      problems.append(f"missing {name} {list(shape)}")
      return None
    used.add(name)
    x = tensors[name]
    if tuple(np.shape(x)) != tuple(shape):
      problems.append(f"{name} has shape {list(np.shape(x))}, expected "
                      f"{list(shape)}")
      return None
    return np.asarray(x)

  for path, name, transposed in _others(cfg):
    want = _get(shapes, path)
    shape = want.shape[::-1] if transposed else want.shape
    x = take(name, shape)
    if x is not None:
      _put(params, path, (x.T if transposed else x).astype(want.dtype))
  for layer, expert in linear_layers(cfg):
    want = _get(shapes, _kernel_path(layer))
    in_dim, out_dim = want.shape[-2:]
    w = np.zeros((out_dim, in_dim), want.dtype)
    for name, rows in linear_rows(cfg, layer, expert):
      x = take(name + ".weight", (rows.size, in_dim))
      if x is not None:
        w[rows] = x.astype(want.dtype)
    path = _kernel_path(layer)
    if expert is None:
      _put(params, path, np.ascontiguousarray(w.T))
    else:
      try:
        stack = _get(params, path)
      except KeyError:
        stack = np.zeros(want.shape, want.dtype)
        _put(params, path, stack)
      stack[expert] = w.T
  if cfg.tie_embeddings and "lm_head.weight" in tensors:
    used.add("lm_head.weight")
    if not np.array_equal(np.asarray(tensors["lm_head.weight"]),
                          np.asarray(tensors["model.embed_tokens.weight"])):
      problems.append("lm_head.weight differs from model.embed_tokens.weight "
                      "but tie_word_embeddings is true")
  extra = sorted(set(tensors) - used)
  if extra:
    problems.append(f"unexpected {extra[:8]}"
                    + (f" and {len(extra) - 8} more" if len(extra) > 8
                       else ""))
  if problems:
    raise ValueError("HF tensors do not match the GPTConfig: "
                     + "; ".join(problems) + ".")
  return params
