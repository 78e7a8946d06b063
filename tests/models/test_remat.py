"""`GPTConfig(remat="quantized")`: blocks save only the quantized residuals;
`remat="full"`: only their inputs."""

import contextlib
import functools
import io
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import print_saved_residuals

import nvfp4_jax as nv
from models import GPT, preset

_BYTES = {"f32": 4, "bf16": 2, "u8": 1, "f8_e4m3fn": 1, "s32": 4, "u32": 4,
          "i32": 4, "bool": 1}


# The test model: blocks, MLP width, and a batch of sequences x tokens.
_LAYERS, _D_FF, _BATCH = 2, 352, (4, 64)


# The precision rules the tests use, by name. The parameters, gradients and
# residuals below are computed once and shared by the tests that ask for the
# same ones (the unrematerialized FP32 gradients and the quantized policy's
# residuals are each two tests' reference).
_RULES = {"nvfp4": nv.PrecisionRules,  # Every projection NVFP4.
          "high_precision": nv.PrecisionRules.high_precision}


def _model(remat, dtype):
  return GPT(preset("tiny", d_model=128, num_layers=_LAYERS, num_heads=2,
                    d_ff=_D_FF, dtype=dtype, remat=remat))


def _tokens():
  return jax.random.randint(jax.random.key(0), _BATCH, 0, 256)


@functools.cache
def _params(dtype="bfloat16"):
  """The parameters every policy's loss is evaluated at: the model's
  without rematerialization, initialized in high precision."""
  with nv.precision_rules(nv.PrecisionRules.high_precision()):
    return jax.jit(_model("none", dtype).init)(jax.random.key(0),
                                               _tokens()[:, :16])


def _loss(remat, rules, dtype="bfloat16"):
  model, tokens, rules = _model(remat, dtype), _tokens(), _RULES[rules]()

  def loss(p):
    with nv.precision_rules(rules, step=0):
      logits = model.apply(p, tokens, rngs={"nvfp4": jax.random.key(1)})
    return logits.astype(jnp.float32).mean()
  return loss


@functools.cache
def _residuals(remat, rules):
  """`(dtype, shape, description)` of the activations autodiff saves (bf16
  model) under policy `remat`, at `_params()`."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    print_saved_residuals(_loss(remat, rules), _params())
  out = []
  for line in buf.getvalue().splitlines():
    m = re.match(r"(\w+)\[([\d,]*)\]\s*(.*)", line)
    if m and "from the argument" not in line:
      shape = tuple(int(s) for s in m.group(2).split(",") if s)
      out.append((m.group(1), shape, m.group(3)))
  return tuple(out)


def _quantized(res):
  """The residuals of the NVFP4 layers' own program: saved by name
  (`nvfp4_residual`), which JAX describes as the name or, the layer being
  one jitted function shared by its blocks (`dot_general`'s `_layer`), as
  an output of that function."""
  return [r for r in res if "nvfp4_residual" in r[2]
          or "jitted function '_linear'" in r[2]]


def _bytes(res):
  return sum(_BYTES[d] * int(np.prod(s)) for d, s, _ in res)


@functools.cache
def _grads(remat, rules):
  """The FP32 model's gradients under policy `remat`, at `_params`."""
  return jax.jit(jax.grad(_loss(remat, rules, "float32")))(
      _params("float32"))


def _same_grads(rules, remat="quantized"):
  # FP32 model: recomputation changes XLA's fusions, and with bf16
  # activations XLA:CPU may keep a fused intermediate in FP32 in one program
  # and round it in the other; in FP32 both compute the same bits. On a GPU
  # XLA picks each program's GEMM algorithms and reduction tilings itself,
  # so two programs sum in different orders: the claim is checked on CPU.
  if jax.default_backend() != "cpu":
    return
  g0 = _grads("none", rules)
  g1 = _grads(remat, rules)
  chex.assert_trees_all_equal(g0, g1)  # Same ops, recomputed.


def test_quantized_remat_keeps_gradients_and_saves_only_fp4():
  _same_grads("nvfp4")
  none, quant = _residuals("none", "nvfp4"), _residuals("quantized", "nvfp4")
  named = _quantized(quant)
  # Per quantized layer: the Wgrad operand (codes, scales, amax) and the
  # 16x16 weight reused by Dgrad (codes, scales, amax).
  assert len(named) == 2 * 4 * 6
  assert {d for d, _, _ in named} == {"u8", "f8_e4m3fn", "f32"}
  others = [r for r in quant if r not in named]
  # Besides them: each block's bf16 input (the remat boundary) and what the
  # embedding and the head keep outside the blocks.
  blocks = [r for r in others if "Block" in r[2]]
  assert len(blocks) <= 2 and all(d == "bf16" for d, _, _ in blocks)
  # The attention, norms and MLP intermediates are recomputed, not kept:
  # at least each block's SwiGLU input `h` (bf16 [tokens, 2 d_ff], what
  # `models.gpt.swiglu` keeps without the policy) is gone, besides the
  # FP32 norm and rotary intermediates.
  tokens = int(np.prod(_BATCH))
  assert _bytes(none) - _bytes(quant) >= _LAYERS * tokens * 2 * _D_FF * 2, (
      _bytes(quant), _bytes(none))


def test_quantized_remat_saves_nothing_for_high_precision_layers():
  res = _residuals("quantized", "high_precision")
  assert not _quantized(res)
  _same_grads("high_precision")


def test_full_remat_keeps_gradients_and_saves_only_block_inputs():
  """`remat="full"`: NVFP4 blocks recompute their quantization too (the
  same values: the rounding keys are inputs), so the gradients are the
  unrematerialized ones bit for bit and a block keeps only its input, less
  than the `quantized` policy's FP4 residuals."""
  _same_grads("nvfp4", "full")
  full = _residuals("full", "nvfp4")
  quant = _residuals("quantized", "nvfp4")
  assert not _quantized(full)
  blocks = [r for r in full if "Block" in r[2]]
  assert blocks and all(d == "bf16" and s == (*_BATCH, 128)
                        for d, s, _ in blocks), blocks
  assert _bytes(full) < _bytes(quant), (_bytes(full), _bytes(quant))
