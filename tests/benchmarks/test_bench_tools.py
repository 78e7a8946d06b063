"""The benchmark drivers' bookkeeping (no GPU: the children are faked)."""

import json
import subprocess
import types

import jax
import pytest

from benchmarks import bench_dense
from benchmarks import bench_step
from benchmarks import profile_step


def test_bench_step_weak_scaling_rows(monkeypatch):
  """Per mesh: the global batch is the per-device batch x devices, and the
  scaling column is tokens/s per device over the one-device row."""
  ms = {"": 0.010, "data=2": 0.0125}  # Step seconds per mesh.

  def fake_run(cmd, **_):
    cfg = bench_step.StepConfig(**json.loads(cmd[-1]))
    out = {"times": [ms[cfg.mesh]] * 3, "params": 1000, "attn_flops": 3000,
           "temp_bytes": 2**20, "device": "NVIDIA H100", "jax": "x"}
    return types.SimpleNamespace(returncode=0, stdout=json.dumps(out),
                                 stderr="")

  monkeypatch.setattr(subprocess, "run", fake_run)
  configs = [bench_step.StepConfig("small", "bf16", 8, 16, mesh=""),
             bench_step.StepConfig("small", "bf16", 16, 16, mesh="data=2")]
  assert [c.devices for c in configs] == [1, 2]
  rows = bench_step.run(configs, repeats=1)
  assert rows[0]["scaling"] == 1.0
  # 2x the tokens in 1.25x the time on 2 devices: 2 / 1.25 / 2 = 0.8.
  assert abs(rows[1]["scaling"] - 0.8) < 1e-12
  # MFU is per device: the same per-device work rate gives the same MFU.
  assert abs(rows[1]["mfu"] / rows[0]["mfu"] - 0.8) < 1e-12
  assert "data=2" in rows[1]["config"]
  # With the attention FLOPs: (6 * 1000 + 3000) / (6 * 1000) of the 6N MFU.
  assert abs(rows[0]["mfu_attn"] / rows[0]["mfu"] - 1.5) < 1e-12


def test_bench_dense_shapes_rows(monkeypatch):
  """`--shapes`: a process per (shape, layer) per round, interleaved; the
  ratio is of the medians over all rounds, its spread of the per-round
  ratios."""
  calls = []
  ms = {"bf16": [0.010, 0.012], "nvfp4": [0.012, 0.0156]}  # Per round.

  def fake_run(cmd, **_):
    t, i, o, layer = json.loads(cmd[-1])
    calls.append(((t, i, o), layer))
    r = sum(c == ((t, i, o), layer) for c in calls) - 1
    out = {"times": [ms[layer][r]] * 3, "peak": 100 if layer == "bf16"
           else 120, "device": "NVIDIA H100", "jax": "x"}
    return types.SimpleNamespace(returncode=0, stdout=json.dumps(out),
                                 stderr="")

  monkeypatch.setattr(subprocess, "run", fake_run)
  shapes = bench_dense.parse_shapes("gpt-base,64x32x48")
  assert shapes[-1] == (64, 32, 48) and len(shapes) == 5
  rows = bench_dense.run_shapes(shapes[-2:], repeats=2, log=None)
  # Interleaved: both layers of each shape, shape after shape, round after
  # round.
  assert [c[1] for c in calls] == ["bf16", "nvfp4"] * 4
  assert [c[0] for c in calls[:4]] == [shapes[-2]] * 2 + [shapes[-1]] * 2
  (row,) = [r for r in rows if r["shape"] == "64x32x48"]
  # Medians over both rounds' samples: (0.012 + 0.0156) / 2 over 0.011.
  assert abs(row["ratio"] - 0.0138 / 0.011) < 1e-12
  assert row["ratio_spread"] == "1.200-1.300"
  assert row["peak_ratio"] == 1.2


def test_bench_dense_rejects_a_bad_shape():
  with pytest.raises(SystemExit, match="TOKENSxINxOUT"):
    bench_dense.parse_shapes("gpt-base,8192x4096")


def test_bench_dense_child_times_a_layer():
  out = bench_dense._child(32, 32, 16, "nvfp4")
  assert len(out["times"]) == 7 and out["peak"] > 0


def test_profile_step_classes():
  c = profile_step.classify
  assert c("nvfp4_quantize_x_and_rht_t__1").startswith("pallas: quantize x")
  assert c("nvfp4_quantize_rht_t__2") == "pallas: quantize rht_t (Wgrad)"
  assert c("nvfp4_quantize_2d") == "pallas: quantize 16x16 (weights)"
  assert c("nvfp4_quantize__1") == "pallas: quantize 1x16"
  assert c("nvfp4_block_values") == "pallas: block values (dequantize)"
  assert c("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == (
      "attention (cuDNN)")
  assert c("nvjet_sm90_tst_128x64_64x8_1x2_h_bz_NNT") == (
      "GEMM (cuBLAS/CUTLASS/Mosaic)")
  assert c("gemm_fusion_dot_284") == "GEMM (cuBLAS/CUTLASS/Mosaic)"
  # The emulated GEMM's Mosaic GPU kernel (`values_matmul`).
  assert c("kernel_mosaic_gpu_kernel") == "GEMM (cuBLAS/CUTLASS/Mosaic)"
  assert c("input_add_reduce_fusion_2") == "XLA reduction fusions"
  assert c("loop_convert_fusion") == "XLA fusions"


def test_profile_step_layer_ops_attributes_kernels_to_layer_ops():
  """Trace kernel names map to HLO instructions (`_3` for `.3`) and their
  source paths: ops inside an `nvfp4_layer[...]` scope are keyed by the
  path after it, backward ops marked; Pallas kernels by their name."""
  scope = "nvfp4_layer[block_0/mlp/up|fprop=nvfp4]"
  hlo = "\n".join([
      f'  %loop_transpose_fusion.3 = bf16[8,4]{{1,0}} fusion(%p), kind=kLoop, '
      f'metadata={{op_name="jit(step)/jvp(GPT)/block_0/{scope}/'
      f'jit(nvfp4_quantize_w)/transpose" stack_frame_id=1}}',
      f'  ROOT %input_reduce_fusion.12 = u32[] fusion(%q), kind=kInput, '
      f'metadata={{op_name="jit(step)/transpose(jvp(GPT))/block_0/{scope}/'
      f'jit(nvfp4_quantize_dy)/reduce_max"}}',
      '  %loop_add_fusion = f32[8]{0} fusion(%r), kind=kLoop, '
      'metadata={op_name="jit(step)/jvp(GPT)/block_0/norm/add"}',
  ])
  kernels = {"loop_transpose_fusion_3": [2.0, 5.0],
             "input_reduce_fusion_12": [1.0, 3.0],
             "loop_add_fusion": [1.0, 7.0],
             "nvfp4_quantize_values__2": [1.0, 40.0],
             "nvfp4_quantize_values": [1.0, 60.0],
             "nvjet_sm90_tst_128x128": [4.0, 900.0]}
  ops, outside = profile_step.layer_ops(hlo, kernels)
  assert ops == {"nvfp4_quantize_w/transpose": [2.0, 5.0],
                 "bwd nvfp4_quantize_dy/reduce_max": [1.0, 3.0],
                 "pallas nvfp4_quantize_values": [2.0, 100.0]}
  assert outside == 907.0


def test_bench_memory_largest_fit():
  from benchmarks import bench_memory  # pylint: disable=g-import-not-at-top
  # Peak = 10 + 2 * batch (GiB-like units): a limit of 100 allows 45 -> 40.
  assert bench_memory.largest_fit(8, 26, 16, 42, 100) == 40
  assert bench_memory.largest_fit(8, 26, 16, 42, 100, multiple=1) == 45
  # Never below one multiple, even if nothing fits.
  assert bench_memory.largest_fit(8, 26, 16, 42, 5) == 8
  with pytest.raises(ValueError, match="does not grow"):
    bench_memory.largest_fit(8, 26, 16, 26, 100)


@pytest.mark.parametrize("name,peak", [
    ("linear", lambda b: 2 + 0.05 * b),
    ("convex", lambda b: 2 + 0.05 * b + 2e-4 * b * b),
    ("concave", lambda b: 2 + 0.1 * b**0.8),
    ("a jump at 152", lambda b: 2 + 0.05 * b + (5 if b > 150 else 0)),
    ("nothing fits", lambda b: 30 + b),
])
@pytest.mark.parametrize("limit", [10, 19.8, 40])
def test_bench_memory_search_finds_the_largest_fitting_batch(name, peak, limit):
  """The compile search ends on the exact answer (a multiple of 8 that fits
  with the next one over), whatever the peak's shape, within 10 compiles."""
  from benchmarks import bench_memory  # pylint: disable=g-import-not-at-top
  peaks = {8: peak(8), 16: peak(16)}
  while (b := bench_memory.next_batch(peaks, limit)) is not None:
    assert b not in peaks and b % 8 == 0, (name, b, peaks)
    peaks[b] = peak(b)
  truth = max((b for b in range(8, 5000, 8) if peak(b) <= limit), default=0)
  assert max((b for b, p in peaks.items() if p <= limit), default=0) == truth
  assert len(peaks) <= 10, (name, list(peaks))


def test_bench_memory_runs_step_down_after_out_of_memory():
  """The search's answer runs first. After a run out of memory, the next is
  the batch whose peak is the margin lower by the line through the failed
  batch and the compiled batch below it (at least 8 less); a run that
  succeeds, the smallest batch, or four runs end it."""
  from benchmarks import bench_memory  # pylint: disable=g-import-not-at-top
  gib = 2**30
  peaks = [[8, 2.5 * gib], [16, 3.2 * gib], [200, 18.9 * gib],
           [208, 19.5 * gib], [216, 20.2 * gib]]
  nr = lambda runs, fits=208: bench_memory.next_run(
      {"fits": fits, "peaks": peaks,
       "runs": [{"batch": b, "ok": ok, "peak": p * gib}
                for b, ok, p in runs]}, margin=2.5 * gib)
  assert nr([]) == 208
  # 208 failed (19.5): the line to 200 gives 0.075 GiB per sequence, so 2.5
  # GiB less is 33 sequences less: 175 -> 168.
  assert nr([(208, False, 19.5)]) == 168
  # 200 failed (18.9): the line to 16 (0.085 per sequence): 170 -> 168.
  assert nr([(200, False, 18.9)]) == 168
  assert nr([(208, False, 19.5), (168, True, 16.0)]) is None
  assert nr([(208, False, 19.5)] * 4) is None
  assert nr([(16, False, 3.2)]) == 8
  assert nr([(8, False, 2.5)]) is None
  assert nr([], fits=0) is None


def test_bench_memory_children_preallocate_the_arena():
  """The children run with JAX's default preallocation even where the
  caller turned it off, and keep a cache the caller set."""
  from benchmarks import bench_memory  # pylint: disable=g-import-not-at-top
  env = bench_memory.child_env({"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                                "JAX_COMPILATION_CACHE_DIR": "/c"}, "/s")
  assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
  assert env["JAX_COMPILATION_CACHE_DIR"] == "/c"
  assert bench_memory.child_env({}, "/s")["JAX_COMPILATION_CACHE_DIR"] == (
      "/s/jax_cache")


def test_bench_memory_refuses_a_state_searched_under_another_limit():
  # XLA compiles (and rematerializes) for the limit it is given, so a
  # state's peaks and bracket belong to the limit it was searched under.
  from benchmarks import bench_memory  # pylint: disable=g-import-not-at-top
  gib = 2**30
  assert bench_memory.same_limit({"peaks": []}, 19.8 * gib, "s.json") == (
      19.8 * gib)
  assert bench_memory.same_limit({"limit": 19.8 * gib}, 19.8 * gib,
                                 "s.json") == 19.8 * gib
  with pytest.raises(SystemExit, match=r"s\.json .* 19\.80 GiB.* 59\.40 GiB"):
    bench_memory.same_limit({"limit": 19.8 * gib}, 59.4 * gib, "s.json")


def test_probe_prologue_counts_the_entry_kernels():
  """A decode left outside the GEMM is a fusion of its own beside the GEMM
  fusion; kernels of other computations are not counted."""
  from benchmarks.archive import probe_prologue
  hlo = """
%fused_multiply (p: u8[4,32]) -> bf16[4,32] {
  %x = bf16[4,32]{1,0} fusion(%p), kind=kLoop, calls=%inner
}

ENTRY %main.3 (c.1: u8[4,32], b.1: bf16[32,8]) -> bf16[4,8] {
  %loop_multiply_fusion = bf16[4,32]{1,0} fusion(%c.1), kind=kLoop, calls=%fused_multiply
  ROOT %gemm_fusion_dot.1 = bf16[4,8]{1,0} fusion(%loop_multiply_fusion, %b.1), kind=kCustom, calls=%gemm_fusion_dot.1_computation
}
"""
  assert probe_prologue.entry_kernels(hlo) == {
      "gemm fusions": 1, "other fusions": 1, "library calls": 0}
  fused = hlo.replace("  %loop_multiply_fusion = bf16[4,32]{1,0} fusion(%c.1), "
                      "kind=kLoop, calls=%fused_multiply\n", "")
  assert probe_prologue.entry_kernels(fused)["other fusions"] == 0


def test_probe_prologue_integer_decode_is_e2m1_decode():
  """The probe's integer-bit decode is `numerics.e2m1_decode` for all 16
  codes (signed zero included), so its timings are of the same values."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from benchmarks.archive import probe_prologue
  from nvfp4_jax.core import numerics as nm
  codes = jnp.arange(16, dtype=jnp.uint8)
  got = np.asarray(probe_prologue._decode_u8(codes).astype(jnp.float32))
  want = np.asarray(nm.e2m1_decode(codes))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_probe_decode_gemm_byte_decode_is_exact():
  """The decoding GEMM's byte decode is `numerics.e2m1_decode` for all 16
  codes (signed zero included), and block values times their E4M3 scale
  are exact in f16, so the probe's kernel multiplies the recipe's values."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from benchmarks.archive import probe_decode_gemm as pdg
  from nvfp4_jax.core import numerics as nm
  codes = jnp.arange(16, dtype=jnp.uint8)
  got = np.asarray(pdg.byte_values(pdg.code_bytes(codes)).astype(jnp.float32))
  want = np.asarray(nm.e2m1_decode(codes))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
  # Every code times every finite E4M3 scale: f16 holds the FP32 product.
  scales = jax.lax.bitcast_convert_type(
      jnp.arange(127, dtype=jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)
  prod = want[:, None] * np.asarray(scales)[None, :]
  np.testing.assert_array_equal(prod.astype(np.float16).astype(np.float32),
                                prod)


def test_probe_decode_gemm_lowers_for_hopper():
  """The Mosaic GPU kernel lowers for CUDA on a CPU-only machine (layouts,
  wgmma shapes and shared memory are checked at lowering), in both forms
  the probe times."""
  import functools  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from benchmarks.archive import probe_decode_gemm as pdg
  m, n, k = 256, 512, 256
  args = (jax.ShapeDtypeStruct((k // 16, m, 16), jnp.uint8),
          jax.ShapeDtypeStruct((k // 16, m), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((k, n), jnp.float16))
  for cfg in (pdg.CONFIGS[0], pdg.Config(tile_k=64, assemble=False)):
    f = jax.jit(functools.partial(pdg.decode_matmul, config=cfg, num_sms=132))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_profile_step_busy_and_span_count_overlaps_once():
  """The GPU's busy time is the union of its kernels' intervals (streams may
  overlap), the span runs from the first start to the last end."""
  f = profile_step.busy_and_span
  assert f([]) == (0.0, 0.0)
  assert f([(0, 10)]) == (10, 10)
  # Overlapping and nested kernels count once; the gap (25-30) is idle.
  assert f([(20, 25), (0, 10), (5, 15), (6, 7), (30, 40)]) == (30, 40)


def test_bench_quantize_used_sweep_checks_every_tile_against_the_default(
    monkeypatch):
  """The used-tile sweep runs each picked kernel at each tile (interpreted
  here) and marks a row exact only if it equals the default tile's output;
  `kernels_swept` keeps the others out."""
  from benchmarks import bench_quantize  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(bench_quantize, "USED_CONFIGS", {
      "dequant": ((16, 256, 4), (8, 128, 2)),
      "row": ((16, 256, 4), (8, 128, 2))})
  rows = bench_quantize.sweep_used(32, 256, kernels_swept="dequant,row")
  assert [r["kernel"] for r in rows] == [
      "row 16x256 w4", "row 8x128 w2", "dequant 16x256 w4",
      "dequant 8x128 w2"]
  assert all(r["exact"] is True for r in rows)


def test_sass_report_cases_lower_to_the_kernels_they_name():
  """Every `tools.sass_report` case lowers (for CUDA, off-GPU) to the
  `pallas_call` it names: a kernel renamed or moved to another layout (as
  the columns RHT kernels did) breaks the report, not silently its rows."""
  from nvfp4_jax.tools import sass_report  # pylint: disable=g-import-not-at-top
  names = set()
  for case in sass_report._cases():  # pylint: disable=protected-access
    lowered = sass_report.lower_case(case, (9, 0))
    assert lowered.name == case.kernel and "tt.func" in lowered.ttir
    names.add(case.kernel)
  # The kernels the layers run on Hopper are all reported.
  assert {"nvfp4_quantize_rht_t_columns_values", "nvfp4_quantize_values",
          "nvfp4_quantize_x_and_rht_t_values",
          "nvfp4_rht_amax_columns"} <= names


def _fake_children(monkeypatch, timing):
  """bench_scaling's child processes, faked: the held ones of round 1
  (`subprocess.Popen`: report a compile, then wait for `go` on stdin) and
  the fresh ones of later rounds (`subprocess.run`). `timing(cfg, flags)`
  is the `ms`/`ms_sync` a child reports. Returns the events in order:
  ("compile", cfg), ("held", cfg) (timed where it compiled) and ("fresh",
  cfg), each with the child's XLA_FLAGS."""
  from benchmarks import bench_scaling
  events = []

  def parse(cmd, env):
    cfg = bench_scaling.Config(**json.loads(cmd[-1])["cfg"])
    return cfg, (env or {}).get("XLA_FLAGS", "")

  head = {"compile_s": 1.0, "device": "NVIDIA H100", "jax": "x"}

  class Popen:

    def __init__(self, cmd, env=None, **_):
      self.cfg, self.flags = parse(cmd, env)
      assert json.loads(cmd[-1])["hold"]
      events.append(("compile", self.cfg, self.flags))
      self.go, self.returncode = False, None
      child = self

      class Stdin:

        def write(self, line):
          child.go = line.strip() == "go"

        def flush(self):
          pass

        def close(self):
          pass

      self.stdin = Stdin()
      self.stdout = self._lines()

    def _lines(self):
      yield bench_scaling.MARK + json.dumps(head) + "\n"
      if self.go:
        events.append(("held", self.cfg, self.flags))
        yield bench_scaling.MARK + json.dumps(
            {**head, **timing(self.cfg, self.flags)}) + "\n"

    def poll(self):
      return self.returncode

    def wait(self, timeout=None):
      del timeout
      self.returncode = 0
      return 0

    def kill(self):
      self.returncode = -9

  def run(cmd, env=None, **_):
    cfg, flags = parse(cmd, env)
    events.append(("fresh", cfg, flags))
    out = {**head, "compile_s": 0.5, **timing(cfg, flags)}
    return types.SimpleNamespace(
        returncode=0, stdout="log line\n" + bench_scaling.MARK
        + json.dumps(out), stderr="")

  monkeypatch.setattr(subprocess, "Popen", Popen)
  monkeypatch.setattr(subprocess, "run", run)
  monkeypatch.setattr(bench_scaling, "_gpu_processes", list)
  return events


def test_bench_scaling_baseline_rounds_and_variants(monkeypatch, capsys):
  """bench_scaling: round 1 compiles `--jobs` configurations at once and
  times each in the process that compiled it, nothing timed while any
  compiles; later rounds run fresh processes (loading from the cache),
  the order reversed; the one-device baseline is a mesh of one device
  (`data=1`); a `--variant` adds its XLA flags to the mesh configurations
  only; scaling is per-device tokens/s over the baseline's (weak scaling:
  the same per-device batch)."""
  from benchmarks import bench_scaling
  ms = {"data=1": 10.0, "data=2": 12.5, "fsdp=2": 20.0}
  events = _fake_children(monkeypatch, lambda c, f: {
      "ms": ms[c.mesh] * (0.8 if c.variant else 1.0), "ms_sync": 1.0})
  bench_scaling.main(["--presets", "small", "--precisions", "bf16",
                      "--meshes", "data=2 fsdp=2", "--rounds", "2",
                      "--variant", "v=--xla_x=1", "--jobs", "2",
                      "--cache-dir", "/nonexistent"])
  d1, d2, d2v, f2, f2v = ("small bf16 data=1", "small bf16 data=2",
                          "small bf16 data=2 [v]", "small bf16 fsdp=2",
                          "small bf16 fsdp=2 [v]")
  assert [(e, c.label) for e, c, _ in events] == [
      ("compile", d1), ("compile", d2), ("held", d1), ("held", d2),
      ("compile", d2v), ("compile", f2), ("held", d2v), ("held", f2),
      ("compile", f2v), ("held", f2v),
      ("fresh", f2v), ("fresh", f2), ("fresh", d2v), ("fresh", d2),
      ("fresh", d1)]
  assert all(("--xla_x=1" in f) == bool(c.variant) for _, c, f in events)
  # The breakdown is traced in round 1 only.
  assert all(c.profile == 0 for e, c, _ in events if e == "fresh")
  out = capsys.readouterr().out
  table = {line.split("|")[1].strip(): line.split("|")
           for line in out.splitlines() if line.startswith("| small")}
  # scaling = baseline ms / ms (the same tokens per device).
  assert float(table[d2][7]) == pytest.approx(0.8)
  assert float(table[f2v][7]) == pytest.approx(10 / 16, rel=1e-2)
  assert table[d2][5].strip() == "2"  # Rounds.


def test_bench_scaling_stops_held_processes_and_warns_of_busy_gpus(
    monkeypatch, capsys):
  """`--rounds 0` only compiles: each held process is then told to
  stop. A budget that runs out skips the rest of round 1's timings and
  compiles no further batch; other processes on the GPUs (they skew
  timings and autotuning) draw a warning."""
  from benchmarks import bench_scaling
  events = _fake_children(monkeypatch, lambda c, f: {"ms": 1.0,
                                                     "ms_sync": 1.0})
  monkeypatch.setattr(bench_scaling, "_gpu_processes",
                      lambda: ["123, python, 900 MiB"])
  bench_scaling.main(["--presets", "small", "--precisions", "bf16",
                      "--meshes", "data=2", "--rounds", "0", "--jobs", "2",
                      "--cache-dir", "/nonexistent"])
  assert [e for e, _, _ in events] == ["compile", "compile"]
  out = capsys.readouterr().out
  assert "WARNING: other processes are on the GPUs (123, python" in out
  # The budget runs out while the first batch compiles: its timings are
  # skipped, and the next batch does not compile.
  events.clear()
  clock = iter(range(0, 1000, 10))
  monkeypatch.setattr(bench_scaling.time, "perf_counter",
                      lambda: float(next(clock)))
  bench_scaling.main(["--presets", "small", "--precisions", "bf16",
                      "--meshes", "data=2 fsdp=2", "--jobs", "2",
                      "--budget-s", "15", "--cache-dir", "/nonexistent"])
  assert [(e, c.mesh) for e, c, _ in events] == [("compile", "data=1"),
                                                 ("compile", "data=2")]
  out = capsys.readouterr().out
  assert "skipped small bf16 data=1 (round 1)" in out
  assert "skipped compiling small bf16 fsdp=2" in out


def test_bench_scaling_baselines_first(monkeypatch):
  """`--baselines-first`: the one-device baselines compile and run alone
  before any mesh compiles (the meshes then read the baselines' GEMM
  autotuning from the cache directory); without it the first batch mixes
  them."""
  from benchmarks import bench_scaling
  events = _fake_children(monkeypatch, lambda c, f: {"ms": 1.0,
                                                     "ms_sync": 1.0})
  argv = ["--presets", "small", "--precisions", "bf16,nvfp4", "--meshes",
          "data=2", "--jobs", "4", "--rounds", "1", "--cache-dir",
          "/nonexistent"]
  bench_scaling.main(argv + ["--baselines-first"])
  assert [(e, c.precision, c.mesh) for e, c, _ in events] == [
      ("compile", "bf16", "data=1"), ("compile", "nvfp4", "data=1"),
      ("held", "bf16", "data=1"), ("held", "nvfp4", "data=1"),
      ("compile", "bf16", "data=2"), ("compile", "nvfp4", "data=2"),
      ("held", "bf16", "data=2"), ("held", "nvfp4", "data=2")]
  events.clear()
  bench_scaling.main(argv)
  assert [e for e, _, _ in events] == ["compile"] * 4 + ["held"] * 4


def test_bench_scaling_held_child_protocol(monkeypatch, capsys):
  """A held child reports its compile on a `MARK` line, then times only
  on `go` (end of input: it returns without timing)."""
  import io  # pylint: disable=g-import-not-at-top
  from benchmarks import bench_scaling
  compiled = types.SimpleNamespace(calls=0)

  def step(state, batch):
    del batch
    compiled.calls += 1
    return state, jax.numpy.zeros(())

  trainer = types.SimpleNamespace(
      mesh_rules=object(), train_step=types.SimpleNamespace(
          lower=lambda s, b: types.SimpleNamespace(compile=lambda: step)))
  monkeypatch.setattr(bench_step, "build", lambda _: (trainer, 0, 0))
  cfg = bench_scaling.Config("tiny", "bf16", 1, 8, "data=1", warmup=1,
                             steps=2)
  monkeypatch.setattr("sys.stdin", io.StringIO(""))
  assert bench_scaling._child(cfg, "", hold=True) is None
  assert compiled.calls == 0
  line = capsys.readouterr().out.strip()
  assert line.startswith(bench_scaling.MARK)
  assert json.loads(line[len(bench_scaling.MARK):])["compile_s"] >= 0
  monkeypatch.setattr("sys.stdin", io.StringIO("go\n"))
  out = bench_scaling._child(cfg, "", hold=True)
  assert compiled.calls == 1 + 2 + 2 and out["ms"] > 0


def test_bench_scaling_wgrad_sums_only_where_they_change_the_program(
    monkeypatch):
  """`--wgrad-sums float32,bfloat16` adds a bf16-sums row only to NVFP4 on
  meshes that sum weight gradients over tokens (`data`, `fsdp`): BF16's
  layers and a `model`-only mesh compile the same program either way."""
  from benchmarks import bench_scaling
  events = _fake_children(monkeypatch, lambda c, f: {"ms": 1.0,
                                                     "ms_sync": 1.0})
  bench_scaling.main(["--presets", "small", "--precisions", "bf16,nvfp4",
                      "--meshes", "data=2 model=2",
                      "--wgrad-sums", "float32,bfloat16", "--jobs", "1",
                      "--rounds", "1", "--cache-dir", "/nonexistent"])
  labels = [c.label for e, c, _ in events if e == "compile"]
  assert [x for x in labels if "sums" in x] == [
      "small nvfp4 data=2 [wgrad sums=bfloat16]"], labels


def test_bench_scaling_sequence_parallel_only_on_model_meshes(monkeypatch):
  """`--sequence-parallel off,on,ring` adds a sequence-parallel row and one
  with its collective matmul, in both precisions, only to meshes with a
  `model` axis of more than one device (elsewhere it changes nothing),
  passes them to the step, and refuses other words."""
  from benchmarks import bench_scaling
  events = _fake_children(monkeypatch, lambda c, f: {"ms": 1.0,
                                                     "ms_sync": 1.0})
  bench_scaling.main(["--presets", "small", "--precisions", "bf16,nvfp4",
                      "--meshes", "data=2 model=2 data=2,model=1",
                      "--sequence-parallel", "off,on,ring", "--jobs", "1",
                      "--rounds", "1", "--cache-dir", "/nonexistent"])
  labels = [c.label for e, c, _ in events if e == "compile"]
  assert [x for x in labels if "sequence" in x] == [
      "small bf16 model=2 [sequence parallel]",
      "small bf16 model=2 [sequence parallel, ring]",
      "small nvfp4 model=2 [sequence parallel]",
      "small nvfp4 model=2 [sequence parallel, ring]"], labels
  seen = []

  class Stop(Exception):
    pass

  def build(cfg):
    seen.append(cfg)
    raise Stop
  monkeypatch.setattr(bench_step, "build", build)
  for value in ("on", "ring"):
    with pytest.raises(Stop):
      bench_scaling._child(bench_scaling.Config(
          "tiny", "nvfp4", 1, 8, "model=2", sequence_parallel=value), "")
  assert [(c.sequence_parallel, c.collective_matmul) for c in seen] == [
      (True, False), (True, True)]
  assert seen[0].label.endswith(" model=2 [seq]")
  assert seen[1].label.endswith(" model=2 [seq ring]")
  assert not bench_step.StepConfig("tiny", "bf16", 1, 8).label.endswith(
      "[seq]")
  with pytest.raises(SystemExit, match="--sequence-parallel 'off,yes': "
                     "'yes' is not one of off,on,ring"):
    bench_scaling.main(["--presets", "small", "--meshes", "model=2",
                        "--sequence-parallel", "off,yes"])


def test_bench_scaling_knob_product(monkeypatch):
  """`--knob-product` times every combination of the knobs' values that
  apply (the partial sums' dtype only to NVFP4), each knob alone without
  it."""
  from benchmarks import bench_scaling
  argv = ["--presets", "small", "--precisions", "bf16,nvfp4", "--meshes",
          "model=2", "--sequence-parallel", "off,on,ring",
          "--tp-partial-sums", "float32,output", "--jobs", "1", "--rounds",
          "0", "--cache-dir", "/nonexistent"]

  def labels(extra):
    events = _fake_children(monkeypatch, lambda c, f: {"ms": 1.0,
                                                       "ms_sync": 1.0})
    bench_scaling.main(argv + extra)
    return [c.label for e, c, _ in events
            if e == "compile" and "model=2" in c.label]
  assert labels(["--knob-product"]) == [
      "small bf16 model=2", "small bf16 model=2 [sequence parallel]",
      "small bf16 model=2 [sequence parallel, ring]",
      "small nvfp4 model=2", "small nvfp4 model=2 [sums=output]",
      "small nvfp4 model=2 [sequence parallel]",
      "small nvfp4 model=2 [sequence parallel, ring]",
      "small nvfp4 model=2 [sums=output] [sequence parallel]",
      "small nvfp4 model=2 [sums=output] [sequence parallel, ring]"]
  assert len(labels([])) == 7  # Each knob alone: 3 BF16, 4 NVFP4 rows.


def test_aot_collectives_passes_sequence_parallel(monkeypatch):
  """`aot_collectives --sequence-parallel [--collective-matmul]` reaches
  `compile_step` (off without the flags); nothing compiles here."""
  from benchmarks import aot_collectives
  seen = []

  def compile_step(*args):
    seen.append(args[-2:])
    return ""
  monkeypatch.setattr(aot_collectives, "compile_step", compile_step)
  monkeypatch.setattr(aot_collectives, "report", lambda text, verbose: "")
  aot_collectives.main(["--mesh", "model=2"])
  aot_collectives.main(["--mesh", "model=2", "--sequence-parallel"])
  aot_collectives.main(["--mesh", "model=2", "--sequence-parallel",
                        "--collective-matmul"])
  assert seen == [(False, False), (True, False), (True, True)]


def test_bench_scaling_exchange_slack(monkeypatch):
  """`--exchange-slack`: an expert-parallel mesh also runs with each listed
  `moe.EXCHANGE_SLACK` (none on meshes without an expert axis), and the
  child process sets it before building the step."""
  from benchmarks import bench_scaling
  from nvfp4_jax.training import moe
  events = _fake_children(monkeypatch, lambda c, f: {"ms": 1.0,
                                                     "ms_sync": 1.0})
  bench_scaling.main(["--presets", "moe-small", "--precisions", "bf16",
                      "--shapes", "moe-small=2x8",
                      "--meshes", "data=2 expert=2",
                      "--exchange-slack", "none,1.5", "--jobs", "1",
                      "--rounds", "1", "--cache-dir", "/nonexistent"])
  labels = [c.label for e, c, _ in events if e == "compile"]
  assert labels == ["moe-small bf16 data=1", "moe-small bf16 data=2",
                    "moe-small bf16 expert=2",
                    "moe-small bf16 expert=2 [slack=none]",
                    "moe-small bf16 expert=2 [slack=1.5]"]
  seen = []
  monkeypatch.setattr(moe, "EXCHANGE_SLACK", moe.EXCHANGE_SLACK)

  class Stop(Exception):
    pass

  def build(_):
    seen.append(moe.EXCHANGE_SLACK)
    raise Stop
  from benchmarks import bench_step
  monkeypatch.setattr(bench_step, "build", build)
  for slack in ("none", "1.5"):
    with pytest.raises(Stop):
      bench_scaling._child(bench_scaling.Config(
          "moe-tiny", "bf16", 1, 8, "expert=2", exchange_slack=slack), "")
  assert seen == [None, 1.5]
  with pytest.raises(SystemExit, match="--shapes moe-tiny=BATCHxSEQ"):
    bench_scaling.main(["--presets", "moe-tiny", "--meshes", "expert=2"])
