"""The mixture-of-experts layer's forward pass, framework-free: one device,
token shards, or expert parallel.

The linen and NNX modules (`nvfp4_jax.flax.moe`: `NVFP4MoE`, `NNXMoE`) hold
the router and the stacked expert kernels and run `moe_forward` here:

    routing     `nvfp4_jax.training.moe_routing`: top-k routing and its
                load-balancing loss, the dispatch of the token copies in
                expert order (capacity, the padded layout) and the combine.
    experts     h = silu(xs @ up[e][:, :H]) * (xs @ up[e][:, H:]),
                out = h @ down[e]: two grouped GEMMs, "experts/up" (gate
                and up fused, [E, D, 2H]) and "experts/down" ([E, H, D]).

Under `mesh_rules` with an `expert` mesh axis the layer runs expert parallel
(`moe_forward`): the token copies move between devices
(`nvfp4_jax.training.moe_exchange`) as `EXCHANGE` and `EXCHANGE_SLACK`
(module-level settings, read while tracing) choose.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from nvfp4_jax.core import spmd
from nvfp4_jax.ops.ragged_quantize.api import padded_length
from nvfp4_jax.sharding import current_rules
from nvfp4_jax.sharding.operands import explicit_mesh
from nvfp4_jax.training.moe_exchange import buffered_exchange
from nvfp4_jax.training.moe_exchange import cond_keeping_first_residuals
from nvfp4_jax.training.moe_exchange import ragged_exchange
from nvfp4_jax.training.moe_routing import GROUP_ALIGN
from nvfp4_jax.training.moe_routing import Routing
from nvfp4_jax.training.moe_routing import combine
from nvfp4_jax.training.moe_routing import dispatch
from nvfp4_jax.training.moe_routing import layout
from nvfp4_jax.training.moe_routing import route
from nvfp4_jax.training.moe_routing import router_logits


# How expert parallelism exchanges the token copies between devices:
# - "ragged": only the copies that exist (`jax.lax.ragged_all_to_all`),
#   one slice per expert straight into the receiver's padded layout;
# - "buffered": `jax.lax.all_to_all` of fixed-size buffers per peer
#   (`EXCHANGE_SLACK` times an even share of the copies where the routing
#   fits, else every copy a device could send each peer: then twice the
#   bytes that exist on two devices), then row gathers into the padded
#   layout;
# - "auto": "buffered" on GPUs, "ragged" elsewhere (TPUs have the ragged
#   collective; CPU devices build it from an all-gather).
# Why not "ragged" on GPUs: on one host, jax 0.11.2's XLA runs the ragged
# all-to-all as a peer-copy kernel (`RaggedAllToAllKernelImpl`) that moved
# `moe-small`'s exchange at ~10 GB/s (105 ms a step on 2 H100s: 0.17 of
# one GPU's throughput per GPU, against 0.55 buffered; BENCHMARKS.md,
# "Expert parallelism"); its NCCL form
# (`--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false
# --xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true`) hung,
# and `--xla_gpu_experimental_ragged_all_to_all_use_device_kernel=true`
# left the same kernel. Set "ragged" where XLA's collective is fast.
EXCHANGE = "auto"
_EXCHANGES = ("auto", "ragged", "buffered")
# The buffered exchange's fast path, opt-in: with a number (1.25: a
# quarter above an even share), each device sends each peer a buffer of
# `EXCHANGE_SLACK` times an even share of its copies (`T_local k / n`),
# and the experts run on `n` such buffers, when no device sends any peer
# more (checked on every device: a `cond` on the largest count, one
# `pmax`); otherwise the whole-buffer exchange runs. Balanced routing
# moves and computes on `slack / n` of the whole buffers. The `cond`
# keeps only the fast path's residuals (`cond_keeping_first_residuals`):
# the whole-buffer branch runs its forward again in the backward pass.
# None (the default): always whole buffers, no `cond`. Why not on by
# default: XLA:GPU runs each conditional by blocking the host on its
# predicate (two a MoE layer and step), and the one timed run of the fast
# path (before its residuals were fixed) was slower than whole buffers
# (BENCHMARKS.md, "Expert parallelism"). `EXCHANGE` and `EXCHANGE_SLACK`
# are read while tracing: set them before a step is first traced (JAX
# reuses its traces; `jax.clear_caches()` after a change).
EXCHANGE_SLACK = None


def exchange_for(platform: str) -> str:
  """The exchange `EXCHANGE` selects on devices of `platform` ("gpu",
  "cuda", "rocm", "tpu", "cpu"): "ragged" or "buffered"."""
  if EXCHANGE not in _EXCHANGES:
    raise ValueError(
        f"nvfp4_jax.training.moe.EXCHANGE = {EXCHANGE!r}: use one of "
        f"{', '.join(map(repr, _EXCHANGES))}.")
  if EXCHANGE != "auto":
    return EXCHANGE
  return "buffered" if platform in ("gpu", "cuda", "rocm") else "ragged"


def exchange_capacity(rows: int, n: int) -> int:
  """Rows per peer of the buffered exchange's fast path: `EXCHANGE_SLACK`
  times an even share of a device's `rows` copies (`rows` itself where
  that is no smaller, or `EXCHANGE_SLACK` is None)."""
  if EXCHANGE_SLACK is None:
    return rows
  if not EXCHANGE_SLACK > 0:
    raise ValueError(
        f"nvfp4_jax.training.moe.EXCHANGE_SLACK = {EXCHANGE_SLACK!r}: use a "
        "positive number (1.25: a quarter above an even share) or None.")
  return min(rows, max(1, math.ceil(rows / n * EXCHANGE_SLACK)))


def swiglu_experts(xs: jax.Array, group_sizes: jax.Array, gemm) -> jax.Array:
  """SwiGLU experts on sorted copies: `gemm(x, group_sizes, name)` runs each
  grouped GEMM ("up": gate and up fused, `[.., 2H]`; "down")."""
  h = gemm(xs, group_sizes, "up")
  gate, lin = jnp.split(h, 2, axis=-1)
  return gemm(jax.nn.silu(gate) * lin, group_sizes, "down")


# ----------------------------------------------------------------------------
# The layer's forward pass, one device or expert parallel.
# ----------------------------------------------------------------------------


def _experts(xs, group_sizes, weights, keys, gemms, first_expert=0,
             aligned=GROUP_ALIGN):
  """SwiGLU experts on sorted copies with the stacked `weights` (each group
  padded to `aligned` rows): `gemms["up"]`, `gemms["down"]` are the
  projections' grouped GEMMs, `gemm(x, w, group_sizes, *, key,
  first_expert, aligned)` (the layers' `nvfp4_jax.flax.moe.ExpertGemm`)."""
  return swiglu_experts(xs, group_sizes, lambda x, gs, n: gemms[n](
      x, weights[n], gs, key=keys[n], first_expert=first_expert,
      aligned=aligned))


def _local_experts(x, routing: Routing, top_k: int, weights, keys, gemms):
  """Every expert here on `x`'s routed copies (the padded layout): `(y,
  aux loss)`."""
  lay = layout(routing, top_k)
  out = _experts(dispatch(x, routing, top_k, lay), lay.group_sizes, weights,
                 keys, gemms)
  return combine(out, routing, top_k, lay), routing.aux_loss


def moe_forward(x, router, weights, keys, gemms, *, top_k: int,
                capacity_factor: float | None):
  """The MoE layer on tokens `x [T, D]`: `(y [T, D], aux loss)`.

  Without `mesh_rules` (or with mesh rules whose batch axes are all of
  size 1) every expert runs here, on the whole (XLA-partitioned) arrays.
  With batch axes (`data`, `fsdp`) and no `expert` axis, each token shard
  routes its own tokens to its own copy of the experts inside `shard_map`
  (a data-parallel micro-batch's numerics: each expert quantizes the
  shard's copies), so no token crosses devices; XLA partitioning the
  whole-batch sort and gathers instead all-reduced every layer's `[T k, D]`
  copies (2069 MiB a `moe-small` step on two devices against 149 now,
  compiled ahead of time). With an `expert` axis of
  `n` devices it runs expert parallel inside `shard_map`: each device routes
  its tokens, sends each copy to the device holding its expert
  (all-to-all), runs its `E / n` experts on the copies it receives (from
  every device of its expert group, in token order) and sends the outputs
  back. An expert then sees exactly the copies it sees on one device, in
  the same order, so its quantization is one device's bit for bit (amax,
  SR positions). `EXCHANGE` chooses how the copies move, and
  `EXCHANGE_SLACK` how large the buffered exchange's buffers are when the
  routing fits them (else every copy a peer could send: dropless, `n x
  T_local * k` rows); the passes over the received rows (the padded layout
  and back) are that long.
  """
  rules = current_rules()
  n = 1 if rules is None or rules.expert is None else rules.sizes[
      rules.expert]
  if rules is None or (n == 1 and spmd.num_shards(rules.sizes,
                                                  rules.batch) == 1):
    routing = route(router_logits(x, router), top_k, capacity_factor)
    return _local_experts(x, routing, top_k, weights, keys, gemms)
  num_experts = router.shape[1]
  if num_experts % n:
    raise ValueError(
        f"MoE layer: {num_experts} experts do not split over the "
        f"{rules.expert!r} mesh axis of {n} devices; use a number of "
        f"experts divisible by {n}.")
  tokens = rules.batch
  local = num_experts // n
  w_spec = P(rules.expert, None, None)
  platform = rules.mesh.devices.flat[0].platform
  ragged = exchange_for(platform) == "ragged"

  def body(x, router, weights, keys):
    routing = route(router_logits(x, router), top_k, capacity_factor,
                    token_axes=tokens)
    if n == 1:  # Batch axes only: each shard's tokens go to its own experts.
      return _local_experts(x, routing, top_k, weights, keys, gemms)
    xs = dispatch(x, routing, top_k)
    rows = xs.shape[0]
    me = jax.lax.axis_index(rules.expert)
    if ragged:
      # Each local expert's copies from peer 0, then peer 1, ..., its group
      # padded to `GROUP_ALIGN` rows: the layout its grouped GEMMs take.
      length = padded_length(n * rows, local, GROUP_ALIGN)
      xc, sizes, back = ragged_exchange(xs, routing.group_sizes, n, local,
                                         length, me, rules.expert, platform)
      out = _experts(xc, sizes, weights, keys, gemms, first_expert=me * local)
      out_xs = back(out)
    else:
      def run(cap, diff, fixed):
        return buffered_exchange(
            diff["xs"], fixed["group_sizes"], n, local, cap, fixed["me"],
            rules.expert,
            lambda xc, sizes: _experts(xc, sizes, diff["weights"],
                                       fixed["keys"], gemms,
                                       first_expert=fixed["me"] * local))
      diff = {"xs": xs, "weights": weights}
      fixed = {"group_sizes": routing.group_sizes, "me": me, "keys": keys}
      cap = exchange_capacity(rows, n)
      if cap < rows:
        # Every device takes the same branch: the largest count any
        # device sends any peer, over every token shard.
        sent = jnp.sum(routing.group_sizes.reshape(n, local), axis=1)
        fits = jax.lax.pmax(jnp.max(sent), tokens) <= cap
        out_xs = cond_keeping_first_residuals(
            fits, lambda d, f: run(cap, d, f), lambda d, f: run(rows, d, f),
            diff, fixed)
      else:
        out_xs = run(rows, diff, fixed)
    return combine(out_xs, routing, top_k), routing.aux_loss

  tok = P(spmd.entry(tokens), None)
  return jax.shard_map(
      body, mesh=rules.mesh,
      in_specs=(tok, P(), {k: w_spec for k in weights},
                {k: P() for k in keys}),
      out_specs=(tok, P()), check_vma=False)(x, router, weights, keys)


def whole(a: jax.Array):
  """Under sharding in types (Explicit mesh axes), `a` replicated, and a
  function that gives a result `a`'s sharding back; else `a` as it is.

  The routing sorts every token of the layer, and each expert is quantized
  from all of its tokens, so under Explicit axes the layer runs on the whole
  arrays (its tokens gathered): the one-device result. Expert parallelism
  runs under `mesh_rules` with an `expert` axis (`moe_forward`).
  """
  if explicit_mesh(a) is None:
    return a, lambda y: y
  spec = jax.typeof(a).sharding.spec
  return jax.sharding.reshard(a, P()), lambda y: jax.sharding.reshard(y,
                                                                      spec)


def check_moe(num_experts: int, top_k: int, capacity_factor, path: str
              ) -> None:
  """A clear error for a configuration the MoE layer cannot run."""
  where = f"MoE layer {path or '<root>'!r}: "
  if not isinstance(num_experts, int) or num_experts < 1:
    raise ValueError(f"{where}num_experts must be a positive int, got "
                     f"{num_experts!r}.")
  if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
    raise ValueError(f"{where}top_k must be an int in [1, num_experts="
                     f"{num_experts}], got {top_k!r}.")
  if capacity_factor is not None and not capacity_factor > 0:
    raise ValueError(f"{where}capacity_factor must be positive or None "
                     f"(dropless), got {capacity_factor!r}.")
