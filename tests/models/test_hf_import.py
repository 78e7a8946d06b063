"""models.load_hf and `--init-from`: HF checkpoints made by transformers
itself (tiny random Llama and Mixtral) load as a GPT with transformers'
logits; what the GPT cannot honour is refused by name; grouped-query
attention keeps its fused layouts and trains in NVFP4."""

import copy
import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nv
import models
from models import GPT, GPTConfig
from models.gpt import fused_permutation

from lazy_import import lazy, skip_unless  # pylint: disable=g-bad-import-order

# Imported when a test first uses them (tests/support/lazy_import.py).
pytestmark = skip_unless("torch", "transformers",
                         reason="needs the [hf] extra: pip install -e .[hf]")
torch = lazy("torch")
transformers = lazy("transformers")

HP = nv.PrecisionRules.high_precision()
U = 2.0**-24  # FP32 unit roundoff.
VOCAB = 1000  # Not a multiple of 16: the head and embedding are not NVFP4.
TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, 32))
# Llama 3's rope scaling, with a short original context so that at 32
# positions all three of its bands matter for head_dim 16 and theta 1e4:
# wavelengths 6.3 (kept: < 32/4), 19.9 (smoothed) and >= 63 (divided by 8).
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
LLAMA3_SCALING = {k: v for k, v in LLAMA3.items()
                  if k not in ("rope_type", "rope_theta")}
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4)


def _randomize(model, seed):
  """Weights of std 0.15 (attention scores of std ~1.5: peaked enough that
  rotary positions change the result) and norm scales 1 +- 0.1 (so a
  swapped norm is seen)."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
      p.copy_(1 + 0.1 * noise if "norm" in name else 0.15 * noise)
  return model.eval()


def _save(model, path, **kw):
  """`(directory, model)`: the model is transformers' own load of what
  save_pretrained wrote, in FP32 (a model cast in memory is not: its
  rotary frequencies would keep the bf16 rounding of the cast)."""
  model.save_pretrained(path, **kw)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(
      str(path), dtype=torch.float32)
  if hasattr(loaded, "set_experts_implementation"):
    # The eager experts run in float64 as well (grouped_mm does not).
    loaded.set_experts_implementation("eager")
  return str(path), loaded.eval()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  """Tiny checkpoints written by transformers' save_pretrained."""
  root = tmp_path_factory.mktemp("hf")
  llama = _randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(
      **SMALL, num_key_value_heads=2, rope_parameters=LLAMA3,
      tie_word_embeddings=False)), 0)
  # Tied, one key/value head, stored in bf16 and sharded with an index.
  tied = _randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(
      **SMALL, num_key_value_heads=1, tie_word_embeddings=True)), 1)
  tied = tied.to(torch.bfloat16)
  mixtral = _randomize(transformers.MixtralForCausalLM(
      transformers.MixtralConfig(**dict(SMALL, num_hidden_layers=1),
                                 num_key_value_heads=2,
                                 num_local_experts=4, num_experts_per_tok=2)),
                       2)
  mistral = _randomize(transformers.MistralForCausalLM(
      transformers.MistralConfig(**SMALL, num_key_value_heads=2,
                                 sliding_window=None)), 3)
  return {"llama": _save(llama, root / "llama"),
          "mistral": _save(mistral, root / "mistral"),
          "tied": _save(tied, root / "tied", max_shard_size="100KB"),
          "mixtral": _save(mixtral, root / "mixtral")}


def _hf_logits(model, dtype):
  m = copy.deepcopy(model).to(dtype)
  with torch.no_grad():
    return m(torch.tensor(TOKENS)).logits.double().numpy()


def _ours(model, params, cfg=None):
  model = model if cfg is None else GPT(cfg)
  # FP32 arithmetic on every backend: XLA:GPU's default precision runs FP32
  # GEMMs on TF32 tensor cores (10-bit mantissas), not what the bound is of.
  with nv.precision_rules(HP), jax.default_matmul_precision("highest"):
    return np.asarray(model.apply({"params": params}, jnp.asarray(TOKENS)),
                      np.float64)


@pytest.mark.parametrize("name", ["llama", "tied", "mistral", "mixtral"])
def test_load_hf_logits_equal_transformers(ckpts, name):
  """`load_hf`'s FP32 logits equal transformers' within FP32 rounding.

  Bound. transformers' float64 run is the reference. Both FP32 runs
  evaluate the same function, each rounding every operation with relative
  error <= u = 2^-24, in different orders (XLA's and ATen's GEMM blocking
  and softmax; our rotary frequencies `base^(-2i/d)` against `1 /
  base^(2i/d)` without scaling). A worst-case propagation of u through the
  blocks is orders of magnitude loose, so this network's FP32 rounding
  error is measured on the other side: `e_hf = max|hf32 - hf64|`. Ours is
  another FP32 evaluation with errors of that scale, so `|ours - hf64| <=
  |ours - hf32| + e_hf`; we require `|ours - hf64| <= 4 e_hf` (twice the
  sum of two errors of one scale), floored at `16 u max|logit|` (the
  logits' own last rounding, in case e_hf happens to be tiny). Switching
  off the rope scaling or misgrouping the key/value heads moves the logits
  by far more (asserted below).
  """
  path, hf = ckpts[name]
  model, params = models.load_hf(path)
  cfg = model.cfg
  ref = _hf_logits(hf, torch.float64)
  e_hf = np.abs(_hf_logits(hf, torch.float32) - ref).max()
  bound = max(4 * e_hf, 16 * U * np.abs(ref).max())
  err = np.abs(_ours(model, params) - ref).max()
  print(f"{name}: max|ours - hf64| {err:.3g}, transformers' FP32 {e_hf:.3g}, "
        f"bound {bound:.3g}, max|logit| {np.abs(ref).max():.3g}")
  assert err <= bound, (name, err, e_hf, bound)
  assert cfg.vocab_size == VOCAB and cfg.dtype == "float32"
  assert cfg.tie_embeddings == (name == "tied")
  assert ("head" in params) == (name != "tied")
  assert cfg.kv_heads == (1 if name == "tied" else 2)
  assert cfg.num_experts == (4 if name == "mixtral" else 0)

  # The same tensors back under their HF names (transformers' own file).
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  if name == "llama":
    saved = load_file(f"{path}/model.safetensors")
    back = models.to_hf_tensors(cfg, params)
    assert set(back) == set(saved)
    for k, v in saved.items():
      np.testing.assert_array_equal(back[k], v, err_msg=k)
    # The test sees the features: without the rope scaling, or with the two
    # key/value heads swapped, the logits move far beyond the bound.
    off = _ours(model, params, cfg.replace(rope_scaling=None))
    assert np.abs(off - ref).max() > 100 * bound
    hd = cfg.head_dim
    swapped = dict(saved)
    for proj in ("k_proj", "v_proj"):
      k = f"model.layers.0.self_attn.{proj}.weight"
      swapped[k] = np.concatenate([saved[k][hd:], saved[k][:hd]])
    wrong = _ours(model, jax.tree.map(
        jnp.asarray, models.from_hf_tensors(cfg, swapped)))
    assert np.abs(wrong - ref).max() > 100 * bound
  if name == "mixtral":
    # transformers 5's in-memory names (fused experts) load alike.
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    again = models.from_hf_tensors(cfg, state)
    jax.tree.map(np.testing.assert_array_equal, again,
                 jax.tree.map(np.asarray, params))


def test_hf_config_round_trips_through_transformers(ckpts, tmp_path):
  """`hf_config` is what transformers loads back into the same model."""
  for name in ("llama", "mixtral"):
    path, _ = ckpts[name]
    cfg = models.load_hf(path)[0].cfg
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(
        json.dumps(models.hf_config(cfg)))
    loaded = transformers.AutoConfig.from_pretrained(str(tmp_path / name))
    assert models.config_from_hf(loaded.to_dict()) == cfg
  assert loaded.num_local_experts == 4 and loaded.num_key_value_heads == 2


def _llama_config(**changes):
  hf = transformers.LlamaConfig(**SMALL, num_key_value_heads=2).to_dict()
  hf["architectures"] = ["LlamaForCausalLM"]
  hf.update(changes)
  return hf


def test_config_from_hf_names_every_field_it_cannot_honour():
  """One error naming all of them; each alone is refused too."""
  bad = dict(attention_bias=True, mlp_bias=True, sliding_window=64,
             attention_dropout=0.1,
             max_position_embeddings=128, hidden_act="gelu", head_dim=32,
             rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                              "factor": 4.0})
  with pytest.raises(ValueError) as e:
    models.config_from_hf(_llama_config(**bad))
  for word in ("attention_bias", "mlp_bias", "sliding_window=64",
               "attention_dropout=0.1",
               "hidden_act='gelu'", "head_dim=32", "'yarn'"):
    assert word in str(e.value), word
  for key, value in bad.items():
    if key == "max_position_embeddings":
      continue
    with pytest.raises(ValueError, match=re.escape(key.split("_")[0])):
      models.config_from_hf(_llama_config(
          **{key: value}, max_position_embeddings=128))
  for arch, why in (("Qwen2ForCausalLM", "biases"),
                    ("Qwen3ForCausalLM", "q_norm"),
                    ("GPT2LMHeadModel", "unknown architecture")):
    with pytest.raises(ValueError, match=why):
      models.config_from_hf(_llama_config(architectures=[arch]))
  with pytest.raises(ValueError, match="quantization_config"):
    models.config_from_hf(_llama_config(quantization_config={}))
  # A window as long as the context is no window at all.
  cfg = models.config_from_hf(_llama_config(
      architectures=["MistralForCausalLM"], model_type="mistral",
      sliding_window=128, max_position_embeddings=128))
  assert cfg.kv_heads == 2


def test_load_hf_refuses_pickles_and_names_tensor_mismatches(ckpts,
                                                            tmp_path):
  path, _ = ckpts["llama"]
  (tmp_path / "config.json").write_text(open(f"{path}/config.json").read())
  # Never unpickled: these bytes are not even a pickle.
  (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
  with pytest.raises(ValueError, match=r"never unpickles.*safe_serialization"
                     r"=True"):
    models.load_hf(str(tmp_path))
  cfg = models.load_hf(path)[0].cfg
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  tensors = load_file(f"{path}/model.safetensors")
  tensors.pop("model.layers.1.mlp.up_proj.weight")
  tensors["model.layers.0.self_attn.q_proj.weight"] = np.zeros((8, 64))
  tensors["model.layers.0.self_attn.q_norm.weight"] = np.zeros(16)
  with pytest.raises(ValueError) as e:
    models.from_hf_tensors(cfg, tensors)
  for word in ("missing model.layers.1.mlp.up_proj.weight",
               "q_proj.weight has shape [8, 64]", "unexpected",
               "q_norm"):
    assert word in str(e.value), word


def test_gqa_fused_layouts_keep_tiles_and_train_in_nvfp4():
  """A GQA GPT (4 query heads, 2 key/value heads of 16) computes the same
  NVFP4 logits in both fused layouts: the permutation moves whole 16-column
  tiles, so every quantized block is the same. And a training step runs
  with NVFP4 GEMMs in all three passes."""
  cfg = GPTConfig(vocab_size=VOCAB, d_model=64, num_layers=1, num_heads=4,
                  num_kv_heads=2, d_ff=64, rope_scaling=LLAMA3_SCALING)
  assert cfg.qkv_width == (4 + 2 * 2) * 16
  perm = fused_permutation(cfg, "qkv", "concatenated", "interleaved")
  blocks = perm.reshape(-1, 16)
  assert (blocks[:, 0] % 16 == 0).all()
  assert (np.diff(blocks, axis=1) == 1).all()
  # [kv, (q0, q1, k, v), hd]: group 0 is q heads 0, 1, k head 0, v head 0.
  assert list(blocks[:4, 0]) == [0, 16, 64, 96]
  toks = jnp.asarray(TOKENS)
  rules = nv.PrecisionRules(default=nv.Recipe.nvfp4())
  with nv.precision_rules(HP):
    params = GPT(cfg).init(jax.random.key(0), toks)["params"]
  params_c = models.convert_fused_layout(params, cfg, "interleaved",
                                         "concatenated")

  def logits(p, layout="interleaved"):
    with nv.precision_rules(rules, step=0):
      return GPT(cfg.replace(fused_layout=layout)).apply(
          {"params": p}, toks, rngs={"nvfp4": jax.random.key(1)})
  logits = jax.jit(logits, static_argnums=1)
  y = logits(params)
  np.testing.assert_array_equal(y, logits(params_c, "concatenated"))
  with nv.precision_rules(HP):
    y_hp = GPT(cfg).apply({"params": params}, toks)
  assert np.abs(np.asarray(y) - np.asarray(y_hp)).max() > 1e-3  # Quantized.

  def loss(p):
    y = logits(p)
    return -jnp.take_along_axis(jax.nn.log_softmax(y[:, :-1]),
                                toks[:, 1:, None], -1).mean()
  # Traced, not run: `--init-from`'s test below trains a GQA model in NVFP4.
  text = str(jax.make_jaxpr(jax.value_and_grad(loss))(params))
  for gemm in ("nvfp4_fprop", "nvfp4_dgrad", "nvfp4_wgrad"):
    assert f"name={gemm}" in text, gemm


def test_rope_inv_freq_is_transformers_llama3():
  """Llama 3.1 8B's scaled frequencies, bit for bit, and this file's."""
  from transformers.modeling_rope_utils import _compute_llama3_parameters  # pylint: disable=g-import-not-at-top
  from models.gpt import rope_inv_freq  # pylint: disable=g-import-not-at-top
  llama31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
  for rope, heads, hd in ((llama31, 32, 128), (LLAMA3, 4, 16)):
    hf = transformers.LlamaConfig(hidden_size=heads * hd,
                                  num_attention_heads=heads,
                                  max_position_embeddings=131072,
                                  rope_parameters=rope)
    want = _compute_llama3_parameters(hf)[0].numpy()
    scaling = models.RopeScaling(**{k: v for k, v in rope.items()
                                    if k not in ("rope_type", "rope_theta")})
    got = np.asarray(rope_inv_freq(hd, rope["rope_theta"], scaling))
    np.testing.assert_array_equal(got, want)
    # Not the unscaled frequencies.
    assert (got != np.asarray(rope_inv_freq(hd, rope["rope_theta"]))).any()


def test_config_checks_gqa_and_rope_fields():
  with pytest.raises(ValueError, match="num_kv_heads=3 must divide"):
    GPTConfig(num_heads=4, num_kv_heads=3)
  # 1 key/value head of 8: width 8 is not a multiple of 16.
  with pytest.raises(ValueError, match="num_kv_heads \\* head_dim"):
    GPTConfig(d_model=64, num_heads=8, num_kv_heads=1)
  with pytest.raises(ValueError, match="high_freq_factor"):
    GPTConfig(rope_scaling=dict(LLAMA3_SCALING, high_freq_factor=0.5))
  # A tensor-parallel split must keep key/value heads whole (traced on an
  # abstract mesh of two `model` devices).
  rules = nv.MeshRules(mesh=jax.sharding.AbstractMesh((2,), ("model",)))
  mqa = GPTConfig(d_model=64, num_layers=1, num_heads=4, num_kv_heads=1,
                  d_ff=64)
  with pytest.raises(ValueError, match=r"model=2.*kv_heads=1"):
    with nv.mesh_rules(rules), nv.precision_rules(HP):
      jax.eval_shape(GPT(mqa).init, jax.random.key(0),
                     jnp.zeros((2, 16), jnp.int32))
  # As a run's config.json saves it (`dataclasses.asdict`).
  saved = json.loads(json.dumps(dataclasses.asdict(
      models.config_from_hf(_llama_config(rope_parameters=LLAMA3)))))
  assert GPTConfig(**saved).rope_scaling.factor == 8.0


def test_init_from_continues_training_a_saved_llama(ckpts, capsys):
  """`TrainConfig(init_from=DIR)` (`python -m train --init-from DIR`): the
  checkpoint's configuration, its weights as the parameters and FP32
  masters, then NVFP4 training steps (every projection quantized)."""
  from tiny_training import config, small_corpus  # pylint: disable=g-import-not-at-top
  from train.cli import main  # pylint: disable=g-import-not-at-top
  from train.loop import Trainer  # pylint: disable=g-import-not-at-top
  path, _ = ckpts["llama"]
  cfg = config(init_from=path, steps=2, warmup_steps=1, all_quantized=True)
  trainer = Trainer(cfg, small_corpus())
  assert trainer.model_cfg.kv_heads == 2
  assert trainer.model_cfg.rope_scaling is not None
  state = trainer.init_state()
  want = models.load_hf(path)[1]
  # The masters are the checkpoint's FP32 weights; the parameters those cast
  # to the compute dtype (float32 on CPU, bfloat16 on a GPU).
  jax.tree.map(np.testing.assert_array_equal, state.opt_state.master, want)
  jax.tree.map(lambda p, w: np.testing.assert_array_equal(
      p, w.astype(p.dtype)), state.params, want)
  losses = []
  for step in range(2):
    batch = trainer.batcher.batch(step).reshape(
        cfg.grad_accum, cfg.micro_batch, cfg.seq_len + 1)
    state, metrics = trainer.train_step(state, batch)
    losses.append(float(metrics["loss"]))
  assert np.isfinite(losses).all(), losses
  moved = state.params["block_0"]["attn"]["qkv"]["kernel"]
  assert not np.array_equal(moved, want["block_0"]["attn"]["qkv"]["kernel"])
  # The model flags conflict with it, with a clear error.
  with pytest.raises(ValueError, match="mlp='relu2' conflicts"):
    config(init_from=path, mlp="relu2")
  assert main(["--init-from", path, "--preset", "small"]) == 2
  assert "--preset conflicts with --init-from" in capsys.readouterr().err


_MESH_SCRIPT = r'''
import sys, time
import mesh_checks  # Sets 8 host devices before jax starts.
from mesh_checks import common, gpt_step as mc
import jax, numpy as np
import models
from tiny_training import config, small_corpus
from train.loop import Trainer

# Grouped-query attention on data=4, model=2 (4 query heads, 2 key/value
# heads: one group per device): the interleaved layout splits into whole
# groups, so XLA adds no reshard inside attention; the concatenated one
# needs them (the check sees a wrong split).
for layout in ("interleaved", "concatenated"):
  reshards = mc.tp_block_reshards(num_heads=4, num_kv_heads=2,
                                  fused_layout=layout)
  print(layout, len(reshards), "reshards")
  assert bool(reshards) == (layout == "concatenated"), reshards

# --init-from on the same mesh: the state is the checkpoint's, sharded.
path = sys.argv[1]
tr = Trainer(config(init_from=path, steps=2, warmup_steps=1),
             small_corpus(), mesh=common.mesh(data=4, model=2))
state = tr.init_state()
want = models.load_hf(path)[1]
jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b),
             state.opt_state.master, want)
kernel = state.params["block_0"]["attn"]["qkv"]["kernel"]
assert kernel.sharding.spec == tr.state_shardings.params["block_0"]["attn"][
    "qkv"]["kernel"].spec, kernel.sharding
print("init_from on data=4, model=2: ok")
'''


@pytest.mark.slow
def test_gqa_and_init_from_on_a_tensor_parallel_mesh(ckpts):
  """On 8 host devices (a fresh process: the device count is fixed before
  jax starts): GQA's interleaved qkv splits over `model` into whole query
  groups (no reshard in attention), and `--init-from` places the
  checkpoint's weights as the mesh's state. The fast tier checks the
  refusal of a split that is not whole groups
  (`test_config_checks_gqa_and_rope_fields`)."""
  import os  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(__file__).resolve().parents[2]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(root), str(root / "tests" / "support")]
      + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, ckpts["llama"][0]],
                        cwd=root, env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  assert "interleaved 0 reshards" in proc.stdout
  assert "init_from on data=4, model=2: ok" in proc.stdout
