"""A GPT train step on DP, FSDP, TP and a mixed mesh against one device,
and what the sharded step communicates."""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import nvfp4_jax as nv
from nvfp4_jax import sharding as shd
from mesh_checks.common import U, mesh


# Block 0 in NVFP4, block 1 with a BF16 forward (the late switch's "forward"
# mode): quantized and high-precision GEMMs both run sharded.
GPT = dict(d_model=64, num_layers=2, num_heads=2, d_ff=64)
GPT_RULES = ((r"block_1/", "bf16_forward"),)
GPT_MESHES = {"dp": dict(data=8), "fsdp": dict(data=2, fsdp=4),
              "tp": dict(data=4, model=2),
              "mixed": dict(data=2, fsdp=2, model=2)}


def gpt_trainer(mesh_sizes, gpt_rules=GPT_RULES, train=None, **gpt):
  import train.loop as loop  # pylint: disable=g-import-not-at-top
  from models import preset  # pylint: disable=g-import-not-at-top
  from tiny_training import small_corpus  # pylint: disable=g-import-not-at-top
  from train.config import TrainConfig  # pylint: disable=g-import-not-at-top
  rules = nv.PrecisionRules(rules=tuple(
      (p, nv.Recipe.from_name(r)) for p, r in gpt_rules))
  cfg = TrainConfig(preset="tiny", precision="nvfp4", steps=8, batch_size=8,
                    seq_len=16, lr=3e-3, warmup_steps=1, eval_every=8,
                    ckpt_every=8, eval_batches=1, diagnostics=False,
                    **(train or {}))
  real = loop.make_rules
  loop.make_rules = lambda cfg, n: rules
  try:
    return loop.Trainer(cfg, small_corpus(), preset("tiny", **dict(GPT, **gpt)),
                        mesh=None if mesh_sizes is None else
                        mesh(**mesh_sizes))
  finally:
    loop.make_rules = real


def _capture(trainer):
  """A jitted `(params, batch, step) -> (loss, {layer: (input, output)},
  {layer: output cotangent})` on one device, with flax interceptors (a zero
  perturbation added to each output yields its cotangent)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from train.step import cross_entropy  # pylint: disable=g-import-not-at-top
  fns = trainer.fns
  kinds = (nv.NVFP4Dense, nn.Dense, nn.Embed, nn.RMSNorm)

  def run(perturb, params, mb, step):
    key = jax.random.fold_in(jax.random.fold_in(fns._sr_key, step), 0)  # pylint: disable=protected-access
    rec = {}

    def icpt(next_fun, args, kwargs, ctx):
      y = next_fun(*args, **kwargs)
      if ctx.method_name == "__call__" and isinstance(ctx.module, kinds):
        path = "/".join(ctx.module.scope.path)
        rec[path] = (args[0], y)
        if perturb is not None:
          y = y + perturb[path]
      return y
    with nn.intercept_methods(icpt):
      logits = fns.forward(params, mb[:, :-1], step, key)
    return cross_entropy(logits, mb[:, 1:]), rec

  @jax.jit
  def capture(params, batch, step):
    shapes = jax.eval_shape(lambda: run(None, params, batch[0], step)[1])
    zeros = {p: jnp.zeros(y.shape, y.dtype) for p, (_, y) in shapes.items()}
    (loss, rec), dys = jax.value_and_grad(run, has_aux=True)(
        zeros, params, batch[0], step)
    return loss, rec, dys
  return capture


def _term_sums(trainer, capture, params, batch, step):
  """`S = sum_t |tau_t|` for every gradient entry, where `tau_t` is token
  t's term of the sum over the batch's N tokens that the gradient is (for
  an NVFP4 Wgrad, an upper bound: its terms are products of quantized
  RHT'd operands, each at most 17/16 of its 16-token block's max, E4M3
  scale rounding included), from each layer's captured input, output and
  output cotangent (which holds the loss mean's 1/N)."""
  loss, rec, dys = capture(params, batch, step)
  sums, flips = {}, {}
  for path, (x, y) in rec.items():
    dy = np.abs(np.asarray(dys[path], np.float64).reshape(-1, y.shape[-1]))
    if path == "embed":
      table = np.zeros(_get(params, path)["embedding"].shape)
      np.add.at(table, np.asarray(x).reshape(-1), dy)
      sums[f"{path}/embedding"] = table
      continue
    xa = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    if path.endswith("norm"):
      scale = np.asarray(_get(params, path)["scale"], np.float64)
      ya = np.asarray(y, np.float64).reshape(-1, y.shape[-1])
      sums[f"{path}/scale"] = np.sum(np.abs(ya / scale) * dy, axis=0)
      flip = _dgrad_flip(trainer, params, rec, dys, path, ya / scale)
      if flip is not None:
        flips[f"{path}/scale"] = flip
      continue
    recipe = trainer.rules.recipe_at(path)
    if path.startswith("block") and recipe.gemm_format("wgrad") == "nvfp4":
      def block_max(z):  # [features, tokens] -> max over 16-token blocks
        z = np.abs(np.asarray(z, np.float64))
        f, t = z.shape
        return np.repeat(z.reshape(f, t // 16, 16).max(-1), 16, axis=1)
      a = block_max(nv.rht(jnp.asarray(xa.T, jnp.float32)))
      b = block_max(nv.rht(jnp.asarray(dy.T, jnp.float32)))
      sums[f"{path}/kernel"] = (17 / 16) ** 2 * (1 + 2.0 ** -10) * (a @ b.T)
      # One operand code that crossed a rounding boundary (see
      # `check_gpt_step`) moves one term by at most the gap between two
      # neighbouring E2M1 values, 2 scales <= (17/16) x its block's max / 3,
      # times its partner (<= 17/16 of the partner's block max).
      flips[f"{path}/kernel"] = ((17 / 16) ** 2 * (1 + 2.0 ** -10) / 3 *
                                 np.max(a[:, None, :] * b[None, :, :], -1))
    else:
      sums[f"{path}/kernel"] = np.abs(xa).T @ dy
  return float(loss), sums, flips


# The NVFP4 layer each norm's output feeds (`models.gpt.Block`).
_NORM_CONSUMERS = {"attn_norm": "attn/qkv", "mlp_norm": "mlp/up"}


def _dgrad_flip(trainer, params, rec, dys, path, xhat):
  """The most one flipped code of an NVFP4 Dgrad's output cotangent moves
  one term of the gradient of the norm scale whose output that layer reads
  (None where there is none, or its Dgrad is not NVFP4).

  The norm scale's gradient is `sum_t xhat[t, i] dX[t, i]` with `dX = dY_q
  W_q` the layer's Dgrad. A value of `dY` that the step reorders by its few
  ulp can land on the other side of its stochastic-rounding threshold (as
  in a Wgrad, `_term_sums`), which moves `dY_q[t, o]` by at most the gap
  between two neighbouring E2M1 values, 2 scales <= (17/16) x its 16-value
  block's max / 3 (E4M3 scale rounding included), and so token t's term by
  that times `|W_q[o, i]|` (<= (17/16)(1 + 2^-10) x the max of its 16x16
  tile of W) times `|xhat[t, i]|`: at most the max of that product over t
  and o. (Seen on the H200 host's CPU at `block_1/mlp_norm/scale`, none on
  this project's 2-core machines.)"""
  block, _, name = path.rpartition("/")
  consumer = f"{block}/{_NORM_CONSUMERS.get(name, '')}"
  if (consumer not in rec or trainer.rules.recipe_at(consumer).gemm_format(
      "dgrad") != "nvfp4"):
    return None
  dy = np.abs(np.asarray(dys[consumer], np.float64))
  dy = dy.reshape(-1, dy.shape[-1])
  t, out = dy.shape
  bmax = np.repeat(dy.reshape(t, out // 16, 16).max(-1), 16, axis=1)
  w = np.abs(np.asarray(_get(params, consumer)["kernel"], np.float64))
  k = w.shape[0]  # [in, out]
  tmax = np.repeat(np.repeat(w.reshape(k // 16, 16, out // 16, 16).max(
      (1, 3)), 16, axis=0), 16, axis=1)
  gap = (17 / 16) / 3 * bmax                              # [t, out]
  wq = (17 / 16) * (1 + 2.0**-10) * tmax                  # [in, out]
  move = np.abs(xhat)[:, :, None] * gap[:, None, :] * wq[None, :, :]
  return move.max(axis=(0, 2))


def _get(tree, path):
  for part in path.split("/"):
    tree = tree[part]
  return tree


def _flat(tree):
  return {"/".join(str(k.key) for k in kp): np.asarray(g, np.float64)
          for kp, g in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _within(what, loss, grads, ref, factor):
  """|loss - ref loss| and every |g - ref g| within `factor` x their
  per-token term sums, plus, in an NVFP4 Wgrad and in a norm scale an
  NVFP4 Dgrad reads, one flipped operand code per entry (counted); returns the worst ratio to the bound and the number
  of entries that needed the flip."""
  loss0, grads0, sums, flips = ref
  dl = abs(float(loss) - loss0)
  assert dl <= factor * loss0, (what, dl)  # S = N * loss, and loss is / N.
  worst, flipped = dl / (factor * loss0), 0
  for path, g in _flat(grads).items():
    err = np.abs(g - grads0[path])
    bound = factor * sums[path]  # The cotangents hold the mean's 1/N.
    over = err > bound
    if path in flips:
      flipped += int(np.sum(over))
      bound = bound + np.where(over, flips[path], 0)
    assert np.all(err <= bound), (what, path, float(np.max(err - bound)))
    worst = max(worst, float(np.max(
        np.where(over, 0, err) / np.maximum(factor * sums[path], 1e-45))))
  return dl, worst, flipped


def assert_step_collectives(name, compiled):
  """What the sharded step communicates. Inside the NVFP4 layers (their
  `nvfp4_layer[...]` name scopes in the HLO metadata) every all-gather
  moves quantized weight bytes (uint8), except the weight of a GEMM the
  recipe keeps in BF16: no activation is gathered, and no weight travels
  in high precision for a quantized GEMM; the other
  collectives there are amax maxima (uint32) and FP32 sums (row-parallel
  outputs, column-parallel input gradients, weight gradients), and with
  the collective matmul the rings' collective-permutes of quantized
  operands and FP32 partial sums. Outside
  them XLA partitions the high-precision parts itself: it gathers the
  head's weight, and the embedding's lookup and scatter over a
  vocabulary-split table move token ids and the (small) output gradient.
  Inside the GPT's attention and MLP, nothing is resharded with tensor
  parallelism either (`block_reshards`, checked by `check_gpt_step`)."""
  cs = [c for c in shd.collectives(compiled) if not c.trivial]
  inside = [c for c in cs if "nvfp4_layer[" in c.line]
  for c in inside:
    tag = re.search(r"nvfp4_layer\[[^|]*\|([^\]]*)\]", c.line).group(1)
    if c.op == "all-gather":
      # Only a GEMM the recipe keeps in BF16 gathers its weight unquantized.
      assert set(c.dtypes) == {"u8"} or "=bf16" in tag, (name, c.line)
    elif c.op == "collective-permute":
      # The collective matmul's rings: quantized operands (u8) and FP32
      # partial sums (a GEMM kept in BF16: its own dtype).
      assert set(c.dtypes) <= {"u8", "f32"} or "=bf16" in tag, (name,
                                                                 c.line)
    else:
      assert c.op in ("all-reduce", "reduce-scatter"), (name, c.line)
      assert set(c.dtypes) <= {"u32", "f32"}, (name, c.line)
  summary = {"NVFP4 layers": {}, "elsewhere": {}}
  for c in cs:
    where = summary["NVFP4 layers" if c in inside else "elsewhere"]
    key = f"{c.op} {'/'.join(sorted(set(c.dtypes)))}"
    where[key] = where.get(key, 0) + c.result_bytes
  for where, d in summary.items():
    print(f"    {where}, bytes per device: {d}")


def block_reshards(compiled, params):
  """The collectives XLA adds inside a GPT block's attention or MLP
  (op names under `/attn/` or `/mlp/`) to reshard activations: every
  all-to-all and collective-permute there, and every all-gather outside
  the NVFP4 layers whose results are not whole parameters (a weight
  gathered over `fsdp` before use). Inside the layers every all-gather is
  a weight's (`assert_step_collectives`). With the fused `qkv`
  and `[gate, up]` columns laid out "interleaved" (`GPTConfig.fused_layout`)
  a contiguous split over `model` gives each device whole heads and
  matching gate and up columns: the list is empty. With the
  "concatenated" layout XLA reshards q, k, v to heads and the MLP's halves
  (all-to-all, collective-permute, gathers of the hidden activations)."""
  shapes = {tuple(x.shape) for x in jax.tree.leaves(params)}
  out = []
  for c in shd.collectives(compiled):
    name = re.search(r'op_name="([^"]*)"', c.line)
    name = name.group(1) if name else ""
    if c.trivial or not re.search(r"/(attn|mlp)/", name):
      continue
    if c.op == "collective-permute" and "nvfp4_layer[" in name:
      continue  # A collective matmul's ring (`assert_step_collectives`).
    if c.op in ("all-to-all", "collective-permute"):
      out.append(f"{c.op} {c.dtypes} {name}")
    elif (c.op == "all-gather" and "nvfp4_layer[" not in name
          and not all(s in shapes for _, s in c.results)):
      out.append(f"{c.op} {c.dtypes} {c.results} {name}")
  return out


def assert_weights_gathered(name, compiled, params):
  """XLA's own partition of a step's high-precision parts moves weights,
  not activations: every all-gather's results are whole parameters (the
  FSDP gather of a weight before use), and nothing is exchanged all-to-all.
  Left to itself XLA gathers the whole batch's output gradients (and token
  ids) to compute each FSDP shard's weight gradient, and reshards the
  norms' activations all-to-all (`training.dot_general._gathered_weight`,
  `MeshRules.gathered`)."""
  shapes = {tuple(np.shape(x)) for x in jax.tree.leaves(params)}
  cs = [c for c in shd.collectives(compiled) if not c.trivial]
  for c in cs:
    assert c.op != "all-to-all", (name, c.line)
    if c.op == "all-gather":
      assert all(s in shapes for _, s in c.results), (name, c.line)
  print(f"    {name}: {sum(c.op == 'all-gather' for c in cs)} all-gathers, "
        f"all of whole parameters; no all-to-all")


def check_gpt_step(names=("dp", "mixed"), resume=True, gpt_rules=GPT_RULES,
                   train=None):
  """One train step from the same state and batch on meshes `names` (here
  the data-parallel one and the mixed one, which splits along all three
  axes; `check_gpt_step_fsdp_tp` runs the pure FSDP and tensor-parallel
  ones), and a mesh checkpoint resumed on one device and on another mesh.

  Tolerance (first order in u = 2^-24). The sharded step reorders FP32 sums
  of two kinds: over the N tokens of the batch (every gradient, the loss
  mean) and over features inside each token's computation (a row-parallel
  GEMM, a column-parallel Dgrad, and XLA:CPU's reductions, which it compiles
  differently for fewer rows per device: RMSNorm's outputs move by 1-2 ulp).
  A gradient entry is `g = sum_t tau_t`; reordering the token sum moves it by
  at most `2 (N - 1) u S` with `S = sum_t |tau_t|` (captured, `_term_sums`).
  Each term is a product of per-token values, each the result of a chain of
  feature sums of at most `F` terms (F = the widest feature axis, the
  vocabulary): to first order each sum moves a value by at most `2 F u`
  times its magnitude (terms of one sign, the worst case), so `tau_t` moves
  by at most `2 D F u |tau_t|` with D the number of such sums along a
  token's path (6 per block, 3 for the embedding, final norm, head and loss;
  twice for the backward pass). Hence `|g_mesh - g_one| <= 2 u ((N - 1) +
  D F) S`, and the same for the loss (a mean of N non-negative
  cross-entropies: `S = N * loss`). Quantized operands carry no error term:
  they are bit for bit equal (tests of the quantizers and of dot_general)
  unless a value crossed a rounding boundary: an operand of a Wgrad's
  stochastic rounding that moved by its few ulp above can land on the other
  side of its random threshold. Such an entry of an NVFP4 Wgrad may exceed
  the bound by one code's change (`_term_sums`), and so may an entry of a
  norm scale whose output an NVFP4 Dgrad reads, through that Dgrad's
  stochastic rounding (`_dgrad_flip`); the check counts them (seen: none
  on one x86 CPU, a few on another, and one norm-scale entry on the H200
  host's). Elsewhere a crossing would fail the check: none happens here.
  """
  import tempfile  # pylint: disable=g-import-not-at-top
  from train.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  one = gpt_trainer(None, gpt_rules)
  state = one.init_state()
  batches = [one.batcher.batch(s).reshape(1, one.cfg.micro_batch, -1)
             for s in (0, 1)]
  n = batches[0].shape[1] * (batches[0].shape[2] - 1)
  depth = 2 * (6 * GPT["num_layers"] + 3)
  factor = 2 * U * ((n - 1) + depth * 256)
  capture = _capture(one)
  grads_fn = jax.jit(one.fns.loss_and_grads)

  def reference(st, step):
    loss, grads = grads_fn(st.params, batches[step], step)
    loss_c, sums, flips = _term_sums(one, capture, st.params, batches[step],
                                     step)
    assert loss_c == float(loss), (loss_c, float(loss))
    return float(loss), _flat(grads), sums, flips
  t0 = time.perf_counter()
  ref0 = reference(state, 0)
  print(f"  one device: loss {ref0[0]:.7f} ({time.perf_counter() - t0:.1f}s"
        f"); tolerance 2u((N-1) + D F) = {factor:.2e} x S with N={n}, "
        f"D={depth}, F=256")
  for path, flip in ref0[3].items():
    if path.endswith("norm/scale"):
      print(f"    {path}: one flipped Dgrad code moves an entry by at most "
            f"{flip.max():.2e} (bound {factor * ref0[2][path].max():.2e})")
  meshes = {}
  for name in names:
    sizes = GPT_MESHES[name]
    t0 = time.perf_counter()
    tr = gpt_trainer(sizes, gpt_rules, train=train)
    if name == "mixed":
      st = tr.init_state()
      for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)  # Every mesh starts alike.
    else:
      st = jax.device_put(state, tr.state_shardings)
    fn = jax.jit(tr.fns.loss_and_grads).lower(
        st.params, tr.put_batch(batches[0]), st.step).compile()
    meshes[name] = (tr, fn)
    loss, grads = fn(st.params, tr.put_batch(batches[0]), st.step)
    dl, worst, flipped = _within(name, loss, grads, ref0, factor)
    print(f"  {name} {sizes}: |dloss| {dl:.2e}, within {100 * worst:.1f}% "
          f"of the bound, {flipped} entries with a flipped code "
          f"({time.perf_counter() - t0:.1f}s)")
    assert_step_collectives(name, fn)
    reshards = block_reshards(fn, st.params)
    assert not reshards, (name, reshards[:4])
    if (train or {}).get("sequence_parallel"):
      # Activations are gathered and scattered over `model` by design (by
      # the collective matmul's rings inside the NVFP4 layers); XLA
      # exchanges nothing else.
      moved = {c.op for c in shd.collectives(fn) if not c.trivial
               and not (c.op == "collective-permute"
                        and "nvfp4_layer[" in c.line)}
      assert not moved & {"all-to-all", "collective-permute"}, (name, moved)
    elif gpt_rules is GPT_HIGH_PRECISION:
      assert_weights_gathered(name, fn, st.params)
  if not resume:
    return

  # A trained state, checkpointed on one device and resumed on two meshes:
  # the restored state is bit for bit the saved one (resharded), and the
  # next step agrees as above.
  t0 = time.perf_counter()
  trained, _ = jax.jit(one.fns.train_step)(state, batches[0])
  saved = jax.device_get(trained)
  with tempfile.TemporaryDirectory() as tmp:
    ckpt = Checkpointer(tmp)
    ckpt.save(1, trained, {"run": "one device"})
    resumed = {name: ckpt.restore(1, meshes[name][0].abstract_state())[0]
               for name in ("mixed", "dp")}
    # And back: the mixed mesh's (sharded) state onto one device.
    ckpt.save(2, resumed["mixed"], {"run": "mesh"})
    back, _ = ckpt.restore(2, one.abstract_state())
    ckpt.close()
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(np.asarray(a), b)
  # The fused kernels' layout conversion (`--resume` of a checkpoint of the
  # old layout) on the mixed mesh's sharded state: each array keeps its
  # sharding and equals the host conversion.
  from models import convert_fused_layout  # pylint: disable=g-import-not-at-top
  mcfg = meshes["mixed"][0].model_cfg
  conv = convert_fused_layout(resumed["mixed"], mcfg, "concatenated",
                              "interleaved")
  host = convert_fused_layout(saved, mcfg, "concatenated", "interleaved")
  for a, b, c in zip(jax.tree.leaves(conv), jax.tree.leaves(host),
                     jax.tree.leaves(resumed["mixed"])):
    np.testing.assert_array_equal(np.asarray(a), b)
    assert a.sharding.is_equivalent_to(c.sharding, a.ndim), (a.sharding,
                                                            c.sharding)
  ref1 = reference(trained, 1)
  for name, st in resumed.items():
    for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(saved)):
      np.testing.assert_array_equal(np.asarray(a), b)
    tr, fn = meshes[name]
    master = st.opt_state.master["block_0"]["mlp"]["up"]["kernel"]
    assert master.sharding.is_equivalent_to(NamedSharding(
        tr.mesh_rules.mesh, tr.mesh_rules.param_spec(
            "block_0/mlp/up/kernel", master.shape)), 2), master.sharding
    loss, grads = fn(st.params, tr.put_batch(batches[1]), st.step)
    dl, worst, flipped = _within(f"resumed on {name}", loss, grads, ref1,
                                 factor)
    print(f"  step 2 resumed on {name}: |dloss| {dl:.2e}, within "
          f"{100 * worst:.1f}% of the bound, {flipped} entries with a flipped"
          f" code; FP32 master of mlp/up split "
          f"{master.sharding.spec}, {master.addressable_shards[0].data.shape}"
          f" per device of {master.shape}")
  print(f"  checkpoint resharded ({time.perf_counter() - t0:.1f}s)")


GPT_HIGH_PRECISION = ((r".*", "bf16"),)


def tp_block_reshards(**gpt):
  """`block_reshards` of the gradient of a one-block GPT (`gpt` overriding
  `GPT`'s fields), every projection in high precision, compiled (not run)
  on the tensor-parallel mesh `GPT_MESHES["tp"]`."""
  tr = gpt_trainer(GPT_MESHES["tp"], GPT_HIGH_PRECISION, num_layers=1, **gpt)
  st = jax.eval_shape(tr.fns.init_state)
  params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(
      s.shape, s.dtype, sharding=sh), st.params, tr.state_shardings.params)
  batch = jax.ShapeDtypeStruct(
      (1, tr.cfg.micro_batch, tr.cfg.seq_len + 1), jnp.int32,
      sharding=NamedSharding(tr.mesh_rules.mesh,
                             tr.mesh_rules.batch_spec(3, axis=1)))
  fn = jax.jit(tr.fns.loss_and_grads).lower(
      params, batch, jax.ShapeDtypeStruct((), jnp.int32)).compile()
  return block_reshards(fn, st.params)


def check_gpt_tp_layout():
  """The GPT's fused kernels on a tensor-parallel mesh (`data=4, model=2`),
  compiled only (one block, every projection in high precision: what
  happens between the layers is XLA's either way): with the "interleaved"
  layout (the default) XLA adds no collective inside attention or the MLP
  (`block_reshards`); with the "concatenated" layout of earlier versions
  the same check finds the reshards (all-to-all, collective-permute), so
  it fails where the layout does not split by heads. `check_gpt_step`
  runs the NVFP4 step on `model=2` and mixed meshes against one device."""
  for layout in ("interleaved", "concatenated"):
    t0 = time.perf_counter()
    reshards = tp_block_reshards(fused_layout=layout)
    kinds = sorted({r.split()[0] for r in reshards})
    print(f"  {layout}: {len(reshards)} reshards in attention and MLP "
          f"{kinds} ({time.perf_counter() - t0:.1f}s)")
    if layout == "interleaved":
      assert not reshards, reshards
    else:
      assert "all-to-all" in kinds or "collective-permute" in kinds, kinds


def check_gpt_step_high_precision_fsdp():
  """`check_gpt_step` on the FSDP mesh with every projection in high
  precision (XLA partitions the whole step): equal to one device within
  the same bound, and its collectives move weights, not activations
  (`assert_weights_gathered`)."""
  check_gpt_step(("fsdp",), resume=False, gpt_rules=GPT_HIGH_PRECISION)


def check_gpt_step_fsdp_tp():
  """`check_gpt_step` on the pure FSDP and tensor-parallel meshes."""
  check_gpt_step(("fsdp", "tp"), resume=False)


def check_gpt_step_sequence_parallel():
  """`check_gpt_step` on the tensor-parallel and mixed meshes with sequence
  parallelism (`TrainConfig(sequence_parallel=True)`; on the mixed mesh
  also with `collective_matmul=True`): within the same derived bound of
  one device. The compiled step reduce-scatters the
  row-parallel outputs and column-parallel input gradients over `model`
  instead of all-reducing them, and runs the norms on token shards: the
  RMSNorm's square-sum over features reads `[tokens / (data x model),
  d_model]` per device (`_norm_rows`)."""
  check_gpt_step(("tp", "mixed"), resume=False,
                 train={"sequence_parallel": True})
  # Every projection in high precision: XLA partitions the layers from the
  # sharding constraints (`dot_general._sequence_constraint`).
  check_gpt_step(("tp",), resume=False, gpt_rules=GPT_HIGH_PRECISION,
                 train={"sequence_parallel": True})
  # With the collective matmul's rings in the quantized layers.
  check_gpt_step(("mixed",), resume=False,
                 train={"sequence_parallel": True, "collective_matmul": True})
  sizes = GPT_MESHES["tp"]
  rows = {}
  for seq in (False, True):
    tr = gpt_trainer(sizes, train={"sequence_parallel": seq})
    st = tr.init_state()
    batch = tr.batcher.batch(0).reshape(1, tr.cfg.micro_batch, -1)
    fn = jax.jit(tr.fns.loss_and_grads).lower(
        st.params, tr.put_batch(batch), st.step).compile()
    rows[seq] = _norm_rows(fn, batch.shape[-1] - 1)
  per_device = 8 // sizes["data"]  # The trainer's batch of 8 sequences.
  assert rows == {False: per_device, True: per_device // sizes["model"]}, rows
  print(f"  tp: RMSNorm on {rows[False]} sequences per device, "
        f"{rows[True]} with sequence parallelism")


def _norm_rows(compiled, seq: int) -> int:
  """The sequences per device a compiled GPT step's first RMSNorm
  (`block_0/attn_norm`) computes on: the leading dimension of its 3-D FP32
  values `[batch, seq, d_model]` per device."""
  rows = set()
  for line in compiled.as_text().splitlines():
    name = re.search(r'op_name="([^"]*)"', line)
    shape = re.search(r"= f32\[(\d+),(\d+),(\d+)\]", line)
    if (name and shape and "block_0/attn_norm" in name.group(1)
        and int(shape.group(2)) == seq):
      rows.add(int(shape.group(1)))
  assert len(rows) == 1, rows
  return rows.pop()
