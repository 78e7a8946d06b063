"""train/: the jitted step, NaN skipping, schedules, diagnostics, outputs."""

import functools
import io
import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tqdm

import nvfp4_jax as nv
from train.diagnostics import tensor_stats
from train.diagnostics import with_diagnostics
from train import metrics
from train import report
from train.loop import Trainer
from train.metrics import read_metrics, select
from train.optim import wsd_schedule
from tiny_training import MODEL, config, small_corpus

def named_gemms(trainer: Trainer) -> dict[str, int]:
  state = trainer.init_state()
  batch = trainer.batcher.batch(0).reshape(
      trainer.cfg.grad_accum, trainer.cfg.micro_batch, -1)
  closed = jax.make_jaxpr(trainer.fns.train_step)(state, batch)
  text = str(closed)
  names = re.findall(r"name=(nvfp4_(?:fprop|dgrad|wgrad))\b", text)
  return {n: names.count(n) for n in set(names)} | {
      "switch": _precision_switches(closed.jaxpr)}


def _precision_switches(jaxpr) -> int:
  """Conds with one branch running an NVFP4 Fprop and the other none."""
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "cond":
      has = ["name=nvfp4_fprop" in str(b) for b in eqn.params["branches"]]
      count += len(has) == 2 and has[0] != has[1]
    for v in eqn.params.values():
      for j in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(j, "jaxpr", j)
        if hasattr(inner, "eqns"):
          count += _precision_switches(inner)
  return count


def test_tiny_training_loss_decreases_and_writes_outputs(tmp_path):
  trainer = Trainer(config(), small_corpus(), MODEL)
  result = trainer.run(tmp_path, progress=False)
  train = select(result.records, "train")
  losses = [r["loss"] for r in train]
  assert [r["step"] for r in train] == list(range(1, 25))
  # A behaviour threshold, not a rounding tolerance: the drop is 2.1 on CPU
  # and 2.5 on an H100.
  assert np.mean(losses[:3]) - np.mean(losses[-3:]) > 1.0, losses
  evals = select(result.records, "eval")
  assert [e["step"] for e in evals] == [8, 16, 24]
  assert evals[-1]["val_loss"] < evals[0]["val_loss"]
  assert result.final_val_loss == evals[-1]["val_loss"]
  assert result.skipped == 0 and all(r["finite"] for r in train)
  # Warmup-stable-decay learning rate, logged per step (computed in FP32: a
  # few roundings of 2^-24, well inside approx's relative 1e-6).
  lrs = [r["lr"] for r in train]
  assert lrs[0] == pytest.approx(1e-3) and lrs[2] == pytest.approx(3e-3)
  assert lrs[-1] < 3e-3 / 4
  # Diagnostics: every NVFP4Dense, flagged quantized as the paper rules say,
  # with plausible statistics (their arithmetic is tested exactly in
  # test_tensor_stats_flushed_and_saturated). A value flushes when it is
  # below about 1/24 of its 16-block's max: up to a third of the SwiGLU
  # outputs (mlp/down's input) are, of the attention outputs (attn/out's) a
  # handful of 16384 or none, varying with the platform; so flushing must show
  # somewhere, not in every layer.
  diag = select(result.records, "diag")[-1]["layers"]
  assert len(diag) == 16
  for path, stats in diag.items():
    assert stats["quantized"] == path.startswith("block_2/"), path
    assert 0 <= stats["x_flushed"] < 0.6 and 0 < stats["w_rel_err"] < 0.3
  assert max(stats["x_flushed"] for stats in diag.values()) > 0.05
  # Files for people and for resuming.
  for name in ("loss.png", "diagnostics.png"):
    assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
  assert json.loads((tmp_path / "config.json").read_text())["train"][
      "precision"] == "nvfp4"
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
      "16", "24"]
  assert read_metrics(tmp_path / "metrics.jsonl") == result.records


def test_train_step_quantizes_per_rules_and_switches_without_recompiling():
  corpus = small_corpus()
  gemms = named_gemms(Trainer(config(), corpus, MODEL))
  # block_2's four projections, each with its three quantized GEMMs.
  assert gemms["nvfp4_fprop"] == gemms["nvfp4_dgrad"] == 4
  assert gemms["nvfp4_wgrad"] == 4
  assert not any(k.startswith("nvfp4") for k in named_gemms(
      Trainer(config(precision="bf16"), corpus, MODEL)))
  # The late switch is a lax.cond on the traced step in each quantized layer.
  switched = named_gemms(Trainer(config(late_switch_step=10), corpus, MODEL))
  assert gemms["switch"] == 0 and switched["switch"] >= 4


def test_diagnostics_flag_layers_by_the_late_switch():
  """The diagnostics flag layers by what their forward GEMM runs at that
  step (quantized before the switch, not from it on)."""
  rules = Trainer(config(late_switch_step=4), small_corpus(), MODEL).rules
  stats = {"block_2/mlp/up": {}, "block_0/mlp/up": {}}
  assert report.diag_record(rules, stats, 3) == {
      "block_2/mlp/up": {"quantized": True},
      "block_0/mlp/up": {"quantized": False}}
  assert not report.diag_record(rules, stats, 4)["block_2/mlp/up"]["quantized"]


# The fast tier has the switch's mechanism (test_rules: the recipes before
# and after, one compilation) and its wiring into the trainer (above: a
# `cond` in each quantized layer); this is the two together, in the slow
# tier (the suite's time budget: three trainers compiled).
@pytest.mark.slow
def test_late_switch_moves_quantized_layers_to_bf16_from_its_step():
  corpus = small_corpus()
  trainers = {name: Trainer(config(**kw), corpus, MODEL) for name, kw in (
      ("nvfp4", {}), ("switched", dict(late_switch_step=4)),
      ("bf16", dict(precision="bf16")))}
  params = trainers["nvfp4"].init_state().params
  batch = trainers["nvfp4"].batcher.batch(0).reshape(1, 4, -1)
  fns = {name: jax.jit(t.fns.loss_and_grads) for name, t in trainers.items()}
  grads = {name: {step: f(params, batch, step)[1] for step in (3, 4)}
           for name, f in fns.items()}
  assert fns["switched"]._cache_size() == 1  # One compilation, both steps.
  # Steps before 4 run NVFP4 (with the same stochastic rounding), from step
  # 4 on BF16. Different programs need not agree bit for bit (a cond's branch
  # fuses differently, GPU reductions such as the embedding's scatter-add are
  # not deterministic, and a quantizer turns a rounding-level difference into
  # a whole FP4 step), so the switched gradient is placed by which recipe's
  # it is nearer: those two differ by ~3e-3 of the gradient's norm here (only
  # block_2 is quantized), its distance to the right one is ~4e-9 on XLA:CPU.
  dist = lambda a, b: float(optax.global_norm(jax.tree.map(jnp.subtract, a,
                                                           b)))
  at = lambda name, step: dist(grads["switched"][step], grads[name][step])
  assert at("nvfp4", 3) < at("bf16", 3)
  assert at("bf16", 4) < at("nvfp4", 4)


def test_non_finite_step_is_skipped_counted_and_not_applied():
  trainer = Trainer(config(), small_corpus(), MODEL)
  state = trainer.init_state()
  batch = trainer.batcher.batch(0).reshape(1, 4, 33)
  poisoned = jax.tree.map(lambda x: x, state.params)
  poisoned["head"]["kernel"] = poisoned["head"]["kernel"].at[0, 0].set(jnp.nan)
  state = state._replace(params=poisoned)
  before = jax.device_get(state)
  state, metrics = trainer.train_step(state, batch)
  assert not bool(metrics["finite"]) and np.isnan(float(metrics["loss"]))
  assert int(state.skipped) == 1 and int(state.step) == 1
  after = jax.device_get(state)
  # Parameters and optimizer state (master weights, Adam moments and count)
  # are exactly as before.
  jax.tree.map(np.testing.assert_array_equal, after.opt_state,
               before.opt_state)
  jax.tree.map(np.testing.assert_array_equal, after.params, before.params)
  master = nv.master_params(after.opt_state)
  assert np.all(np.isfinite(master["head"]["kernel"]))
  # A finite step afterwards is applied.
  state = state._replace(params=jax.tree.map(
      jnp.asarray, nv.master_params(after.opt_state)))
  state, metrics = trainer.train_step(state, batch)
  assert bool(metrics["finite"]) and int(state.skipped) == 1
  assert not np.array_equal(nv.master_params(state.opt_state)["head"]["kernel"],
                            master["head"]["kernel"])
  # The skip is a select per element, not a `lax.cond` around the update
  # (XLA kept a second copy of the state for the branches).
  step = jax.make_jaxpr(trainer.train_step)(state, batch).jaxpr
  body = step.eqns[0].params["jaxpr"].jaxpr if step.eqns[0].primitive.name in (
      "jit", "pjit") else step
  names = {e.primitive.name for e in body.eqns}
  assert "cond" not in names and "select_n" in names, names


# The modules that own the GPT's parameters; each acts token by token.
_TOKENWISE = (nn.Embed, nn.Dense, nn.RMSNorm, nv.NVFP4Dense)


def token_terms(fns, params, batch: jax.Array) -> dict[tuple, tuple]:
  """Each parameter-owning module's input and output cotangent, per token.

  Every parameter of the GPT belongs to a module that acts token by token
  (`_TOKENWISE`): its output at token t depends on its input `x_t` alone, so
  the gradient of a loss is `sum_t c_t` with token t's term
  `c_t = J(x_t)^T dy_t`, `dy_t` the loss's cotangent of the module's output
  at t: for a kernel the outer product `x_t dy_t^T`, for the embedding `dy_t`
  added to the row of token t, for an RMSNorm scale `x_t / rms(x_t) * dy_t`.

  Args:
    fns: the trainer's `StepFunctions`.
    params: the parameters.
    batch: int32 `[batch, seq_len + 1]`: one `fns.loss` over all its tokens.

  Returns:
    `{module path: (module, x [tokens, ...], dy [tokens, ...])}`, `dy`
    captured as the gradient of a zero added to the module's output.
  """
  modules = {}

  def loss(probes):
    inputs, outputs = {}, {}

    def intercept(next_fun, args, kwargs, context):
      m, y = context.module, next_fun(*args, **kwargs)
      if context.method_name != "__call__" or not isinstance(m, _TOKENWISE):
        return y
      modules[m.path] = m.clone(parent=None)
      inputs[m.path], outputs[m.path] = args[0], y
      return y if probes is None else y + probes[m.path]

    with nn.intercept_methods(intercept):
      return fns.loss(params, batch, 0, jax.random.key(0)), (inputs, outputs)

  @jax.jit
  def capture():
    shapes = jax.eval_shape(lambda: loss(None))[1][1]
    probes = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    dys, (xs, _) = jax.grad(loss, has_aux=True)(probes)
    tokens = lambda a: a.reshape(-1, *a.shape[2:])  # [batch, seq, ...]
    return jax.tree.map(tokens, xs), jax.tree.map(tokens, dys)

  xs, dys = capture()
  return {path: (modules[path], xs[path], dys[path]) for path in xs}


def term_sums(fns, params, terms1, terms2):
  """`sum_t |c1_t|`, `sum_t |c2_t|`, `sum_t |c1_t - c2_t|` per parameter.

  Args:
    fns: the trainer's `StepFunctions` (its rules apply the modules).
    params: the parameters.
    terms1, terms2: `token_terms` of two computations of one gradient, over
      the same tokens in the same order.

  Returns:
    Three FP32 trees shaped like `params` (missing a parameter that no
    `_TOKENWISE` module owns, which the caller's tree comparison catches).
  """
  @jax.jit
  def sums(arrays1, arrays2):
    out = ({}, {}, {})
    for path, (module, _, _) in terms1.items():
      own = functools.reduce(lambda tree, k: tree[k], path, params)

      def term(x_t, dy_t, module=module, own=own):
        with nv.precision_rules(fns.rules):
          _, vjp = jax.vjp(lambda p: module.apply({"params": p}, x_t[None]),
                           own)
        return vjp(dy_t[None])[0]

      def three(x1, dy1, x2, dy2, term=term):
        return jax.tree.map(
            lambda a, b: jnp.stack([jnp.abs(a), jnp.abs(b), jnp.abs(a - b)]),
            term(x1, dy1), term(x2, dy2))

      s = jax.vmap(three)(*arrays1[path], *arrays2[path])
      for i, tree in enumerate(out):
        node = functools.reduce(lambda t, k: t.setdefault(k, {}), path[:-1],
                                tree)
        node[path[-1]] = jax.tree.map(lambda v, i=i: v.sum(0)[i], s)
    return out

  arrays = lambda terms: {k: v[1:] for k, v in terms.items()}
  return sums(arrays(terms1), arrays(terms2))


def test_gradient_accumulation_matches_one_big_batch():
  # On XLA:CPU, whatever the machine's backend. The bound below takes each
  # path's per-token terms from a replay of it. XLA:CPU chooses its GEMMs by
  # shape, without autotuning, and there the replay's terms stay close to
  # the gradient's own (measured: |g1 - g2| is at most 1/40 of the bound).
  # A GPU picks GEMM algorithms per program and per machine: the replay is
  # then a looser proxy, and on one lent H100 of two the bound failed by
  # ~1e-12 with correct accumulation. What the test checks (the mean over
  # micro-batches, every micro-batch counted, the optimizer applied to it)
  # is the same JAX program on every backend.
  with jax.default_device(jax.local_devices(backend="cpu")[0]):
    _check_gradient_accumulation()


def _check_gradient_accumulation():
  corpus = small_corpus()
  cfg = config(precision="bf16", batch_size=8)
  # One block of MODEL: what accumulation must keep (the mean over the
  # micro-batches, the optimizer applied to it) does not depend on the depth,
  # and the bound below is derived per element from the model's own terms,
  # whatever the model (every parameter-owning module is still there: the
  # embedding, a block's norms, attention and MLP, the head).
  model = MODEL.replace(num_layers=1)
  one = Trainer(cfg, corpus, model)
  two = Trainer(cfg.replace(grad_accum=2), corpus, model)
  params = one.init_state().params
  batch = one.batcher.batch(0)
  # The bound below is for FP32 arithmetic: the model computes in FP32 ("bf16"
  # precision quantizes nothing), and FP32 matmuls must not run in TF32, as
  # they may by default on GPUs.
  assert model.dtype == "float32"
  with jax.default_matmul_precision("highest"):
    l1, g1 = jax.jit(one.fns.loss_and_grads)(params, batch.reshape(1, 8, -1),
                                             0)
    l2, g2 = jax.jit(two.fns.loss_and_grads)(params, batch.reshape(2, 4, -1),
                                             0)
    # Each path's per-token terms: the big batch's; the micro-batches', whose
    # loss is over 128 tokens, halved as the accumulation's mean halves them.
    big = token_terms(one.fns, params, batch)
    halves = [token_terms(one.fns, params, half) for half in (batch[:4],
                                                              batch[4:])]
    acc = {path: (module, jnp.concatenate([halves[0][path][1],
                                           halves[1][path][1]]),
                  jnp.concatenate([halves[0][path][2],
                                   halves[1][path][2]]) / 2)
           for path, (module, _, _) in big.items()}
    s1, s2, diff = term_sums(one.fns, params, big, acc)
    state, metrics = two.train_step(two.init_state(), batch.reshape(2, 4, -1))

  # What accumulation must preserve: the gradient. The loss is the mean of
  # T = 8 * 32 per-token terms; the big batch scales each by 1/256, the
  # accumulation by 1/128 and the sum of its two micro-batches by 1/2:
  # powers of two, exact in FP32. So both compute a sum over tokens of
  # per-token terms (`token_terms`), c1_t and c2_t, in different orders (one
  # reduction over 256 tokens vs two over 128 and an addition). The terms
  # themselves may differ by a few roundings too: the backward pass of a
  # sequence is not quite the same in a batch of 8 as in one of 4 (GEMM
  # kernels and blocking are chosen by shape). A sum of T products in any
  # order is within gamma_T * sum_t |c_t| of its exact value (Higham,
  # Accuracy and Stability of Numerical Algorithms, eq. (3.5); FP32 with
  # u = 2^-24, gamma_n = n u / (1 - n u)), so per element
  #   |g1 - g2| <= gamma_T (S1 + S2) + d,  S_i = sum_t |c_i_t|,
  #                                        d = sum_t |c1_t - c2_t|.
  # s1, s2 and diff compute S1, S2 and d in FP32 from each term's factors:
  # rounding each term's product moves d by at most u (S1 + S2), which
  # gamma_(T+1) >= gamma_T + u absorbs, and an FP32 sum of T nonnegative
  # values is at least (1 - gamma_T) times the exact one, which the division
  # undoes. The terms are captured from a replay of each path (the same loss
  # on the same shapes, plus zero probes), on XLA:CPU the terms inside
  # loss_and_grads (see the caller). Measured: |g1 - g2| is at most 1/40 of
  # the bound (d ~ 1e-3 of the first term); accumulation that forgets to
  # divide by the number of micro-batches, or drops one, exceeds it on nearly
  # every element.
  u, tokens = 2.0**-24, batch.shape[0] * (batch.shape[1] - 1)
  gamma = lambda n: n * u / (1 - n * u)
  bound = jax.tree.map(
      lambda a, b, d: (gamma(tokens + 1) * (np.float64(a) + np.float64(b))
                       + np.float64(d)) / (1 - gamma(tokens)), s1, s2, diff)
  assert jax.tree.structure(bound) == jax.tree.structure(g1)
  excess = jax.tree.map(
      lambda a, b, bd: np.abs(np.float64(a) - np.float64(b)) - bd,
      g1, g2, bound)
  assert max(float(e.max()) for e in jax.tree.leaves(excess)) <= 0, excess
  # The loss: a mean of T nonnegative per-token terms, the same argument
  # with the per-token losses as the terms.
  forward = jax.jit(one.fns.forward)
  logits = lambda b: forward(params, b[:, :-1], 0, jax.random.key(0))
  per_token = lambda lg, b: optax.softmax_cross_entropy_with_integer_labels(
      lg, b[:, 1:]) / tokens
  with jax.default_matmul_precision("highest"):
    t1 = per_token(logits(batch), batch)
    t2 = jnp.concatenate([per_token(logits(h), h) for h in (batch[:4],
                                                            batch[4:])])
  loss_bound = (gamma(tokens + 1) * (float(t1.sum()) + float(t2.sum()))
                + float(jnp.abs(t1 - t2).sum())) / (1 - gamma(tokens))
  assert abs(float(l1) - float(l2)) <= loss_bound
  # The step reports the mean loss: the same terms as l2, maybe added in
  # another order (another program).
  assert abs(float(metrics["loss"]) - float(l2)) <= loss_bound

  # And the step applies the optimizer to that gradient. The first AdamW
  # update of an element is -lr_0 * (m / (sqrt(v) + eps) + wd * p) with
  # m = g', v = g'^2 after bias correction (g' the clipped gradient, eps
  # optax's default; wd is 0 for vectors, and using it for every element only
  # loosens both bounds): at most lr_0 * (1 + wd |p|) in size; against the
  # gradient and at least lr_0 * (0.99 - wd |p|) where |g'| >= 99 eps. In
  # FP32 the dozen roundings of the update add a relative 16 u at most, and
  # adding it to the master at most u |p + update| <= 2 u |p'| (p' the new
  # value); the model's parameter lands within 2 u |p| of the new master
  # (`master_weights`). Both are checked.
  assert bool(metrics["finite"]) and int(state.skipped) == 0
  lr0, wd, eps = float(two.schedule(0)), cfg.weight_decay, 1e-8
  clip = min(1.0, cfg.clip_norm / float(optax.global_norm(g2)))
  state = jax.device_get(state)

  def check(p, q, g, bd):
    p, q, g = np.float64(p), np.float64(q), np.float64(g)
    step, decay = q - p, wd * np.abs(p)
    slack = 2 * u * (np.abs(p) + np.abs(q))
    assert np.all(np.abs(step) <= lr0 * (1 + decay) * (1 + 16 * u) + slack)
    # The step's own gradient is within `bd` of g (the same terms, maybe
    # summed in another order): where |g| > bd it has g's sign.
    sure = (clip * np.abs(g) >= 99 * eps) & (np.abs(g) > bd)
    assert sure.any()
    assert np.all(-np.sign(g[sure]) * step[sure] >= lr0 * (
        0.99 - decay[sure]) * (1 - 16 * u) - slack[sure])

  for new in (state.params, nv.master_params(state.opt_state)):
    jax.tree.map(check, jax.device_get(params), new, g2, bound)


def test_wsd_schedule():
  s = wsd_schedule(1.0, total=100, warmup=10, decay_fraction=0.2)
  lr = np.array([float(s(i)) for i in range(100)])
  # One FP32 rounding of a quotient: within 2^-24 < assert_allclose's
  # relative 1e-7.
  np.testing.assert_allclose(lr[:10], np.arange(1, 11) / 10)
  np.testing.assert_allclose(lr[10:80], 1.0)
  assert np.all(np.diff(lr[80:]) < 0) and lr[-1] == pytest.approx(1 / 20)


def test_tensor_stats_flushed_and_saturated():
  x = np.ones((16, 32), np.float32)
  x[0, :16] = 0.0
  x[0, 0] = 1000.0                   # Tensor amax: 1000, alone in its block.
  # Row 1, block 0: block amax 0.01 -> scale 0.01 * 2688 / 1000 / 6 = 0.00448,
  # subnormal in E4M3 (step 2^-9): rounds to 0.00390625, so 0.01 scales to
  # 6.88 (clipped to 6 but < 7: not saturated) and 0.0005 to 0.34 -> 0.5.
  x[1, :16] = 0.0005
  x[1, 0] = 0.01
  # Row 2, block 0: block amax 0.0065 -> 0.0029 rounds down to 2^-9:
  # 0.0065 scales to 8.9 > 7: saturated.
  x[2, :16] = 0.0065
  # Row 3, block 1: values below 1/4 of the block's FP4 step flush to zero.
  x[3, 16:] = 1.0
  x[3, 16:20] = 0.01
  s = jax.device_get(tensor_stats(jnp.asarray(x), block_2d=False))
  assert s["saturated"] == pytest.approx(1 / 32)
  assert s["flushed"] == pytest.approx(4 / np.count_nonzero(x))
  assert 0 < s["rel_err"] < 0.01
  w = jax.device_get(tensor_stats(jnp.asarray(x), block_2d=True))
  assert w["saturated"] == 0.0  # One tile holds 1000: no subnormal scales.


def test_progress_bar_shows_loss_tokens_per_second_and_eta(monkeypatch):
  now = [0.0]
  monkeypatch.setattr(tqdm.std, "time", lambda: now[0])  # tqdm's clock.

  class Terminal(io.StringIO):
    def isatty(self):
      return True

  log, tty = io.StringIO(), Terminal()
  for stream in (log, tty):
    bar = metrics.Progress(20, stream=stream, label="nvfp4 ")
    for step in range(1, 21):
      now[0] += 1.0 if step > 1 else 100.0  # Compiling, then 1 s per step.
      bar.update(step, 3.0 - 0.1 * step, 2048)
    bar.close()
  lines = log.getvalue().splitlines()
  assert 10 <= len(lines) <= 12  # About every 10% when not a terminal.
  assert "\r" not in log.getvalue()
  assert lines[0].startswith("nvfp4:   5%|")
  # Rates and the ETA leave out the first step (compilation).
  assert lines[5].endswith("11/20 [00:10<00:09, loss 1.9000, 2.05k tok/s]")
  assert lines[-1].endswith("20/20 [00:19<00:00, loss 1.0000, 2.05k tok/s]")
  out = tty.getvalue()
  assert out.count("\r") >= 20 and out.endswith("\n")  # Redrawn in place.
  assert out.rstrip().rsplit("\r", 1)[-1] == lines[-1]
  quiet = io.StringIO()
  bar = metrics.Progress(20, stream=quiet, enabled=False)
  bar.update(1, 1.0, 10)
  bar.close()
  assert quiet.getvalue() == ""


@pytest.mark.slow  # 5-15 s (its own compile on another worker): the suite's
# budget; the slow tier's two-process CLI run covers several processes.
def test_a_later_process_writes_no_run_files(tmp_path, monkeypatch):
  """In a multi-process run (`--distributed`) only the first process
  writes the metrics, config and plots (every process writes its shards
  of the checkpoints); a later one keeps its records in memory. (The
  program is the first test's: compiled once per suite. The two processes
  themselves run in the slow tier, `tests/sharding/test_mesh.py`.)"""
  import train.loop as loop  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(loop, "_first_process", lambda: False)
  result = Trainer(config(), small_corpus(), MODEL).run(tmp_path,
                                                        progress=False)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]
  assert result.loss_plot is None and result.diag_plot is None
  assert [r["step"] for r in select(result.records, "train")] == list(
      range(1, 25))
  assert [r["step"] for r in select(result.records, "eval")] == [8, 16, 24]
  assert result.final_val_loss == select(result.records, "eval")[-1][
      "val_loss"]


def test_diagnostics_quantize_one_layer_at_a_time():
  """The diagnostics loop over a shape's layers (`lax.map`): outside the loop
  no array of the stacked inputs' size is computed on, so the memory is the
  stacked inputs plus one layer's temporaries. A vmap held every layer's at
  once: 23.9 GiB a GPU for GPT base's evaluation at 16 x 1024 tokens (bf16,
  compiled for 4 H100s), which ran a 4-GPU run out of memory at its first
  evaluation; with the loop, 5.1 GiB.
  """
  trainer = Trainer(config(), small_corpus(), MODEL)
  params = trainer.init_state().params
  tokens = trainer.batcher.batch(0)[:, :-1]
  fn = with_diagnostics(lambda p, t: trainer.fns.forward(
      p, t, 0, jax.random.key(0)))
  jaxpr = jax.make_jaxpr(fn)(params, tokens).jaxpr
  layers, m = MODEL.num_layers, tokens.size
  # The stacked inputs of a shape: [layers, tokens, features].
  stacked = lambda e: any(
      getattr(v.aval, "shape", ())[:2] == (layers, m) for v in e.outvars)
  on_stacks = {e.primitive.name for e in jaxpr.eqns if stacked(e)}
  # Only their building (jnp.stack) makes them; the loop takes them in.
  assert on_stacks and on_stacks <= {"stack", "concatenate"}, on_stacks
  # One loop per kind of tensor (inputs, weights) and shape.
  assert sum(e.primitive.name == "scan" for e in jaxpr.eqns) >= 2
