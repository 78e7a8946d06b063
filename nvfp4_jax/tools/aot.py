"""Compiling for a GPU that is not here: what a program lowers to on Blackwell.

    with aot.compiling_for("b200") as c:
      hlo = c.compile(step, *abstract_args)   # XLA's optimized HLO text
    print(aot.gemm_lowerings(hlo))

XLA compiles ahead of time for a GPU described by a `GpuTargetConfig` (JAX's
`jax.experimental.topologies.get_topology_desc(..., target_config=...)`), with
no such GPU and no GPU at all: it needs JAX's CUDA plugin installed (the
`gpu` extra), not CUDA's libraries. On a machine without them, start Python
with `JAX_PLATFORMS=cpu` (the plugin then registers without loading cuDNN;
`nvfp4-check-device --target ...` sets it). Inside the block
the project's dispatch answers for that device (`dispatch.target_device`), so
every op picks the kernels it would pick there; the Triton kernels that
jax-triton compiles while lowering are recorded (their PTX), and nothing runs.

The targets (`TARGETS`) carry the figures XLA's cost models read (SM count,
shared memory, memory size and bandwidth); the compute capability and the
cuDNN version decide what the program lowers to. cuDNN's version is the
one `jax[cuda13]` brings (9.14 when written); `cudnn=` names another, e.g.
(9, 8), below the 9.10 where cuDNN's block-scaled dot appeared: XLA then
decomposes `jax.nn.scaled_matmul` into dequantize and an FP32 GEMM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from typing import Any, Callable, Iterator

import jax

from nvfp4_jax.core import dispatch


@dataclasses.dataclass(frozen=True)
class Target:
  """A GPU to compile for.

  Attributes:
    name: the key in `TARGETS` (`check_device --target NAME`).
    device_kind: what `jax.Device.device_kind` says on it.
    cc: compute capability `(major, minor)`.
    sm_count: streaming multiprocessors.
    shared_memory_per_sm: bytes; `shared_memory_per_block_optin` is what one
      block may opt in to (the per-SM figure less 1 KiB).
    threads_per_sm: resident threads per SM.
    memory_bytes: device memory.
    bandwidth: memory bandwidth, bytes/s.
    l2_bytes: L2 cache size.
    clock_ghz: SM clock.
    features: the compute capability's feature extension
      (`FEATURE_EXTENSIONS`): "ACCELERATED_FEATURES" (the default), as
      XLA describes a GPU from 9.0 it runs on (it then compiles for sm_XYa,
      e.g. sm_120a, where the arch-specific instructions exist, such as
      the E2M1 conversion),
      "FAMILY_COMPATIBLE_FEATURES" (sm_XYf), or None: the bare capability
      (plain sm_XY; `target(name, features=None)`).
  """

  name: str
  device_kind: str
  cc: tuple[int, int]
  sm_count: int
  shared_memory_per_sm: int
  threads_per_sm: int
  memory_bytes: int
  bandwidth: float
  l2_bytes: int
  clock_ghz: float
  features: str | None = "ACCELERATED_FEATURES"

  @property
  def shared_memory_per_block_optin(self) -> int:
    return self.shared_memory_per_sm - 1024


_GIB = 1 << 30
_DC = dict(shared_memory_per_sm=233472, threads_per_sm=2048)  # sm_100/103.
_CONSUMER = dict(shared_memory_per_sm=102400, threads_per_sm=1536)  # sm_12x.

# Data-center Blackwell (cc 10.x) and the consumer/workstation parts (12.x).
# SM counts, memory and bandwidth are the vendors' published figures; they
# steer XLA's tiling heuristics only, not which instructions exist.
TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("b200", "NVIDIA B200", (10, 0), 148, memory_bytes=180 * _GIB,
           bandwidth=8.0e12, l2_bytes=126 * (1 << 20), clock_ghz=1.965,
           **_DC),
    Target("gb200", "NVIDIA GB200", (10, 0), 152, memory_bytes=186 * _GIB,
           bandwidth=8.0e12, l2_bytes=126 * (1 << 20), clock_ghz=2.06,
           **_DC),
    Target("b300", "NVIDIA B300 SXM6 AC", (10, 3), 148,
           memory_bytes=268 * _GIB, bandwidth=8.0e12,
           l2_bytes=126 * (1 << 20), clock_ghz=2.03, **_DC),
    Target("rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell Server Edition",
           (12, 0), 188, memory_bytes=96 * _GIB, bandwidth=1.79e12,
           l2_bytes=128 * (1 << 20), clock_ghz=2.29, **_CONSUMER),
    Target("rtx-5090", "NVIDIA GeForce RTX 5090", (12, 0), 170,
           memory_bytes=32 * _GIB, bandwidth=1.79e12,
           l2_bytes=96 * (1 << 20), clock_ghz=2.41, **_CONSUMER),
    Target("gb10", "NVIDIA GB10", (12, 1), 48, memory_bytes=119 * _GIB,
           bandwidth=2.73e11, l2_bytes=24 * (1 << 20), clock_ghz=2.42,
           **_CONSUMER),
    Target("thor", "NVIDIA Thor", (11, 0), 20, memory_bytes=119 * _GIB,
           bandwidth=2.73e11, l2_bytes=32 * (1 << 20), clock_ghz=1.57,
           **_DC),
    # Hopper, the lent GPUs: to read what a multi-GPU program communicates
    # (`topology_devices`) without them.
    Target("h100", "NVIDIA H100 80GB HBM3", (9, 0), 132,
           memory_bytes=80 * _GIB, bandwidth=3.35e12,
           l2_bytes=50 * (1 << 20), clock_ghz=1.98, **_DC),
)}

# cuDNN's version in the jax[cuda13] wheels this was written against.
DEFAULT_CUDNN = (9, 14)


# `GpuTargetConfig`'s `cuda_compute_capability.feature_extension` values
# (None: none, the bare capability).
FEATURE_EXTENSIONS = (None, "ACCELERATED_FEATURES",
                      "FAMILY_COMPATIBLE_FEATURES")
_OWN = "the target's"


def target(name: str | Target, features: str | None = _OWN) -> Target:
  """`TARGETS[name]`, with an error naming the choices; `features` replaces
  its feature extension (`Target.features`; None: the bare capability)."""
  if not isinstance(name, Target):
    if name not in TARGETS:
      raise ValueError(f"unknown target {name!r}; use one of "
                       f"{', '.join(TARGETS)}.")
    name = TARGETS[name]
  if features is _OWN:
    return name
  if features not in FEATURE_EXTENSIONS:
    raise ValueError(f"feature extension {features!r}; use one of "
                     f"{FEATURE_EXTENSIONS}.")
  return dataclasses.replace(name, features=features)


def target_config(t: str | Target, cudnn: tuple[int, int] = DEFAULT_CUDNN,
                  cuda: int = 13) -> str:
  """The `GpuTargetConfig` text (protobuf text format) XLA compiles for."""
  t = target(t)
  info = dict(
      threads_per_block_limit=1024, threads_per_warp=32,
      shared_memory_per_block=49152,
      shared_memory_per_core=t.shared_memory_per_sm,
      threads_per_core_limit=t.threads_per_sm, core_count=t.sm_count,
      fpus_per_core=128, block_dim_limit_x=2147483647,
      block_dim_limit_y=65535, block_dim_limit_z=65535,
      memory_bandwidth=int(t.bandwidth), l2_cache_size=t.l2_bytes,
      clock_rate_ghz=t.clock_ghz, device_memory_size=t.memory_bytes,
      shared_memory_per_block_optin=t.shared_memory_per_block_optin)
  fields = " ".join(f"{k}:{v}" for k, v in info.items())
  ext = f" feature_extension:{t.features}" if t.features else ""
  return (f"gpu_device_info{{{fields} cuda_compute_capability{{major:"
          f"{t.cc[0]} minor:{t.cc[1]}{ext}}} registers_per_core_limit:65536 "
          f"registers_per_block_limit:65536}}\n"
          f"runtime_version{{major:{cuda}}} platform_name:\"CUDA\" "
          f"dnn_version_info{{major:{cudnn[0]} minor:{cudnn[1]}}} "
          f"device_description_str:\"{t.device_kind}\"")


class Unavailable(RuntimeError):
  """Ahead-of-time compilation for CUDA is not possible in this process."""


def unavailable_reason() -> str | None:
  """Why `compiling_for` cannot work here, or None if it can."""
  try:
    import jax_plugins.xla_cuda13  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    try:
      import jax_plugins.xla_cuda12  # pylint: disable=g-import-not-at-top,unused-import
    except ImportError:
      return ("JAX's CUDA plugin is not installed (pip install "
              "'nvfp4-jax[gpu]', or jax-cuda13-plugin and jax-cuda13-pjrt "
              "of jax's version).")
  try:
    _topology_device(TARGETS["b200"], DEFAULT_CUDNN)
  except Exception as e:  # pylint: disable=broad-except
    return (f"JAX's CUDA plugin did not register ({type(e).__name__}: "
            f"{str(e)[:200]}); on a machine without CUDA's libraries start "
            f"Python with JAX_PLATFORMS=cpu.")
  return None


def _topology_device(t: Target, cudnn: tuple[int, int]):
  return topology_devices(t, 1, cudnn)[0]


def topology_devices(t: str | Target, n: int,
                     cudnn: tuple[int, int] = DEFAULT_CUDNN) -> list:
  """`n` devices of target `t` in one process (one host), for
  `jax.sharding.Mesh`es that a program is compiled for ahead of time
  (topology "1x1xN": slices x hosts x devices per host)."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  t = target(t)
  topo = topologies.get_topology_desc(
      t.name, "cuda", target_config=target_config(t, cudnn),
      topology=f"1x1x{n}")
  return list(topo.devices)


@dataclasses.dataclass
class TritonKernel:
  """A Triton kernel jax-triton compiled while lowering: its PTX."""

  name: str
  ptx: str


@dataclasses.dataclass
class Compiler:
  """What `compiling_for` yields: the device and the compile function."""

  target: Target
  cudnn: tuple[int, int]
  device: Any
  triton_kernels: list[TritonKernel]
  _triton_cache: dict = dataclasses.field(default_factory=dict)

  def abstract(self, shape, dtype) -> jax.ShapeDtypeStruct:
    """An argument on the target device (nothing is allocated)."""
    return jax.ShapeDtypeStruct(
        shape, dtype, sharding=jax.sharding.SingleDeviceSharding(self.device))

  def place(self, tree):
    """`tree`'s arrays and `ShapeDtypeStruct`s as arguments on the device."""
    return jax.tree.map(lambda x: self.abstract(x.shape, x.dtype), tree)

  def lower(self, fn: Callable, *args, **kwargs):
    """`jax.jit(fn)` lowered for the target, arguments placed on it;
    `triton_kernels` then holds the Triton kernels of this program."""
    args, kwargs = self.place((args, kwargs))
    del self.triton_kernels[:]
    self._triton_cache.clear()
    return jax.jit(fn).trace(*args, **kwargs).lower()

  def compile(self, fn: Callable, *args, **kwargs) -> str:
    """The optimized HLO text XLA compiled `fn` to for the target."""
    return self.lower(fn, *args, **kwargs).compile().as_text()

  def cudnn_visible(self) -> bool:
    """Whether this JAX's compile without a GPU hands a block-scaled dot to
    cuDNN at all (a bare `jax.nn.scaled_matmul`, NVFP4 operands, aligned
    shapes, compiled for a B200 with this cuDNN version). jax 0.10's XLA
    reads cuDNN's version from the target config; jax 0.11's compiles for a
    topology "devicelessly" and its autotuner sees no cuDNN (version 0.0.0:
    "Cudnn version is too old"), so it decomposes every block-scaled dot,
    whatever the GPU would run. (Probed on sm_100: jax 0.11.2's XLA aborts
    the process compiling the decomposition's E2M1 convert for sm_120.)
    """
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    device = _topology_device(TARGETS["b200"], self.cudnn)
    s = lambda shape, dtype: jax.ShapeDtypeStruct(
        shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))
    f4, e4 = jnp.float4_e2m1fn, jnp.float8_e4m3fn
    hlo = jax.jit(lambda a, b, sa, sb: jax.nn.scaled_matmul(
        a, b, sa, sb, preferred_element_type=jnp.float32)).trace(
            s((1, 128, 128), f4), s((1, 128, 128), f4), s((1, 128, 8), e4),
            s((1, 128, 8), e4)).lower().compile().as_text()
    return "__cudnn$blockScaledDot" in hlo


@contextlib.contextmanager
def compiling_for(name: str | Target, *, cudnn: tuple[int, int] = DEFAULT_CUDNN,
                  features: str | None = _OWN) -> Iterator[Compiler]:
  """Within the block, the project's dispatch answers for the target GPU,
  and `Compiler.compile` compiles for it; `features`: another feature
  extension than the target's (`target`; None: the bare capability, e.g.
  plain sm_120).

  Raises:
    Unavailable: no CUDA plugin (see the module's docstring).
  """
  t = target(name, features)
  try:
    device = _topology_device(t, cudnn)
  except Exception as e:  # pylint: disable=broad-except
    reason = unavailable_reason() or f"{type(e).__name__}: {e}"
    raise Unavailable(f"cannot compile for {t.name}: {reason}") from e
  kernels: list[TritonKernel] = []
  cache: dict = {}
  # JAX caches traces by function and argument types, not by the device
  # dispatch answers for: a trace made before (or in) the block must not be
  # reused in (or after) it.
  jax.clear_caches()
  # The persistent compilation cache holds executables for this process's
  # devices; one compiled for a topology cannot be read back: off in the
  # block (JAX decides once per process whether it uses the cache, hence
  # the reset, before and after).
  cache_on = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  _reset_compilation_cache()
  try:
    with contextlib.ExitStack() as stack:
      stack.enter_context(dispatch.target_device("gpu", t.cc, cudnn))
      stack.enter_context(_recording_triton(kernels, cache))
      stack.enter_context(_pallas_triton_target(t.cc))
      # Kernels that ask whether an instruction compiles (`pallas_kernels.
      # e2m1_encode.hardware_e2m1`) compile their probe for this device too.
      stack.enter_context(dispatch.probe_compiler(
          ("aot", t.name, t.cc, t.features, cudnn), functools.partial(_compile_probe, device)))
      yield Compiler(t, cudnn, device, kernels, cache)
  finally:
    jax.config.update("jax_enable_compilation_cache", cache_on)
    _reset_compilation_cache()
    jax.clear_caches()


def _compile_probe(device, fn: Callable, *args) -> None:
  """`dispatch.compile_probe` in a `compiling_for` block: `fn` compiled for
  the target's device (raises where it does not compile there)."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
               for a in args)
  jax.jit(fn).trace(*args).lower().compile()


def _reset_compilation_cache() -> None:
  try:
    from jax._src import compilation_cache  # pylint: disable=g-import-not-at-top
    compilation_cache.reset_cache()
  except (ImportError, AttributeError):
    pass


@contextlib.contextmanager
def _recording_triton(kernels: list[TritonKernel], cache: dict
                      ) -> Iterator[None]:
  """Records the PTX of each kernel jax-triton compiles in the block; its
  kernel cache is `cache` meanwhile (cleared per program), so that each
  program's kernels compile (and are recorded)."""
  try:
    from jax_triton import triton_lib  # pylint: disable=g-import-not-at-top
  except ImportError:
    yield
    return
  compile_ttir = triton_lib.compile_ttir_inplace
  saved = triton_lib._COMPILED_KERNEL_CACHE  # pylint: disable=protected-access

  def record(*args, **kwargs):
    result = compile_ttir(*args, **kwargs)
    kernels.append(TritonKernel(result.name, result.binary))
    return result

  triton_lib.compile_ttir_inplace = record
  triton_lib._COMPILED_KERNEL_CACHE = cache  # pylint: disable=protected-access
  try:
    yield
  finally:
    triton_lib.compile_ttir_inplace = compile_ttir
    triton_lib._COMPILED_KERNEL_CACHE = saved  # pylint: disable=protected-access


@contextlib.contextmanager
def _pallas_triton_target(cc: tuple[int, int]) -> Iterator[None]:
  """Pallas-Triton's lowering asks the GPU here for its compute capability
  (jax >= 0.11); in the block it is the target's."""
  try:
    from jax._src.pallas.triton import pallas_call_registration as reg  # pylint: disable=g-import-not-at-top
  except ImportError:
    yield
    return
  if not hasattr(reg, "gpu_info_lib"):
    yield
    return
  saved = reg.gpu_info_lib

  class _Info:
    @staticmethod
    def get_gpu_info(*_, **__):
      return type("GpuInfo", (), {"compute_capability": cc[0] * 10 + cc[1]})

  reg.gpu_info_lib = _Info
  try:
    yield
  finally:
    reg.gpu_info_lib = saved


# --- Reading what a program lowered to --------------------------------------

_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
_CUDNN_DOT_OPERANDS = re.compile(
    r'custom-call\(([^)]*)\), custom_call_target="__cudnn\$blockScaledDot"')
_DOT = re.compile(r"=\s*(\w+)\[[^\]]*\][^=]*?\s(?:dot|convolution)\(")


@dataclasses.dataclass(frozen=True)
class Lowering:
  """What a compiled program runs, counted from its optimized HLO.

  Attributes:
    cudnn_block_scaled: cuDNN block-scaled dots (`__cudnn$blockScaledDot`).
    cudnn_global_scaled: those of them that take a global scale (a fifth
      operand: NVFP4's alpha, applied in cuDNN's graph).
    scaled_dot_left: block-scaled dots XLA neither handed to cuDNN nor
      decomposed (`__op$block_scaled_dot` still there).
    triton_calls: jax-triton kernel calls (`triton_kernel_call`).
    pallas_triton: Pallas-Triton kernels (`__gpu$xla.gpu.triton`).
    cublas: cuBLAS GEMMs (`__cublas$gemm`, `__cublas$lt$matmul...`).
    dots: XLA `dot` instructions left in the program, by result type.
  """

  cudnn_block_scaled: int
  cudnn_global_scaled: int
  scaled_dot_left: int
  triton_calls: int
  pallas_triton: int
  cublas: tuple[str, ...]
  dots: tuple[str, ...]


def lowering(hlo: str) -> Lowering:
  """Counts the GEMM-like instructions of an optimized HLO module's text."""
  targets = _CUSTOM_CALL.findall(hlo)
  return Lowering(
      cudnn_block_scaled=sum(t == "__cudnn$blockScaledDot" for t in targets),
      cudnn_global_scaled=sum(len(ops.split(",")) == 5
                              for ops in _CUDNN_DOT_OPERANDS.findall(hlo)),
      scaled_dot_left=sum(t == "__op$block_scaled_dot" for t in targets),
      triton_calls=sum(t == "triton_kernel_call" for t in targets),
      pallas_triton=sum(t == "__gpu$xla.gpu.triton" for t in targets),
      cublas=tuple(t for t in targets if t.startswith("__cublas")),
      dots=tuple(_DOT.findall(hlo)))


_MMA = re.compile(r"(tcgen05\.mma\S*|mma\.sync\S*|wgmma\.mma_async\S*)")


def ptx_mma(ptx: str) -> tuple[str, ...]:
  """The distinct MMA instructions of a PTX text (sorted)."""
  return tuple(sorted(set(m.rstrip(";") for m in _MMA.findall(ptx))))


def describe_mma(instructions: tuple[str, ...]) -> str:
  """A short name of a kernel's MMA: `tcgen05 kind::mxf4nvf4` (sm_100),
  `OMMA kind::mxf4nvf4` (sm_120's `mma.sync` block-scaled), ..."""
  if not instructions:
    return "no MMA"
  names = []
  for ins in instructions:
    kind = re.search(r"kind::(\w+)", ins)
    scale = re.search(r"scale_vec::(\w+)", ins)
    detail = (f" kind::{kind.group(1)}" if kind else "") + (
        f" scale_vec::{scale.group(1)}" if scale else "")
    if ins.startswith("tcgen05"):
      names.append("tcgen05" + detail)
    elif ins.startswith("mma.sync") and kind and "block_scale" in ins:
      names.append("OMMA (mma.sync block_scale)" + detail)
    else:
      names.append(ins.split(".")[0] + detail)
  return ", ".join(dict.fromkeys(names))
