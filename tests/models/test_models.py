"""models/: the MLP and the GPT decoder, their precision and presets."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nv
from models import GPT, GPTConfig, MLP, PRESETS, param_count, preset
import jaxprs

CFG = GPTConfig(d_model=64, num_layers=6, num_heads=2, d_ff=128)
TOKENS = jax.random.randint(jax.random.key(1), (2, 32), 0, 256)
BF16 = nv.PrecisionRules(default=nv.Recipe.bf16())


def _init(cfg=CFG):
  with nv.precision_rules(BF16):
    return GPT(cfg).init(jax.random.key(0), TOKENS)["params"]


def _apply(params, rules, tokens=TOKENS, cfg=CFG):
  with nv.precision_rules(rules, step=0):
    return GPT(cfg).apply({"params": params}, tokens,
                          rngs={"nvfp4": jax.random.key(0)})


_apply_jit = jax.jit(_apply, static_argnums=(1, 3))


def _named_regions(fn, *args):
  """Counts of the recipe's named GEMM regions in the jaxpr of `fn`, one
  per call (the blocks' layers share their traced programs)."""
  return {n: c for n, c in jaxprs.jit_names(fn, *args).items()
          if re.fullmatch(r"(?:nvfp4|bf16)_(?:fprop|dgrad|wgrad)", n)}


def test_gpt_structure_every_projection_is_nvfp4dense_without_bias():
  params = _init()
  layers = nv.nvfp4_layer_paths(GPT(CFG), TOKENS)
  expected = sorted(f"block_{i}/{m}" for i in range(6) for m in (
      "attn/qkv", "attn/out", "mlp/up", "mlp/down"))
  assert layers == expected
  # Untied embedding and head are plain high-precision modules.
  assert set(params) == {"embed", "head", "final_norm"} | {
      f"block_{i}" for i in range(6)}
  assert params["embed"]["embedding"].shape == (256, 64)
  assert params["head"]["kernel"].shape == (64, 256)
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  assert not any("bias" in jax.tree_util.keystr(p) for p, _ in leaves)
  assert params["block_0"]["mlp"]["up"]["kernel"].shape == (64, 2 * 128)


def test_gpt_is_causal_and_returns_fp32_logits():
  params = _init()
  logits = _apply_jit(params, BF16)
  assert logits.shape == (2, 32, 256) and logits.dtype == jnp.float32
  changed = TOKENS.at[:, 20:].set(7)
  logits2 = _apply_jit(params, BF16, changed)
  np.testing.assert_array_equal(logits[:, :20], logits2[:, :20])
  assert not np.allclose(logits[:, 20:], logits2[:, 20:])
  # With NVFP4 layers only approximately: the tensor scale (amax) of each
  # quantized operand spans all tokens, future ones included.
  rules = nv.paper_rules(6)
  q1 = _apply_jit(params, rules)
  q2 = _apply_jit(params, rules, changed)
  np.testing.assert_allclose(q1[:, :20], q2[:, :20], atol=0.1)


def test_paper_preset_quantizes_the_middle_blocks_only():
  params = _init()
  rules = nv.paper_rules(CFG.num_layers)

  def loss(p):
    return _apply(p, rules).mean()
  regions = _named_regions(jax.grad(loss), params)
  # Blocks 0, 1 and the last ceil(0.15 * 6) = 1 stay BF16: blocks 2-4 quantize.
  assert regions.get("nvfp4_fprop") == 3 * 4
  assert regions.get("nvfp4_dgrad") == 3 * 4
  assert regions.get("nvfp4_wgrad") == 3 * 4
  assert regions.get("bf16_fprop", 0) == 0  # BF16 layers call plain dot.
  for i in range(6):
    recipe = rules.recipe_for(f"block_{i}/mlp/up")
    assert recipe.quantized == (i in (2, 3, 4))
  # The quantized forward differs from BF16, but not by much.
  ref = _apply_jit(params, BF16)
  out = _apply_jit(params, rules)
  assert not np.array_equal(out, ref)
  rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
  assert rel < 0.1


def test_bf16_rules_run_no_quantization():
  params = _init()
  regions = _named_regions(jax.grad(lambda p: _apply(p, BF16).mean()), params)
  assert not any(k.startswith("nvfp4") for k in regions)


def test_relu2_mlp_option():
  cfg = CFG.replace(mlp="relu2")
  params = _init(cfg)
  assert params["block_0"]["mlp"]["up"]["kernel"].shape == (64, 128)
  out = _apply_jit(params, nv.paper_rules(6), TOKENS, cfg)
  assert np.all(np.isfinite(out))


def test_gpt_config_validates():
  with pytest.raises(ValueError, match="multiple of 32"):
    GPTConfig(d_model=100)
  with pytest.raises(ValueError, match="even size"):
    GPTConfig(d_model=96, num_heads=32)
  with pytest.raises(ValueError, match="unknown mlp"):
    GPTConfig(mlp="gelu")
  with pytest.raises(ValueError, match="unknown preset"):
    preset("huge")


def test_preset_parameter_counts():
  counts = {name: param_count(cfg) for name, cfg in PRESETS.items()}
  assert 0.5e6 < counts["tiny"] < 2e6
  assert 22e6 < counts["small"] < 28e6
  assert 115e6 < counts["base"] < 135e6
  assert 330e6 < counts["large"] < 370e6
  for name, cfg in PRESETS.items():
    d = cfg.d_model
    # qkv + out, SwiGLU up (gate and up fused) + down, two norm scales;
    # a mixture: E such experts and the router [d, E].
    experts = max(cfg.num_experts, 1)
    block = (4 * d * d + experts * 3 * d * cfg.d_ff + 2 * d
             + d * cfg.num_experts)
    assert counts[name] == cfg.num_layers * block + 2 * 256 * d + d


def test_mlp_is_a_drop_in_for_dense():
  x = jax.random.normal(jax.random.key(3), (32, 48))

  class DenseMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(32, name="dense_0")(x))
      return nn.Dense(16, name="dense_1")(x)

  mlp = MLP(features=(32, 16), recipe=nv.Recipe.bf16())
  params = mlp.init(jax.random.key(0), x)
  ref_params = DenseMLP().init(jax.random.key(0), x)
  assert jax.tree.structure(params) == jax.tree.structure(ref_params)
  np.testing.assert_array_equal(mlp.apply(params, x),
                                DenseMLP().apply(params, x))
  # With the NVFP4 recipe the GEMMs are quantized: the output moves a little.
  q = MLP(features=(32, 16), recipe=nv.Recipe.nvfp4()).apply(
      params, x, rngs={"nvfp4": jax.random.key(0)})
  ref = mlp.apply(params, x)
  assert not np.array_equal(q, ref)
  assert np.linalg.norm(q - ref) / np.linalg.norm(ref) < 0.2


def test_fused_attention_uses_cudnn_on_gpu_only_where_cudnn_applies(
    monkeypatch):
  from models import gpt  # pylint: disable=g-import-not-at-top
  q = jnp.zeros((2, 16, 4, 64), jnp.bfloat16)
  assert gpt.fused_attention_implementation(q) == (
      "cudnn" if jax.default_backend() == "gpu" else "xla")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert gpt.fused_attention_implementation(q) == "cudnn"
  assert gpt.fused_attention_implementation(q.astype(jnp.float16)) == "cudnn"
  # cuDNN takes 16-bit inputs and head dimensions that are multiples of 8
  # up to 128; anything else stays on XLA.
  assert gpt.fused_attention_implementation(q.astype(jnp.float32)) == "xla"
  assert gpt.fused_attention_implementation(q[..., :60]) == "xla"
  assert gpt.fused_attention_implementation(
      jnp.zeros((2, 16, 4, 256), jnp.bfloat16)) == "xla"


def test_fused_attention_matches_the_reference_attention():
  """`attention="fused"` (cuDNN flash attention on a GPU) against the
  explicit FP32-softmax attention, both with bf16 operands.

  Tolerance: both round the softmax probabilities to bf16 before the PV
  product, each within 2^-8 relative, but possibly on different sides, so
  the outputs (convex combinations of v) differ by at most 2 * 2^-8 * max|v|,
  and each output is rounded to bf16 once more (2^-8 * max|v|): 3 * 2^-8 *
  max|v| in all. The FP32 scores and exponentials add ~1e-6 relative.
  """
  from models import gpt  # pylint: disable=g-import-not-at-top
  ks = jax.random.split(jax.random.key(3), 3)
  shape = (2, 128, 4, 64)
  q, k, v = (3 * jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16)
             for kk in ks)
  fused = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True,
      implementation=gpt.fused_attention_implementation(q)))(q, k, v)
  ref = jax.jit(gpt.causal_attention, static_argnums=3)(q, k, v, jnp.bfloat16)
  bound = 3 * 2.0**-8 * float(jnp.max(jnp.abs(v.astype(jnp.float32))))
  err = np.max(np.abs(np.asarray(fused, np.float32) - np.asarray(ref,
                                                                 np.float32)))
  assert err <= bound, (err, bound)


def test_fused_attention_falls_back_to_xla_where_cudnn_refuses(monkeypatch):
  """A GPU without usable cuDNN (missing, compute capability < 8) makes
  `jax.nn.dot_product_attention(implementation="cudnn")` raise while
  tracing; the model then runs XLA's attention instead of failing."""
  from models import gpt  # pylint: disable=g-import-not-at-top
  real = jax.nn.dot_product_attention
  calls = []

  def fake(*args, implementation=None, **kw):
    calls.append(implementation)
    if implementation == "cudnn":
      raise NotImplementedError("cuDNN flash attention needs sm80+")
    return real(*args, implementation=implementation, **kw)

  monkeypatch.setattr(gpt, "fused_attention_implementation",
                      lambda q: "cudnn")
  monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
  cfg = CFG.replace(dtype="bfloat16")
  params = _init(cfg)
  logits = _apply(params, BF16, cfg=cfg)
  assert calls[-2:] == ["cudnn", "xla"]
  assert bool(jnp.all(jnp.isfinite(logits)))


@pytest.mark.parametrize("vocab", [256, 4096])
def test_embedding_gradient_is_summed_in_fp32(vocab, monkeypatch):
  """Both routes (one-hot GEMM up to ONE_HOT_VOCAB, FP32 scatter beyond) give
  the FP32 sum of the cotangents per token id, rounded once to the table's
  dtype: with a bf16 table, autodiff of `jnp.take` sums in bf16 instead.

  Reference: float64 sums. The FP32 sum of n terms is within ~n * 2^-24
  relative of it, far below the one bf16 rounding (2^-9 relative) that
  follows, so the result must be the float64 sum rounded to bf16 except
  where that sum lies within ~n * 2^-24 of a rounding boundary: at most one
  bf16 ulp off, and exact for almost all entries.
  """
  from models import gpt  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(gpt, "ONE_HOT_VOCAB", 2048)
  d, n = 32, 8192
  ids = jax.random.randint(jax.random.key(0), (4, n // 4), 0, min(vocab, 64))
  g = jax.random.normal(jax.random.key(1), (4, n // 4, d), jnp.float32)
  g = g.astype(jnp.bfloat16)
  table = jnp.zeros((vocab, d), jnp.bfloat16)
  _, vjp = jax.vjp(lambda t: gpt.embed_lookup(t, ids), table)
  (dt,) = vjp(g)
  assert dt.dtype == jnp.bfloat16
  exact = np.zeros((vocab, d))
  np.add.at(exact, np.asarray(ids).reshape(-1),
            np.asarray(g, np.float64).reshape(-1, d))
  want = exact.astype(np.float32).astype(jnp.bfloat16)
  got = np.asarray(dt)
  ulp = np.abs(np.asarray(want, np.float64)) * 2.0**-8 + 1e-30
  diff = np.abs(got.astype(np.float64) - np.asarray(want, np.float64))
  assert np.all(diff <= ulp), float(np.max(diff / ulp))
  assert np.mean(got[:64] == want[:64]) > 0.99
  # The forward is the plain lookup.
  tab = jax.random.normal(jax.random.key(2), (vocab, d)).astype(jnp.bfloat16)
  np.testing.assert_array_equal(gpt.embed_lookup(tab, ids),
                                jnp.take(tab, ids, axis=0))
  # Switched off (jnp.take's own gradient: a bf16 scatter-add of ~128 terms
  # per row), the sums are visibly off.
  _, vjp_take = jax.vjp(lambda t: jnp.take(t, ids, axis=0), table)
  (dt_take,) = vjp_take(g)
  used = slice(0, 64)
  assert np.mean(np.asarray(dt_take)[used] == want[used]) < 0.5
  # FP32 cotangents take the FP32 scatter-add, which is jnp.take's gradient.
  # On a GPU that scatter adds with atomics in no fixed order, so both equal
  # the float64 sum only within the bound of FP32 summation in any order:
  # |error| <= gamma_(n-1) * sum|g_i|, gamma_k = k u / (1 - k u), u = 2^-24,
  # n the most terms any row sums. On the CPU the order is sequential and
  # the two are the same bits.
  g32, t32 = g.astype(jnp.float32), table.astype(jnp.float32)
  (ours,) = jax.vjp(lambda t: gpt.embed_lookup(t, ids), t32)[1](g32)
  (theirs,) = jax.vjp(lambda t: jnp.take(t, ids, axis=0), t32)[1](g32)
  n = np.bincount(np.asarray(ids).reshape(-1)).max()
  gamma = (n - 1) * 2.0**-24 / (1 - (n - 1) * 2.0**-24)
  abs_sum = np.zeros((vocab, d))
  np.add.at(abs_sum, np.asarray(ids).reshape(-1),
            np.abs(np.asarray(g, np.float64)).reshape(-1, d))
  for dt32 in (ours, theirs):
    err = np.abs(np.asarray(dt32, np.float64) - exact)
    assert np.all(err <= gamma * abs_sum), float(np.max(err / (abs_sum + 1e-30)))
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(ours, theirs)


def _swiglu_autodiff(h):
  """The plain expression `swiglu` replaces, differentiated by JAX."""
  gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
  return (jax.nn.silu(gate) * up).astype(h.dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_swiglu_matches_autodiff(dtype):
  from models.gpt import swiglu  # pylint: disable=g-import-not-at-top
  kh, kg = jax.random.split(jax.random.key(3))
  # Heavy-tailed inputs (sigmoid saturates at both ends) and the edges.
  h = (jax.random.t(kh, 3.0, (4, 8, 96)) * 4).astype(dtype)
  h = h.at[0, 0, :6].set(jnp.array([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30],
                                     dtype))
  g = jax.random.t(kg, 3.0, (4, 8, 48)).astype(dtype)
  y, vjp = jax.vjp(swiglu, h)
  y_ref, vjp_ref = jax.vjp(_swiglu_autodiff, h)
  dh = np.asarray(vjp(g)[0], np.float64)
  dh_ref = np.asarray(vjp_ref(g)[0], np.float64)
  # Products only: the forward and d_up are the same FP32 operations in the
  # same order, equal bits.
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
  np.testing.assert_array_equal(dh[..., 48:], dh_ref[..., 48:])
  # d_gate = gu * s + gate * gu * s (1 - s) has one add, which the compiler
  # may contract into an FMA in one fusion and not in the other. Between a
  # contracted and an uncontracted evaluation: one product rounding
  # (u |product|) and the two final roundings (2u |sum|), u = 2^-24, so at
  # most 3u (|gu s| + |t|); 4u leaves room for the float64 terms' own
  # error. A bf16 result may then round to either neighbour: one bf16 ulp.
  gate, up = (np.asarray(h[..., :48], np.float64),
              np.asarray(h[..., 48:], np.float64))
  s = 1 / (1 + np.exp(-gate))
  gu = np.asarray(g, np.float64) * up
  tol = 4 * 2.0**-24 * (np.abs(gu * s) + np.abs(gate * gu * s * (1 - s)))
  if dtype == jnp.bfloat16:
    tol += np.spacing(np.abs(dh_ref[..., :48]).astype(np.float32)).astype(
        np.float64) * 2**16  # bf16 spacing = FP32 spacing x 2^16.
  assert np.all(np.abs(dh[..., :48] - dh_ref[..., :48]) <= tol)


def test_swiglu_keeps_only_its_input_for_the_backward():
  from models.gpt import swiglu  # pylint: disable=g-import-not-at-top
  from jax.ad_checkpoint import print_saved_residuals  # pylint: disable=g-import-not-at-top
  import contextlib, io  # pylint: disable=g-import-not-at-top,g-multiple-import

  def saved(f):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
      print_saved_residuals(lambda h: f(h).astype(jnp.float32).sum(),
                            jnp.ones((2, 16, 64), jnp.bfloat16))
    return [l.split()[0] for l in buf.getvalue().splitlines()
            if "from the argument" not in l]
  # Autodiff of the plain expression keeps FP32 intermediates of the
  # sigmoid ([2, 16, 32] each); `swiglu` recomputes them from its bf16 input.
  assert any(r.startswith("f32[2,16,32]") for r in saved(_swiglu_autodiff))
  assert saved(swiglu) == []  # Its input h itself, nothing computed.


def test_swiglu_backward_is_one_elementwise_expression():
  # `dh`'s halves come from one select over a [..., 2, F] view: a
  # concatenate of separately computed halves compiled to four passes over
  # `dh` on the H100 (BENCHMARKS.md).
  from models.gpt import swiglu  # pylint: disable=g-import-not-at-top
  h = jnp.ones((2, 16, 64), jnp.bfloat16)
  g = jnp.ones((2, 16, 32), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(lambda h, g: jax.vjp(swiglu, h)[1](g))(h, g)

  def prims(j):  # Primitive names, nested jaxprs (jnp's jit) included.
    for e in j.eqns:
      yield e.primitive.name
      for v in e.params.values():
        v = getattr(v, "jaxpr", v)
        if hasattr(v, "eqns"):
          yield from prims(v)
  names = set(prims(jaxpr.jaxpr))
  assert "select_n" in names and "concatenate" not in names, names


def test_swiglu_interleaved_blocks_equal_the_halves_permuted():
  """`swiglu(h, block)` (gate and up alternating in blocks of `block`
  columns) is `swiglu` of the halves, forward and backward, bit for bit:
  the same FP32 operations per element, only the columns' order moved."""
  from models.gpt import swiglu  # pylint: disable=g-import-not-at-top
  f, b = 64, 16
  rng = np.random.default_rng(4)
  h = (rng.standard_t(3.0, (2, 8, 2 * f)) * 4).astype(np.float32)
  g = rng.standard_t(3.0, (2, 8, f)).astype(np.float32)
  # Column j of the interleaved `hi` is column perm[j] of the halves `h`.
  perm = np.arange(2 * f).reshape(2, f // b, b).transpose(1, 0, 2).ravel()

  @jax.jit
  def both(h, hi, g):
    y, vjp = jax.vjp(swiglu, h)
    yi, vjpi = jax.vjp(lambda hi: swiglu(hi, b), hi)
    return y, vjp(g)[0], yi, vjpi(g)[0]
  y, dh, yi, dhi = both(h, h[..., perm], g)
  np.testing.assert_array_equal(yi, y)
  np.testing.assert_array_equal(dhi, np.asarray(dh)[..., perm])
  with pytest.raises(ValueError, match="multiple of block=16"):
    swiglu(h[..., :40], b)


def test_gpt_layouts_compute_the_same_model():
  """A GPT whose fused kernels are converted between the "concatenated"
  and "interleaved" layouts (`convert_fused_layout`) computes the same
  logits with NVFP4 layers (the permutation moves whole 16-column tiles,
  so every quantized weight tile keeps its contents; the activations'
  1x16 blocks run along `in`, which does not move). Equal to XLA:CPU's
  GEMMs' per-output-column sums, which do not depend on the columns'
  order: bit for bit here. A model applied to the other layout's
  parameters unconverted computes another function."""
  from models import convert_fused_layout  # pylint: disable=g-import-not-at-top
  cfg = GPTConfig(d_model=64, num_layers=1, num_heads=2, d_ff=64,
                  fused_layout="concatenated")
  new = cfg.replace(fused_layout="interleaved")
  rules = nv.PrecisionRules(default=nv.Recipe.nvfp4())
  params = _init(cfg)
  conv = convert_fused_layout(params, cfg, "concatenated", "interleaved")
  a = _apply_jit(params, rules, TOKENS, cfg)
  b = _apply_jit(conv, rules, TOKENS, new)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(_apply_jit(params, rules, TOKENS, new), a)
  assert (conv["block_0"]["attn"]["qkv"]["kernel"].shape
          == params["block_0"]["attn"]["qkv"]["kernel"].shape)
  with pytest.raises(ValueError, match="fused_layout"):
    GPTConfig(fused_layout="heads")
