"""Packed NVFP4 export, loader, W4A4 and weight-only inference (issue 13)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nv
from nvfp4_jax.tools import export
from nvfp4_jax.tools import safetensors
from models import GPT, preset
from nvfp4_jax.ops.weight_only_matmul import pallas_triton as weight_only_kernel
from quantizer_checks import heavy

CFG = preset("tiny", d_model=64, num_layers=4, num_heads=2, d_ff=128)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  model = GPT(CFG)
  tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, 256)
  with nv.precision_rules(nv.PrecisionRules.high_precision()):
    params = model.init(jax.random.key(0), tokens)["params"]
  path = tmp_path_factory.mktemp("export") / "tiny.safetensors"
  return model, params, tokens, path


# Four-over-Six and 1D weights in the slow tier (the suite's time budget):
# the fast tier keeps the paper's recipe.
@pytest.mark.parametrize("recipe", [
    nv.Recipe.nvfp4(),
    pytest.param(nv.Recipe.nvfp4(four_over_six="weights"),
                 marks=pytest.mark.slow),
    pytest.param(nv.Recipe.nvfp4(two_d_weights=False),
                 marks=pytest.mark.slow)])
def test_w4a4_logits_equal_the_training_forward(trained, recipe):
  model, params, tokens, path = trained
  rules = nv.paper_rules(CFG.num_layers, recipe=recipe)
  info = export.save(path, model, params, rules, tokens)
  assert info["quantized"] == [f"block_2/{p}" for p in (
      "attn/out", "attn/qkv", "mlp/down", "mlp/up")]
  packed = export.load(path)
  with nv.precision_rules(rules):
    want = model.apply({"params": params}, tokens)
  np.testing.assert_array_equal(export.apply(model, packed, tokens), want)
  q = packed["block_2"]["mlp"]["up"]["packed"]
  assert isinstance(q, nv.NVFP4Array) and q.shape == (2 * CFG.d_ff, 64)
  assert q.four_over_six == recipe.fprop_w.four_over_six
  assert "kernel" not in packed["block_2"]["mlp"]["up"]


def test_file_holds_4_5_bits_per_quantized_weight(trained):
  model, params, tokens, path = trained
  rules = nv.PrecisionRules()  # Every projection packed.
  info = export.save(path, model, params, rules, tokens)
  assert info["bits_per_quantized_weight"] == 4.5
  flat = jax.tree.leaves(params)
  hp = sum(a.size * a.dtype.itemsize for a in flat) - sum(
      params[b][s][p]["kernel"].size * 4 for b in params if b.startswith(
          "block") for s in ("attn", "mlp") for p in params[b][s])
  packed_bytes = sum(params[b][s][p]["kernel"].size * 4.5 / 8 for b in params
                     if b.startswith("block") for s in ("attn", "mlp")
                     for p in params[b][s])
  # The rest is the header (JSON, < 16 KiB here) and 8 bytes of scalars/layer.
  assert 0 < info["bytes"] - hp - packed_bytes < 16384
  tensors, _ = safetensors.load(path)
  w = tensors["block_0.mlp.up.weight"]
  assert w.dtype == np.uint8 and w.shape == (2 * CFG.d_ff, 32)
  assert tensors["block_0.mlp.up.weight_scale"].dtype == jnp.float8_e4m3fn
  assert tensors["block_0.mlp.up.weight_scale_2"].shape == ()


def test_weight_only_reads_the_packed_weight(trained):
  model, params, tokens, path = trained
  rules = nv.paper_rules(CFG.num_layers)
  export.save(path, model, params, rules, tokens)
  packed = export.load(path)
  fn = functools.partial(export.apply, model, mode="weight_only",
                         implementation="pallas")
  text = str(jax.make_jaxpr(fn)(packed, tokens))
  assert text.count("name=nvfp4_weight_only_matmul") == 4
  logits = fn(packed, tokens)
  w4a4 = export.apply(model, packed, tokens)
  assert logits.shape == w4a4.shape and np.all(np.isfinite(logits))
  # Only the activations' quantization differs: the same next tokens mostly.
  agree = np.mean(np.argmax(logits, -1) == np.argmax(w4a4, -1))
  assert agree > 0.8, agree


# The fast tier keeps a decode row, ragged M, N and K, several M tiles, and
# each of split K, swapped operands and both together; the slow tier adds
# the shapes those already cover (the CPU suite's budget).
_slow = lambda *case: pytest.param(*case, marks=pytest.mark.slow)


@pytest.mark.parametrize("m,n,k,cfg", [
    (1, 48, 64, None), (5, 100, 256, None), _slow(64, 64, 512, None),
    (17, 16, 48, None), _slow(3, 40, 1024, None), (130, 48, 256, None),
    (3, 40, 1024, dict(block_k=128, split_k=4)),
    _slow(20, 64, 512, dict(block_k=128, split_k=2)),
    _slow(5, 100, 256, dict(block_n=32, swap_ab=True)),
    (20, 64, 512, dict(block_k=128, split_k=2, swap_ab=True)),
    (33, 80, 256, dict(block_m=32, block_n=64, block_k=64, swap_ab=True))])
def test_weight_only_matmul_kernel_matches_reference(m, n, k, cfg):
  x = heavy((m, k), jnp.bfloat16, seed=m)
  w = nv.quantize(heavy((n, k), seed=n), block_2d=n % 16 == 0)
  if cfg is None:  # The default: split when the output has few tiles.
    fn = functools.partial(nv.weight_only_matmul, implementation="pallas")
    assert (k, weight_only_kernel.default_config(m, n, k).split_k) != (1024, 1)
  else:
    fn = functools.partial(weight_only_kernel.weight_only_matmul,
                           config=weight_only_kernel.WeightOnlyConfig(**cfg))
  got = np.asarray(fn(x, w, out_dtype=jnp.float32), np.float64)
  want = np.asarray(nv.weight_only_matmul(x, w, out_dtype=jnp.float32,
                                          implementation="xla"), np.float64)
  # Products of bf16 values are exact; the FP32 sums of K terms in another
  # order differ by at most (K - 1) * 2^-24 * sum |terms| (times the factor).
  terms = (np.abs(np.asarray(x, np.float64))
           @ np.abs(np.asarray(nv.block_dequantize(w)[0], np.float64)).T)
  bound = (k - 1) * 2.0**-24 * terms * float(w.tensor_scale) * 2
  assert np.all(np.abs(got - want) <= bound + 1e-30)
  exact = np.asarray(x, np.float64) @ np.asarray(nv.dequantize(w),
                                                 np.float64).T
  np.testing.assert_allclose(want, exact, rtol=0,
                             atol=float(np.max(bound)) * 4 + 1e-6 * float(
                                 np.max(np.abs(exact))))


def test_bad_and_truncated_files_give_clear_errors(trained, tmp_path):
  model, params, tokens, path = trained
  export.save(path, model, params, nv.paper_rules(CFG.num_layers), tokens)
  raw = path.read_bytes()
  cases = {
      "truncated": raw[: len(raw) // 2],
      "tiny": raw[:5],
      "header": raw[:8] + b"{not json" + raw[17:],
  }
  for name, data in cases.items():
    bad = tmp_path / f"{name}.safetensors"
    bad.write_bytes(data)
    with pytest.raises(safetensors.SafetensorsError, match="not a valid "
                       "safetensors file.*Re-export"):
      export.load(bad)
  other = tmp_path / "other.safetensors"
  safetensors.save(other, {"w": np.zeros((2, 2), np.float32)})
  with pytest.raises(safetensors.SafetensorsError, match="not an nvfp4-jax"):
    export.load(other)
  with pytest.raises(FileNotFoundError):
    export.load(tmp_path / "missing.safetensors")


def test_safetensors_roundtrip_and_interop(tmp_path):
  tensors = {"a": np.arange(12, dtype=np.float32).reshape(3, 4),
             "b": np.asarray([1.5, -2.0], jnp.bfloat16),
             "c": np.asarray([448.0, 0.015625], jnp.float8_e4m3fn),
             "d": np.asarray(7, np.uint8)}
  f = tmp_path / "t.safetensors"
  safetensors.save(f, tensors, {"k": "v"})
  back, meta = safetensors.load(f)
  assert meta == {"k": "v"}
  for k, v in tensors.items():
    assert back[k].dtype == v.dtype and back[k].shape == v.shape
    np.testing.assert_array_equal(back[k].view(np.uint8), v.view(np.uint8))
  # The reference implementation reads the same file (its numpy frontend
  # has no float8 dtype, so only the others are fetched).
  st = pytest.importorskip("safetensors")
  with st.safe_open(str(f), framework="np") as g:
    assert sorted(g.keys()) == sorted(tensors) and g.metadata() == meta
    np.testing.assert_array_equal(g.get_tensor("a"), tensors["a"])
    assert g.get_tensor("d").shape == ()


def test_weight_only_config_must_divide_k():
  w = nv.quantize(heavy((16, 96)))
  with pytest.raises(ValueError, match=r"block_k=32 x split_k=2 must divide "
                     r"K=96"):
    weight_only_kernel.weight_only_matmul(
        jnp.ones((1, 96), jnp.bfloat16), w,
        config=weight_only_kernel.WeightOnlyConfig(block_k=32, split_k=2))
