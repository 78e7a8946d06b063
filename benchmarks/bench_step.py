"""GPT train-step time and memory, each configuration in its own process.

    python -m benchmarks.bench_step --preset small --batch 64 --seq 512 \\
        --precisions bf16,nvfp4 --repeats 3
    python -m benchmarks.bench_step --meshes "data=2 fsdp=2"   # several GPUs

The lent GPUs swing by up to +-30% between steps and runs, and a configuration
timed in a process after other configurations ran up to 1.6x slower. So each
configuration runs in a fresh process (`--child`), the configurations are
interleaved, the whole round is repeated, and the table reports the median
step time over all rounds with the spread of the per-round medians, the ratio
to the first configuration, tokens/s, TFLOP/s by the 6N rule (N = parameters
of the projections, embeddings and head), MFU by that rule (`mfu`) and with
the causal attention products added (`mfu_attn`, see
`attention_flops_per_token`) and the compiled step's memory.
With `--meshes`, each configuration also runs on those meshes with `--batch`
sequences per device (weak scaling), and the table adds the scaling
efficiency: tokens/s per device over the same configuration on one device
(there a mesh of one device, `data=1`: the same sharded program).
`benchmarks.bench_scaling` is the multi-GPU benchmark (all configurations
compiled at once, the baseline's order alternated, a communication
breakdown).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time

# Dense bf16 peak TFLOP/s by device kind (for MFU); unknown devices get none.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0,
                    "GB200": 2500.0}


@dataclasses.dataclass(frozen=True)
class StepConfig:
  preset: str
  precision: str
  batch: int
  seq: int
  attention: str = "fused"
  remat: str = "none"
  steps: int = 15
  mesh: str = ""  # "" one device; else `--mesh` syntax, e.g. "data=2".
  residuals: str = "codes"  # `Recipe.residuals` of the NVFP4 layers.
  tp_partial_sums: str = "float32"  # `MeshRules.partial_sums`.
  amax: str = "global"  # `MeshRules.amax`.
  wgrad_schedule: str = "layer"  # `MeshRules.wgrad_schedule`.
  wgrad_sums: str = "float32"  # `MeshRules.wgrad_sums`.
  sequence_parallel: bool = False  # `MeshRules.sequence_parallel`.
  collective_matmul: bool = False  # `MeshRules.collective_matmul`.

  @property
  def mesh_sizes(self) -> dict[str, int]:
    """`mesh` as `{axis: size}` ({} on one device)."""
    from train.mesh_flags import parse_mesh  # pylint: disable=g-import-not-at-top
    return parse_mesh(self.mesh) if self.mesh else {}

  @property
  def devices(self) -> int:
    return math.prod(self.mesh_sizes.values())

  @property
  def label(self) -> str:
    extra = "" if self.remat == "none" else f" remat={self.remat}"
    if self.residuals != "codes":
      extra += f" residuals={self.residuals}"
    where = f" {self.mesh}" if self.mesh else ""
    seq = (" [seq ring]" if self.collective_matmul else
           " [seq]" if self.sequence_parallel else "")
    return (f"{self.preset} {self.precision} {self.batch}x{self.seq} "
            f"{self.attention}{extra}{where}{seq}")


def build(cfg: StepConfig):
  """The trainer, its initial state and one batch for `cfg`, on random
  bytes (the step's cost does not depend on the data)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from nvfp4_jax import sharding  # pylint: disable=g-import-not-at-top
  from train import data  # pylint: disable=g-import-not-at-top
  from train.config import TrainConfig  # pylint: disable=g-import-not-at-top
  from train.loop import Trainer  # pylint: disable=g-import-not-at-top
  from train.loop import model_config  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  n = cfg.batch * (cfg.seq + 1) * 4
  corpus = data.Corpus(train=rng.integers(0, 256, n).astype(np.uint8),
                       val=rng.integers(0, 256, n // 4).astype(np.uint8),
                       vocab_size=256, source="random")
  tc = TrainConfig(preset=cfg.preset, precision=cfg.precision,
                   steps=1000, batch_size=cfg.batch, seq_len=cfg.seq,
                   diagnostics=False, residuals=cfg.residuals,
                   tp_partial_sums=cfg.tp_partial_sums, amax=cfg.amax,
                   wgrad_schedule=cfg.wgrad_schedule,
                   wgrad_sums=cfg.wgrad_sums,
                   sequence_parallel=cfg.sequence_parallel,
                   collective_matmul=cfg.collective_matmul)
  mc = model_config(tc, 256).replace(attention=cfg.attention,
                                     remat=cfg.remat)
  mesh = (sharding.make_mesh(jax.devices()[:cfg.devices], **cfg.mesh_sizes)
          if cfg.mesh else None)
  trainer = Trainer(tc, corpus, mc, mesh=mesh)
  state = trainer.init_state()
  batch = trainer.put_batch(
      trainer.batcher.batch(0).reshape(1, cfg.batch, cfg.seq + 1))
  return trainer, state, batch


def _child(cfg: StepConfig) -> dict:
  """Times `cfg.steps` train steps in this process; returns the figures."""
  import jax  # pylint: disable=g-import-not-at-top

  from models import param_count  # pylint: disable=g-import-not-at-top

  trainer, state, batch = build(cfg)
  if trainer.mesh_rules is None:  # On the device, as a mesh's batch is.
    batch = jax.device_put(batch, jax.devices()[0])
  mc = trainer.model_cfg
  compiled = trainer.train_step.lower(state, batch).compile()
  mem = compiled.memory_analysis()
  state, m = compiled(state, batch)  # Warm-up (the state is donated).
  jax.block_until_ready(m)
  times = []
  for _ in range(cfg.steps):
    t0 = time.perf_counter()
    state, m = compiled(state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  dev = jax.devices()[0]
  return {"times": times, "params": param_count(mc),
          "attn_flops": attention_flops_per_token(mc, cfg.seq),
          "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
          "device": dev.device_kind, "jax": jax.__version__}


def attention_flops_per_token(mc, seq: int) -> int:
  """Training FLOPs per token of the attention products (`QK^T` and `PV`),
  which the 6N rule leaves out: `2 * 2 * seq * d_model` per layer forward
  for full attention, half of it under the causal mask (what a flash
  kernel computes), times 3 for forward + backward: `6 * layers * seq *
  d_model`. PaLM's MFU (Chowdhery et al. 2022, appendix B) adds the full
  `12 * layers * seq * d_model`; counting the causal half is the
  conservative choice."""
  return 6 * mc.num_layers * seq * mc.d_model


def run(configs: list[StepConfig], repeats: int = 3) -> list[dict]:
  """Times every configuration in a fresh process, interleaved, `repeats`
  rounds; returns one row per configuration."""
  from nvfp4_jax.tools import timing  # pylint: disable=g-import-not-at-top
  results: dict[str, list[dict]] = {c.label: [] for c in configs}
  for _ in range(repeats):
    for c in configs:
      results[c.label].append(timing.run_child(
          "benchmarks.bench_step", dataclasses.asdict(c), c.label))
      # Progress, so a run cut short still shows what it timed.
      print(f"{c.label}: median "
            f"{statistics.median(results[c.label][-1]['times']) * 1e3:.1f} ms",
            file=sys.stderr, flush=True)
  rows, base = [], None
  single = {}  # tokens/s on one device by (precision, remat, attention).
  for c in configs:
    runs = results[c.label]
    times = [t for r in runs for t in r["times"]]
    medians = [statistics.median(r["times"]) for r in runs]
    t = statistics.median(times)
    base = base or t
    tokens = c.batch * c.seq
    tflops = 6 * runs[0]["params"] * tokens / t / 1e12
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items()
                 if k in runs[0]["device"]), None)
    key = (c.precision, c.remat, c.attention)
    if c.devices == 1:
      single[key] = tokens / t
    rows.append({
        "config": c.label, "ms": t * 1e3,
        "spread_ms": f"{min(medians) * 1e3:.1f}-{max(medians) * 1e3:.1f}",
        "vs_first": t / base, "tokens_per_s": tokens / t,
        "tflops_6n": tflops,
        "mfu": tflops / (peak * c.devices) if peak else float("nan"),
        # With the causal attention products (see attention_flops_per_token).
        "mfu_attn": ((6 * runs[0]["params"] + runs[0]["attn_flops"])
                     * tokens / t / 1e12 / (peak * c.devices)
                     if peak else float("nan")),
        "temp_mib": (runs[0]["temp_bytes"] or float("nan")) / 2**20,
        # Weak scaling: tokens/s per device against the same configuration
        # on one device.
        "scaling": (tokens / t / c.devices / single[key] if key in single
                    else float("nan")),
        "device": runs[0]["device"], "jax": runs[0]["jax"]})
  return rows


COLS = ("config", "ms", "spread_ms", "vs_first", "tokens_per_s", "tflops_6n",
        "mfu", "mfu_attn", "temp_mib")
MESH_COLS = COLS + ("scaling",)


def step_arguments(p: argparse.ArgumentParser) -> None:
  """The flags that choose the steps to run (shared with profile_step)."""
  p.add_argument("--child", help=argparse.SUPPRESS)
  p.add_argument("--preset", default="small")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--seq", type=int, default=512)
  p.add_argument("--precisions", default="bf16,nvfp4")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  step_arguments(p)
  p.add_argument("--attention", default="fused",
                 help="comma list of fused,reference")
  p.add_argument("--remat", default="none", help="comma list of none,quantized")
  p.add_argument("--residuals", default="codes",
                 help="comma list of codes,values: the NVFP4 layers' "
                 "Recipe.residuals (BF16 runs once)")
  p.add_argument("--steps", type=int, default=15)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--meshes", default="",
                 help="space-separated meshes to time besides one device, "
                 "e.g. 'data=2 fsdp=2'; --batch is then per device (weak "
                 "scaling) and the table adds the scaling efficiency")
  a = p.parse_args(argv)
  if a.child:
    print(json.dumps(_child(StepConfig(**json.loads(a.child)))))
    return
  # With meshes, one device is a mesh of one (`data=1`): the trainer's same
  # sharded program (MeshRules, the sharded NVFP4 layers), as
  # `bench_scaling` times it.
  meshes = ["data=1" if a.meshes else ""] + a.meshes.split()
  configs = []
  for att in a.attention.split(","):
    for remat in a.remat.split(","):
      for prec in a.precisions.split(","):
        for res in (a.residuals.split(",") if prec == "nvfp4" else
                    ["codes"]):
          for mesh in meshes:
            c = StepConfig(a.preset, prec, a.batch, a.seq, att, remat,
                           a.steps, mesh, res)
            configs.append(dataclasses.replace(c, batch=a.batch * c.devices))
  from nvfp4_jax.tools import timing  # pylint: disable=g-import-not-at-top
  rows = run(configs, a.repeats)
  print(f"device: {rows[0]['device']}; jax {rows[0]['jax']}; {a.repeats} "
        f"rounds x {a.steps} steps, a fresh process per configuration")
  print(timing.table(rows, MESH_COLS if a.meshes else COLS))


if __name__ == "__main__":
  main()
