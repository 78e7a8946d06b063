"""`implementation=` dispatch between the pure-jnp reference and the kernels.

Every op with kernels is an `Op`: its implementations by name, registered in
one place (the op's module), and one platform preference for all of them
(`PREFERRED`). "xla" is the pure-jnp reference (the truth, and the CPU
default); the other names select kernels, imported lazily (the GPU extras need
not be installed to use the reference). `implementation=None` picks per
platform: the first preferred implementation that supports the call, falling
back when a kernel raises `NotImplementedError` (unsupported backend, size or
combination). An explicit name never falls back: its `NotImplementedError`
reaches the caller.

The public ops validate their arguments before calling `Op.__call__`, so every
implementation may trust its inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Any, Callable, Hashable, Iterator, Mapping

import jax

from nvfp4_jax.core.scope import ScopeStack

_OVERRIDE: ScopeStack[str] = ScopeStack()
# `(platform, compute capability, cuDNN version)` of a device compiled for
# ahead of time.
_TARGET: ScopeStack[tuple[str, tuple[int, int] | None,
                          tuple[int, int] | None]] = ScopeStack()
# `(key, compile)` of a device compiled for ahead of time: how
# `compile_probe` compiles for it (`probe_compiler`).
_PROBE: ScopeStack[tuple[Hashable, Callable[..., Any]]] = ScopeStack()

# Platform -> implementation names tried in order before the reference. The
# one preference of every op: kernels on GPUs, the reference elsewhere.
PREFERRED: Mapping[str, tuple[str, ...]] = {"gpu": ("pallas",)}


def platform() -> str:
  """The default backend's platform: "cpu", "gpu", "tpu" (inside a
  `target_device` block: that device's)."""
  target = _TARGET.current()
  if target is not None:
    return target[0]
  return jax.default_backend()


def target_platform() -> str | None:
  """The platform of the innermost `target_device` block, or None."""
  target = _TARGET.current()
  return None if target is None else target[0]


def compute_capability() -> tuple[int, int] | None:
  """`(major, minor)` of the first GPU, or None if unknown (or no GPU);
  inside a `target_device` block, that device's."""
  target = _TARGET.current()
  if target is not None:
    return target[1]
  try:
    cc = jax.devices("gpu")[0].compute_capability
  except (RuntimeError, AttributeError, IndexError):
    return None
  major, minor = str(cc).split(".")[:2]
  return int(major), int(minor)


def cudnn_version() -> tuple[int, int] | None:
  """`(major, minor)` of the cuDNN XLA compiles against, or None if unknown
  (no CUDA plugin); inside a `target_device` block, that device's."""
  target = _TARGET.current()
  if target is not None:
    return target[2]
  if platform() != "gpu":
    return None
  try:
    from jax._src.lib import cuda_versions  # pylint: disable=g-import-not-at-top
    v = int(cuda_versions.cudnn_get_version())
  except Exception:  # pylint: disable=broad-except
    return None
  return v // 10000, v // 100 % 100


@contextlib.contextmanager
def target_device(platform_name: str, cc: tuple[int, int] | None = None,
                  cudnn: tuple[int, int] | None = None) -> Iterator[None]:
  """Within the block, `platform()`, `compute_capability()` and
  `cudnn_version()` describe another device than this process's: the one a
  program is compiled for ahead of time (`nvfp4_jax.tools.aot`), so that
  dispatch picks that device's kernels while tracing. Nothing runs on it.
  JAX caches traces by function and argument types, not by this block:
  clear them (`jax.clear_caches()`) on entering and leaving it, as
  `aot.compiling_for` does.
  """
  if platform_name not in ("cpu", "gpu", "tpu"):
    raise ValueError(f"target_device: platform {platform_name!r}; use "
                     f"'cpu', 'gpu' or 'tpu'.")
  pair = lambda v: None if v is None else (int(v[0]), int(v[1]))
  with _TARGET.push((platform_name, pair(cc), pair(cudnn))):
    yield


@contextlib.contextmanager
def probe_compiler(key: Hashable, compile_fn: Callable[..., Any]
                   ) -> Iterator[None]:
  """Within the block, `compile_probe(fn, *args)` compiles for the device
  a program is compiled for ahead of time (`target_device`'s) by calling
  `compile_fn(fn, *args)`, which raises where `fn` does not compile there;
  `key` names that device and toolchain (`probe_target`: results cached by
  it stay valid while it is the same). Set by `nvfp4_jax.tools.aot`."""
  with _PROBE.push((key, compile_fn)):
    yield


def _local_gpu():
  try:
    return jax.devices("gpu")[0]
  except (RuntimeError, IndexError):
    return None


def probe_target() -> Hashable | None:
  """What `compile_probe` compiles for: the innermost `probe_compiler`'s
  key; else this process's first GPU where it is the GPU dispatch answers
  for (`("gpu", device kind, compute capability)`); else None (nothing to
  compile for: no GPU, or a `target_device` of another capability without
  a `probe_compiler`)."""
  probe = _PROBE.current()
  if probe is not None:
    return probe[0]
  if platform() != "gpu":
    return None
  cc = compute_capability()
  device = _local_gpu() if cc is not None else None
  if device is None:
    return None
  try:
    major, minor = str(device.compute_capability).split(".")[:2]
  except AttributeError:
    return None
  if (int(major), int(minor)) != cc:
    return None
  return ("gpu", device.device_kind, cc)


def compile_probe(fn: Callable[..., Any], *args: jax.ShapeDtypeStruct
                  ) -> None:
  """Compiles `jax.jit(fn)` for `args` (shapes and dtypes only) for
  `probe_target()`'s device, nothing run: so kernels can ask while tracing
  whether an instruction compiles there (it may be called inside another
  trace: the arguments are abstract, never the caller's tracers).

  Raises:
    What the compile raises where `fn` does not compile there;
    RuntimeError where `probe_target()` is None.
  """
  probe = _PROBE.current()
  if probe is not None:
    probe[1](fn, *args)
    return
  if probe_target() is None:
    raise RuntimeError("compile_probe: no GPU to compile for here (see "
                       "dispatch.probe_target).")
  sharding = jax.sharding.SingleDeviceSharding(_local_gpu())
  args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
               for a in args)
  jax.jit(fn).trace(*args).lower().compile()


@contextlib.contextmanager
def default_implementation(name: str) -> Iterator[None]:
  """Within the block, `implementation=None` tries `name` first.

  Applies while tracing: wrap the `jax.jit`/first call, e.g.
  `with default_implementation("xla"): step(...)` runs the pure-jnp reference
  everywhere (for comparisons and benchmarks) without touching model code.
  Ops without that implementation, or that cannot run it, fall back to "xla".

  Args:
    name: an implementation's name ("xla", "pallas", ...).
  """
  with _OVERRIDE.push(name):
    yield


def current_default() -> str | None:
  """The innermost `default_implementation` name in force, or None.

  Code that traces later (a custom_vjp's backward pass, a cached trace) passes
  it along, so the block's choice holds for everything it started.
  """
  return _OVERRIDE.current()


@contextlib.contextmanager
def maybe_default_implementation(name: str | None) -> Iterator[None]:
  """`default_implementation(name)`, or nothing when `name` is None."""
  if name is None:
    yield
  else:
    with default_implementation(name):
      yield


@dataclasses.dataclass(frozen=True)
class Op:
  """An op's implementations, dispatched by name.

  Attributes:
    name: the op's public name, for error messages.
    implementations: implementation name -> the callable, or a
      "module:function" string imported on first use. Must hold "xla".
    preferred: a callable `platform -> names` overriding `PREFERRED` for this
      op (e.g. a GEMM that prefers native FP4 on some GPUs); None uses
      `PREFERRED`.
    per_shard: how a kernel runs per shard when XLA partitions the program
      (auto mode): a callable `(kernel, *args, **kwargs) -> result` that
      calls the kernel (e.g. through `spmd.blockwise`). The reference
      ("xla") is pure jnp, which XLA partitions itself. None: the kernel is
      called as it is.
  """

  name: str
  implementations: Mapping[str, Callable[..., Any] | str]
  preferred: Callable[[str], tuple[str, ...]] | None = None
  per_shard: Callable[..., Any] | None = None

  def __post_init__(self):
    if "xla" not in self.implementations:
      raise ValueError(f"{self.name}: the reference 'xla' is missing.")

  def resolve(self, name: str) -> Callable[..., Any]:
    impl = self.implementations[name]
    if isinstance(impl, str):
      module, fn = impl.split(":")
      impl = getattr(importlib.import_module(module), fn)
    return impl

  def order(self) -> tuple[str, ...]:
    """The names `implementation=None` tries here, the reference last."""
    override = _OVERRIDE.current()
    if override is not None:
      names = (override,)
    elif self.preferred is not None:
      names = tuple(self.preferred(platform()))
    else:
      names = tuple(PREFERRED.get(platform(), ()))
    return tuple(n for n in names if n in self.implementations
                 and n != "xla") + ("xla",)

  def __call__(self, implementation: str | None, *args, **kwargs) -> Any:
    """Runs `implementation` (None: the platform's preference) on the args.

    Raises:
      ValueError: unknown implementation name.
      NotImplementedError: the named implementation does not support the call.
    """
    if implementation is None:
      *kernels, _ = self.order()
      for name in kernels:
        try:
          return self._run(name, *args, **kwargs)
        except NotImplementedError:
          continue
      return self._run("xla", *args, **kwargs)
    if implementation not in self.implementations:
      raise ValueError(
          f"{self.name}: unknown implementation {implementation!r}; use one "
          f"of {tuple(self.implementations)} or None (the platform's "
          f"default).")
    return self._run(implementation, *args, **kwargs)

  def _run(self, name: str, *args, **kwargs) -> Any:
    fn = self.resolve(name)
    if name == "xla" or self.per_shard is None:
      return fn(*args, **kwargs)
    return self.per_shard(fn, *args, **kwargs)
