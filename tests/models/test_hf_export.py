"""`models.save_hf` and `python -m train.export --format ...`: HF directories
loaded by the other side's own code (transformers, compressed-tensors' ModelOpt
converter), issue 57 item 4.

Bounds used below:

- Two FP32 forwards of the same weights (ours in JAX, transformers' in
  torch) differ by their rounding only. Along the path of a logit there are
  `n = 6 * layers + 2` sequential reductions (per block: qkv, scores, values,
  out, up, down; the final norm and the head), each of at most `K` terms
  (`K` the longest: d_model, d_ff or the sequence), and each adds at most
  `K * 2^-24` relative error of its absolute sum (Higham's gamma_K); to first
  order these add along the residual stream, and the logit's error is at
  most that relative error times its absolute sum `sum_k |h_k| |E_vk|`
  (`h` the final normed state, `E` the head). Twice for two
  implementations: `2 n K 2^-24 sum |h||E|` (`fp32_bound`).
- A decompressed NVFP4 weight (compressed-tensors: `bf16(code * f32(scale /
  global_scale))`) against ours (`code * scale * (amax / 2688)`, one FP32
  rounding): the FP32 steps differ by at most 4 roundings (2^-22 relative)
  and the bf16 cast adds at most half a bf16 ulp, 2^-8 relative: `|a - b| <=
  (2^-8 + 2^-20) |b|` elementwise. After compressed-tensors' ModelOpt
  converter the global scale is ModelOpt's 0-dim scalar, and torch computes
  `scale / global_scale` in bf16 (a 0-dim tensor does not promote the
  dtype): a second bf16 rounding, `(2^-7 + 2^-15) |b|`.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nv
from models import GPT, from_hf_tensors, hf_export, linear_rows, preset
from models import save_hf, to_hf_tensors
from nvfp4_jax.tools import safetensors
from train import export as export_cli
from train.loop import Trainer
from lazy_import import lazy, skip_unless
from tiny_training import MODEL, config, small_corpus

# The [hf] extra's modules, imported when a test first uses them
# (tests/support/lazy_import.py: not in every xdist worker's collection).
pytestmark = skip_unless("torch", "transformers", "compressed_tensors",
                         reason="needs the [hf] extra: pip install -e .[hf]")
torch = lazy("torch")
transformers = lazy("transformers")
_ct_nvfp4 = lazy("compressed_tensors.compressors.nvfp4.base")
_ct_convert = lazy("compressed_tensors.entrypoints.convert")
_ct_modelopt = lazy(
    "compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4")
_ct_quantization = lazy("compressed_tensors.quantization")
_st_torch = lazy("safetensors.torch")

U = 2.0**-24
WEIGHT_RTOL = 2.0**-8 + 2.0**-20
CONVERTED_RTOL = 2.0**-7 + 2.0**-15


def _init(cfg, seed=0):
  model = GPT(cfg)
  with nv.precision_rules(nv.PrecisionRules.high_precision()):
    params = jax.jit(model.init)(jax.random.key(seed),
                                 jnp.zeros((1, 32), jnp.int32))["params"]
  return model, jax.tree.map(np.asarray, params)


def _bf16(tree):
  return jax.tree.map(lambda x: np.asarray(
      np.asarray(x).astype(jnp.bfloat16), np.float32), tree)


def _ours(model, params, tokens):
  """Our FP32 logits (every layer high precision) and `fp32_bound`."""
  cfg = model.cfg
  with nv.precision_rules(nv.PrecisionRules.high_precision()):
    logits, state = jax.jit(lambda p, t: model.apply(
        {"params": p}, t, capture_intermediates=lambda m, _: (
            m.name == "final_norm")))(params, tokens)
  h = np.asarray(state["intermediates"]["final_norm"]["__call__"][0],
                 np.float64)
  head = (np.asarray(params["embed"]["embedding"], np.float64).T
          if cfg.tie_embeddings else np.asarray(params["head"]["kernel"],
                                                np.float64))
  terms = np.abs(h) @ np.abs(head)
  k = max(cfg.d_model, cfg.d_ff, tokens.shape[1])
  n = 6 * cfg.num_layers + 2
  return np.asarray(logits), 2 * n * k * U * terms


def _theirs(directory, tokens, **kw):
  """transformers' model of `directory` (FP32, NVFP4 decompressed at load)
  and its logits on `tokens`."""
  if "quantization_config" in json.loads(
      (directory / "config.json").read_text()):
    kw["quantization_config"] = transformers.CompressedTensorsConfig(
        dequantize=True)
  m = transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=torch.float32, **kw)
  with torch.no_grad():
    logits = m(torch.asarray(np.asarray(tokens, np.int64))).logits.numpy()
  return m, logits


def _state(m) -> dict[str, np.ndarray]:
  return {k: v.detach().float().numpy() for k, v in m.state_dict().items()}


def _same_logits(model, theirs_model, theirs_logits, tokens):
  """transformers' logits equal our forward of the weights it holds."""
  params = from_hf_tensors(model.cfg, _state(theirs_model))
  ours, bound = _ours(model, params, tokens)
  assert np.all(np.abs(theirs_logits - ours) <= bound), np.max(
      np.abs(theirs_logits - ours) - bound)
  return ours


def test_hf_format_gqa_tied_loads_in_transformers(tmp_path):
  cfg = preset("tiny", d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
               d_ff=128, tie_embeddings=True)
  model, params = _init(cfg)
  info = save_hf(tmp_path / "out", model, params)
  assert {"config.json", "generation_config.json", "model.safetensors",
          "tokenizer.json"} <= set(info["files"])
  tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 256)
  m, logits = _theirs(tmp_path / "out", tokens)
  assert type(m).__name__ == "LlamaForCausalLM"
  assert m.config.num_key_value_heads == 2 and m.config.tie_word_embeddings
  # Every tensor is the bf16 of our master, under its HF name.
  theirs = _state(m)
  for name, want in to_hf_tensors(cfg, _bf16(params)).items():
    np.testing.assert_array_equal(theirs[name], want, err_msg=name)
  # FP32 logits of the bf16 weights, ours against transformers'.
  ours, bound = _ours(model, _bf16(params), tokens)
  assert np.all(np.abs(logits - ours) <= bound)
  assert np.max(np.abs(ours)) > 100 * np.max(bound)  # A bound that binds.
  tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
  text = "héllo, wörld\n\t~"
  assert tok.encode(text, add_special_tokens=False) == list(text.encode())
  assert tok.decode(list(text.encode())) == text


def test_moe_exports_in_the_mixtral_layout(tmp_path):
  cfg = preset("moe-tiny", num_layers=2)
  model, params = _init(cfg)
  tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 256)
  # Sharded (a small limit): the index and shards are what loads.
  info = save_hf(tmp_path / "bf16", model, params, max_shard_size=2**16)
  assert "model.safetensors.index.json" in info["files"]
  assert "model.safetensors" not in info["files"]
  m, logits = _theirs(tmp_path / "bf16", tokens)
  assert type(m).__name__ == "MixtralForCausalLM"
  want = _bf16(params)
  got = from_hf_tensors(cfg, _state(m))
  jax.tree.map(np.testing.assert_array_equal, got, want)
  _same_logits(model, m, logits, tokens)
  # Calibration: each expert's amax over the tokens routed to it.
  # (High-precision rules: the observer is what is tested, cheaply.)
  hp = nv.PrecisionRules.high_precision()
  amax = hf_export.calibrate(model, params, hp, [tokens])
  with nv.precision_rules(hp):
    _, inter = jax.jit(lambda p, t: model.apply(
        {"params": p}, t, capture_intermediates=(
            lambda mdl, _: mdl.name in ("attn_norm", "mlp_norm"))))(
                params, tokens)
  for i in range(cfg.num_layers):
    h = np.asarray(inter["intermediates"][f"block_{i}"]["mlp_norm"][
        "__call__"][0]).reshape(-1, cfg.d_model)
    router = np.asarray(params[f"block_{i}"]["moe"]["router"])
    top = np.argsort(-(h.astype(np.float64) @ router), axis=-1)[:, :cfg.top_k]
    want = [np.max(np.abs(h[np.any(top == e, axis=-1)]), initial=0.0)
            for e in range(cfg.num_experts)]
    np.testing.assert_array_equal(amax[f"block_{i}/moe/experts/up"], want)
    assert amax[f"block_{i}/moe/experts/down"].shape == (cfg.num_experts,)
    # q, k and v share one input: the normed residual stream.
    normed = inter["intermediates"][f"block_{i}"]["attn_norm"]["__call__"][0]
    assert amax[f"block_{i}/attn/qkv"] == np.max(np.abs(normed))
  # NVFP4 experts, weight-only, decompressed by compressed-tensors' own
  # NVFP4 compressor under the scheme our config.json declares.
  # (transformers 5.24 decompresses NVFP4 experts without their
  # weight_global_scale -- its DummyModule has none -- so its MoE weights
  # are off by that factor; vLLM applies it. Not ours to paper over.)
  rules = nv.PrecisionRules()
  save_hf(tmp_path / "w4a16", model, params, format="compressed-tensors",
          rules=rules, activations="bf16")
  qc = _ct_quantization.QuantizationConfig.model_validate(json.loads(
      (tmp_path / "w4a16" / "config.json").read_text())["quantization_config"])
  scheme = qc.config_groups["group_0"]
  assert scheme.input_activations is None  # W4A16.
  stored = _st_torch.load_file(tmp_path / "w4a16" / "model.safetensors")
  q = nv.export.quantized_weights(model, params, rules,
                                  jnp.zeros((1, 32), jnp.int32))
  # Each expert's codes are the grouped GEMM's (`quantize_experts`: as
  # `quantize` of that expert alone, tests/kernels/test_ragged_quantize.py).
  kernel = params["block_1"]["moe"]["experts"]["down"]["kernel"]
  for e, qe in enumerate(q["block_1/moe/experts/down"]):
    want = nv.quantize(jnp.asarray(kernel[e]).T, block_2d=True)
    np.testing.assert_array_equal(qe.codes, want.codes)
    np.testing.assert_array_equal(np.asarray(qe.scales).view(np.uint8),
                                  np.asarray(want.scales).view(np.uint8))
  for i in range(cfg.num_layers):
    for proj in ("up", "down"):
      layer = f"block_{i}/moe/experts/{proj}"
      for e, qe in enumerate(q[layer]):
        ours = np.asarray(nv.dequantize(qe), np.float64)
        for name, rows in linear_rows(cfg, layer, e):
          got = _ct_nvfp4.NVFP4PackedCompressor.decompress(
              {k: stored[f"{name}.{k}"] for k in (
                  "weight_packed", "weight_scale", "weight_global_scale")},
              scheme)["weight"].float().numpy()
          assert np.all(np.abs(got - ours[rows]) <= WEIGHT_RTOL
                        * np.abs(ours[rows])), name
  # The attention layers through transformers' own load.
  m4, _ = _theirs(tmp_path / "w4a16", tokens)
  state = _state(m4)
  ours = np.asarray(nv.dequantize(q["block_1/attn/qkv"]), np.float64)
  for name, rows in linear_rows(cfg, "block_1/attn/qkv"):
    assert np.all(np.abs(state[f"{name}.weight"] - ours[rows])
                  <= WEIGHT_RTOL * np.abs(ours[rows])), name


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A run trained with NVFP4 (`paper_rules`: block_2 of 4 quantized), as
  test_train_resume trains it (the session's compilation cache holds it)."""
  run = tmp_path_factory.mktemp("hf") / "run"
  Trainer(config(steps=10, ckpt_every=3, eval_every=5, diagnostics=False),
          small_corpus(), MODEL).run(run, progress=False)
  return run


def _scale(tensors, name):
  return np.asarray(tensors[name], np.float32).reshape(-1)[0]


def test_compressed_tensors_and_modelopt_of_a_trained_run(run, tmp_path,
                                                          capsys):
  ct, mo = tmp_path / "ct", tmp_path / "mo"
  for fmt, out in (("compressed-tensors", ct), ("modelopt", mo)):
    assert export_cli.main([str(run), str(out), "--format", fmt,
                            "--calibrate", "2"]) == 0
  text = capsys.readouterr().out
  assert "compressed-tensors, " in text and "7 NVFP4 linear modules" in text
  _, mcfg, step, master, rules = export_cli.restore_run(run)
  model = GPT(mcfg)
  # The library's own packed file: the trained forward's codes and scales
  # (test_export.py: its W4A4 logits are the training forward's).
  packed = tmp_path / "packed.safetensors"
  nv.export.save(packed, model, master, rules, jnp.zeros((1, 32), jnp.int32),
                 step=step)
  own, _ = safetensors.load(packed)
  cts, _ = safetensors.load(ct / "model.safetensors")
  mos, _ = safetensors.load(mo / "model.safetensors")
  quantized = ["attn/qkv", "attn/out", "mlp/up", "mlp/down"]
  for layer in (f"block_2/{p}" for p in quantized):
    src = layer.replace("/", ".")
    amax = np.float32(own[f"{src}.weight_amax"])
    for name, rows in linear_rows(mcfg, layer):
      for tensors, codes in ((cts, "weight_packed"), (mos, "weight")):
        # Byte for byte the forward's codes and E4M3 scales.
        np.testing.assert_array_equal(tensors[f"{name}.{codes}"],
                                      own[f"{src}.weight"][rows])
        np.testing.assert_array_equal(
            tensors[f"{name}.weight_scale"].view(np.uint8),
            own[f"{src}.weight_scale"][rows].view(np.uint8))
      # 16x16 tiles: each tile's scale on its 16 rows.
      sc = cts[f"{name}.weight_scale"].view(np.uint8)
      s = sc.reshape(-1, 16, sc.shape[1])
      assert np.all(s == s[:, :1])
      # The fused tensor's global scale on every shard (q/k/v, gate/up).
      assert mos[f"{name}.weight_scale_2"].shape == ()
      assert _scale(mos, f"{name}.weight_scale_2") == np.float32(
          own[f"{src}.weight_scale_2"])
      assert _scale(cts, f"{name}.weight_global_scale") == np.float32(
          2688.0) / amax
      # The calibrated input scale: one amax per layer input, both forms.
      a = _scale(mos, f"{name}.input_scale")
      b = _scale(cts, f"{name}.input_global_scale")
      assert 0 < a and abs(float(a) * float(b) - 1) < 4 * U
  for layer in ("block_0/attn/qkv", "block_3/mlp/down"):  # BF16 blocks.
    for name, _ in linear_rows(mcfg, layer):
      assert cts[f"{name}.weight"].dtype == jnp.bfloat16
  config = json.loads((ct / "config.json").read_text())["quantization_config"]
  assert config["format"] == "nvfp4-pack-quantized"
  group = config["config_groups"]["group_0"]
  assert group["weights"]["strategy"] == "tensor_group"
  assert group["weights"]["group_size"] == 16
  assert "lm_head" in config["ignore"]
  assert "model.layers.0.self_attn.q_proj" in config["ignore"]
  hq = json.loads((mo / "hf_quant_config.json").read_text())
  assert hq["producer"]["name"] == "nvfp4-jax"
  assert hq["quantization"]["quant_algo"] == "NVFP4"
  assert hq["quantization"]["group_size"] == 16
  assert hq["quantization"]["kv_cache_quant_algo"] is None
  assert hq["quantization"]["exclude_modules"] == config["ignore"]

  # transformers decompresses the NVFP4 weights: ours, dequantized.
  # Held-out tokens: the validation split.
  val = np.asarray(small_corpus().val[: 2 * 32], np.int32).reshape(2, 32)
  m, logits = _theirs(ct, val)
  fwd = hf_export.forward_params(model, master)
  weights = nv.export.quantized_weights(model, fwd, rules,
                                        jnp.zeros((1, 32), jnp.int32),
                                        step=step)
  state = _state(m)
  for layer in (f"block_2/{p}" for p in quantized):
    ours = np.asarray(nv.dequantize(weights[layer]), np.float64)
    for name, rows in linear_rows(mcfg, layer):
      theirs = state[f"{name}.weight"]
      assert np.all(np.abs(theirs - ours[rows]) <= WEIGHT_RTOL
                    * np.abs(ours[rows])), name
  _same_logits(model, m, logits, val)
  # Loaded compressed (W4A4 emulated: activations fake-quantized with the
  # static global scale), the input scales are transformers' parameters.
  w4a4 = transformers.AutoModelForCausalLM.from_pretrained(
      ct, dtype=torch.bfloat16)
  q_proj = w4a4.model.layers[2].self_attn.q_proj
  assert float(q_proj.input_global_scale) == _scale(
      cts, "model.layers.2.self_attn.q_proj.input_global_scale")
  with torch.no_grad():
    assert torch.isfinite(w4a4(torch.asarray(val, dtype=torch.int64))
                          .logits).all()

  # compressed-tensors' own ModelOpt NVFP4 converter validates and converts
  # the ModelOpt directory; transformers loads the result, the same model.
  conv = tmp_path / "converted"
  converter = _ct_modelopt.ModelOptNvfp4Converter(
      ignore=hq["quantization"]["exclude_modules"], targets=["Linear"])
  _ct_convert.convert_checkpoint(mo, conv, converter, max_workers=1,
                                 device="cpu")
  m2, logits2 = _theirs(conv, val)
  state2 = _state(m2)
  for layer in (f"block_2/{p}" for p in quantized):
    ours = np.asarray(nv.dequantize(weights[layer]), np.float64)
    for name, rows in linear_rows(mcfg, layer):
      assert np.all(np.abs(state2[f"{name}.weight"] - ours[rows])
                    <= CONVERTED_RTOL * np.abs(ours[rows])), name
  _same_logits(model, m2, logits2, val)


def test_fused_split_must_keep_16_row_tiles(tmp_path):
  # head_dim 8: q_proj's rows of attn/qkv are runs of 8 rows, half tiles.
  cfg = preset("tiny", d_model=64, num_layers=1, num_heads=8, d_ff=128)
  model, params = _init(cfg)
  with pytest.raises(ValueError, match="whole 16-row tiles.*multiple of 16"):
    save_hf(tmp_path / "o", model, params, format="compressed-tensors",
            rules=nv.PrecisionRules(), activations="bf16")
  assert not (tmp_path / "o").exists()


def test_bad_arguments_are_named(tmp_path, capsys):
  model, params = _init(preset("tiny", d_model=64, num_layers=1, num_heads=2,
                               d_ff=128))
  rules = nv.PrecisionRules()
  cases = [
      (dict(format="modelopt", rules=rules, activations="bf16"),
       "no weight-only variant"),
      (dict(format="compressed-tensors", rules=rules),
       "needs their static input scales"),
      (dict(format="hf", calibration=[np.zeros((1, 32), np.int32)]),
       "format 'hf' writes BF16"),
      (dict(format="modelopt", calibration=[]), "needs rules="),
      (dict(format="gguf"), "unknown format"),
      (dict(format="compressed-tensors", rules=nv.PrecisionRules.
            high_precision(), activations="bf16"), "quantize no layer"),
  ]
  for kw, match in cases:
    with pytest.raises((ValueError, TypeError), match=match):
      save_hf(tmp_path / "o", model, params, **kw)
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "model.safetensors").write_bytes(b"old")
  with pytest.raises(FileExistsError, match="not an empty directory"):
    save_hf(tmp_path / "full", model, params)
  big = _init(preset("tiny", vocab_size=512, d_model=64, num_layers=1,
                     num_heads=2, d_ff=128))
  with pytest.raises(ValueError, match="needs its tokenizer"):
    save_hf(tmp_path / "v", *big)
  # A run's own tokenizer (trained here) is copied and loads as itself.
  from tokenizers import Tokenizer, models as tm, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top,line-too-long
  tok = Tokenizer(tm.BPE(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(["def main(): return 0", "import os, sys"] * 8,
                          trainers.BpeTrainer(vocab_size=300,
                                              special_tokens=["[UNK]"]))
  (tmp_path / "tok").mkdir()
  tok.save(str(tmp_path / "tok" / "tokenizer.json"))
  save_hf(tmp_path / "v", *big, tokenizer=tmp_path / "tok")
  auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "v")
  text = "def main(): import sys"
  assert auto.encode(text, add_special_tokens=False) == tok.encode(text).ids
  n = tok.get_vocab_size()
  assert n > 32
  small = _init(preset("tiny", vocab_size=32, d_model=64, num_layers=1,
                       num_heads=2, d_ff=128))
  with pytest.raises(ValueError, match=f"has {n} ids but the model's "
                     f"vocabulary is 32"):
    save_hf(tmp_path / "w", *small, tokenizer=tmp_path / "tok")
  for argv, match in (
      (["--format", "modelopt"], "give --calibrate N"),
      (["--format", "modelopt", "--activations", "bf16"], "no weight-only"),
      (["--format", "hf", "--calibrate", "2"], "--format hf writes BF16"),
      (["--format", "compressed-tensors", "--generate", "3"],
       "sample from the packed format"),
      (["--calibrate", "2"], "applies to the HF formats"),
      (["--format", "compressed-tensors", "--activations", "bf16",
        "--calibrate", "1"], "drop --calibrate")):
    assert export_cli.main([str(tmp_path), str(tmp_path / "new")]
                           + argv) == 2
    assert match in capsys.readouterr().err, argv
